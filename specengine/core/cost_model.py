"""Step cost model and acceptance per draft position: the maths behind ``k="auto"``
(docs/design.md §15; the rollout simulator, ``benchmarks/sim_model.py``, uses the same fit
and rule).

A decode step of ``B`` sequences drafting ``k`` tokens each costs
``t_draft(B, k) + t_verify(B, k + 1)``:

* ``t_draft = θ_d·[1, B, 1{k>0}, 1{k>0}·B, k, k·B]``: staging the batch (every step), a draft
  pass's fixed cost, and the draft passes per proposed token;
* ``t_verify = θ_v·[1, B, B·n, n, s, s·B, v, v·B]`` with ``n = k + 1`` tokens per sequence:
  the target pass, rejection sampling and bookkeeping, ``s = 1`` when the drafter catches up
  after the pass (its catch-up pass over the accepted tokens), and ``v = 1{n > 1}``: a pass
  that verifies drafts costs more than a decode beyond its extra tokens (the drafts'
  rejection sampling, the accepted path's bookkeeping). Measured on the bundled pair (CPU,
  batch 32): verify + bookkeeping 4.8 ms at n = 1 with catch-up, 6.4 ms at n = 2, then
  +0.3 ms per token; a line in n through those costs long chains about twice their price.

Both are fitted by :func:`fit_relative` (least absolute relative error: the conditional
median, which bursts of another job on a shared machine barely move) to measured steps, every
coefficient at least 0 (each term is a cost: a column the fit would make negative is left
out and the rest refitted; with few batch sizes or chain lengths a free fit traded a negative
per-token cost against a positive per-sequence one and read long chains as free at small
batches).
Each step then runs the ``k`` of :func:`best_k`:
``argmax_k E[accepted + 1 | k] / (t_draft(B, k) + t_verify(B, k + 1))`` with
``E[accepted | k] = sum_{j=1..k} prod_{i<=j} a_i`` (:func:`expected_accepted`) for the
conditional acceptance ``a_i`` of draft position ``i`` (:class:`AcceptanceTracker`), except
that the smallest ``k`` whose rate is within the fit's own error of the best one wins
(``tolerance``: :attr:`CostModel.error`, the median relative error of the fitted step times,
capped at :data:`MAX_TOLERANCE`). Rates that close are not told apart by the fit, and where
they are not the shorter chain is the safer guess: the model is linear in ``k`` while a
verify pass's cost per token rises past some length (on a CPU, ``k >= 5`` of the bundled
pair), and the acceptance of the far positions, tried least, is the least known. The rule
gives up at most the tolerance where the longer chain really was better.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

import numpy as np

#: features of t_draft and t_verify (names for docs and debugging)
DRAFT_FEATURES = ("1", "B", "1{k>0}", "1{k>0}B", "k", "kB")
VERIFY_FEATURES = ("1", "B", "Bn", "n", "s", "sB", "v", "vB")


def fit_relative(x: np.ndarray, y: np.ndarray, robust: bool = True,
                 iters: int = 30) -> np.ndarray:
    """``θ`` with ``x @ θ ≈ y`` in relative error: least squares on ``x / y ≈ 1``, or with
    ``robust`` least absolute relative error by iteratively reweighted least squares (the
    conditional median). Small and large steps count alike."""
    x = np.asarray(x, dtype=float)
    y = np.asarray(y, dtype=float)
    if x.ndim != 2 or len(x) != len(y) or (y <= 0).any():
        raise ValueError("fit_relative needs x [N, P], y [N] > 0")
    xs = x / y[:, None]
    weights = np.ones(len(y))
    theta = np.zeros(x.shape[1])
    for _ in range(iters if robust else 1):
        w = np.sqrt(weights)
        theta = np.linalg.lstsq(xs * w[:, None], w, rcond=None)[0]
        weights = 1.0 / np.maximum(np.abs(xs @ theta - 1.0), 1e-6)
    return theta


def expected_accepted(conditional: Sequence[float], k: int) -> float:
    """``E[accepted drafts | a chain of k] = sum_{j=1..k} prod_{i<=j} a_i`` for conditional
    acceptance ``a_i`` of position ``i`` (``conditional[i - 1]``; needs ``k`` of them)."""
    total, reach = 0.0, 1.0
    for a in conditional[:k]:
        reach *= a
        total += reach
    return total


def best_k(expected: Sequence[float], step_times: Sequence[float], tolerance: float = 0.0
           ) -> tuple[int, np.ndarray]:
    """The smallest ``k`` whose expected tokens per second ``(1 + expected[k]) /
    step_times[k]`` is within ``tolerance`` (relative) of the most (ties: the smaller k),
    and the rate of every k."""
    if not 0.0 <= tolerance < 1.0:
        raise ValueError(f"tolerance must be in [0, 1), got {tolerance!r}")
    rates = (1.0 + np.asarray(expected, dtype=float)) / np.maximum(
        np.asarray(step_times, dtype=float), 1e-12)
    return int(np.argmax(rates >= rates.max() * (1.0 - tolerance))), rates


def expected_by_k(conditional: Sequence[float], k_max: int) -> np.ndarray:
    """``expected_accepted(conditional, k)`` for k = 0..k_max."""
    return np.concatenate([[0.0], np.cumsum(np.cumprod(np.asarray(conditional[:k_max],
                                                                   dtype=float)))])


def expected_distinct_experts(num_tokens: float, num_experts: int, top_k: int) -> float:
    """Experts a MoE layer's pass over ``num_tokens`` tokens touches (and so whose weights it
    reads) when each token routes to ``top_k`` distinct experts of ``num_experts`` uniformly
    and independently: an expert is missed by one token with probability ``1 - top_k / E``,
    by all ``n`` with ``(1 - top_k / E)^n``, so by linearity ``E·(1 - (1 - top_k / E)^n)``.
    One token reads ``top_k`` experts; a verify pass of ``B·(k + 1)`` tokens reads up to all
    ``E``: why speculation's extra tokens cost a MoE target more than a dense one."""
    if num_experts < 1 or not 1 <= top_k <= num_experts:
        raise ValueError(f"need 1 <= top_k <= num_experts, got top_k={top_k}, "
                         f"num_experts={num_experts}")
    if num_tokens < 0:
        raise ValueError(f"num_tokens must be >= 0, got {num_tokens}")
    return num_experts * (1.0 - (1.0 - top_k / num_experts) ** num_tokens)


