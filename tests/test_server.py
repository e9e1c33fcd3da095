"""The HTTP rollout server (``specengine.server``) live on 127.0.0.1, driven by the real client
(``specengine.client``) and raw sockets: outputs equal ``SpecEngine.generate`` with the same
seeds (200 concurrent requests, requests joining a running batch, streaming), abort and
disconnects free KV blocks, metrics, overload and a graceful shutdown. Bad requests and auth:
test_server_errors.py; weight endpoints: test_server_weights.py; the ``specengine serve``
process and SIGTERM: test_serve_cli.py."""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from server_helpers import (
    GREEDY,
    WAIT_S,
    assert_idle_and_free,
    assert_same,
    bundled_engine,
    families,
    in_engine,
    mixed_params,
    raw_request,
    running_server,
)

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.arith_task import heldout_prompts
from specengine.client import ServerError, SpecEngineClient
from specengine.outputs import GenerationOutput
from specengine.server.serve import RolloutServer

LONG = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)  # >= 25 steps at k=3


@pytest.fixture(scope="module")
def reference() -> SpecEngine:
    return bundled_engine()


@pytest.fixture(scope="module")
def aeng() -> Iterator[AsyncSpecEngine]:
    a = AsyncSpecEngine(bundled_engine())
    yield a
    asyncio.run(a.close())


@pytest.fixture(scope="module")
def served(aeng: AsyncSpecEngine) -> Iterator[tuple[RolloutServer, SpecEngineClient]]:
    with running_server(aeng, default_k=3) as pair:
        yield pair


def test_200_concurrent_requests_equal_generate(served, aeng, reference) -> None:
    _, client = served
    n = 200
    texts = heldout_prompts(n, seed=5)
    # Half text, half token ids; a quarter at k=0, the rest at the server's default k=3.
    prompts = [t if i % 2 else reference.tokenizer.encode(t) for i, t in enumerate(texts)]
    params = mixed_params(n)
    ks = [0 if i % 4 == 0 else None for i in range(n)]
    expected: dict[int, GenerationOutput] = {}
    for k in (0, 3):
        idx = [i for i in range(n) if (3 if ks[i] is None else ks[i]) == k]
        outs = reference.generate([prompts[i] for i in idx], k=k,
                                  sampling=[params[i] for i in idx])
        expected.update(zip(idx, outs))
    with ThreadPoolExecutor(max_workers=n) as pool:  # all 200 in flight at once
        got = list(pool.map(lambda i: client.generate(prompts[i], params[i], k=ks[i]),
                            range(n)))
    for i in range(n):
        assert_same(got[i], expected[i])
    in_engine(aeng, assert_idle_and_free)


def test_requests_join_while_another_runs(served, aeng, reference) -> None:
    server, client = served
    long_prompt, shorts = "Q:385+472=", heldout_prompts(4, seed=9)
    want_long = reference.generate([long_prompt], k=3, sampling=LONG)[0]
    want_short = reference.generate(shorts, k=3, sampling=mixed_params(4))
    stream = client.generate_stream(long_prompt, LONG, request_id="long")
    first = next(stream)
    assert not first.finished
    with ThreadPoolExecutor(max_workers=4) as pool:
        got_short = list(pool.map(lambda ip: client.generate(ip[1], mixed_params(4)[ip[0]]),
                                  enumerate(shorts)))
    # The long request (>= 25 steps) is still running after the short ones joined and left.
    snap = families(client.metrics())
    assert snap["specengine_num_requests_running"][()] == 1
    assert "long" in server.state.live
    tokens = list(first.new_token_ids)
    for out in stream:
        tokens.extend(out.new_token_ids)
    assert out.finished and tuple(tokens) == out.output.token_ids
    assert_same(out.output, want_long)
    for got, want in zip(got_short, want_short):
        assert_same(got, want)
    in_engine(aeng, assert_idle_and_free)


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0, max_tokens=24),
                                    SamplingParams(temperature=0.8, top_p=0.9, max_tokens=24,
                                                   seed=7)],
                         ids=["greedy", "seeded"])
def test_stream_gives_the_same_tokens_as_non_stream(served, params) -> None:
    _, client = served
    for prompt in heldout_prompts(3, seed=11):
        whole = client.generate(prompt, params)
        events = list(client.generate_stream(prompt, params))
        assert len(events) > 1 and all(not e.finished and e.output is None for e in events[:-1])
        assert events[-1].finished
        tokens = tuple(t for e in events for t in e.new_token_ids)
        assert tokens == whole.token_ids == events[-1].output.token_ids
        assert_same(events[-1].output, whole)


def test_abort_ends_a_running_stream_and_frees_its_kv(served, aeng, reference) -> None:
    server, client = served
    want = reference.generate(["Q:472*6="], k=3, sampling=LONG)[0]
    stream = client.generate_stream("Q:472*6=", LONG, request_id="to-abort")
    tokens = list(next(stream).new_token_ids)
    with pytest.raises(ServerError) as dup:  # the id is taken while it runs
        client.generate([1, 2, 3], GREEDY, request_id="to-abort")
    assert dup.value.status == 400 and "already used" in dup.value.message
    aborted = client.abort("to-abort")
    assert aborted.finish_reason == "abort"
    for out in stream:
        tokens.extend(out.new_token_ids)
    assert out.finished and out.output.finish_reason == "abort"
    assert out.output.token_ids == tuple(tokens) == aborted.token_ids
    assert 0 < len(tokens) < len(want.token_ids)
    assert want.token_ids[:len(tokens)] == tuple(tokens)  # greedy: a prefix of the full run
    in_engine(aeng, assert_idle_and_free)
    for rid in ("to-abort", "never-added"):  # finished, unknown
        with pytest.raises(ServerError) as err:
            client.abort(rid)
        assert err.value.status == 404 and rid in err.value.message
    assert client.generate([1, 2, 3], GREEDY) == reference.generate([[1, 2, 3]], k=3,
                                                                    sampling=GREEDY)[0]


