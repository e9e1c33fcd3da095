"""The step cost model and acceptance tracker behind ``k="auto"`` (core/cost_model.py,
docs/design.md §15), unit by unit: the exact features of ``t_draft`` and ``t_verify``, the
step times (per k, cached, non-decreasing), the relative fit (plain and robust, argument
checks), the CostModel's window per batch-size octave, refit cadence and identified terms,
and the AcceptanceTracker's decay, prior pulling and argument checks. No engine, no timing."""

from __future__ import annotations

import itertools
import math
from fractions import Fraction

import numpy as np
import pytest

from specengine.core.cost_model import (
    AcceptanceTracker,
    CostModel,
    StepCost,
    StepMeasure,
    best_k,
    draft_features,
    drafts_identified,
    expected_accepted,
    expected_by_k,
    expected_distinct_experts,
    fit_relative,
    identified_terms,
    verify_features,
)

# every coefficient distinct, so that a feature mixed up shows in the step time
COST = StepCost(draft=(1e-3, 2e-3, 3e-3, 4e-3, 5e-3, 6e-3),
                verify=(7e-3, 8e-3, 9e-3, 10e-3, 11e-3, 12e-3, 13e-3, 14e-3))
TRUE = StepCost(draft=(1e-4, 1e-6, 5e-4, 2e-6, 1e-3, 3e-5),
                verify=(5e-3, 2e-4, 2e-5, 1e-4, 2e-3, 1e-5, 1e-3, 2e-5))


def measured(b: int, k: int, sync: bool, scale: float = 1.0) -> StepMeasure:
    return StepMeasure(b, k, sync, scale * TRUE.t_draft(b, k),
                       scale * TRUE.t_verify(b, k + 1, sync))


def identifying_steps() -> list[StepMeasure]:
    """Steps at two batch octaves, three chain lengths each, plain and catch-up: every term
    of the model identified."""
    return [measured(b, k, k > 0) for b in (2, 16) for k in (0, 1, 3)] + [
        measured(b, 0, True) for b in (2, 16)]


# ---------------------------------------------------------------------------- features


def test_draft_features_are_staging_fixed_pass_and_per_token_terms() -> None:
    assert draft_features(3, 0) == [1.0, 3, 0.0, 0.0, 0, 0]
    assert draft_features(3, 1) == [1.0, 3, 1.0, 3.0, 1, 3]
    assert draft_features(3, 2) == [1.0, 3, 1.0, 3.0, 2, 6]


def test_verify_features_are_pass_tokens_and_catch_up_terms() -> None:
    assert verify_features(3, 2, False) == [1.0, 3, 6, 2, 0.0, 0.0, 1.0, 3.0]
    assert verify_features(3, 2, True) == [1.0, 3, 6, 2, 1.0, 3.0, 1.0, 3.0]
    # a pass without drafts (n = 1) has no verify-of-drafts terms
    assert verify_features(3, 1, True) == [1.0, 3, 3, 1, 1.0, 3.0, 0.0, 0.0]


# ------------------------------------------------------------------------- step times


def test_step_time_is_draft_plus_verify_of_k_plus_one_tokens_with_catch_up() -> None:
    """By hand at B = 2: k = 0 plain, k = 0 catching up, k = 1 (drafting always catches
    up); ``t_verify`` defaults to no catch-up."""
    assert COST.step_time(2, 0) == pytest.approx((1 + 4) * 1e-3 + (7 + 16 + 18 + 10) * 1e-3)
    assert COST.step_time(2, 0, sync=True) == pytest.approx(
        5e-3 + (7 + 16 + 18 + 10 + 11 + 24) * 1e-3)
    assert COST.step_time(2, 1) == pytest.approx(
        (1 + 4 + 3 + 8 + 5 + 12) * 1e-3 + (7 + 16 + 36 + 20 + 11 + 24 + 13 + 28) * 1e-3)
    assert COST.t_verify(2, 1) == pytest.approx(51e-3)
    assert COST.t_draft(2, 0) == pytest.approx(5e-3)