def draft_features(batch: float, k: float) -> list[float]:
    d = 1.0 if k > 0 else 0.0
    return [1.0, batch, d, d * batch, k, k * batch]


def verify_features(batch: float, num_tokens: float, sync: bool) -> list[float]:
    s = 1.0 if sync else 0.0
    v = 1.0 if num_tokens > 1 else 0.0
    return [1.0, batch, batch * num_tokens, num_tokens, s, s * batch, v, v * batch]


@dataclass(frozen=True)
class StepCost:
    """Fitted coefficients of ``t_draft`` and ``t_verify`` (module docstring); seconds."""

    draft: tuple[float, ...]
    verify: tuple[float, ...]
    # step_times by (batch, k_max): the step loop asks for the same few every step
    _cache: dict = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        if len(self.draft) != len(DRAFT_FEATURES) or len(self.verify) != len(VERIFY_FEATURES):
            raise ValueError(f"StepCost needs {len(DRAFT_FEATURES)} draft and "
                             f"{len(VERIFY_FEATURES)} verify coefficients")
        if not all(math.isfinite(t) for t in self.draft + self.verify):
            raise ValueError("StepCost coefficients must be finite")

    def t_draft(self, batch: int, k: int) -> float:
        return max(float(np.dot(self.draft, draft_features(batch, k))), 0.0)

    def t_verify(self, batch: int, num_tokens: int, sync: bool = False) -> float:
        return max(float(np.dot(self.verify, verify_features(batch, num_tokens, sync))), 1e-9)

    def step_time(self, batch: int, k: int, sync: bool = False) -> float:
        """A step drafting ``k`` per sequence (the drafter catches up when ``k > 0`` or
        ``sync``)."""
        return self.t_draft(batch, k) + self.t_verify(batch, k + 1, sync or k > 0)

    def step_times(self, batch: int, k_max: int, sync: bool = False) -> np.ndarray:
        """:meth:`step_time` of k = 0..k_max (at k = 0 the drafter catches up iff ``sync``),
        made non-decreasing in k: a fit to noisy steps may dip, but a longer chain never
        costs less."""
        hit = self._cache.get((batch, k_max, sync))
        if hit is not None:
            return hit
        ks = np.arange(k_max + 1, dtype=float)
        d = (ks > 0).astype(float)
        s = np.maximum(d, float(sync))
        b = float(batch)
        xd = np.stack([np.ones_like(ks), np.full_like(ks, b), d, d * b, ks, ks * b], axis=1)
        xv = np.stack([np.ones_like(ks), np.full_like(ks, b), b * (ks + 1), ks + 1, s, s * b,
                       d, d * b], axis=1)
        t = np.maximum(xd @ np.asarray(self.draft), 0.0) + np.maximum(
            xv @ np.asarray(self.verify), 1e-9)
        out = self._cache[(batch, k_max, sync)] = np.maximum.accumulate(t)
        if len(self._cache) > 4096:  # batch sizes are bounded; this is only a guard
            self._cache.clear()
        return out


