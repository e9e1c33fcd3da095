"""Issue 22, "one bad request never hurts another": every number of a request is range-checked
where it is built (``SamplingParams``, ``resolve_k``, the server's schemas), against what the
engine holds (int32 / int64 fields, float32 temperatures), so a value such as 2**63, 1e30,
NaN or inf is refused at admission naming the field, and never reaches a step, where it would
fail every request in flight. Also the server's small frictions: a JSON body without a JSON
Content-Type, a lowercase ``bearer`` scheme, ``serve --k auto``."""

from __future__ import annotations

import asyncio
import http.client
import json
import math
import re
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import pytest
from server_helpers import (
    assert_idle_and_free,
    assert_same,
    bundled_engine,
    in_engine,
    post_json,
    raw_request,
    running_server,
)

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.arith_task import heldout_prompts
from specengine.cli import _parser
from specengine.config import MAX_K
from specengine.outputs import GenerationOutput
from specengine.sampling import MAX_N, MAX_STOP_TOKEN_IDS, MAX_TEMPERATURE, MIN_TEMPERATURE
from specengine.server.app import build_app
from specengine.server.serve import RolloutServer
from specengine.weights.protocol import Manifest, WeightSyncError

INT32 = 2**31 - 1
INT64 = 2**63 - 1
# Values no numeric field may take: past int64 both ways, not numbers, huge, a bool.
HOSTILE = [2**63, -(2**63) - 1, float("nan"), float("inf"), 1e30, True]
# The numeric fields of SamplingParams; stop_token_ids is checked entry by entry.
NUMERIC_FIELDS = ["temperature", "top_k", "top_p", "max_tokens", "seed", "max_policy_lag", "n",
                  "stop_token_ids"]
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def params_with(field: str, value: object) -> dict[str, object]:
    return {field: [value] if field == "stop_token_ids" else value}


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
@pytest.mark.parametrize("field", NUMERIC_FIELDS)
def test_sampling_params_refuse_hostile_numbers(field: str, value: object) -> None:
    kw = params_with(field, value)
    if field == "stop_token_ids":
        kw[field] = tuple(kw[field])  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=field) as err:
        SamplingParams(**kw)  # type: ignore[arg-type]
    assert repr(value) in str(err.value)  # the value, so the caller sees what was wrong


EDGES = [  # (field, largest / smallest value accepted, the next one refused)
    ("max_tokens", INT32, INT32 + 1),
    ("max_tokens", 1, 0),
    ("top_k", INT32, INT32 + 1),  # the kernels read top-k as int32
    ("top_k", -1, -2),
    ("temperature", MAX_TEMPERATURE, MAX_TEMPERATURE * 1.01),
    ("temperature", MIN_TEMPERATURE, MIN_TEMPERATURE * 0.99),
    ("top_p", 1.0, 1.0 + 1e-9),
    ("seed", INT64, INT64 + 1),
    ("seed", 0, -1),
    ("max_policy_lag", INT64, INT64 + 1),
    ("max_policy_lag", 0, -1),
    ("n", MAX_N, MAX_N + 1),
    ("n", 1, 0),
    ("stop_token_ids", INT32, INT32 + 1),
    ("stop_token_ids", 0, -1),
]


@pytest.mark.parametrize("field,ok,bad", EDGES, ids=[f"{e[0]}={e[2]!r}" for e in EDGES])
def test_sampling_params_bounds_are_exact(field: str, ok: object, bad: object) -> None:
    fix = (lambda v: (v,)) if field == "stop_token_ids" else (lambda v: v)
    SamplingParams(**{field: fix(ok)})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=rf"{field}.* must be .*got {bad!r}"):
        SamplingParams(**{field: fix(bad)})  # type: ignore[arg-type]


def test_sampling_params_refuse_wrong_types() -> None:
    for kw in ({"stop_token_ids": "12"}, {"stop_token_ids": (1.0,)}, {"ignore_eos": 1},
               {"temperature": "1"}, {"top_p": None}, {"max_tokens": 12.0}):
        with pytest.raises(ValueError, match=next(iter(kw))):
            SamplingParams(**kw)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def engine() -> SpecEngine:
    return bundled_engine()


@pytest.fixture(scope="module")
def reference(engine: SpecEngine) -> list[GenerationOutput]:
    return engine.generate(heldout_prompts(2), k=3, sampling=GREEDY)


