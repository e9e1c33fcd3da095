"""The ``k="auto"`` rule's pieces (core/auto_k.py, docs/design.md §15) in process, without an
engine: the argument checks of ``resolve_k`` and ``AutoKConfig`` with their messages, the
warm-up plan, the per-position counts read from ``StepTimes``, the rule's settings passed to
its cost model and tracker, the rates cache, and ``record`` / ``run`` over a step's measured
times. The rule's choices on synthetic costs are in tests/test_auto_k.py."""

from __future__ import annotations

import logging
import re

import numpy as np
import pytest

from specengine.config import DEFAULT_K_MAX, MAX_K
from specengine.core.auto_k import (
    SYNC,
    AutoK,
    AutoKConfig,
    conditional_counts,
    resolve_k,
    snapshot,
    step_counts,
)
from specengine.core.cost_model import StepCost
from specengine.core.run_stats import StepTimes

# a step costs 1 + 0.3 k at every batch size
FLAT = StepCost(draft=(0, 0, 0, 0, 0.3, 0), verify=(1, 0, 0, 0, 0, 0, 0, 0))


def given(cost: StepCost, conditional: float | None = None, **cfg: object) -> AutoK:
    """A rule with the cost model given (no warm-up) and, optionally, a long history at one
    conditional acceptance rate."""
    auto = AutoK(AutoKConfig(**cfg))  # type: ignore[arg-type]
    auto.costs.cost = cost
    if conditional is not None:
        auto.acceptance.update([1e6] * MAX_K, [conditional * 1e6] * MAX_K)
    return auto


# ------------------------------------------------------------------------------ resolve_k


def test_resolve_k_takes_ints_in_range_and_auto() -> None:
    assert resolve_k(0) == (0, False) and resolve_k(MAX_K) == (MAX_K, False)
    assert resolve_k("auto") == (DEFAULT_K_MAX, True)
    assert resolve_k("auto", 0) == (0, True) and resolve_k("auto", MAX_K) == (MAX_K, True)
    assert resolve_k(3, 5) == (3, False)


@pytest.mark.parametrize("k", [-1, MAX_K + 1, True, 2.5, "autoo", "AUTO", None])
def test_resolve_k_refuses_other_k_saying_what_is_allowed(k: object) -> None:
    message = (rf"^k \(draft length\) must be an int in \[0, {MAX_K}\] or \"auto\", "
               rf"got {re_repr(k)}$")
    with pytest.raises(ValueError, match=message):
        resolve_k(k)


@pytest.mark.parametrize("k_max", [-1, MAX_K + 1, True, "8", 8.0])
def test_resolve_k_refuses_an_invalid_k_max_whatever_k_is(k_max: object) -> None:
    for k in ("auto", 3):
        message = rf"^k_max must be an int in \[0, {MAX_K}\], got {re_repr(k_max)}$"
        with pytest.raises(ValueError, match=message):
            resolve_k(k, k_max)


def re_repr(value: object) -> str:
    return re.escape(repr(value))


# ---------------------------------------------------------------------------- AutoKConfig


@pytest.mark.parametrize("cfg", [dict(probe_min=1, probe_max=1), dict(memory=0.5),
                                 dict(window=8), dict(refit_every=1), dict(neighbour_every=2),
                                 dict(warmup_steps=1), dict(warmup_ks=(1,))])
def test_config_accepts_its_edge_values(cfg: dict) -> None:
    AutoKConfig(**cfg)


@pytest.mark.parametrize("cfg, message", [
    (dict(probe_min=0), r"^need 1 <= probe_min <= probe_max, got 0, 256$"),
    (dict(probe_min=8, probe_max=4), r"^need 1 <= probe_min <= probe_max, got 8, 4$"),
    (dict(memory=0.0), None), (dict(window=7), None), (dict(refit_every=0), None),
    (dict(neighbour_every=1), None),
    (dict(warmup_steps=0), r"^the warm-up needs warmup_steps >= 1 and warmup_ks >= 1 \(or "
                           r"None\), got 0, None$"),
    (dict(warmup_ks=()), r"^the warm-up needs warmup_steps >= 1 and warmup_ks >= 1 \(or "
                         r"None\), got 2, \(\)$"),
    (dict(warmup_ks=(2, 0)), r"^the warm-up needs warmup_steps >= 1 and warmup_ks >= 1 \(or "
                             r"None\), got 2, \(2, 0\)$"),
])
def test_config_refuses_bad_values_saying_which(cfg: dict, message: str | None) -> None:
    message = message or (r"^need memory > 0, window >= 8, refit_every >= 1, "
                          r"neighbour_every >= 2$")
    with pytest.raises(ValueError, match=message):
        AutoKConfig(**cfg)


