"""How a failing step is searched (``specengine.core.isolation``), pinned at its edges:

- a batch known to fail is never retried whole: its halves are (a lone request that failed is
  retried once, to tell a passing glitch);
- ``ENGINE_WIDE_AFTER`` (3) sequences failing alone in a row, in one step's search or across
  steps, make the fault the engine's: the step's own error is raised (two are two culprits);
- what an operator reads: the warning naming the failed run (prefill or verify step, its size,
  the error, its traceback) and the error when the fault is taken for the engine's;
- the message a failed request carries (``describe``).

The engine and the failure injection are ``test_request_isolation``'s (the arithmetic model on
the CPU; a wrapped prefill or verify pass raises whenever its batch holds a chosen request)."""

from __future__ import annotations

import logging

import pytest
from test_request_isolation import (
    CULPRITS,
    INNOCENT,
    MESSAGE,
    Boom,
    assert_free,
    greedy,
    has_culprit,
    install,
    make_engine,
)

from specengine.core.isolation import ENGINE_WIDE_AFTER, describe

LOGGER = "specengine.core.isolation"


def counting(engine, calls: list[int], fails=lambda seqs: True) -> None:
    """Wrap the prefill: record each batch's size, then raise when ``fails(batch)``."""
    real = engine.runner.prefill

    def prefill(seqs, *args, **kw):
        calls.append(len(seqs))
        if fails(seqs):
            raise Boom(MESSAGE)
        return real(seqs, *args, **kw)

    engine.runner.prefill = prefill


def test_describe_names_the_exception_type_and_its_message() -> None:
    assert describe(Boom(MESSAGE)) == f"Boom: {MESSAGE}"
    assert describe(Boom()) == "Boom"
    assert describe(KeyError()) == "KeyError"


def test_a_failed_batch_is_retried_in_halves_never_whole() -> None:
    """Two requests, the second bad: the pair failed once, so each is retried alone (the good
    one goes through, the bad one fails alone: 3 prefills); never the pair again."""
    engine = make_engine()
    calls: list[int] = []
    counting(engine, calls, has_culprit)
    good, bad = engine.generate([INNOCENT[0], CULPRITS[0]], sampling=greedy(2))
    assert calls[:3] == [2, 1, 1] and 2 not in calls[1:]
    assert bad.finish_reason == "error" and good.finish_reason != "error"
    assert_free(engine)


@pytest.mark.parametrize("n", [ENGINE_WIDE_AFTER, ENGINE_WIDE_AFTER + 1])
def test_that_many_lone_failures_in_a_row_are_an_engine_fault(n: int) -> None:
    """Every prefill fails: the third sequence failing alone raises the step's own error
    (wherever it falls in the search: the first half's second half with 3, the second half's
    first with 4), and every request is aborted."""
    engine = make_engine()
    counting(engine, [])
    with pytest.raises(Boom, match=MESSAGE):
        engine.generate(INNOCENT[:n], sampling=greedy(n))
    assert_free(engine)


def test_two_lone_failures_are_two_culprits() -> None:
    engine = make_engine()
    counting(engine, [])
    outs = engine.generate(INNOCENT[:ENGINE_WIDE_AFTER - 1], sampling=greedy(2))
    assert [o.finish_reason for o in outs] == ["error", "error"]
    assert all(o.error == f"Boom: {MESSAGE}" for o in outs)
    assert_free(engine)


def test_a_set_going_through_resets_the_count() -> None:
    """A good request retried on its own goes through between lone failures: the two bad
    requests after it are two culprits, not the third and fourth of an engine fault."""
    engine = make_engine()
    counting(engine, [], has_culprit)
    good, *bad = engine.generate([INNOCENT[0], CULPRITS[0], CULPRITS[1]], sampling=greedy(3))
    assert good.finish_reason != "error"
    assert [o.finish_reason for o in bad] == ["error", "error"]
    assert_free(engine)


def test_lone_failures_add_up_across_steps() -> None:
    """A request failing alone in each of three steps, nothing going through in between: the
    third step's error is raised (the engine, not the requests, is taken to be broken)."""
    engine = make_engine()
    counting(engine, [])
    for i in range(ENGINE_WIDE_AFTER - 1):
        rid = engine.add_request(INNOCENT[i], greedy(1)[0])
        [out] = engine.step()
        assert out.request_id == rid and out.output.finish_reason == "error"
    engine.add_request(INNOCENT[2], greedy(1)[0])
    with pytest.raises(Boom, match=MESSAGE):
        engine.step()
    assert_free(engine)


def test_the_failed_run_is_logged_with_its_kind_size_error_and_traceback(
        caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch) -> None:
    for stage, kind in (("prefill", "prefill"), ("verify", "verify step")):
        engine = make_engine()
        install(engine, stage, monkeypatch)
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger=LOGGER):
            engine.generate([INNOCENT[0], CULPRITS[0]], k=3, sampling=greedy(2))
        [warn] = [r for r in caplog.records if r.levelno == logging.WARNING]
        assert warn.getMessage() == (f"a {kind} of 2 sequences failed (Boom: {MESSAGE}); "
                                     "retrying them apart")
        assert warn.exc_info is not None and isinstance(warn.exc_info[1], Boom)
        [err] = [r for r in caplog.records if r.levelno == logging.ERROR]
        assert err.getMessage() == ("request 'req-1' failed alone in a step; it ends with "
                                    "finish_reason='error'")
        assert err.exc_info is not None and isinstance(err.exc_info[1], Boom)
        monkeypatch.undo()


def test_an_engine_fault_is_logged_as_one(caplog: pytest.LogCaptureFixture) -> None:
    engine = make_engine()
    counting(engine, [])
    with caplog.at_level(logging.ERROR, logger=LOGGER), pytest.raises(Boom):
        engine.generate(INNOCENT[:ENGINE_WIDE_AFTER], sampling=greedy(ENGINE_WIDE_AFTER))
    assert caplog.records[-1].getMessage() == (
        f"{ENGINE_WIDE_AFTER} sequences in a row failed alone: an engine-wide fault, every "
        "request is aborted")
