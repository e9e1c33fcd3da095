"""Stop strings at their edges (issue 37, survivors of the generated mutants of
``core/stop_strings.py``), on the bundled pair (its tokenizer: one character per token):

- a sequence that ends by its stop string in the same step as another ends by its length
  limit: both are reported finished, each with its own reason, and the engine goes idle;
- a request restarted from its prompt by an update (``policy_lag_action="restart"``) starts
  its stop-string state over and stops exactly where an undisturbed run stops.
"""

from __future__ import annotations

import dataclasses

import pytest

from specengine import SamplingParams, SpecEngine
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

TEXTS = ["Q:472+385=", "Q:18+904=", "Q:333+333=", "Q:70+7="]
PLAIN = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def engine(**kw: object) -> SpecEngine:
    return SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", kernel_backend="torch",
                      kv_cache_tokens=4096, **kw)


@pytest.fixture(scope="module")
def free_run() -> list[str]:
    return [o.text for o in engine().generate(TEXTS, k=0, sampling=PLAIN)]


def first_stop_at(text: str, m: int) -> str:
    """A stop string (a suffix of the first ``m`` characters) whose first occurrence ends at
    character ``m`` of ``text``."""
    for width in range(1, m + 1):
        s = text[m - width:m]
        if text.find(s) == m - width:
            return s
    raise AssertionError("unreachable: the whole prefix occurs first at 0")


@pytest.mark.parametrize("k", [0, 3])
def test_a_stop_string_and_a_length_limit_ending_in_the_same_step(free_run, k: int) -> None:
    eng = engine()
    m = 5  # tokens: the 5th token ends both (k = 0: the same step for both rows)
    stop = first_stop_at(free_run[1], m)
    params = [dataclasses.replace(PLAIN, max_tokens=m),
              dataclasses.replace(PLAIN, stop=[stop])]
    outs = eng.generate(TEXTS[:2], k=k, sampling=params)
    assert outs[0].finish_reason == "length" and len(outs[0].token_ids) == m
    assert outs[1].finish_reason == "stop" and outs[1].stop_reason == stop
    assert outs[1].text == free_run[1][:m - len(stop)] and len(outs[1].token_ids) == m
    assert not eng.has_unfinished()
    again = eng.generate(TEXTS[:2], k=k, sampling=params)  # nothing was left behind
    assert [o.token_ids for o in again] == [o.token_ids for o in outs]


def test_a_restarted_request_stops_where_an_undisturbed_one_does(free_run) -> None:
    stops = [first_stop_at(t, 7) for t in free_run]
    params = [dataclasses.replace(PLAIN, stop=[s], max_policy_lag=0) for s in stops]
    want = engine().generate(TEXTS, k=0, sampling=params)
    eng = engine(policy_lag_action="restart")
    ids = [eng.add_request(t, p) for t, p in zip(TEXTS, params)]
    for _ in range(3):  # a few tokens each, stop-string text included
        eng.step()
    eng.load_weights(DEFAULT_TARGET)  # every request is now 1 version behind: restarted
    got = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.finished:
                got[out.request_id] = out.output
    for rid, w in zip(ids, want):
        assert got[rid].token_ids == w.token_ids and got[rid].text == w.text
        assert got[rid].stop_reason == w.stop_reason and got[rid].finish_reason == "stop"