@pytest.mark.parametrize("batch", [1, 3, 2.5])
def test_step_times_match_step_time_per_k(batch: float) -> None:
    """The vectorised step times are :meth:`StepCost.step_time` at every k (a cost that
    grows in k: nothing to flatten), a fractional mean batch included; without ``sync`` the
    k = 0 step does not catch up."""
    cost = StepCost(COST.draft, COST.verify)  # its own cache
    for sync in (False, True):
        want = [cost.step_time(batch, k, sync) for k in range(5)]  # type: ignore[arg-type]
        assert cost.step_times(batch, 4, sync) == pytest.approx(want, rel=1e-12)  # type: ignore[arg-type]
    assert cost.step_times(3, 2)[0] == pytest.approx(cost.step_time(3, 0, sync=False))


def test_step_times_never_fall_with_a_longer_chain() -> None:
    """A fit whose per-token draft cost came out negative: the step times are the running
    maximum of the step time in k."""
    cost = StepCost(draft=(0, 0, 0.5, 0, -0.2, 0), verify=(1, 0, 0, 0, 0, 0, 0, 0))
    raw = [cost.step_time(1, k) for k in range(5)]
    assert raw[2] < raw[1]
    assert cost.step_times(1, 4) == pytest.approx(np.maximum.accumulate(raw))


def test_step_times_are_cached_per_batch_and_bounded() -> None:
    """The step loop asks for the same few step times every step: the same array comes back;
    the cache holds 4096 entries and is dropped on the next."""
    cost = StepCost(COST.draft, COST.verify)
    first = cost.step_times(1, 3)
    assert cost.step_times(1, 3) is first
    assert cost.step_times(1, 3, sync=True) is not first
    for b in range(2, 4096):  # 4096 entries with the two above
        cost.step_times(b, 3)
    assert cost.step_times(1, 3) is first
    cost.step_times(5000, 3)  # the 4097th
    again = cost.step_times(1, 3)
    assert again is not first and np.array_equal(again, first)


def test_step_cost_checks_its_coefficients() -> None:
    with pytest.raises(ValueError, match=r"^StepCost needs 6 draft and 8 verify coefficients$"):
        StepCost(draft=(0.0,) * 5, verify=(0.0,) * 8)
    with pytest.raises(ValueError, match=r"^StepCost needs 6 draft and 8 verify coefficients$"):
        StepCost(draft=(0.0,) * 6, verify=(0.0,) * 7)
    with pytest.raises(ValueError, match=r"^StepCost coefficients must be finite$"):
        StepCost(draft=(0.0,) * 5 + (math.nan,), verify=(0.0,) * 8)


# ------------------------------------------------------------------------------ fitting


def _noisy_problem() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    x = np.column_stack([np.ones(40), rng.uniform(1, 50, 40)])
    y = x @ np.array([2.0, 0.3]) * rng.uniform(0.9, 1.1, 40)
    y[::9] *= 4.0  # bursts
    return x, y


def test_plain_fit_is_least_squares_on_relative_error() -> None:
    x, y = _noisy_problem()
    want = np.linalg.lstsq(x / y[:, None], np.ones(len(y)), rcond=None)[0]
    assert fit_relative(x, y, robust=False) == pytest.approx(want, rel=1e-10)
    assert not np.allclose(fit_relative(x, y), want, rtol=1e-3)  # the robust one differs


def test_robust_fit_runs_thirty_reweightings_by_default_and_none_gives_zeros() -> None:
    x, y = _noisy_problem()
    assert np.array_equal(fit_relative(x, y), fit_relative(x, y, iters=30))
    assert not np.array_equal(fit_relative(x, y, iters=30), fit_relative(x, y, iters=31))
    assert np.array_equal(fit_relative(x, y, iters=0), np.zeros(2))


def test_robust_fit_is_the_median_of_relative_error() -> None:
    """One coefficient: the least absolute relative error solution is the median of y / x,
    which the bursts do not move."""
    x = np.ones((7, 1))
    y = np.array([1.0, 1.0, 1.0, 1.0, 1.0, 9.0, 9.0])
    assert fit_relative(x, y, iters=60)[0] == pytest.approx(1.0, rel=1e-3)


