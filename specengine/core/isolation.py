"""One bad request never hurts another (docs/design.md §1): a step that raises is undone and
its sequences are retried apart until the one that fails alone is found.

``EngineCore.step`` takes a :meth:`Isolation.checkpoint` before it runs its batch (a prefill,
or the verify steps of the running sequences): a copy of the arena's lengths and counters, the
only per-sequence state a run's append changes. When the run raises an ``Exception``:

1. **Undo.** Every sequence of the run gets its length and counters back (the failed run
   appended nothing and finished nobody) and is evicted as a preemption evicts it (blocks
   freed, drafter state dropped, tokens kept). Recomputing a preempted sequence gives the
   same tokens (``tests/test_scheduler.py``), so nothing of the failure is left in them.
2. **Bisect.** These suspects are retried apart, in halves: a set is prefilled again on its
   own (in batches within ``max_num_batched_tokens``, ahead of the waiting queue) and, when
   the failed run was a verify step, takes one verify step on its own. A set that goes through
   has made a normal step and rejoins the batch; a set that fails has its failing run undone
   the same way and is split (members whose earlier prefill batch went through run on); a
   sequence that fails alone is the culprit: it finishes with
   ``finish_reason="error"`` and the exception's message (logged with its traceback).
3. **Engine-wide faults.** A broken device fails every set. After ``ENGINE_WIDE_AFTER``
   sequences in a row failed alone with no verify step or retried set going through in
   between (in this step or earlier ones), the fault is taken to be the engine's: the step's
   error is raised and the step aborts every request, as before isolation existed. (Two bad
   requests side by side fail alone as two culprits; three first in a retry order are taken
   for an engine fault.)

A step's statistics may still count a failed run's work. Cost when nothing fails: the two
array copies of the checkpoint per step (capacity-sized, no Python loop over sequences).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from specengine.core.run_stats import RunStats
from specengine.core.scheduler import ScheduledBatch
from specengine.core.sequence import SeqStatus, Sequence

if TYPE_CHECKING:
    from specengine.core.engine_core import EngineCore

logger = logging.getLogger(__name__)

#: sequences failing alone in a row (no verify step going through) that make a fault
#: engine-wide
ENGINE_WIDE_AFTER = 3


def describe(exc: BaseException) -> str:
    """The message a failed request carries (``GenerationOutput.error``)."""
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Isolation:
    """The checkpoint before each run and the search after a failed one (module docstring)."""

    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self._lens = np.zeros_like(core.arena.lens)
        self._counters = np.zeros_like(core.arena.counters)
        #: sequences that failed alone since a verify step or retried set last went through
        self.lone_failures = 0

    def checkpoint(self) -> None:
        """Remember what a run's append changes (taken before every run)."""
        np.copyto(self._lens, self.core.arena.lens)
        np.copyto(self._counters, self.core.arena.counters)

    def isolate(self, failed: ScheduledBatch, error: Exception, run: RunStats,
                version: int) -> tuple[Sequence, ...]:
        """After ``failed`` raised ``error``: undo it and retry its sequences apart (module
        docstring). Returns them (each finished, running again, or queued to run again);
        raises ``error`` when the fault is engine-wide."""
        suspects = failed.seqs
        kind = "prefill" if failed.is_prefill else "verify step"
        logger.warning("a %s of %d sequences failed (%s); retrying them apart", kind,
                       len(suspects), describe(error), exc_info=error)
        self._undo(suspects)
        verify = not failed.is_prefill
        if len(suspects) == 1:  # it failed alone already; a retry tells a passing glitch
            self._search(suspects, verify, error, run, version)
        else:  # the whole set is known to fail: start with its halves
            half = len(suspects) // 2
            self._search(suspects[:half], verify, error, run, version)
            self._search(suspects[half:], verify, error, run, version)
        return suspects

    def _search(self, seqs: tuple[Sequence, ...], verify: bool, error: Exception,
                run: RunStats, version: int) -> None:
        """Retry ``seqs`` together; on failure split them, down to the culprits."""
        # Not those that finished or ran on (in a prefill batch that went through) meanwhile.
        seqs = tuple(s for s in seqs if s.status is SeqStatus.WAITING)
        if not seqs:
            return
        exc = self._try(seqs, verify, run, version)
        if exc is None:
            return
        if len(seqs) > 1:
            half = len(seqs) // 2
            self._search(seqs[:half], verify, error, run, version)
            self._search(seqs[half:], verify, error, run, version)
            return
        self.lone_failures += 1
        if self.lone_failures >= ENGINE_WIDE_AFTER:
            logger.error("%d sequences in a row failed alone: an engine-wide fault, every "
                         "request is aborted", self.lone_failures)
            raise error
        self._fail(seqs[0], exc)

    def _try(self, seqs: tuple[Sequence, ...], verify: bool, run: RunStats, version: int
             ) -> Exception | None:
        """Prefill ``seqs`` apart (and, with ``verify``, one verify step of them). None when
        every run went through; else the error of the run that failed, undone. Runs that went
        through stand: they were normal steps of their sequences (which then run on)."""
        core = self.core
        pending = list(seqs)
        while pending:
            batch = core.scheduler.admit_only(pending)
            pending = pending[len(batch.seqs):]
            exc = self._run(batch, run, version)
            if exc is not None:
                return exc
        if verify:
            exc = self._run(core.scheduler.decode_only(seqs, core.lookahead), run, version)
            if exc is not None:
                return exc
        self.lone_failures = 0  # the engine itself works
        return None

    def _run(self, batch: ScheduledBatch, run: RunStats, version: int) -> Exception | None:
        self.checkpoint()
        try:
            self.core.run_batch(batch, run, version)
        except Exception as exc:  # this set fails (again): undo its run
            self._undo(batch.seqs)
            return exc
        return None

    def _undo(self, seqs: tuple[Sequence, ...]) -> None:
        """Put back the checkpoint's lengths and counters of ``seqs`` and evict them (which
        unfinishes the ones the failed run finished)."""
        arena = self.core.arena
        for seq in seqs:
            if seq.arena is arena:  # (its slot's "ended" flag goes when the slot is given back)
                slot = seq.slot
                arena.lens[slot] = self._lens[slot]
                arena.counters[:, slot] = self._counters[:, slot]
            seq.finish_reason = None  # a finish in the failed run is void (evicted: waiting)
            self.core.scheduler.evict(seq)
        # The failure may have left the persistent batch half staged: rebuild it next run.
        self.core.graphs.verifier.state.clear()

    def _fail(self, seq: Sequence, exc: Exception) -> None:
        """``seq`` failed alone: it finishes with ``finish_reason="error"`` (held nothing:
        it was evicted)."""
        request_id = self.core.fail(seq, describe(exc))
        logger.error("request %r failed alone in a step; it ends with finish_reason='error'",
                     request_id, exc_info=exc)


__all__ = ["ENGINE_WIDE_AFTER", "Isolation", "describe"]