@pytest.mark.parametrize("value", HOSTILE, ids=repr)
def test_k_and_k_max_refuse_hostile_numbers(engine: SpecEngine, reference: list,
                                            value: object) -> None:
    prompts = heldout_prompts(2)
    for kw, name in (({"k": value}, "k"), ({"k": "auto", "k_max": value}, "k_max"),
                     ({"k": 3, "k_max": value}, "k_max")):
        with pytest.raises(ValueError, match=rf"\b{name} .*must be") as err:
            engine.generate(prompts, sampling=GREEDY, **kw)
        assert repr(value) in str(err.value)
        with pytest.raises(ValueError, match=rf"\b{name} .*must be"):
            engine.add_request(prompts[0], GREEDY, **kw)
        assert not engine.has_unfinished()
    # Refused before anything was queued: the engine serves exactly as before.
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    for got, want in zip(engine.generate(prompts, k=3, sampling=GREEDY), reference):
        assert_same(got, want)


@pytest.mark.parametrize("value", [*HOSTILE, 0, -1.0, 86400.5], ids=repr)
def test_weight_group_refuses_hostile_timeouts_at_once(engine: SpecEngine, value: object) -> None:
    """Refused before any rendezvous is tried (a timedelta or the store's C++ timeout would
    overflow on 1e30); the engine is in no group afterwards."""
    with pytest.raises(ValueError, match=r"timeout_s must be .*\(0, 86400\]"):
        engine.init_weight_update_group("127.0.0.1", 1, 1, 2, backend="gloo", timeout_s=value)
    with pytest.raises(RuntimeError, match="no weight-update group"):
        engine.update_weights_from_distributed()


@pytest.mark.parametrize(("kw", "name"), [({"world_size": 2**31}, "world_size"),
                                          ({"world_size": True}, "world_size"),
                                          ({"master_port": 65536}, "master_port"),
                                          ({"master_port": -1}, "master_port")])
def test_weight_group_refuses_out_of_range_ranks_and_ports(engine: SpecEngine, kw: dict,
                                                           name: str) -> None:
    args = {"master_address": "127.0.0.1", "master_port": 1, "rank": 1, "world_size": 2,
            **kw}
    with pytest.raises(ValueError, match=rf"{name} must be an int in"):
        engine.init_weight_update_group(backend="gloo", timeout_s=1.0, **args)


@pytest.mark.parametrize("version", [2**63, -1, True, 1.5, float("nan")], ids=repr)
def test_weight_versions_are_int64(engine: SpecEngine, reference: list, version: object
                                   ) -> None:
    """Every later token is stamped with the version in an int64 array: 2**63 would overflow
    in the next step of every request."""
    before = engine.weight_version
    with pytest.raises(ValueError, match=r"weight version must be an int in \[0, "):
        engine.load_weights({}, version=version)
    assert engine.weight_version == before
    with pytest.raises(WeightSyncError, match="manifest version must be an int in"):
        Manifest(version, "policy", False, 1 << 20, ())  # what a sender would broadcast
    for got, want in zip(engine.generate(heldout_prompts(2), k=3, sampling=GREEDY), reference):
        assert_same(got, want)


def test_stop_ids_are_bounded_in_number(engine: SpecEngine, reference: list) -> None:
    """Every step checks each running sequence's stop ids in one array as wide as the longest
    list: one request may not widen it for all. Repeats of an id count once."""
    SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS)))
    SamplingParams(stop_token_ids=(5,) * 10_000)
    with pytest.raises(ValueError, match=f"{MAX_STOP_TOKEN_IDS + 1} distinct ids; at most "
                                         f"{MAX_STOP_TOKEN_IDS}"):
        SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1)))
    # At the bound (every id of the small vocabulary but the ones the reference emits), the
    # others' outputs are unchanged.
    vocab = engine.model_config.vocab_size
    emitted = {t for out in reference for t in out.token_ids}
    stops = tuple(t for t in range(min(vocab, MAX_STOP_TOKEN_IDS)) if t not in emitted)
    sp = SamplingParams(temperature=0.0, max_tokens=GREEDY.max_tokens, stop_token_ids=stops)
    for got, want in zip(engine.generate(heldout_prompts(2), k=3, sampling=sp), reference):
        assert_same(got, want)


def test_largest_max_tokens_runs_to_max_model_len(engine: SpecEngine) -> None:
    """2**31 - 1 fits every field it reaches; the sequence ends at max_model_len."""
    prompt = heldout_prompts(1)
    sp = SamplingParams(temperature=0.0, max_tokens=INT32, ignore_eos=True)
    out = engine.generate(prompt, k=3, sampling=sp)[0]
    assert out.finish_reason == "length"
    assert len(out.prompt_token_ids) + len(out.token_ids) == engine.config.max_model_len