def test_fits_and_rates_take_exact_rationals_as_floats() -> None:
    """Times given as exact rationals are read as floats: the fit, the rule's rates, the
    expected counts and the tracker's counts come out as float arrays."""
    x, y = _noisy_problem()
    fx = [[Fraction(float(v)) for v in row] for row in x]
    fy = [Fraction(float(v)) for v in y]
    assert np.array_equal(fit_relative(np.asarray(fx, dtype=object), y), fit_relative(x, y))
    assert np.array_equal(fit_relative(x, np.asarray(fy, dtype=object)), fit_relative(x, y))
    k, rates = best_k([Fraction(0), Fraction(1, 2)], [1.0, 1.2])
    assert rates.dtype == np.float64 and k == 1
    k, rates = best_k([0.0, 0.5], [Fraction(1), Fraction(6, 5)])
    assert rates.dtype == np.float64 and k == 1
    assert expected_by_k([Fraction(1, 2)] * 3, 3).dtype == np.float64
    tracker = AcceptanceTracker(2)
    tracker.update([Fraction(4), Fraction(2)], [2.0, 1.0])
    tracker.update([4.0, 2.0], [Fraction(2), Fraction(1)])
    assert tracker.proposed.dtype == np.float64 and tracker.accepted.dtype == np.float64


def test_fit_relative_checks_its_arguments() -> None:
    msg = r"^fit_relative needs x \[N, P\], y \[N\] > 0$"
    with pytest.raises(ValueError, match=msg):
        fit_relative(np.ones(3), np.ones(3))  # x not 2-D
    with pytest.raises(ValueError, match=msg):
        fit_relative(np.ones((3, 2)), np.ones(4))  # lengths differ
    with pytest.raises(ValueError, match=msg):
        fit_relative(np.ones((3, 2)), np.array([1.0, 0.0, 1.0]))  # a zero time


# --------------------------------------------------------------------------- CostModel


def test_cost_model_starts_unfitted_and_counts_its_refits() -> None:
    model = CostModel()
    assert model.version == 0 and model.terms == (False, False) and not model.fitted
    model.calibrate(identifying_steps())
    assert model.version == 1 and model.terms == (True, True) and model.fitted


def test_calibration_needs_two_chain_lengths() -> None:
    with pytest.raises(ValueError, match=r"^a calibration needs steps at >= 2 chain lengths k$"):
        CostModel().calibrate([measured(4, 2, True)] * 3)
    fit = CostModel().calibrate([measured(4, 0, True), measured(4, 2, True)] * 2)
    assert fit.step_time(4, 2, True) == pytest.approx(TRUE.step_time(4, 2, True), rel=1e-6)


def test_refit_uses_steps_added_without_calibration() -> None:
    model = CostModel()
    for s in identifying_steps():
        model.add(s)
    assert not model.fitted  # no refit before a calibration
    fit = model.refit()
    assert fit.step_time(8, 2) == pytest.approx(TRUE.step_time(8, 2), rel=1e-4)


def test_cost_model_fits_with_its_iteration_count() -> None:
    """The fit of an identified model is :func:`fit_relative` over all columns with the
    model's ``iters`` (12 by default): a cheap refit, spread over many steps."""
    rng = np.random.default_rng(14)  # noise whose free fit is >= 0 (no column left out)
    steps = [measured(s.batch, s.k, s.sync, float(rng.uniform(0.8, 1.5)))
             for s in identifying_steps() * 3]
    xv = np.array([verify_features(s.batch, s.k + 1, s.sync) for s in steps])
    yv = np.array([s.verify_s for s in steps])
    for iters, model in ((12, CostModel()), (5, CostModel(iters=5))):
        fit = model.calibrate(steps)
        # equal but for rounding (the kept columns are a copy of x)
        assert np.allclose(fit.verify, fit_relative(xv, yv, iters=iters), rtol=1e-9, atol=0)
    assert not np.allclose(fit_relative(xv, yv, iters=12), fit_relative(xv, yv, iters=13),
                           rtol=1e-6, atol=0)


def test_the_verify_of_drafts_terms_need_a_step_without_drafts() -> None:
    """``v = 1{n > 1}`` is told from the per-token terms only by a step without drafts next
    to two drafting lengths; without one it is left out (its coefficients 0), with one the
    fit prices the decode and the verify passes as they are."""
    steps = [measured(b, k, True) for b in (2, 16) for k in (1, 3, 5)]
    assert not drafts_identified(steps)
    fit = CostModel().calibrate(steps)
    assert fit.verify[6] == fit.verify[7] == 0.0
    steps += [measured(b, 0, True) for b in (2, 16)]
    assert drafts_identified(steps) and not drafts_identified(steps[:1] + steps[-1:])
    fit = CostModel().calibrate(steps)
    for b, k in ((16, 0), (16, 1), (2, 4)):
        assert fit.step_time(b, k, sync=True) == pytest.approx(TRUE.step_time(b, k, sync=True),
                                                               rel=1e-4)
    assert fit.verify[6] == pytest.approx(TRUE.verify[6], rel=1e-3)