def test_warmup_plan_drafts_one_and_half_of_k_max_after_catching_up() -> None:
    """Each step of the plan is repeated ``warmup_steps + 1`` times (the first unmeasured);
    the drafting lengths are distinct, sorted and capped by ``k_max``."""
    assert AutoKConfig().warmup_plan(5) == [SYNC] * 3 + [1] * 3 + [3] * 3
    assert AutoKConfig().warmup_plan(1) == [SYNC] * 3 + [1] * 3
    assert AutoKConfig(warmup_steps=1).warmup_plan(8) == [SYNC, SYNC, 1, 1, 4, 4]
    assert AutoKConfig(warmup_ks=(3, 1, 3, 7)).warmup_plan(5) == (
        [SYNC] * 3 + [1] * 3 + [3] * 3 + [5] * 3)


# ------------------------------------------------------------------ counts and settings


def test_step_counts_are_the_drafts_since_the_snapshot_up_to_the_deepest() -> None:
    times = StepTimes()
    times.position_counts[:, :2] = [[5, 5], [4, 3]]
    times.draft, times.verify, times.bookkeeping = 1.0, 2.0, 0.5
    before = snapshot(times)
    assert (before.draft, before.verify) == (1.0, 2.5)
    times.position_counts[:, :3] += [[4, 4, 2], [4, 2, 0]]  # none accepted at the 3rd
    assert step_counts(before, times) == ([4, 4, 2], [4, 2, 0])
    assert before.counts[:, :3].tolist() == [[5, 5, 0], [4, 3, 0]]  # a copy, not a view


def test_conditional_tries_of_a_position_nobody_reached_are_zero() -> None:
    tries, acc = conditional_counts([6, 0, 3], [2, 0, 0])
    assert tries == [6.0, 2.0 * 0 / 6, 0.0] and acc == [2.0, 0.0, 0.0]
    assert conditional_counts([], []) == ([], [])


def test_the_rule_passes_its_settings_to_the_fit_and_the_tracker() -> None:
    auto = AutoK(AutoKConfig(window=9, refit_every=5, memory=100.0, probe_min=3))
    assert (auto.costs.window, auto.costs.refit_every) == (9, 5)
    assert auto.acceptance.memory == 100.0 and len(auto.acceptance.proposed) == MAX_K
    assert auto.probe_interval == 3 and auto.synced and not auto.calibrated
    default = AutoK()
    assert (default.costs.window, default.costs.refit_every, default.acceptance.memory) == (
        64, 32, 2048.0)
    assert (default.num_zero_steps, default.num_probes, default.num_draft_steps) == (0, 0, 0)


def test_rates_are_cached_until_the_acceptance_or_the_fit_changes() -> None:
    auto = given(FLAT, 0.8)
    first = auto.rates(4, 8)
    assert auto.rates(4, 8) is first and auto.rates(4, 8, sync=True) is not first
    auto.acceptance.update([10.0], [0.0])
    again = auto.rates(4, 8)
    assert again is not first and again[1][1] < first[1][1]
    auto.costs.cost = StepCost(FLAT.draft, (2, 0, 0, 0, 1, 0, 0, 0))
    assert auto.rates(4, 8)[1][0] == pytest.approx(0.5)
    assert auto.rates(4, 8, sync=True)[1][0] == pytest.approx(1 / 3)  # a catch-up costs 1
    fresh = given(FLAT, 0.8)
    hits = [fresh.rates(b, 8) for b in range(1, 66)]  # 65 entries: all kept
    assert fresh.rates(1, 8) is hits[0] and fresh.rates(65, 8) is hits[-1]
    fresh.rates(66, 8)  # more than 64 held: dropped before the 66th goes in
    assert fresh.rates(1, 8) is not hits[0]


def test_nothing_to_choose_without_drafts() -> None:
    auto = given(FLAT, 0.9)
    assert auto.choose(4, 0) == 0 and not auto.observes(0) and not auto.on_prefill(0)
    assert not AutoK().observes(0) and AutoK().choose(4, 0) == 0


