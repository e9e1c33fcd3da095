"""``k="auto"``: each step's draft length from the step cost model and the drafter's
acceptance per position (docs/design.md §15; maths in ``core.cost_model``).

Per step of a group of ``k="auto"`` requests (``EngineCore`` groups them apart from fixed-k
ones), :meth:`AutoK.choose` returns the ``k`` in ``0..k_max`` with the most expected tokens
per second, then :meth:`AutoK.record` feeds the step's measured draft / verify times to the
cost model and its accepted drafts per position to the acceptance tracker. The rule:

* Warm-up: until the cost model is fitted, the steps follow a short plan on the user's own
  requests (:meth:`AutoKConfig.warmup_plan`: catch-up steps, then ``k = 1`` and
  ``ceil(k_max / 2)``, a few measured steps each), and the fit is made from those steps. No
  start-up sweep on synthetic requests: the warm-up's steps produce tokens, so fitting costs
  only their distance from the best k, and it works the same on a busy engine or a server.
* ``k > 0`` when it pays, and the smallest ``k`` among those the fit cannot tell apart
  (within its own median error, ``core.cost_model.best_k``). A drafter that skipped steps
  (it observes nothing at ``k = 0``) first catches up for one step (``SYNC``: no drafts, the
  drafter observes the pass), since drafting from a stale root would be rejected and would
  teach the tracker a false low rate.
* ``k = 0`` otherwise. While drafting would pay at batch 1 (the drafts are good; the batch is
  what makes them too dear, and it shrinks as a rollout's long tail runs) the drafter keeps
  catching up at ``k = 0`` steps (``SYNC``) and on the prefills of auto requests
  (:meth:`AutoK.observes`), as vLLM's proposer does on non-speculative steps; with drafts that
  pay nowhere it stays idle and a ``k = 0`` step (and a prefill) costs a plain one. Positions
  it skipped stay unwritten in its KV cache: later drafts of those sequences are accepted less
  (lossless either way).
* Exploration: until ``explore_min`` first drafts were counted, the acceptance estimate is not
  trusted: steps draft at least one token and the drafter keeps catching up.
* Neighbours: every ``neighbour_every`` drafting steps, one runs the better-rated of
  ``k +- 1`` instead, so the fit keeps seeing how the cost changes around the chosen k.
* Probes: after ``probe_interval`` consecutive ``k = 0`` steps, one step drafts the best
  ``k >= 1`` (after a catch-up step if needed) so a drafter that became good is noticed. The
  interval starts at ``probe_min``, doubles after every probe (up to ``probe_max``) and goes
  back to ``probe_min`` whenever the rule itself drafts: a useless drafter costs a few
  probes, fewer as the run goes on.

Lossless whatever is chosen: every step is an ordinary verify step of some k (docs/design.md
§1); greedy output equals ``k = 0``'s, sampled output has the policy's distribution.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from specengine.config import DEFAULT_K_MAX, MAX_K
from specengine.core.cost_model import (
    MAX_TOLERANCE,
    AcceptanceTracker,
    CostModel,
    StepMeasure,
    best_k,
    expected_by_k,
)
from specengine.core.run_stats import StepTimes

logger = logging.getLogger(__name__)

#: the k a step runs with when the drafter only catches up (no drafts; core/step.py)
SYNC = -1
#: ``generate(k="auto")``
AUTO = "auto"


def resolve_k(k: object, k_max: object = DEFAULT_K_MAX) -> tuple[int, bool]:
    """``(k, auto)`` for a request's ``k``: an int in ``0..MAX_K`` (``auto`` False), or
    ``"auto"`` (the step picks one in ``0..k_max``; returns ``(k_max, True)``). Anything else
    raises ``ValueError`` saying what is allowed; ``k_max`` is checked whatever ``k`` is, so a
    bad one is refused even where this request does not use it."""
    if isinstance(k_max, bool) or not isinstance(k_max, int) or not 0 <= k_max <= MAX_K:
        raise ValueError(f"k_max must be an int in [0, {MAX_K}], got {k_max!r}")
    if k == AUTO and isinstance(k, str):
        return k_max, True
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= MAX_K:
        raise ValueError(f"k (draft length) must be an int in [0, {MAX_K}] or \"auto\", "
                         f"got {k!r}")
    return k, False


@dataclass(frozen=True)
class AutoKConfig:
    """Knobs of the rule (module docstring) and of the warm-up that fits the cost model."""

    probe_min: int = 16
    probe_max: int = 256
    memory: float = 2048.0  # drafts per position the acceptance estimate remembers
    explore_min: float = 16.0  # first drafts counted before the estimate decides alone
    window: int = 64  # measured steps per batch-size octave the fit keeps
    refit_every: int = 32
    #: every this many drafting steps the rule runs the better neighbour of its k (k +- 1)
    neighbour_every: int = 16
    #: chain lengths the warm-up drafts (capped by k_max); None: 1 and ceil(k_max / 2)
    warmup_ks: tuple[int, ...] | None = None
    warmup_steps: int = 2  # measured steps per warm-up k (and catch-up), after one unmeasured

    def __post_init__(self) -> None:
        if not 1 <= self.probe_min <= self.probe_max:
            raise ValueError(f"need 1 <= probe_min <= probe_max, got {self.probe_min}, "
                             f"{self.probe_max}")
        if (self.memory <= 0 or self.window < 8 or self.refit_every < 1
                or self.neighbour_every < 2):
            raise ValueError("need memory > 0, window >= 8, refit_every >= 1, "
                             "neighbour_every >= 2")
        if self.warmup_steps < 1 or (self.warmup_ks is not None and (
                not self.warmup_ks or min(self.warmup_ks) < 1)):
            raise ValueError(f"the warm-up needs warmup_steps >= 1 and warmup_ks >= 1 (or "
                             f"None), got {self.warmup_steps}, {self.warmup_ks}")

    def warmup_plan(self, k_max: int) -> list[int]:
        """The warm-up's steps: catch-up steps (``SYNC``), then each drafting k; each k's
        first step is not measured (it may compile kernels or capture a graph)."""
        ks = self.warmup_ks or (1, -(-k_max // 2))
        plan = [SYNC, *sorted({min(k, k_max) for k in ks})]
        return [k for k in plan for _ in range(self.warmup_steps + 1)]


@dataclass(frozen=True)
class _Before:
    draft: float
    verify: float
    counts: np.ndarray  # StepTimes.position_counts: [2, P] proposed / accepted per position


def snapshot(times: StepTimes) -> _Before:
    return _Before(times.draft, times.verify + times.bookkeeping,
                   times.position_counts.copy())


def step_counts(before: _Before, times: StepTimes) -> tuple[list[int], list[int]]:
    """Drafts proposed / accepted per position by the steps since ``before`` (up to the
    deepest position proposed)."""
    diff = times.position_counts - before.counts
    depth = int(np.count_nonzero(diff[0]))  # proposals at j imply proposals at every i < j
    return diff[0, :depth].tolist(), diff[1, :depth].tolist()


def conditional_counts(proposed: Sequence[int], accepted: Sequence[int]
                       ) -> tuple[list[float], list[float]]:
    """Tries and successes of each position's conditional acceptance: position ``j + 1`` is
    tried by the rows that proposed it and had their first ``j`` drafts accepted (exact when
    all rows drafted alike, as a group of auto requests does; rows cut short scale it)."""
    tries, prev_acc, prev_prop = [], None, None
    for p, a in zip(proposed, accepted):
        if prev_acc is None:
            tries.append(float(p))
        else:
            tries.append(prev_acc * p / prev_prop if prev_prop else 0.0)
        prev_acc, prev_prop = a, p
    return tries, [float(a) for a in accepted]


class AutoK:
    """The per-step rule of ``k="auto"`` for one engine and its drafter (module docstring)."""

    def __init__(self, config: AutoKConfig | None = None) -> None:
        self.config = config or AutoKConfig()
        self.costs = CostModel(self.config.window, self.config.refit_every)
        self._rates: dict[tuple, tuple[int, np.ndarray]] = {}
        self.acceptance = AcceptanceTracker(MAX_K, self.config.memory)
        self.synced = True  # the drafter observed the last step (a prefill observes)
        self.probe_interval = self.config.probe_min
        self.num_zero_steps = 0  # consecutive k = 0 steps
        self._probe_next: int | None = None  # a probe's k after its catch-up step
        self.num_probes = 0
        self.num_draft_steps = 0  # steps the rule chose to draft (neighbour_every counts them)
        # The warm-up (until the cost model is fitted): the plan, the step it is at, whether
        # the step just chosen is the plan's, and the steps it measured.
        self._plan: list[int] = []
        self._plan_at = 0
        self._planned = False
        self._warm: list[StepMeasure] = []

    @property
    def calibrated(self) -> bool:
        return self.costs.fitted

    def rates(self, batch: int, k_max: int, sync: bool = False) -> tuple[int, np.ndarray]:
        """The best k for ``batch`` and the expected tokens per second of k = 0..k_max
        (``sync``: a k = 0 step would have the drafter catch up, and costs that)."""
        cost = self.costs.cost
        assert cost is not None
        # Cached until the acceptance or the fit changes (a k = 0 run recomputes nothing).
        key = (batch, k_max, sync, self.acceptance.version, self.costs.version, id(cost))
        hit = self._rates.get(key)
        if hit is None:
            if len(self._rates) > 64:
                self._rates.clear()
            # the smallest k the fit cannot tell from the best (cost_model.best_k)
            hit = self._rates[key] = best_k(expected_by_k(self.acceptance.conditional(), k_max),
                                            cost.step_times(batch, k_max, sync),
                                            min(self.costs.error, MAX_TOLERANCE))
        return hit

    def choose(self, batch: int, k_max: int) -> int:
        """This step's k for a group of ``batch`` auto requests (``SYNC``: no drafts, the
        drafter catches up)."""
        if k_max == 0:
            return 0  # nothing to choose
        if not self.calibrated:
            return self._warmup(k_max)
        if self._probe_next is not None:
            k, self._probe_next = min(self._probe_next, k_max), None
            return k
        # Compared with what k = 0 would cost: a catch-up step while the drafter is kept in sync.
        observe = self.observes(k_max)
        k, rates = self.rates(batch, k_max, observe)
        if k == 0 and self.uncertain:
            k = 1 + int(np.argmax(rates[1:]))  # explore: measure the drafts first
        if k > 0:
            self.probe_interval = self.config.probe_min
            if not self.synced:
                return SYNC
            self.num_draft_steps += 1
            if self.num_draft_steps % self.config.neighbour_every == 0:
                k = self._neighbour(k, rates)
            return k
        self.num_zero_steps += 1
        if self.num_zero_steps >= self.probe_interval:
            self.num_zero_steps = 0
            self.num_probes += 1
            self.probe_interval = min(2 * self.probe_interval, self.config.probe_max)
            probe = 1 + int(np.argmax(rates[1:]))
            if self.synced:
                return probe
            self._probe_next = probe
            return SYNC
        return SYNC if observe else 0

    @staticmethod
    def _neighbour(k: int, rates: np.ndarray) -> int:
        """The better-rated of ``k - 1`` and ``k + 1`` (drafting, within ``k_max``): run now and
        then so the fit keeps measuring the slope around the chosen k. Otherwise every step
        runs one k and the fit's slope in k stays what the warm-up's few steps made it (a
        burst of another job there would pin the choice for good)."""
        around = [j for j in (k - 1, k + 1) if 1 <= j < len(rates)]
        return max(around, key=lambda j: rates[j]) if around else k

    def _warmup(self, k_max: int) -> int:
        """The warm-up plan's next step (:meth:`AutoKConfig.warmup_plan`): real steps of the
        user's requests, so fitting the cost model costs only the steps run at another k than
        the best one; a drafting step after a plain one catches up first."""
        if not self._plan:
            self._plan, self._plan_at, self._warm = self.config.warmup_plan(k_max), 0, []
        k = min(self._plan[self._plan_at], k_max)
        self._planned = k <= 0 or self.synced
        return k if self._planned else SYNC

    def _record_warmup(self, measure: StepMeasure) -> None:
        """A warm-up step ran: keep its times unless it is the first of its k (it may have
        compiled or captured); fit once the plan is done (again if the drafter proposed too
        few distinct lengths to fit, e.g. an n-gram drafter without matches)."""
        at, plan = self._plan_at, self._plan
        if at and plan[at - 1] == plan[at] and measure.usable:
            self._warm.append(measure)
        self._plan_at += 1
        if self._plan_at < len(plan):
            return
        self._plan = []
        if len({m.k for m in self._warm}) >= 2:
            self.costs.calibrate(self._warm)
            logger.info("k='auto' cost model fitted to %d warm-up steps", len(self._warm))

    def on_prefill(self, k_max: int) -> bool:
        """A prefill of auto requests: whether the drafter observes it (:meth:`observes`);
        if not, the next drafting step catches up first."""
        observe = self.observes(k_max)
        self.synced = self.synced and observe
        return observe

    @property
    def uncertain(self) -> bool:
        """Too few first drafts counted (recently) to trust the acceptance estimate."""
        return bool(self.acceptance.proposed[0] < self.config.explore_min)

    def observes(self, k_max: int = DEFAULT_K_MAX) -> bool:
        """Whether the drafter should catch up when an auto group does not draft (k = 0 steps,
        prefills): while the estimate is uncertain, or drafting would pay at batch 1."""
        if k_max == 0:
            return False
        if not self.calibrated:
            return True  # the warm-up drafts
        return self.uncertain or self.rates(1, k_max)[0] > 0

    def record(self, batch: int, k: int, before: _Before, times: StepTimes) -> None:
        """The step just run with ``k`` (``choose``'s) for ``batch`` sequences: ``times``
        now, ``before`` it (:func:`snapshot`). On CUDA the times are the device's (the step's
        timing events, ``core.graphs.StepClock``) and a step's bookkeeping (its catch-up pass)
        is read at the next step's sync, so the verify + bookkeeping seconds here hold the
        previous step's bookkeeping: one step late, the same within a run of one batch and
        k (the warm-up's runs of one k), never an extra sync."""
        proposed, accepted = step_counts(before, times)
        self.record_step(batch, k, proposed, accepted, times.draft - before.draft,
                         times.verify + times.bookkeeping - before.verify)

    def record_step(self, batch: int, k: int, proposed: Sequence[int],
                    accepted: Sequence[int], draft_s: float, verify_s: float) -> None:
        """A step run with ``k``: drafts proposed / accepted per position (engine counts:
        rows with a draft there / rows whose draft there was accepted) and its seconds."""
        width = sum(1 for n in proposed if n > 0)
        if width:
            self.num_zero_steps = 0
            self.acceptance.update(*conditional_counts(proposed, accepted))
        self.synced = k != 0
        measure = StepMeasure(batch, width, k != 0, draft_s, verify_s)
        if self._planned and self._plan:
            self._planned = False
            self._record_warmup(measure)
        elif self.calibrated:
            self.costs.add(measure)

    def run(self, batch: int, k_max: int, times: StepTimes,
            run_step: Callable[[int], None]) -> int:
        """Choose, run ``run_step(k)``, record; returns the k run (``SYNC`` as 0 drafts)."""
        k = self.choose(batch, k_max)
        before = snapshot(times)
        run_step(k)
        self.record(batch, k, before, times)
        return max(k, 0)


__all__ = ["AUTO", "DEFAULT_K_MAX", "SYNC", "AutoK", "AutoKConfig", "resolve_k"]
