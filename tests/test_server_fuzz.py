"""Property-based fuzzing of every endpoint of a live rollout server, from the server's own
OpenAPI schema (schemathesis builds valid and invalid requests from it; hypothesis drives
them): no answer is a 5xx, none hangs, and afterwards the engine still gives a fixed greedy
request its reference output and holds no KV block.

Requests that the schema alone would rarely make valid (a prompt inside the vocabulary) are
grafted in for part of the cases, so the fuzzed sampling parameters, ``k`` and ``stream``
reach the engine's step instead of stopping at validation. The weight-group rendezvous is
always pointed at a loopback port nobody listens on, with a short timeout: it must fail
cleanly (and the engine keep serving) however the other fields are set.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator

import pytest

schemathesis = pytest.importorskip("schemathesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
from net_helpers import free_port  # noqa: E402
from server_helpers import (  # noqa: E402
    assert_idle_and_free,
    in_engine,
    post_json,
    running_server,
)

from specengine import AsyncSpecEngine, SpecEngine  # noqa: E402
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET  # noqa: E402

MAX_EXAMPLES = 300
CALL_TIMEOUT_S = 30.0  # a call that takes longer is a hang
RENDEZVOUS_TIMEOUT_S = 1.0
FIXED_PROMPT = [17, 16, 5, 10, 7, 12, 6, 9, 4, 14]  # "Q:385+472=" in the bundled vocabulary


def _engine() -> SpecEngine:
    # A short context bounds the work of any accepted request (max_tokens is capped by it).
    return SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", kernel_backend="torch",
                      max_batch_size=16, kv_cache_tokens=4096, max_model_len=64)


@pytest.fixture(scope="module")
def served() -> Iterator[tuple[AsyncSpecEngine, int, dict]]:
    aeng = AsyncSpecEngine(_engine())
    try:
        with running_server(aeng) as (server, _client):
            yield aeng, server.port, server.config.app.openapi()
    finally:
        import asyncio

        asyncio.run(aeng.close())


# Boundary values that the schema's types allow but the engine's tensors may not hold.
EXTREMES = (2**63, 2**63 - 1, -(2**63) - 1, 2**31, 2**32 + 1, 1e30, -1e30, 1e308, 5e-324, -1,
            0, 1)
# Each grafted field is a boundary value or one a caller would send.
TYPICAL = {"temperature": (0.0, 0.7, 1.0), "top_k": (-1, 5), "top_p": (0.9, 1.0),
           "max_tokens": (1, 16), "seed": (0, 7), "max_policy_lag": (0, 2), "n": (1,),
           "k": (0, 3, "auto")}


def _graft(case: object, port: int, valid: tuple[list[int], dict, tuple | None] | None
           ) -> None:
    """Point the rendezvous at loopback. ``valid``: make a /generate body a plausible call (a
    prompt inside the vocabulary, typical sampling fields and ``k``) with at most one field set
    to a boundary value, so that field's handling is what the call tests."""
    body = getattr(case, "body", None)
    if not isinstance(body, dict):
        return
    # Rendezvous bodies (SGLang's, and vLLM's nested under init_info) point at loopback.
    rendezvous = body if case.path == "/init_weight_update_group" else (
        body.get("init_info") if case.path == "/init_weight_transfer_engine" else None)
    if isinstance(rendezvous, dict):
        rendezvous["master_address"] = "127.0.0.1"  # never any other address
        rendezvous["master_port"] = port
        t = rendezvous.get("timeout_s")
        if not isinstance(t, (int, float)) or isinstance(t, bool) or not 0 < t <= 1e9:
            t = RENDEZVOUS_TIMEOUT_S
        rendezvous["timeout_s"] = min(float(t), RENDEZVOUS_TIMEOUT_S)
    elif case.path == "/generate" and valid is not None:
        prompt, fields, boundary = valid
        fields = dict(fields)
        if boundary is not None:
            fields[boundary[0]] = boundary[1]
        body.pop("prompt", None)
        body.pop("request_id", None)
        body["prompt_token_ids"] = prompt
        body["k"] = fields.pop("k", 0)
        body["sampling_params"] = fields


def test_fuzzed_requests_never_get_a_5xx_and_leave_the_engine_whole(served) -> None:
    aeng, port, spec = served
    base = f"http://127.0.0.1:{port}"
    reference = post_json(port, "/generate", {"prompt_token_ids": FIXED_PROMPT,
                                              "sampling_params": {"temperature": 0.0,
                                                                  "max_tokens": 24}})
    assert reference[0] == 200, reference
    schema = schemathesis.openapi.from_dict(spec)
    assert set(spec["paths"]) >= {"/generate", "/abort", "/load_weights",
                                  "/init_weight_update_group",
                                  "/update_weights_from_distributed", "/health", "/metrics"}
    modes = list(schemathesis.GenerationMode)
    every_op = [schema[path][method].as_strategy(mode)
                for path, methods in spec["paths"].items() for method in methods
                for mode in modes]
    # Half the cases are plausible generate calls with one boundary value: they are the ones
    # that reach the step.
    generate = schema["/generate"]["POST"].as_strategy()
    vocab = aeng.engine.model_config.vocab_size
    prompts = st.lists(st.integers(0, vocab - 1), min_size=1, max_size=12)
    typical = st.fixed_dictionaries({}, optional={
        name: st.sampled_from(values) for name, values in TYPICAL.items()})
    boundary = st.tuples(st.sampled_from(sorted(TYPICAL)), st.sampled_from(EXTREMES))
    plausible = st.tuples(generate, st.tuples(prompts, typical, st.one_of(st.none(), boundary)))
    cases = st.one_of(plausible, st.tuples(st.one_of(every_op), st.none()))
    dead_port = free_port()
    statuses: Counter[tuple[str, int]] = Counter()
    failures: list[str] = []

    @settings(max_examples=MAX_EXAMPLES, deadline=None, database=None, derandomize=True,
              suppress_health_check=list(HealthCheck))
    @given(drawn=cases)
    def fuzz(drawn) -> None:
        case, valid = drawn
        _graft(case, dead_port, valid)
        resp = case.call(base_url=base, timeout=CALL_TIMEOUT_S)
        statuses[(case.path, resp.status_code)] += 1
        if case.path == "/pause_generation" and resp.status_code == 200:
            # A paused server holds new /generate calls until /continue_generation (as
            # SGLang's does): resume, so the next case tests its own request, not the pause.
            assert post_json(port, "/continue_generation", {})[0] == 200
        if resp.status_code >= 500:
            body = json.dumps(case.body, default=str)[:300]
            failures.append(f"{case.method} {case.path} {body} -> {resp.status_code} "
                            f"{resp.text[:300]}")

    fuzz()
    assert not failures, "\n".join(failures[:10])
    # The fuzzer reached the engine: some generate calls ran (200) and some were refused.
    assert statuses[("/generate", 200)] > 0, statuses
    assert any(p == "/generate" and 400 <= s < 500 for p, s in statuses), statuses
    after = post_json(port, "/generate", {"prompt_token_ids": FIXED_PROMPT,
                                          "sampling_params": {"temperature": 0.0,
                                                              "max_tokens": 24}})
    assert after[0] == 200, after
    assert after[1]["token_ids"] == reference[1]["token_ids"]
    in_engine(aeng, assert_idle_and_free)
    in_engine(aeng, lambda e: e.close_weight_update_group())
