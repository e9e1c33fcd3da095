"""The rollout simulator's maths (benchmarks/sim_model.py, sim_roofline.py) on cases worked
out by hand: acceptance profiles, k = 0 against the closed form, constant acceptance, the
draft cut at max_tokens, the auto policy's choice, the cost fit, the roofline and the
step-speedup bound. No timing."""

from __future__ import annotations

import itertools
import math
import sys
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

from sim_model import (  # noqa: E402
    Acceptance,
    LinearStepCost,
    Policy,
    StepSample,
    lognormal_lengths,
    plain_decode_time,
    simulate,
    step_speedup_bound,
)
from sim_roofline import GPUS, SHAPES, RooflineCost  # noqa: E402

from specengine.core.cost_model import expected_distinct_experts  # noqa: E402


@dataclass(frozen=True)
class ToyCost:
    """``step = base + per_seq * B + per_draft * k``; prefill ``pre``."""

    base: float = 1.0
    per_seq: float = 0.0
    per_draft: float = 0.0
    pre: float = 0.0

    def step_time(self, batch: int, k: int, ctx: int) -> float:
        return self.base + self.per_seq * batch + self.per_draft * k

    def prefill_time(self, batch: int, num_tokens: int) -> float:
        return self.pre


class BatchCost(ToyCost):
    """A draft token costs 1 % of a step per sequence: ``1 + 0.01 * B * k``."""

    def step_time(self, batch: int, k: int, ctx: int) -> float:
        return 1.0 + 0.01 * batch * k


def test_step_speedup_bound() -> None:
    assert step_speedup_bound(0.5, 2.0) == pytest.approx(1 / (0.25 + 0.5))
    assert step_speedup_bound(1.0, 3.0) == pytest.approx(3.0)  # all generation: S = alpha
    assert step_speedup_bound(0.0, 3.0) == pytest.approx(1.0)  # no generation: nothing
    assert step_speedup_bound(0.9, 1e9) == pytest.approx(10.0)  # Amdahl's limit 1/(1-R)
    for bad in ((1.5, 2.0), (-0.1, 2.0), (0.5, 0.0)):
        with pytest.raises(ValueError):
            step_speedup_bound(*bad)


def test_acceptance_profiles() -> None:
    acc = Acceptance.from_conditional([0.5, 0.5])
    assert acc.reach == (0.5, 0.25)
    assert acc.expected(2) == pytest.approx(0.75)
    assert acc.pmf(2) == pytest.approx([0.5, 0.25, 0.25])
    assert acc.reach_at(3) == pytest.approx(0.0625)  # continues at the last conditional rate
    assert acc.pmf(0) == pytest.approx([1.0])
    for k in range(6):
        assert acc.pmf(k).sum() == pytest.approx(1.0)
        assert (np.arange(k + 1) * acc.pmf(k)).sum() == pytest.approx(acc.expected(k))
    # engine.stats: accepted / proposed per position, made non-increasing; empty positions end
    stats = Acceptance.from_stats([80, 60, 50, 0], [100, 100, 50, 0])
    assert stats.reach == pytest.approx((0.8, 0.6, 0.6))
    # a sequence's own profile, shrunk toward the batch's with 2 pseudo-drafts per position
    own = Acceptance((0.5, 0.5)).shrunk([2, 0], [2, 2])
    assert own.reach == pytest.approx(((2 + 1) / 4, (0 + 1) / 4))
    for bad in ((), (0.5, 0.6), (1.2,)):
        with pytest.raises(ValueError):
            Acceptance(bad)
    with pytest.raises(ValueError, match="no drafts"):
        Acceptance.from_stats([], [])


