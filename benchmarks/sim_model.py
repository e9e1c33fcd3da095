"""The rollout simulator's maths (``simulate.py``): acceptance per draft position, step cost
models, k policies and the step loop with a shrinking batch.

A rollout of ``N`` sequences with prompt lengths ``P_i`` and completion lengths ``L_i``: one
prefill step (every sequence gets its first token), then decode steps over the sequences still
running; a step with draft length ``k`` costs ``cost.step_time(B, k, ctx)`` for ``B`` running
sequences holding ``ctx`` tokens in all, and each sequence keeps ``1 + A`` tokens (``A`` ~ the
accepted drafts of a chain of ``k``, cut at its end), so the batch shrinks as the long tail
finishes. Policies: ``k = 0``, a fixed ``k``, and ``auto``: every step the ``k <= k_max`` with the
most expected tokens per second ``E[A + 1 | k] / t(B, k)`` (the issue's rule; with the true
acceptance it is the per-step oracle).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from specengine.core.cost_model import best_k, fit_relative


@dataclass(frozen=True)
class StepSample:
    """One measured engine step: ``B`` requests advanced, ``k`` the longest chain drafted in
    it (0 for a prefill), ``ctx`` tokens held before it (a prefill: the prompt tokens it
    processed), CPU and wall seconds, and how many requests it finished."""

    batch: int
    k: int
    ctx: int
    cpu_s: float
    wall_s: float
    prefill: bool
    finished: int = 0


@dataclass(frozen=True)
class Acceptance:
    """``reach[j]`` = P(the first ``j + 1`` drafts are all accepted) for a chain longer than
    ``j`` (non-increasing, in [0, 1]). Positions past the measured ones continue with the last
    conditional rate ``reach[-1] / reach[-2]`` (or ``reach[0]`` with one position)."""

    reach: tuple[float, ...]

    def __post_init__(self) -> None:
        r = self.reach
        if not r or any(not 0.0 <= x <= 1.0 for x in r) or any(b > a + 1e-12 for a, b in
                                                                zip(r, r[1:])):
            raise ValueError(f"reach must be non-empty, in [0, 1] and non-increasing, got {r}")

    @classmethod
    def from_stats(cls, accepted_per_position: Sequence[int],
                   proposed_per_position: Sequence[int]) -> Acceptance:
        """From ``engine.stats``: position j's accepted over proposed (positions with nothing
        proposed are dropped), made non-increasing."""
        reach, last = [], 1.0
        for a, p in zip(accepted_per_position, proposed_per_position):
            if p <= 0:
                break
            last = min(last, a / p)
            reach.append(last)
        if not reach:
            raise ValueError("no drafts were proposed: no acceptance to measure")
        return cls(tuple(reach))

    @classmethod
    def from_conditional(cls, rates: Sequence[float]) -> Acceptance:
        """From conditional rates: draft j accepted given drafts 0..j-1 were."""
        return cls(tuple(float(x) for x in np.cumprod(rates)))

    def shrunk(self, accepted: Sequence[int], proposed: Sequence[int],
               weight: float = 2.0) -> Acceptance:
        """One sequence's own profile from its counts, shrunk toward this one (``weight``
        pseudo-drafts per position): sequences differ (a hard prompt drafts worse all along),
        and the slowest ones set how long a rollout's tail runs."""
        reach, last = [], 1.0
        for j, r in enumerate(self.reach):
            a = accepted[j] if j < len(accepted) else 0
            p = proposed[j] if j < len(proposed) else 0
            last = min(last, (a + weight * r) / (p + weight))
            reach.append(last)
        return Acceptance(tuple(reach))

    def reach_at(self, j: int) -> float:
        r = self.reach
        if j < len(r):
            return r[j]
        tail = r[-1] / r[-2] if len(r) > 1 and r[-2] > 0 else r[0]
        return r[-1] * tail ** (j - len(r) + 1)

    def expected(self, k: int) -> float:
        """E[accepted drafts | chain of k]."""
        return sum(self.reach_at(j) for j in range(k))

    def pmf(self, k: int) -> np.ndarray:
        """P(A = a), a = 0..k, for a chain of k."""
        reach = [1.0] + [self.reach_at(j) for j in range(k)] + [0.0]
        return np.array([reach[a] - reach[a + 1] for a in range(k + 1)])