def test_largest_top_k_is_no_filter(engine: SpecEngine) -> None:
    """A top-k past the vocabulary (up to int32's largest) keeps every token: the same
    sampled output as top-k off."""
    prompts = heldout_prompts(3)
    off = SamplingParams(temperature=1.0, top_k=-1, max_tokens=24, seed=7)
    huge = SamplingParams(temperature=1.0, top_k=INT32, max_tokens=24, seed=7)
    for a, b in zip(engine.generate(prompts, k=3, sampling=huge),
                    engine.generate(prompts, k=3, sampling=off)):
        assert_same(a, b)


@pytest.mark.parametrize("temperature", [MIN_TEMPERATURE, MAX_TEMPERATURE])
def test_temperature_bounds_sample_finite_probabilities(engine: SpecEngine,
                                                        temperature: float) -> None:
    """At both bounds the float32 sampler (target and EAGLE drafts, whose logits hold -inf)
    stays finite; past them 1 / t overflows (t = 1e-39 gave NaN logprobs and garbage)."""
    sp = SamplingParams(temperature=temperature, max_tokens=24, seed=3, ignore_eos=True)
    for out in engine.generate(heldout_prompts(4), k=3, sampling=sp):
        assert len(out.token_ids) == 24
        assert all(math.isfinite(lp) and lp <= 0 for lp in out.logprobs), out.logprobs
    if temperature == MIN_TEMPERATURE:  # next to greedy: its tokens
        want = engine.generate(heldout_prompts(4), k=3,
                               sampling=SamplingParams(temperature=0.0, max_tokens=24,
                                                       ignore_eos=True))
        assert [o.token_ids for o in engine.generate(heldout_prompts(4), k=3, sampling=sp)] \
            == [w.token_ids for w in want]


# ---- the server ------------------------------------------------------------------------------
LONG = SamplingParams(temperature=0.0, max_tokens=96, ignore_eos=True)
SERVER_FIELDS = [*NUMERIC_FIELDS, "k"]
WIRE_HOSTILE = [2**63, 1e30, float("nan"), float("inf")]  # json.dumps: NaN, Infinity


@pytest.fixture(scope="module")
def aeng() -> Iterator[AsyncSpecEngine]:
    a = AsyncSpecEngine(bundled_engine())
    yield a
    asyncio.run(a.close())


@pytest.fixture(scope="module")
def served(aeng: AsyncSpecEngine) -> Iterator[tuple[RolloutServer, Any]]:
    with running_server(aeng, default_k=3) as pair:
        yield pair


def bad_body(field: str, value: float) -> bytes:
    body: dict[str, Any] = {"prompt_token_ids": [1, 2]}
    if field == "k":
        body["k"] = value
    else:
        body["sampling_params"] = params_with(field, value)
    return json.dumps(body).encode()  # allow_nan: Python writes NaN / Infinity


def test_hostile_numbers_are_refused_while_others_run(served, aeng, engine: SpecEngine
                                                      ) -> None:
    server, client = served
    prompts = heldout_prompts(20)
    want = engine.generate(prompts, k=3, sampling=LONG)
    ids = [f"ok-{i}" for i in range(len(prompts))]

    def run(i: int) -> GenerationOutput:
        if i % 2:
            return client.generate(prompts[i], LONG, request_id=ids[i])
        *_, last = client.generate_stream(prompts[i], LONG, request_id=ids[i])
        assert last.finished and last.output is not None
        return last.output

    with ThreadPoolExecutor(len(prompts)) as pool:
        futures = [pool.submit(run, i) for i in range(len(prompts))]
        server.state.live.wait_for(lambda live: set(ids) <= live, "the 20 requests")
        # Wait for their first step, so they are in the engine's batch, not just queued.
        in_engine(aeng, lambda e: None)
        while in_engine(aeng, lambda e: e.core.num_unfinished) < len(ids):
            in_engine(aeng, lambda e: None)
        answers = []
        for field in SERVER_FIELDS:
            for value in WIRE_HOSTILE:
                status, answer = raw_request(server.port, "POST", "/generate",
                                             bad_body(field, value))
                answers.append((field, value, status, answer))
        still_running = set(ids) <= set(server.state.live)
        outs = [f.result() for f in futures]
    for field, value, status, answer in answers:
        assert status in (400, 422), (field, value, status, answer)
        if not math.isfinite(value):  # NaN / Infinity are no JSON numbers: the schema's 422
            assert status == 422, (field, value, status, answer)
        assert re.search(rf"(^|\W){field}(\W|$)", answer["error"]), (field, value, answer)
    assert still_running, "the 20 requests finished before the bad ones were sent"
    for got, w in zip(outs, want):
        assert_same(got, w)
    in_engine(aeng, assert_idle_and_free)


