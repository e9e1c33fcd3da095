"""The HTTP rollout server (``specengine.server``) live on 127.0.0.1, driven by the real client
(``specengine.client``) and raw ``http.client`` requests: outputs equal ``SpecEngine.generate``
with the same seeds, streaming, abort and disconnects free KV blocks, bad requests get clear
4xx JSON errors and change nothing, auth, metrics. Weight endpoints: test_server_weights.py;
the ``specengine serve`` process and SIGTERM: test_serve_cli.py."""

from __future__ import annotations

import asyncio
import shutil
import socket
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_helpers import (
    WAIT_S,
    assert_idle_and_free,
    bundled_engine,
    in_engine,
    post_json,
    raw_request,
    running_server,
)

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.arith_task import heldout_prompts
from specengine.assets import DEFAULT_TARGET
from specengine.client import ServerError, SpecEngineClient
from specengine.outputs import GenerationOutput
from specengine.server import API_KEY_ENV
from specengine.server.serve import RolloutServer

GREEDY = SamplingParams(temperature=0.0, max_tokens=12)
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


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy and seeded sampling, 8..16 tokens."""
    return [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=8 + i % 9,
                           seed=2000 + i) for i in range(n)]


def assert_same(got: GenerationOutput, want: GenerationOutput) -> None:
    assert got.token_ids == want.token_ids
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.finish_reason == want.finish_reason
    assert got.text == want.text
    assert got.token_weight_versions == want.token_weight_versions
    assert got.weight_version == want.weight_version
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def families(text: str) -> dict[str, dict[tuple, float]]:
    """Prometheus text -> {sample name: {sorted labels: value}} (parsing fails on bad text)."""
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out


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


BAD_GENERATE = [
    # (id, raw body, status, words the error must contain)
    ("malformed json", b'{"prompt_token_ids": [1, 2', 400, "malformed JSON"),
    ("not an object", b"[1, 2, 3]", 422, "JSON object"),
    ("empty body", b"", 422, "JSON object"),
    ("unknown field", b'{"prompt_token_ids": [1], "temprature": 0}', 422,
     "unknown field 'temprature'"),
    ("unknown sampling field", b'{"prompt": "Q:1+2=", "sampling_params": {"tmp": 1}}', 422,
     "unknown field 'sampling_params.tmp'"),
    ("string token id", b'{"prompt_token_ids": [1, "2"]}', 422, "prompt_token_ids.1"),
    ("float token id", b'{"prompt_token_ids": [1, 2.5]}', 422, "prompt_token_ids.1"),
    ("bool k", b'{"prompt_token_ids": [1], "k": true}', 422, "k: "),
    ("no prompt", b'{"k": 1}', 422, "exactly one of prompt_token_ids"),
    ("two prompts", b'{"prompt": "Q:", "prompt_token_ids": [1]}', 422, "exactly one of"),
    ("token id too big", b'{"prompt_token_ids": [1, 20]}', 400, "outside the vocabulary"),
    ("negative token id", b'{"prompt_token_ids": [-1]}', 400, "outside the vocabulary"),
    ("too-long prompt", b'{"prompt_token_ids": [%s]}' % b", ".join([b"5"] * 300), 400,
     "max_model_len is 256"),
    ("empty prompt", b'{"prompt_token_ids": []}', 400, "is empty"),
    ("unknown character", b'{"prompt": "Q:1+x="}', 400, "'x'"),
    ("bad k", b'{"prompt_token_ids": [1], "k": 17}', 400, "k (draft length)"),
    ("bad temperature", b'{"prompt_token_ids": [1], "sampling_params": {"temperature": -1}}',
     400, "temperature must be"),
    ("bad top_p", b'{"prompt_token_ids": [1], "sampling_params": {"top_p": 0}}', 400,
     "top_p must be"),
    ("bad max_tokens", b'{"prompt_token_ids": [1], "sampling_params": {"max_tokens": 0}}',
     400, "max_tokens must be"),
    ("bad seed", b'{"prompt_token_ids": [1], "sampling_params": {"seed": %d}}' % 2**63, 400,
     "seed must be"),
    ("stop id out of vocab", b'{"prompt_token_ids": [1], "sampling_params": '
     b'{"stop_token_ids": [99]}}', 400, "stop_token_ids"),
    ("long request id", b'{"prompt_token_ids": [1], "request_id": "%s"}' % (b"r" * 300), 422,
     "request_id"),
]


@pytest.mark.parametrize("body,status,words", [c[1:] for c in BAD_GENERATE],
                         ids=[c[0] for c in BAD_GENERATE])
def test_bad_generate_request_is_a_clear_4xx_and_changes_nothing(
        served, aeng, reference, body: bytes, status: int, words: str) -> None:
    server, client = served
    got_status, answer = raw_request(server.port, "POST", "/generate", body)
    assert got_status == status, answer
    assert set(answer) == {"error"} and words in answer["error"], answer
    in_engine(aeng, assert_idle_and_free)
    assert in_engine(aeng, lambda e: e.weight_version) == 0
    assert_same(client.generate([5, 6, 7], GREEDY),
                reference.generate([[5, 6, 7]], k=3, sampling=GREEDY)[0])


def test_unknown_route_and_method_are_json_errors(served) -> None:
    server, _ = served
    status, answer = raw_request(server.port, "GET", "/nope")
    assert status == 404 and answer == {"error": "no such endpoint"}
    status, answer = raw_request(server.port, "GET", "/generate")
    assert status == 405 and "Method Not Allowed" in answer["error"]


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


def test_api_key_is_required_on_every_endpoint(aeng, reference) -> None:
    with running_server(aeng, api_key="s3cret", default_k=3) as (server, client):
        port = server.port
        calls = [("GET", "/health", None), ("GET", "/metrics", None),
                 ("POST", "/generate", b'{"prompt_token_ids": [1, 2]}'),
                 ("POST", "/abort", b'{"request_id": "x"}'),
                 ("POST", "/load_weights", b'{"path": "/nonexistent"}'),
                 ("POST", "/init_weight_update_group", b"{}"),
                 ("POST", "/update_weights_from_distributed", b"{}"),
                 ("POST", "/generate", b"{not json"), ("GET", "/nope", None)]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "bearer s3cret"}):
            for method, path, body in calls:
                status, answer = raw_request(port, method, path, body, headers)
                assert status == 401 and "unauthorized" in answer["error"], (path, headers)
        assert client.health()["status"] == "ok"  # the client sends the token
        assert_same(client.generate([1, 2], GREEDY),
                    reference.generate([[1, 2]], k=3, sampling=GREEDY)[0])
        assert "specengine_weight_version" in client.metrics()
        with pytest.raises(ServerError) as err:
            SpecEngineClient(client.base_url, api_key="wrong").health()
        assert err.value.status == 401
    in_engine(aeng, assert_idle_and_free)


def test_api_key_from_the_environment(aeng, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    with running_server(aeng) as (server, client):
        status, _ = raw_request(server.port, "GET", "/health")
        assert status == 401
        assert SpecEngineClient(client.base_url, api_key="from-env").health()["status"] == "ok"


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled target without its tokenizer files."""
    path = tmp_path_factory.mktemp("no_tokenizer")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(DEFAULT_TARGET) / name, path / name)
    return path