def test_every_fitted_coefficient_is_a_cost_at_least_zero() -> None:
    """A term the steps would fit below zero (a token, a sequence or a pass that saves time)
    is left out and the rest refitted: on steps whose unconstrained fit has a negative
    coefficient, the fit has none, and it is the unconstrained fit of the other columns."""
    rng = np.random.default_rng(3)
    steps = [measured(s.batch, s.k, s.sync, float(rng.uniform(0.8, 1.5)))
             for s in identifying_steps() * 3]
    xv = np.array([verify_features(s.batch, s.k + 1, s.sync) for s in steps])
    yv = np.array([s.verify_s for s in steps])
    free = fit_relative(xv, yv, iters=12)
    assert (free < 0).any()
    fit = CostModel().calibrate(steps)
    got = np.array(fit.verify)
    assert (got >= 0).all() and (got == 0).any()
    kept = np.flatnonzero(got != 0)
    assert np.allclose(got[kept], fit_relative(xv[:, kept], yv, iters=12), rtol=1e-9)


def test_steps_that_say_nothing_are_dropped() -> None:
    """A negative draft time or a non-positive verify time is not recorded; a step that did
    not draft (draft time 0) is."""
    model = CostModel()
    model.add(StepMeasure(4, 1, True, -1e-3, 1e-2))
    model.add(StepMeasure(4, 1, True, 1e-3, 0.0))
    model.add(StepMeasure(4, 1, True, 1e-3, -1e-2))
    assert sum(len(q) for q in model.recent.values()) == 0
    model.add(StepMeasure(4, 0, False, 0.0, 1e-2))
    assert [len(q) for q in model.recent.values()] == [1]


def test_recent_steps_are_kept_per_batch_octave() -> None:
    """``window`` latest steps of each octave (1, 2-3, 4-7, ...): batch 1 and batch 2 are
    octaves apart, and many steps of one do not crowd out the other."""
    model = CostModel(window=2)
    for b in (1, 1, 1, 2, 3, 3, 4):
        model.add(measured(b, 1, True))
    assert {o: [s.batch for s in q] for o, q in model.recent.items()} == {
        1: [1, 1], 2: [3, 3], 3: [4]}
    default = CostModel()
    for _ in range(65):
        default.add(measured(8, 1, True))
    assert [len(q) for q in default.recent.values()] == [64]


def test_batch_one_and_two_are_an_octave_apart_for_the_batch_terms() -> None:
    steps = [measured(b, k, k > 0) for b in (1, 2) for k in (0, 1, 3)]
    assert identified_terms(steps) == (True, True)
    model = CostModel(refit_every=1000)
    model.calibrate([measured(1, k, k > 0) for k in (0, 1, 3)] + [measured(1, 0, False),
                                                                   measured(2, 1, True)])
    assert model.terms == (False, True)
    model.add(measured(2, 3, True))  # the second octave's second chain length
    assert model.version == 2 and model.terms == (True, True)


def test_refits_every_refit_every_steps() -> None:
    """Once calibrated on steps that identify every term, the model refits on exactly every
    128th new step (the default), and not in between."""
    model = CostModel()
    model.calibrate(identifying_steps())
    step = measured(16, 1, True)
    for round_ in (2, 3):
        for _ in range(127):
            model.add(step)
        assert model.version == round_ - 1
        model.add(step)
        assert model.version == round_


# -------------------------------------------------------------------- AcceptanceTracker


def test_tracker_counts_decay_with_the_drafts_counted() -> None:
    """Every count shrinks by ``exp(-n / memory)`` (memory 2048 by default) when ``n`` new
    first drafts are counted."""
    tracker = AcceptanceTracker(2)
    tracker.update([10.0, 6.0], [6.0, 3.0])
    tracker.update([10.0, 4.0], [8.0, 2.0])
    decay = math.exp(-10.0 / 2048.0)
    assert tracker.proposed.tolist() == pytest.approx([10 * decay + 10, 6 * decay + 4])
    assert tracker.accepted.tolist() == pytest.approx([6 * decay + 8, 3 * decay + 2])
    short = AcceptanceTracker(1, memory=5.0)
    short.update([5.0], [5.0])
    short.update([1.0], [0.0])
    assert short.accepted[0] == pytest.approx(5 * math.exp(-0.2))


