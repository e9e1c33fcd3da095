"""The rollout server's ``/generate`` body carries issue 25's sampling fields to the engine
(live uvicorn server, real client and raw HTTP): answers equal ``SpecEngine.generate``'s, a
penalty or a bad value is a 400 naming the field, with nothing left in flight."""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from server_helpers import (
    assert_idle_and_free,
    assert_same,
    bundled_engine,
    in_engine,
    post_json,
    running_server,
)

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.arith_task import heldout_prompts

PROMPTS = heldout_prompts(3)


@pytest.fixture(scope="module")
def reference() -> SpecEngine:
    return bundled_engine()


@pytest.fixture(scope="module")
def served() -> Iterator:
    aeng = AsyncSpecEngine(bundled_engine())
    with running_server(aeng, default_k=3) as (server, client):
        yield aeng, server, client


PARAMS = [
    SamplingParams(temperature=0.0, max_tokens=40, stop=("+0", "A:"), min_tokens=3),
    SamplingParams(temperature=0.0, max_tokens=40, stop=(";",), include_stop_str_in_output=True,
                   logprobs=3),
    SamplingParams(temperature=1.0, max_tokens=30, min_p=0.2, seed=7, logprobs=1),
]


@pytest.mark.parametrize("i", range(len(PARAMS)))
def test_fields_through_the_client_equal_generate(served, reference: SpecEngine,
                                                  i: int) -> None:
    _, _, client = served
    got = client.generate(PROMPTS[i], PARAMS[i], k=3)
    want = reference.generate([PROMPTS[i]], k=3, sampling=PARAMS[i])[0]
    assert_same(got, want)
    assert got.stop_reason == want.stop_reason
    assert [set(e) for e in got.top_logprobs] == [set(e) for e in want.top_logprobs]
    for g, w in zip(got.top_logprobs, want.top_logprobs):
        assert all(abs(g[t] - w[t]) <= 1e-4 for t in g)


def test_raw_body_fields(served, reference: SpecEngine) -> None:
    """A hand-written body: ``stop`` as one string, ``min_p``, ``min_tokens``, ``logprobs``."""
    aeng, server, _ = served
    body = {"prompt": PROMPTS[0], "k": 3,
            "sampling_params": {"temperature": 0.0, "max_tokens": 40, "stop": "+0",
                                "min_tokens": 2, "min_p": 0.05, "logprobs": 2}}
    status, out = post_json(server.port, "/generate", body)
    assert status == 200, out
    want = reference.generate([PROMPTS[0]], k=3, sampling=SamplingParams(
        temperature=0.0, max_tokens=40, stop="+0", min_tokens=2, min_p=0.05, logprobs=2))[0]
    assert (out["text"], out["token_ids"], out["stop_reason"]) == \
        (want.text, list(want.token_ids), want.stop_reason)
    assert [sorted(map(int, e)) for e in out["top_logprobs"]] == \
        [sorted(e) for e in want.top_logprobs]
    in_engine(aeng, assert_idle_and_free)


@pytest.mark.parametrize(("field", "value"), [
    ("repetition_penalty", 1.2), ("presence_penalty", 0.3), ("frequency_penalty", 0.3),
    ("min_p", 1.5), ("min_tokens", 99), ("logprobs", 21), ("stop", [""]),
])
def test_refused_with_400_naming_the_field(served, field: str, value: object) -> None:
    aeng, server, _ = served
    body = {"prompt": PROMPTS[0],
            "sampling_params": {"temperature": 0.0, "max_tokens": 40, field: value}}
    status, out = post_json(server.port, "/generate", body)
    assert status == 400, out
    assert field in str(out), out
    in_engine(aeng, assert_idle_and_free)