class StepCost(Protocol):
    def step_time(self, batch: int, k: int, ctx: int) -> float:
        """Seconds of one decode step: ``batch`` sequences, ``k`` drafts each, ``ctx``
        tokens in the KV cache in all."""
        ...

    def prefill_time(self, batch: int, num_tokens: int) -> float:
        """Seconds of the prefill of ``batch`` prompts, ``num_tokens`` in all."""
        ...


def _step_features(batch: np.ndarray, k: np.ndarray, ctx: np.ndarray) -> np.ndarray:
    drafting = (k > 0).astype(float)
    return np.stack([np.ones_like(batch), batch, k, k * batch, drafting, drafting * batch,
                     ctx * (k + 1)], axis=1).astype(float)


@dataclass(frozen=True)
class LinearStepCost:
    """A measured step cost: ``t(B, k, ctx) = θ·[1, B, k, kB, 1{k>0}, 1{k>0}B, ctx(k+1)]``
    (host work per step and per sequence, draft passes per token and per row, the verify
    pass's tokens, attention over the context) and ``prefill = π·[1, B, tokens]``, fitted by
    least squares on relative error so small and large batches both count."""

    theta: tuple[float, ...]
    prefill: tuple[float, float, float]

    def step_time(self, batch: int, k: int, ctx: int) -> float:
        f = _step_features(np.array([batch]), np.array([k]), np.array([ctx]))[0]
        return max(float(f @ np.asarray(self.theta)), 1e-9)

    def prefill_time(self, batch: int, num_tokens: int) -> float:
        p0, p1, p2 = self.prefill
        return max(p0 + p1 * batch + p2 * num_tokens, 1e-9)

    @classmethod
    def fit(cls, samples: Sequence[StepSample], use_wall: bool = False,
            robust: bool = False) -> LinearStepCost:
        """Least squares on relative error; ``robust``: least absolute relative error (the
        conditional median, by iteratively reweighted least squares), which a shared
        machine's bursts (steps another job slowed) barely move."""
        dec = [s for s in samples if not s.prefill]
        pre = [s for s in samples if s.prefill]
        if len(dec) < 8 or not pre:
            raise ValueError("calibration needs >= 8 decode steps and a prefill")
        y = np.array([s.wall_s if use_wall else s.cpu_s for s in dec])
        x = _step_features(np.array([s.batch for s in dec], float),
                           np.array([s.k for s in dec], float),
                           np.array([s.ctx for s in dec], float))
        theta = fit_relative(x, y, robust=robust, iters=50)  # the engine's k="auto" fit
        yp = np.array([s.wall_s if use_wall else s.cpu_s for s in pre])
        xp = np.array([[1.0, s.batch, s.ctx] for s in pre])
        if len(pre) >= 3:
            pi = np.linalg.lstsq(xp / yp[:, None], np.ones_like(yp), rcond=None)[0]
        else:  # too few prefills to separate the terms: a mean time per token
            pi = np.array([0.0, 0.0, yp.sum() / xp[:, 2].sum()])
        return cls(tuple(float(t) for t in theta), (float(pi[0]), float(pi[1]), float(pi[2])))


@dataclass(frozen=True)
class Policy:
    """``k`` every step (``auto=False``), or the best ``k`` in 0..``k`` for the step."""

    k: int
    auto: bool = False

    def choose(self, batch: int, ctx: int, cost: StepCost, acc: Acceptance | None) -> int:
        if not self.auto or acc is None:
            return self.k if acc is not None else 0
        return best_k([acc.expected(k) for k in range(self.k + 1)],  # the engine's rule
                      [cost.step_time(batch, k, ctx) for k in range(self.k + 1)])[0]

    @property
    def label(self) -> str:
        return f"auto (k<={self.k})" if self.auto else f"k={self.k}"


@dataclass
class SimResult:
    time_s: float
    prefill_s: float
    num_steps: float
    tokens_per_step: float  # tokens kept per (sequence, step)
    k_hist: dict[int, int] = field(default_factory=dict)