def test_k0_equals_plain_decode_time() -> None:
    # lengths 1, 3, 5: after the prefill, steps 1-2 run two sequences, steps 3-4 one
    cost = ToyCost(base=0.0, per_seq=1.0, pre=10.0)
    sim = simulate([1, 3, 5], [2, 2, 2], cost, None, Policy(0))
    assert sim.num_steps == 4 and sim.time_s == pytest.approx(10 + 2 + 2 + 1 + 1)
    assert plain_decode_time([1, 3, 5], [2, 2, 2], cost) == pytest.approx(sim.time_s)
    lin = LinearStepCost((1e-3, 2e-4, 5e-4, 1e-5, 1e-4, 1e-6, 1e-7), (1e-3, 1e-4, 1e-5))
    lengths = lognormal_lengths(40, 20, 0.8, 90, seed=3)
    prompts = list(range(5, 45))
    # a drafter policy without an acceptance profile also decodes plainly
    for policy in (Policy(0), Policy(4)):
        got = simulate(lengths, prompts, lin, None, policy).time_s
        assert got == pytest.approx(plain_decode_time(lengths, prompts, lin), rel=1e-12)


def test_constant_acceptance_and_the_cut_at_max_tokens() -> None:
    always = Acceptance((1.0,))  # every draft accepted: k = 3 keeps 4 tokens a step
    cost = ToyCost(base=1.0, per_draft=0.5)
    # 9 tokens: the prefill's, then 4 + 4
    sim = simulate([9, 9], [1, 1], cost, always, Policy(3))
    assert sim.num_steps == 2 and sim.time_s == pytest.approx(2 * 2.5)
    assert sim.tokens_per_step == pytest.approx(4.0)
    # 10 tokens: 4 + 4, then the last token with no draft (max_tokens - generated - 1 = 0)
    sim = simulate([10], [1], cost, always, Policy(3))
    assert sim.num_steps == 3 and sim.time_s == pytest.approx(2.5 + 2.5 + 1.0)
    # padded (static path): the last step still verifies k + 1
    sim = simulate([10], [1], cost, always, Policy(3), padded=True)
    assert sim.time_s == pytest.approx(3 * 2.5)
    # ended early (a stop token) below max_tokens: no cut, the step costs its k
    sim = simulate([10], [1], cost, always, Policy(3), max_tokens=[64])
    assert sim.time_s == pytest.approx(3 * 2.5)
    # nothing accepted: the steps of k = 0, each paying for its drafts
    never = Acceptance((0.0,))
    sim = simulate([6, 4], [1, 1], cost, never, Policy(2), max_tokens=[50, 50])
    assert sim.num_steps == 5 and sim.time_s == pytest.approx(5 * 2.0)
    with pytest.raises(ValueError, match="max_tokens"):
        simulate([10], [1], cost, always, Policy(3), max_tokens=[5])


def test_monte_carlo_tokens_per_step() -> None:
    # one draft accepted with probability 0.3: E[kept] = 1.3 per step, Var = 0.21
    acc = Acceptance((0.3,))
    sim = simulate([4001], [1], ToyCost(), acc, Policy(1), repeats=8, seed=1)
    # 4000 tokens in about 4000 / 1.3 steps; the per-run steps' sd is about 26, of the mean ~9
    assert sim.num_steps == pytest.approx(4000 / 1.3, abs=40)
    assert sim.tokens_per_step == pytest.approx(1.3, abs=0.02)