# ------------------------------------------------------------------------- record / run


def test_run_records_the_steps_measured_times_and_counts() -> None:
    """``run`` chooses, runs the step and records what the step's times say: its draft
    seconds, its verify + bookkeeping seconds, and the drafts per position; a catch-up step
    runs as 0 drafts."""
    auto = given(FLAT, 0.9)
    times = StepTimes(draft=2.0, verify=3.0, bookkeeping=1.0)  # earlier steps' seconds
    ran = []

    def step(k: int) -> None:
        ran.append(k)
        times.draft += 0.25
        times.verify += 1.0
        times.bookkeeping += 0.125
        times.position_counts[0, :k] += 4
        times.position_counts[1, :k] += 3

    version = auto.acceptance.version
    k = auto.run(4, 8, times, step)
    assert k == ran[0] > 0
    (measure,) = [m for q in auto.costs.recent.values() for m in q]
    assert (measure.batch, measure.k, measure.sync) == (4, k, True)
    assert (measure.draft_s, measure.verify_s) == (0.25, 1.125)
    assert auto.acceptance.version == version + 1
    assert auto.acceptance.proposed[0] == pytest.approx(1e6 * np.exp(-4 / 2048) + 4)
    lagging = given(FLAT, 0.9)
    lagging.synced = False
    assert lagging.run(4, 8, StepTimes(), lambda k: ran.append(k)) == 0 and ran[-1] == SYNC
    assert lagging.synced  # the catch-up step observed
    plain = given(FLAT, 0.0)  # useless drafts: a plain step, the drafter left behind
    assert plain.run(4, 8, StepTimes(), lambda k: ran.append(k)) == 0 == ran[-1]
    assert not plain.synced
    times = StepTimes(draft=2.0, verify=3.0)
    before = snapshot(times)
    times.verify += 0.5
    plain.record(4, 0, before, times)
    assert not plain.synced
    assert [(m.sync, m.draft_s, m.verify_s) for q in plain.costs.recent.values()
            for m in q][-1] == (False, 0.0, 0.5)


def test_a_plain_step_leaves_the_drafter_behind_and_a_draft_resets_the_zero_run() -> None:
    auto = given(FLAT, 0.0)
    auto.num_zero_steps = 5
    auto.record_step(4, 0, [], [], 0.0, 1.0)
    assert not auto.synced and auto.num_zero_steps == 5
    auto.record_step(4, 2, [4, 0], [0, 0], 0.1, 1.0)  # one position drafted: width 1
    assert auto.synced and auto.num_zero_steps == 0
    widths = [m.k for q in auto.costs.recent.values() for m in q]
    assert widths == [0, 1]


def test_a_catch_up_or_drafting_step_is_measured_as_one_that_caught_up() -> None:
    auto = given(FLAT, 0.5)
    auto.record_step(4, 1, [1, 1], [1, 0], 0.1, 1.0)  # one row drafting: width 2
    auto.record_step(4, SYNC, [], [], 0.0, 1.0)
    got = [(m.k, m.sync) for q in auto.costs.recent.values() for m in q]
    assert got == [(2, True), (0, True)]


def _rule_with_costly_catch_up() -> AutoK:
    # drafting per token and sequence 0.02, a catch-up pass 0.5: at batch 50 drafting pays
    # against a catch-up step at k = 0 but not against a plain one
    return given(StepCost((0, 0, 0, 0, 0, 0.02), (1, 0, 0, 0, 0.5, 0, 0, 0)), 0.9)


def test_a_rule_keeping_the_drafter_in_sync_compares_with_a_catch_up_step() -> None:
    auto = _rule_with_costly_catch_up()
    assert auto.observes(8)
    k, rates = auto.rates(50, 8, sync=True)
    assert rates[0] == pytest.approx(1 / 1.5) and k > 0
    assert auto.rates(50, 8)[1][0] == pytest.approx(1.0) and auto.rates(50, 8)[0] == 0
    assert auto.choose(50, 8) == k


def test_observes_while_drafting_pays_at_batch_one_even_for_one_draft() -> None:
    """At 0.8 s per draft and sequence one draft pays at batch 1 (and longer chains do not),
    at batch 2 none does: the drafter keeps catching up."""
    auto = given(StepCost((0, 0, 0, 0, 0, 0.8), (1, 0, 0, 0, 0, 0, 0, 0)), 0.9)
    assert auto.rates(1, 8)[0] == 1 and auto.rates(2, 8)[0] == 0
    assert auto.observes(8)