@dataclass(frozen=True)
class StepMeasure:
    """One measured step: ``batch`` sequences, ``k`` the longest chain drafted (0: none),
    ``sync`` whether the drafter caught up, and its draft and verify seconds."""

    batch: int
    k: int
    sync: bool
    draft_s: float
    verify_s: float

    @property
    def usable(self) -> bool:
        """False for a clock that went backwards or a step that did nothing: it says nothing."""
        return self.draft_s >= 0 and self.verify_s > 0


#: the most :func:`best_k`'s tolerance may be (a noisy fit must not make k = 0 look as good
#: as drafts that pay by more than this)
MAX_TOLERANCE = 0.05


#: columns of the batch-size terms in draft_features / verify_features
DRAFT_BATCH_COLUMNS = (1, 3, 5)
VERIFY_BATCH_COLUMNS = (1, 2, 5, 7)
#: columns of the catch-up terms in verify_features
VERIFY_SYNC_COLUMNS = (4, 5)
#: columns of the verify-of-drafts terms in verify_features
VERIFY_DRAFTS_COLUMNS = (6, 7)


def identified_terms(samples: Sequence[StepMeasure]) -> tuple[bool, bool]:
    """Which terms of the model ``samples`` can tell apart from the constant ones:
    ``(batch, catch_up)``.

    * The batch-size terms need steps at two batch sizes an octave or more apart (a run's
      batch drifting from 32 to 30 cannot separate ``θ·1`` from ``θ·B``), each at two or more
      chain lengths (the verify pass's cost per token, per sequence and per step; the chosen
      k and the neighbour the rule runs now and then are two; with k = 0 as one of them, the
      draft pass's cost per token comes from the warm-up's two drafting lengths). Without them
      the fit is constant in B. Identified as early as that: a rollout's batch shrinks from
      its size to 1 as sequences end, and a fit constant in B reads the cheap steps of the
      late small batches, at whatever k ran then, as long chains that cost little (measured
      on the bundled pair at batch 32 -> 1: a 24 % median error, and k = 6 fitted at 1.1x a
      k = 0 step where it costs 3.4x).
    * The catch-up terms ``s, s·B`` need plain k = 0 steps (``s = 0``) next to steps that
      caught up: every drafting step catches up, so without a plain step ``s`` is the
      constant column again, and a plain step is taken to cost a catch-up step.
    """
    ks: dict[int, set[int]] = {}
    for s in samples:
        ks.setdefault(max(s.batch, 1).bit_length(), set()).add(s.k)
    return _terms(ks, {s.sync for s in samples})


def drafts_identified(samples: Sequence[StepMeasure]) -> bool:
    """Whether ``samples`` tell a pass that verifies drafts (``v``) from its extra tokens: a
    step without drafts (n = 1, plain or catching up, as the warm-up's first steps) and two
    drafting lengths. Else ``v`` is left out and the verify cost is a line in n."""
    ks = {s.k for s in samples}
    return 0 in ks and len(ks) >= 3