def test_auto_policy_maximises_tokens_per_second() -> None:
    acc = Acceptance.from_conditional([0.9] * 8)
    free = ToyCost(base=1.0)  # drafting costs nothing: the longest chain wins
    assert Policy(6, auto=True).choose(8, 0, free, acc) == 6
    costly = ToyCost(base=1.0, per_draft=1.0)  # (1 + E[A|k]) / (1 + k) is best at k = 0
    assert Policy(6, auto=True).choose(8, 0, costly, Acceptance((0.1,))) == 0
    # in between, by hand: rates 1, 1.9/1.3, 2.71/1.6, 3.439/1.9, ... peak at k = 5
    mid = ToyCost(base=1.0, per_draft=0.3)
    rates = [(1 + acc.expected(k)) / (1 + 0.3 * k) for k in range(9)]
    assert Policy(8, auto=True).choose(1, 0, mid, acc) == int(np.argmax(rates))
    assert Policy(3).choose(1, 0, mid, acc) == 3 and Policy(3).choose(1, 0, mid, None) == 0
    sim = simulate([50] * 4, [1] * 4, mid, acc, Policy(8, auto=True))
    assert set(sim.k_hist) == {int(np.argmax(rates))}  # the cost does not depend on B here
    # a batch-dependent cost: drafts pay at batch 1, not at batch 100
    batchy = BatchCost()
    assert Policy(8, auto=True).choose(1, 0, batchy, acc) == 8
    assert Policy(8, auto=True).choose(100, 0, batchy, acc) == 0


def test_cost_fit_recovers_known_coefficients() -> None:
    theta = (7e-3, 6e-5, 3e-3, 6e-5, 3e-4, 7e-6, 1.4e-6)
    truth = LinearStepCost(theta, (8e-3, 3e-3, 1e-5))
    samples = [StepSample(b, k, c, truth.step_time(b, k, c), 0.0, False)
               for b in (1, 3, 8, 16, 40, 64) for k in (0, 1, 2, 3, 5) for c in (10, 500, 3000)]
    samples += [StepSample(b, 0, n, truth.prefill_time(b, n), 0.0, True)
                for b, n in ((1, 9), (8, 80), (64, 700), (16, 150))]
    fit = LinearStepCost.fit(samples)
    assert fit.theta == pytest.approx(theta, rel=1e-6)
    assert fit.prefill == pytest.approx((8e-3, 3e-3, 1e-5), rel=1e-6)
    # steps slowed by another job's burst (3 of 90, twice as long) pull a least-squares fit;
    # the median fit lands on the others
    slowed = [StepSample(x.batch, x.k, x.ctx, 2 * x.cpu_s, 0.0, False) if i % 30 == 7 else x
              for i, x in enumerate(samples)]
    assert LinearStepCost.fit(slowed).theta != pytest.approx(theta, rel=1e-2)
    robust = LinearStepCost.fit(slowed, robust=True)
    for x in samples[:60]:
        assert robust.step_time(x.batch, x.k, x.ctx) == pytest.approx(x.cpu_s, rel=1e-3)
    with pytest.raises(ValueError, match="calibration"):
        LinearStepCost.fit(samples[:3])


def test_roofline_by_hand() -> None:
    h100, s = GPUS["H100"], SHAPES["8B"]
    cost = RooflineCost(h100, s)
    # Qwen3-8B: per layer q/o 2 * 4096 * 4096, k/v 2 * 4096 * 1024, MLP 3 * 4096 * 12288
    layer = 2 * 4096 * 4096 + 2 * 4096 * 1024 + 3 * 4096 * 12288
    weights = 2 * (36 * layer + 151936 * 4096)  # bf16 bytes read by a decode pass
    assert weights / 1e9 == pytest.approx(15.14, abs=0.01)
    # batch 1, no context: weight-bound, plus its KV entry written (36 layers of K and V,
    # 8 heads x 128) and its logits written and read
    kv = 36 * 2 * 8 * 128 * 2
    expected = (weights + kv + 2 * 2 * 151936) / (h100.hbm_bytes_s * 0.8) + cost.pass_s
    assert cost.verify_time(1, 0, 0) == pytest.approx(expected)
    assert cost.verify_time(1, 3, 0) > cost.verify_time(1, 0, 0)  # more logits, same weights
    # a big batch turns compute-bound: 2 * tokens * params / (peak * 0.6)
    big = cost.verify_time(4096, 3, 0) - cost.pass_s
    params = 36 * layer + 151936 * 4096
    assert big == pytest.approx(2 * 4096 * 4 * params / (h100.bf16_flops_s * 0.6))
    # MoE: one token reads its top-8 experts of 128, a large pass all of them
    moe = SHAPES["235B-A22B"]
    expert = 3 * 4096 * 1536
    assert moe.mlp_params(1) == pytest.approx((8 * expert + 4096 * 128, 8 * expert))
    assert moe.mlp_params(10**6)[0] == pytest.approx(128 * expert + 4096 * 128)
    assert cost.draft_time(8, 0, 100) == 0.0 and cost.draft_time(8, 3, 100) > 0.0
    # a faster GPU is never slower
    for b, k in ((1, 0), (64, 3), (512, 7)):
        assert (RooflineCost(GPUS["B200"], s).step_time(b, k, 1000 * b)
                <= cost.step_time(b, k, 1000 * b))
    assert math.isfinite(cost.prefill_time(8, 2048))