def disconnects(client: SpecEngineClient) -> float:
    return families(client.metrics())["specengine_client_disconnects_total"][()]


def test_client_that_disconnects_mid_stream_aborts_its_request(served, aeng) -> None:
    server, client = served
    before = disconnects(client)
    stream = client.generate_stream("Q:472*6=", LONG, request_id="leaver")
    assert not next(stream).finished
    stream.close()  # closes the connection
    server.state.live.wait_for(lambda live: "leaver" not in live, "the stream's handler to end")
    in_engine(aeng, assert_idle_and_free)  # runs after the abort the handler queued
    assert disconnects(client) == before + 1


def test_client_that_disconnects_before_the_answer_aborts_its_request(served, aeng) -> None:
    server, client = served
    before = disconnects(client)
    body = (b'{"prompt": "Q:472*6=", "request_id": "impatient", "sampling_params": '
            b'{"temperature": 0, "max_tokens": 200, "ignore_eos": true}}')
    sock = socket.create_connection(("127.0.0.1", server.port), timeout=WAIT_S)
    sock.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                 b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
    server.state.live.wait_for(lambda live: "impatient" in live, "the request to arrive")
    for _ in range(10_000):  # each call waits for the engine thread's next gap
        if in_engine(aeng, lambda e: e.has_unfinished()):
            break
    else:
        raise AssertionError("the request never reached the engine")
    sock.close()
    server.state.live.wait_for(lambda live: "impatient" not in live, "the handler to end")
    in_engine(aeng, assert_idle_and_free)
    assert disconnects(client) == before + 1


def test_metrics_parse_and_move_after_a_request(served) -> None:
    server, client = served
    before = families(client.metrics())
    out = client.generate("Q:472*6=", GREEDY, k=3)
    after = families(client.metrics())

    def moved(name: str, labels: tuple = ()) -> float:
        return after[name][labels] - before[name].get(labels, 0.0)

    assert moved("specengine_generated_tokens_total") == len(out.token_ids)
    assert moved("specengine_draft_tokens_total") == out.num_draft_tokens > 0
    assert moved("specengine_accepted_draft_tokens_total") == out.num_accepted_tokens
    assert moved("specengine_requests_total", (("finish_reason", out.finish_reason),)) == 1
    assert after["specengine_weight_version"][()] == 0
    total = after["specengine_kv_blocks_total"][(("cache", "target"),)]
    assert total == in_engine(server.state.engine, lambda e: e.kv_cache.num_blocks)
    assert after["specengine_kv_blocks_in_use"][(("cache", "target"),)] == 0
    assert after["specengine_num_requests_running"][()] == 0
    assert after["specengine_num_requests_waiting"][()] == 0
    assert after["specengine_mean_accepted_length"][()] >= 1.0  # the last busy span: k=3
    rates = after["specengine_acceptance_rate"]
    assert sorted(dict(lbl)["position"] for lbl in rates) == ["0", "1", "2"]
    assert all(0.0 <= v <= 1.0 for v in rates.values())
    assert after["specengine_generation_tokens_per_second"][()] > 0
    # Live state while a request runs: one running, its KV blocks held.
    stream = client.generate_stream("Q:472*6=", LONG, request_id="watched")
    next(stream)
    live = families(client.metrics())
    assert live["specengine_num_requests_running"][()] == 1
    assert live["specengine_kv_blocks_in_use"][(("cache", "target"),)] > 0
    stream.close()
    server.state.live.wait_for(lambda ids: "watched" not in ids, "the stream to end")
    status, _ = raw_request(server.port, "POST", "/generate", b"{")
    errors = families(client.metrics())["specengine_http_errors_total"]
    assert errors[(("status_code", "400"),)] >= 1


def test_overload_is_a_503_and_shutdown_lets_requests_in_flight_finish(reference) -> None:
    a = AsyncSpecEngine(bundled_engine(), max_waiting=1)
    want = reference.generate(["Q:472*6="], k=3, sampling=LONG)[0]
    try:
        with running_server(a, default_k=3, shutdown_timeout_s=WAIT_S) as (server, client):
            stream = client.generate_stream("Q:472*6=", LONG)
            tokens = list(next(stream).new_token_ids)
            with pytest.raises(ServerError) as err:  # max_waiting=1: the second is refused
                client.generate([5, 6, 7], GREEDY)
            assert err.value.status == 503 and "max_waiting=1" in err.value.message
            server.should_exit = True  # as SIGTERM: stop accepting, let the stream finish
            for out in stream:
                tokens.extend(out.new_token_ids)
            assert out.output.finish_reason == "length"
            assert_same(out.output, want)
            assert tuple(tokens) == want.token_ids
        with pytest.raises(OSError):  # it no longer listens
            client.health()
        in_engine(a, assert_idle_and_free)
    finally:
        asyncio.run(a.close())