def _terms(ks: dict[int, set[int]], syncs: set[bool]) -> tuple[bool, bool]:
    """:func:`identified_terms` from the chain lengths measured per batch-size octave and the
    catch-up flags seen."""
    return sum(1 for found in ks.values() if len(found) >= 2) >= 2, len(syncs) == 2


class CostModel:
    """:class:`StepCost` fitted to a run's first steps (the warm-up of ``core.auto_k``, kept
    for good) and the latest measured steps, ``window`` of each batch-size octave (1, 2-3,
    4-7, ...: a run of small batches does not crowd out what large ones cost), refitted every
    ``refit_every`` new steps and whenever the steps come to identify more terms
    (:func:`identified_terms`: a first plain k = 0 step, a second batch size); ``iters`` IRLS
    iterations: a refit costs milliseconds, so it is spread over many steps."""

    def __init__(self, window: int = 64, refit_every: int = 128, iters: int = 12) -> None:
        self.calibration: list[StepMeasure] = []
        self.window = window
        self.recent: dict[int, deque[StepMeasure]] = {}
        self.refit_every = refit_every
        self.iters = iters
        self.cost: StepCost | None = None
        self.version = 0  # bumped by every refit
        self.terms = (False, False)  # identified_terms of the last fit
        #: median relative error of the last fit's step times (draft + verify) over its steps
        self.error = 0.0
        self._since_fit = 0
        # what every step so far measured: octave -> chain lengths, catch-up flags, and the
        # terms they identify (a change triggers a refit)
        self._ks: dict[int, set[int]] = {}
        self._syncs: set[bool] = set()
        self._seen = (False, False)

    @property
    def fitted(self) -> bool:
        return self.cost is not None

    def calibrate(self, samples: Sequence[StepMeasure]) -> StepCost:
        """Fit to a run's first measured steps (needs steps at >= 2 chain lengths)."""
        if len({s.k for s in samples}) < 2:
            raise ValueError("a calibration needs steps at >= 2 chain lengths k")
        self.calibration = list(samples)
        for s in samples:
            self._note(s)
        return self.refit()

    def add(self, sample: StepMeasure) -> None:
        """A measured step; refits (once calibrated) every ``refit_every`` steps, or at once
        when it lets the fit identify a term it could not (:func:`identified_terms`)."""
        if not sample.usable:
            return
        octave = max(sample.batch, 1).bit_length()
        if octave not in self.recent:
            self.recent[octave] = deque(maxlen=self.window)
        self.recent[octave].append(sample)
        self._since_fit += 1
        if self._note(sample) and self.calibration:
            self.refit()
        elif self.calibration and self._since_fit >= self.refit_every:
            self.refit()

    def _note(self, s: StepMeasure) -> bool:
        """Track what the steps measured; whether that identifies a term it did not."""
        self._ks.setdefault(max(s.batch, 1).bit_length(), set()).add(s.k)
        self._syncs.add(s.sync)
        seen, self._seen = self._seen, _terms(self._ks, self._syncs)
        return seen != self._seen

    def refit(self) -> StepCost:
        samples = self.calibration + [s for q in self.recent.values() for s in q]
        batch, catch_up = self.terms = identified_terms(samples)
        draft = [s for s in samples if s.draft_s > 0]
        dropped_d = () if batch else DRAFT_BATCH_COLUMNS
        dropped_v = (() if batch else VERIFY_BATCH_COLUMNS) + (
            () if catch_up else VERIFY_SYNC_COLUMNS) + (
            () if drafts_identified(samples) else VERIFY_DRAFTS_COLUMNS)
        xd = np.array([draft_features(s.batch, s.k) for s in draft]).reshape(-1, 6)
        xv = np.array([verify_features(s.batch, s.k + 1, s.sync) for s in samples])
        theta_d = _fit_columns(xd, np.array([s.draft_s for s in draft]), dropped_d, self.iters)
        theta_v = _fit_columns(xv, np.array([s.verify_s for s in samples]), dropped_v,
                               self.iters)
        self.cost = StepCost(tuple(float(t) for t in theta_d),
                             tuple(float(t) for t in theta_v))
        self.error = fit_error(self.cost, samples)
        self._since_fit = 0
        self.version += 1
        return self.cost