def _distinct_by_enumeration(num_tokens: int, num_experts: int, top_k: int) -> float:
    """The mean number of distinct experts over every routing of ``num_tokens`` tokens, each
    to a ``top_k``-subset of ``num_experts`` (all equally likely): exact, no sampling."""
    subsets = list(itertools.combinations(range(num_experts), top_k))
    total = count = 0
    for routing in itertools.product(subsets, repeat=num_tokens):
        total += len(set().union(*routing))
        count += 1
    return total / count


@pytest.mark.parametrize("num_tokens,num_experts,top_k",
                         [(1, 5, 2), (2, 5, 2), (3, 5, 2), (2, 6, 3), (3, 4, 1), (2, 7, 7)])
def test_expected_distinct_experts_by_enumeration(num_tokens: int, num_experts: int,
                                                  top_k: int) -> None:
    got = expected_distinct_experts(num_tokens, num_experts, top_k)
    assert got == pytest.approx(_distinct_by_enumeration(num_tokens, num_experts, top_k))


def test_expected_distinct_experts_limits_and_errors() -> None:
    assert expected_distinct_experts(0, 128, 8) == 0.0
    assert expected_distinct_experts(1, 128, 8) == pytest.approx(8.0)  # one token: its top-k
    # a verify pass of 4 tokens (k=3) touches more than one token does, fewer than 4·top_k
    four = expected_distinct_experts(4, 128, 8)
    assert 8.0 < four < 32.0
    assert expected_distinct_experts(10**6, 128, 8) == pytest.approx(128.0)
    for bad in [dict(num_experts=4, top_k=5), dict(num_experts=4, top_k=0),
                dict(num_experts=0, top_k=1)]:
        with pytest.raises(ValueError, match="top_k"):
            expected_distinct_experts(3, **bad)
    with pytest.raises(ValueError, match="num_tokens"):
        expected_distinct_experts(-1, 8, 2)


@pytest.mark.parametrize("shape", ["30B-A3B", "235B-A22B"])
def test_roofline_moe_reads_expected_distinct_experts(shape: str) -> None:
    """The simulator's MoE projection reads the weights of exactly the expected distinct
    experts of a pass's tokens (plus the router), and uses top_k experts' FLOPs per token."""
    s = SHAPES[shape]
    assert s.experts == 128 and s.top_k == 8
    expert = 3 * s.hidden * s.expert_intermediate
    for tokens in (1, 4, 64 * 4, 512 * 8):
        touched = expected_distinct_experts(tokens, s.experts, s.top_k)
        assert s.mlp_params(tokens) == pytest.approx(
            (touched * expert + s.hidden * s.experts, s.top_k * expert))
    # verify of k=3 at batch 1 reads ~3.6x the expert weights of a 1-token decode, so it
    # costs a MoE target relatively more than a dense one of the same width
    cost, dense = RooflineCost(GPUS["H100"], s), RooflineCost(GPUS["H100"], SHAPES["8B"])
    assert (cost.verify_time(1, 3, 0) / cost.verify_time(1, 0, 0)
            > dense.verify_time(1, 3, 0) / dense.verify_time(1, 0, 0))