def test_text_prompt_without_a_tokenizer_is_a_400(no_tokenizer: Path) -> None:
    eng = SpecEngine(no_tokenizer, device="cpu", kernel_backend="torch", kv_cache_tokens=1024)
    assert eng.tokenizer is None and eng.drafter is None
    want = eng.generate([[5, 6, 7]], sampling=GREEDY)[0]
    a = AsyncSpecEngine(eng)
    try:
        with running_server(a) as (server, client):
            status, answer = post_json(server.port, "/generate", {"prompt": "Q:1+2="})
            assert status == 400 and "no tokenizer" in answer["error"]
            with pytest.raises(ServerError) as err:  # k > 0 without a drafter
                client.generate([5, 6, 7], GREEDY, k=2)
            assert err.value.status == 400 and "needs a drafter" in err.value.message
            assert client.generate([5, 6, 7], GREEDY) == want  # default k: 0
    finally:
        asyncio.run(a.close())


def test_build_app_refuses_bad_options(aeng, no_tokenizer: Path) -> None:
    from specengine.server.app import build_app

    with pytest.raises(ValueError, match="default_k must be"):
        build_app(aeng, default_k=17)
    with pytest.raises(ValueError, match="api_key"):
        build_app(aeng, api_key="")
    plain = AsyncSpecEngine(SpecEngine(no_tokenizer, device="cpu", kernel_backend="torch",
                                       kv_cache_tokens=1024))
    try:
        with pytest.raises(ValueError, match="needs a drafter"):
            build_app(plain, default_k=3)
    finally:
        asyncio.run(plain.close())


def test_schema_mirrors_sampling_params() -> None:
    """Every SamplingParams field can be sent, and nothing else (the schema must follow the
    dataclass when a field is added)."""
    import dataclasses

    from specengine.server.schemas import SamplingParamsBody

    assert set(SamplingParamsBody.model_fields) == {
        f.name for f in dataclasses.fields(SamplingParams)}