def test_tracker_pulls_few_counts_toward_the_position_before() -> None:
    """Two pseudo-drafts by default: position 1 toward ``prior``, each later one toward the
    estimate of the one before."""
    tracker = AcceptanceTracker(3)
    assert tracker.conditional() == pytest.approx([0.5, 0.5, 0.5])
    tracker.update([4.0], [4.0])
    first = (4 + 2 * 0.5) / (4 + 2)
    assert tracker.conditional() == pytest.approx([first, first, first])
    tracker.update([6.0, 4.0], [0.0, 0.0])
    a1 = (4 * math.exp(-6 / 2048) + 2 * 0.5) / (4 * math.exp(-6 / 2048) + 6 + 2)
    a2 = (0 + 2 * a1) / (4 + 2)
    assert tracker.conditional() == pytest.approx([a1, a2, a2])
    assert tracker.expected(2) == pytest.approx(expected_accepted(tracker.conditional(), 2))
    assert tracker.expected(2) == pytest.approx(a1 + a1 * a2)


def test_tracker_counts_each_step_once_and_skips_empty_ones() -> None:
    """A step that tried nothing (no tries, or zero tries) changes nothing, not even the
    version; one first draft counts; the version goes up by one per counted step."""
    tracker = AcceptanceTracker(2)
    tracker.update([], [])
    tracker.update([0.0, 0.0], [0.0, 0.0])
    assert tracker.version == 0 and tracker.proposed.tolist() == [0.0, 0.0]
    tracker.update([1.0], [1.0])
    assert tracker.version == 1 and tracker.proposed.tolist() == [1.0, 0.0]
    tracker.update([3.0, 1.0], [1.0, 0.0])
    assert tracker.version == 2


@pytest.mark.parametrize("kwargs", [dict(max_k=1), dict(max_k=2, memory=0.5),
                                    dict(max_k=2, prior=0.0), dict(max_k=2, prior=1.0),
                                    dict(max_k=2, prior_weight=0.5)])
def test_tracker_accepts_edge_arguments(kwargs: dict) -> None:
    AcceptanceTracker(**kwargs)


@pytest.mark.parametrize("kwargs", [dict(max_k=0), dict(max_k=2, memory=0.0),
                                    dict(max_k=2, prior=-0.1), dict(max_k=2, prior=1.5),
                                    dict(max_k=2, prior_weight=0.0)])
def test_tracker_rejects_bad_arguments(kwargs: dict) -> None:
    with pytest.raises(ValueError, match=r"^AcceptanceTracker needs max_k >= 1, memory > 0, "
                                         r"prior in \[0, 1\], prior_weight > 0$"):
        AcceptanceTracker(**kwargs)


def _distinct_experts_exactly(num_tokens: int, num_experts: int, top_k: int) -> float:
    """The mean count of distinct experts over every routing of the tokens (each picks
    ``top_k`` distinct experts, all choices alike)."""
    choices = [set(c) for c in itertools.combinations(range(num_experts), top_k)]
    counts = [len(set().union(*r)) for r in itertools.product(choices, repeat=num_tokens)]
    return sum(counts) / len(counts) if num_tokens else 0.0


@pytest.mark.parametrize("num_tokens,num_experts,top_k",
                         [(0, 3, 1), (1, 1, 1), (2, 1, 1), (1, 4, 2), (3, 4, 2), (2, 3, 3),
                          (3, 5, 1)])
def test_distinct_experts_match_counting_every_routing(num_tokens: int, num_experts: int,
                                                        top_k: int) -> None:
    assert expected_distinct_experts(num_tokens, num_experts, top_k) == pytest.approx(
        _distinct_experts_exactly(num_tokens, num_experts, top_k), rel=1e-12)


def test_distinct_experts_check_their_arguments() -> None:
    msg = r"^need 1 <= top_k <= num_experts, got top_k=%d, num_experts=%d$"
    for top_k, num_experts in ((5, 4), (0, 4), (1, 0)):
        with pytest.raises(ValueError, match=msg % (top_k, num_experts)):
            expected_distinct_experts(3, num_experts, top_k)
    with pytest.raises(ValueError, match=r"^num_tokens must be >= 0, got -1$"):
        expected_distinct_experts(-1, 4, 2)
    assert expected_distinct_experts(0.5, 2, 2) == pytest.approx(2.0)  # a fraction of a token