def test_weight_bodies_bound_their_numbers(served) -> None:
    server, _ = served
    group = {"master_address": "127.0.0.1", "master_port": 29500, "rank": 1, "world_size": 2}
    cases = [
        ("/init_weight_update_group", dict(group, timeout_s=1e300), "timeout_s"),
        ("/init_weight_update_group", dict(group, timeout_s=float("inf")), "timeout_s"),
        ("/init_weight_update_group", dict(group, timeout_s=0.0), "timeout_s"),
        ("/init_weight_update_group", dict(group, rank=2**31), "rank"),
        ("/init_weight_update_group", dict(group, world_size=2**63), "world_size"),
        ("/init_weight_update_group", dict(group, master_port=1e30), "master_port"),
        ("/load_weights", {"path": "/x", "version": 2**63}, "version"),
        ("/load_weights", {"path": "/x", "version": -1}, "version"),
        ("/load_weights", {"path": "/x", "version": float("nan")}, "version"),
        ("/update_weights_from_distributed", {"src_rank": 2**31}, "src_rank"),
        ("/update_weights_from_distributed", {"src_rank": -1}, "src_rank"),
    ]
    for path, body, field in cases:
        status, answer = post_json(server.port, path, body)
        assert status == 422 and field in answer["error"], (path, body, answer)


# ---- frictions -------------------------------------------------------------------------------
def post_as(port: int, body: bytes, content_type: str | None) -> tuple[int, dict[str, Any]]:
    """POST /generate with this Content-Type, or none at all (``raw_request`` always sends
    application/json)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        headers = {} if content_type is None else {"Content-Type": content_type}
        conn.request("POST", "/generate", body=body, headers=headers)
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read())
    finally:
        conn.close()


def test_json_body_whatever_its_content_type(served, engine: SpecEngine) -> None:
    server, _ = served
    want = engine.generate([[1, 2]], k=3, sampling=GREEDY)[0]
    body = json.dumps({"prompt_token_ids": [1, 2], "sampling_params":
                       {"temperature": 0.0, "max_tokens": 12}}).encode()
    for ctype in (None, "text/plain", "application/x-www-form-urlencoded",
                  "application/json; charset=utf-8"):
        status, answer = post_as(server.port, body, ctype)
        assert status == 200, (ctype, answer)
        assert tuple(answer["token_ids"]) == want.token_ids
    status, answer = post_as(server.port, b"a=1", "application/x-www-form-urlencoded")
    assert status == 400 and "malformed JSON" in answer["error"]


def test_bearer_scheme_is_case_insensitive(aeng) -> None:
    with running_server(aeng, api_key="s3cret") as (server, _):
        for auth in ("Bearer s3cret", "bearer s3cret", "BEARER s3cret", "Bearer   s3cret"):
            status, answer = raw_request(server.port, "GET", "/health",
                                         headers={"Authorization": auth})
            assert status == 200, (auth, answer)
        for auth in ("Basic s3cret", "bearer s3cre", "s3cret", "bearer"):
            status, answer = raw_request(server.port, "GET", "/health",
                                         headers={"Authorization": auth})
            assert status == 401, (auth, answer)


def test_serve_takes_k_auto(aeng, engine: SpecEngine) -> None:
    args = _parser().parse_args(["serve", "--k", "auto", "--k-max", "8"])
    assert args.k == "auto" and args.k_max == 8
    with pytest.raises(SystemExit):  # outside 0..MAX_K
        _parser().parse_args(["serve", "--k-max", str(MAX_K + 1)])
    with pytest.raises(ValueError, match="default_k must be"):
        build_app(aeng, default_k="automatic")
    with pytest.raises(ValueError, match="default_k_max"):
        build_app(aeng, default_k="auto", default_k_max=MAX_K + 1)
    with running_server(aeng, default_k="auto") as (server, client):
        assert server.state.default_k == "auto"
        got = client.generate([1, 2], GREEDY)  # no k: the server's "auto"
        assert got.token_ids == engine.generate([[1, 2]], k=0, sampling=GREEDY)[0].token_ids
        steps = in_engine(aeng, lambda e: e.stats.auto_k_steps)
        assert sum(steps) > 0, "the request did not run with k='auto'"
    # --k-max reaches every "auto" request that sends none; a request's own k_max wins.
    with running_server(aeng, default_k="auto", default_k_max=1) as (server, client):
        for body_k_max, most in ((None, 1), (2, 2)):
            body = {"prompt_token_ids": [1, 2], "sampling_params": {"temperature": 0.0,
                                                                    "max_tokens": 40}}
            if body_k_max is not None:
                body["k_max"] = body_k_max
            status, answer = post_json(server.port, "/generate", body)
            assert status == 200, answer
            steps = in_engine(aeng, lambda e: e.stats.auto_k_steps)
            assert sum(steps) > 0 and not any(steps[most + 1:]), (body_k_max, steps)
            assert any(steps[1:]), f"no step drafted: {steps}"