def simulate(lengths: Sequence[int], prompt_lens: Sequence[int], cost: StepCost,
             acc: Acceptance | None, policy: Policy, *, max_tokens: Sequence[int] | None = None,
             per_seq: Sequence[Acceptance] | None = None, padded: bool = False,
             repeats: int = 16, seed: int = 0) -> SimResult:
    """Predicted rollout time (mean over ``repeats`` Monte Carlo draws of the accepted counts;
    exact with no drafting). ``lengths``: completion tokens per sequence (>= 1). As in the
    engine, a sequence drafts at most ``max_tokens - generated - 1`` tokens (default: its
    length is its ``max_tokens``); a step costs its longest chain (the eager path) or the
    policy's ``k`` (``padded``: the static / CUDA-graph path verifies ``k + 1`` per row).
    ``acc`` is the batch's acceptance (the policy decides from it); ``per_seq``, if given,
    each sequence's own (what its drafts' fate is drawn from)."""
    lens = np.asarray(lengths, dtype=np.int64)
    prompts = np.asarray(prompt_lens, dtype=np.int64)
    limit = lens if max_tokens is None else np.asarray(max_tokens, dtype=np.int64)
    if lens.size == 0 or (lens < 1).any() or prompts.shape != lens.shape or \
            limit.shape != lens.shape or (limit < lens).any():
        raise ValueError("lengths must be >= 1, one per sequence, with a prompt length and a "
                         "max_tokens >= the length each")
    rng = np.random.default_rng(seed)
    prefill = cost.prefill_time(len(lens), int(prompts.sum()))
    times, steps, seq_steps, k_hist = [], [], [], {}
    pmfs: dict[int, np.ndarray] = {}
    for _ in range(repeats if acc is not None else 1):
        left = lens - 1  # the prefill emits the first token
        ctx = prompts + 1
        t, n, ns = prefill, 0, 0
        while True:
            running = np.flatnonzero(left > 0)
            b = len(running)
            if b == 0:
                break
            c = int(ctx[running].sum())
            k = policy.choose(b, c, cost, acc)
            k_hist[k] = k_hist.get(k, 0) + 1
            cuts = np.minimum(k, limit[running] - (lens[running] - left[running]) - 1)
            cuts = np.maximum(cuts, 0)
            t += cost.step_time(b, k if padded else int(cuts.max()), c)
            kept = np.ones(b, dtype=np.int64)
            if per_seq is not None:
                for r, (i, cut) in enumerate(zip(running.tolist(), cuts.tolist())):
                    if cut > 0:
                        kept[r] += rng.choice(cut + 1, p=per_seq[i].pmf(cut))
            for cut in np.unique(cuts[cuts > 0]).tolist() if per_seq is None else ():
                rows = cuts == cut
                if cut not in pmfs:
                    pmfs[cut] = acc.pmf(cut)  # type: ignore[union-attr]
                kept[rows] += rng.choice(cut + 1, size=int(rows.sum()), p=pmfs[cut])
            kept = np.minimum(kept, left[running])
            left[running] -= kept
            ctx[running] += kept
            n += 1
            ns += b
        times.append(t)
        steps.append(n)
        seq_steps.append(ns)
    tokens = float((lens - 1).sum())
    return SimResult(float(np.mean(times)), prefill, float(np.mean(steps)),
                     tokens / max(float(np.mean(seq_steps)), 1.0), k_hist)


def plain_decode_time(lengths: Sequence[int], prompt_lens: Sequence[int],
                      cost: StepCost) -> float:
    """``k = 0`` in closed form: the prefill, then step ``s`` (1, 2, ...) runs the sequences
    longer than ``s`` tokens, each holding its prompt and ``s`` tokens."""
    total = cost.prefill_time(len(lengths), int(sum(prompt_lens)))
    for s in range(1, max(lengths)):
        running = [p for p, n in zip(prompt_lens, lengths) if n > s]
        total += cost.step_time(len(running), 0, sum(running) + s * len(running))
    return total


def step_speedup_bound(r_gen: float, alpha: float) -> float:
    """Amdahl: an RL step whose generation share is ``r_gen`` gains at most
    ``1 / (r_gen / alpha + 1 - r_gen)`` from a rollout speedup ``alpha``."""
    if not 0.0 <= r_gen <= 1.0 or alpha <= 0:
        raise ValueError(f"need 0 <= r_gen <= 1 and alpha > 0, got {r_gen}, {alpha}")
    return 1.0 / (r_gen / alpha + 1.0 - r_gen)


def lognormal_lengths(n: int, median: float, sigma: float, cap: int, seed: int = 0
                      ) -> list[int]:
    """``n`` long-tailed completion lengths: lognormal around ``median``, cut at ``cap``."""
    rng = np.random.default_rng(seed)
    raw = np.exp(math.log(median) + sigma * rng.standard_normal(n))
    return [int(x) for x in np.clip(np.round(raw), 1, cap)]