def fit_error(cost: StepCost, samples: Sequence[StepMeasure]) -> float:
    """Median of ``|predicted / measured - 1|`` of whole steps (draft + verify seconds): how
    far apart two step times must be before the fit can tell them apart."""
    if not samples:
        return 0.0
    pred = np.array([cost.t_draft(s.batch, s.k) + cost.t_verify(s.batch, s.k + 1, s.sync)
                     for s in samples])
    got = np.array([s.draft_s + s.verify_s for s in samples])
    return float(np.median(np.abs(pred / got - 1.0)))


def _fit_columns(x: np.ndarray, y: np.ndarray, dropped: tuple[int, ...],
                 iters: int) -> np.ndarray:
    """:func:`fit_relative` on the columns not ``dropped`` (their coefficients are 0); all
    zeros when there is nothing to fit (no step drafted: no draft time to model)."""
    theta = np.zeros(x.shape[1])
    if not len(y):
        return theta
    keep = [c for c in range(x.shape[1]) if c not in dropped]
    while keep:  # at most one refit per column: an active set that only shrinks
        theta[:] = 0.0
        theta[keep] = fit_relative(x[:, keep], y, iters=iters)
        worst = min(keep, key=lambda c: theta[c])
        if theta[worst] >= 0:
            break
        keep.remove(worst)
    return theta


class AcceptanceTracker:
    """Conditional acceptance per draft position, from decayed counts: every position's
    counts shrink by ``exp(-n / memory)`` when ``n`` new first drafts are counted, so the
    estimate follows a drifting policy over about ``memory`` drafts, and a position no
    longer tried (the chain got shorter) forgets its old rate. A position with few counts is
    pulled toward the one before it (``prior_weight`` pseudo-drafts; position 1 toward
    ``prior``): a longer chain is tried as soon as the shorter one does well."""

    def __init__(self, max_k: int, memory: float = 2048.0, prior: float = 0.5,
                 prior_weight: float = 2.0) -> None:
        if max_k < 1 or memory <= 0 or not 0.0 <= prior <= 1.0 or prior_weight <= 0:
            raise ValueError("AcceptanceTracker needs max_k >= 1, memory > 0, prior in "
                             "[0, 1], prior_weight > 0")
        self.accepted = np.zeros(max_k)
        self.proposed = np.zeros(max_k)
        self.memory = memory
        self.prior = prior
        self.prior_weight = prior_weight
        self.version = 0  # bumped by every update (callers cache what they derive)
        self._conditional: list[float] | None = None

    def update(self, tries: Sequence[float], accepted: Sequence[float]) -> None:
        """One step's counts per position: drafts there whose earlier drafts were all
        accepted (``tries``) and how many of them were accepted."""
        clock = max(tries, default=0.0)
        if clock <= 0:
            return
        decay = math.exp(-clock / self.memory)
        self.proposed *= decay
        self.accepted *= decay
        n = min(len(tries), len(self.proposed))
        self.proposed[:n] += np.asarray(tries[:n], dtype=float)
        self.accepted[:n] += np.asarray(accepted[:n], dtype=float)
        self.version += 1
        self._conditional = None

    def conditional(self) -> list[float]:
        """Estimated ``a_i``, positions 1..max_k."""
        if self._conditional is None:
            out, prev, w = [], self.prior, self.prior_weight
            for a, p in zip(self.accepted.tolist(), self.proposed.tolist()):
                prev = (a + w * prev) / (p + w)
                out.append(prev)
            self._conditional = out
        return self._conditional

    def expected(self, k: int) -> float:
        return expected_accepted(self.conditional(), k)


__all__ = ["MAX_TOLERANCE", "AcceptanceTracker", "CostModel", "StepCost", "StepMeasure",
           "best_k", "drafts_identified", "fit_error",
           "expected_accepted", "expected_by_k", "fit_relative", "identified_terms"]