# a draft pass costs a whole step, a token 1 % more: at 0.5 acceptance no k pays, and the
# best drafting k is 6
FIXED = StepCost((0, 0, 1.0, 0, 0.01, 0), (1, 0, 0, 0, 0, 0, 0, 0))


def test_exploration_and_probes_draft_the_best_drafting_k() -> None:
    explorer = given(FIXED)  # nothing counted yet: prior 0.5 everywhere, uncertain
    _, rates = explorer.rates(4, 8, sync=True)
    assert int(np.argmax(rates)) == 0 and int(np.argmax(rates[1:])) + 1 == 6
    assert explorer.uncertain and explorer.choose(4, 8) == 6
    prober = given(FIXED, 0.5, probe_min=2, probe_max=2)
    ks = []
    for _ in range(3):
        ks.append(prober.choose(4, 8))
        prober.record_step(4, ks[-1], [4] * max(ks[-1], 0), [2] * max(ks[-1], 0), 0.1, 1.0)
    assert ks == [0, SYNC, 6]


def test_probes_restart_the_zero_count_even_when_nothing_was_proposed() -> None:
    """A probe whose drafter proposed nothing (an n-gram drafter without a match) still
    restarts the count of plain steps: the next probe comes ``probe_interval`` steps on."""
    auto = given(FLAT, 0.0, probe_min=2, probe_max=2)
    ks = []
    for _ in range(8):
        ks.append(auto.choose(4, 8))
        auto.record_step(4, ks[-1], [], [], 0.0, 1.0)
    assert ks == [0, SYNC, 1, 0, SYNC, 1, 0, SYNC] and auto.num_probes == 3


def test_drafting_resets_the_probe_interval_and_counts_drafting_steps() -> None:
    auto = given(FLAT, 0.9, probe_min=3)
    auto.probe_interval = 12
    assert all(auto.choose(4, 8) > 0 for _ in range(3))
    assert auto.probe_interval == 3 and auto.num_draft_steps == 3


def test_neighbour_steps_take_the_better_side_and_stay_in_range() -> None:
    """With ``neighbour_every=2`` every other drafting step runs the better-rated of k +- 1:
    k - 1 when it rates better, and never 0 or above ``k_max``."""
    for a in np.linspace(0.3, 0.95, 27):
        auto = given(FLAT, float(a), neighbour_every=2)
        best, rates = auto.rates(4, 8)
        if best >= 2 and rates[best - 1] > rates[best + 1]:
            break
    else:
        raise AssertionError("no acceptance rate with k - 1 the better neighbour")
    assert [auto.choose(4, 8) for _ in range(2)] == [best, best - 1]
    one = given(FLAT, 0.9, neighbour_every=2)
    assert [one.choose(4, 1) for _ in range(2)] == [1, 1]  # k_max 1: no neighbour
    low = given(StepCost((0, 0, 0, 0, 0.6, 0), (1, 0, 0, 0, 0, 0, 0, 0)), 0.8, neighbour_every=2)
    k, rates = low.rates(4, 8)
    assert k == 1 and [low.choose(4, 8) for _ in range(2)] == [1, 2]  # not 0


def test_warm_up_fits_from_two_chain_lengths_and_drops_empty_steps(caplog) -> None:
    """A plan of catch-up and k = 1 steps is enough to fit (two lengths: 0 and 1); a step
    that measured no verify time is not kept; the fit is logged with the steps it used."""
    true = StepCost((0, 0, 0, 0, 0, 0.0002), (0.01, 0.0004, 0, 0, 0.001, 0, 0, 0))
    auto = AutoK(AutoKConfig(warmup_ks=(1,)))
    caplog.set_level(logging.INFO, logger="specengine.core.auto_k")
    for i in range(6):
        k = auto.choose(8, 8)
        drafts = max(k, 0)
        verify = 0.0 if i == 5 else true.t_verify(8, drafts + 1, k != 0)
        auto.record_step(8, k, [8] * drafts, [4] * drafts, true.t_draft(8, drafts), verify)
    assert auto.calibrated and len(auto.costs.calibration) == 3
    assert "k='auto' cost model fitted to 3 warm-up steps" in caplog.messages
