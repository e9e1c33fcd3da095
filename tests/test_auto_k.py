"""``k="auto"`` (core/auto_k.py, core/cost_model.py): the rule on synthetic costs and
acceptance (no timing: the cost model is given), probes, the engine's greedy output against
k=0 (eager and static path) while k changes from step to step, sampled output against the
policy's exact law (chi-square), bad k values, and the chosen k in ``engine.stats``."""

from __future__ import annotations

import numpy as np
import pytest
from test_sampling_lossless import (  # noqa: F401  (module fixtures)
    P_MIN,
    PROMPT,
    chi_square_p,
    eagle_dir,
    exact_joint,
    models,
    run_joint,
)

from specengine import SamplingParams, SpecEngine
from specengine.arith_task import encode, heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.core.auto_k import SYNC, AutoK, AutoKConfig, conditional_counts, resolve_k
from specengine.core.cost_model import (
    MAX_TOLERANCE,
    AcceptanceTracker,
    CostModel,
    StepCost,
    StepMeasure,
    best_k,
    expected_accepted,
    expected_by_k,
    fit_error,
    fit_relative,
    identified_terms,
)

NUM_SEQS = 12_000  # samples of the (t2, t3) law: enough for cells >= 5 expected counts

# t_draft = 0.3 k (per row: 0), t_verify = 1: a step costs 1 + 0.3 k at every batch size
FLAT = StepCost(draft=(0, 0, 0, 0, 0.3, 0), verify=(1, 0, 0, 0, 0, 0, 0, 0))
# a draft token costs 1 % of a step per sequence: drafting pays at small batches only
BATCHY = StepCost(draft=(0, 0, 0, 0, 0, 0.01), verify=(1, 0, 0, 0, 0, 0, 0, 0))
# 3 %: with the bundled head's ~0.98 acceptance drafting pays below ~32 sequences only
TAIL = StepCost(draft=(0, 0, 0, 0, 0, 0.03), verify=(1, 0, 0, 0, 0, 0, 0, 0))


def controller(cost: StepCost, conditional: float | None = None, history: float = 1e6,
               **cfg: float) -> AutoK:
    auto = AutoK(AutoKConfig(**cfg))  # type: ignore[arg-type]
    auto.costs.cost = cost  # given, not calibrated: no refit from measured steps
    if conditional is not None:  # a history at this conditional rate at every position
        auto.acceptance.update([history] * 16, [conditional * history] * 16)
    return auto


def test_expected_accepted_and_conditional_counts() -> None:
    assert expected_accepted([0.5, 0.5, 0.5], 2) == pytest.approx(0.5 + 0.25)
    assert list(expected_by_k([0.8, 0.5], 2)) == pytest.approx([0, 0.8, 0.8 + 0.4])
    # engine counts (rows with a draft at j / accepted there) -> conditional tries
    tries, acc = conditional_counts([10, 10, 5], [8, 4, 1])
    assert tries == pytest.approx([10, 8, 4 * 5 / 10]) and acc == [8, 4, 1]
    tr = AcceptanceTracker(4, prior=0.5, prior_weight=2)
    assert tr.conditional() == pytest.approx([0.5] * 4)
    tr.update([8, 0], [8, 0])  # unseen positions follow the one before them
    assert tr.conditional()[0] == pytest.approx((8 + 1) / 10)
    assert tr.conditional()[1] == pytest.approx(0.9)


def test_best_k_maximises_tokens_per_second() -> None:
    for a in (0.9, 0.6, 0.2):
        auto = controller(FLAT, a)
        rates = [(1 + expected_accepted([a] * 8, k)) / (1 + 0.3 * k) for k in range(9)]
        assert auto.choose(4, 8) == int(np.argmax(rates))
    assert controller(FLAT, 0.9).choose(4, 8) > 0
    assert controller(FLAT, 0.9).choose(4, 3) <= 3  # k_max bounds it
    assert controller(BATCHY, 0.9).choose(1, 8) == 8
    # large batch: drafting does not pay, but it would at batch 1, so the drafter catches up
    assert controller(BATCHY, 0.9).choose(200, 8) == SYNC
    k, rates = best_k([0, 0.5], [1.0, 1.5])
    assert k == 0 and rates == pytest.approx([1.0, 1.0])  # a tie: the smaller k


def test_the_smallest_k_the_fit_cannot_tell_from_the_best_wins() -> None:
    """Rates within the fit's own error of the best are not told apart, and the shortest of
    those chains runs; the tolerance is the fit's median error, capped so that a noisy fit
    never makes k = 0 win over drafts that pay by more than the cap."""
    expected, times = [0, 0.5, 0.52, 0.53], [1.0] * 4
    assert best_k(expected, times)[0] == 3
    assert best_k(expected, times, 0.01)[0] == 2  # 1.52 >= 0.99 * 1.53
    assert best_k(expected, times, 0.03)[0] == 1
    for bad in (-0.1, 1.0):
        with pytest.raises(ValueError, match="tolerance"):
            best_k(expected, times, bad)
    auto = controller(FLAT, 0.9)  # rates 1, 1.46, 1.69, 1.81, 1.86, 1.88 (best), 1.86, ...
    assert auto.rates(4, 8)[0] == 5
    auto.costs.error = 0.04
    auto.costs.version += 1
    k, rates = auto.rates(4, 8)
    assert k == 3 and rates[3] >= 0.96 * rates.max() > rates[2]
    assert auto.choose(4, 8) == 3
    auto.costs.error = 0.5  # capped at MAX_TOLERANCE: drafting still wins over k = 0
    auto.costs.version += 1
    k, rates = auto.rates(4, 8)
    assert MAX_TOLERANCE == 0.05 and k == 3 and rates[0] < 0.95 * rates.max()


def test_the_fit_error_is_the_median_relative_error_of_whole_steps() -> None:
    true = StepCost(draft=(0, 0, 0, 0, 0.001, 0), verify=(0.01, 0, 0, 0.002, 0, 0, 0, 0))
    exact = [StepMeasure(8, k, True, true.t_draft(8, k), true.t_verify(8, k + 1, True))
             for k in (1, 2, 3, 4) * 4]
    model = CostModel()
    model.calibrate(exact)
    assert model.error < 1e-6
    noisy = [StepMeasure(m.batch, m.k, m.sync, m.draft_s * f, m.verify_s * f)
             for m, f in zip(exact, [1.05] * 8 + [0.95] * 8)]  # every k both ways
    assert fit_error(true, noisy) == pytest.approx((1 / 0.95 - 1 / 1.05) / 2, rel=1e-9)
    model.calibrate(noisy)  # any fit between the two halves is off by 5 % on average
    assert 0.04 < model.error < 0.06


def test_a_drafting_rule_measures_the_neighbours_of_its_k() -> None:
    """Every ``neighbour_every``-th drafting step runs the better-rated of k - 1 and k + 1, so
    the fit keeps seeing the cost's slope around the chosen k; the others run the best k."""
    auto = controller(FLAT, 0.9, neighbour_every=4)
    best, rates = auto.rates(4, 8)
    ks = [auto.choose(4, 8) for _ in range(12)]
    j = max((best - 1, best + 1), key=lambda i: rates[i])
    assert best > 1 and ks == [best, best, best, j] * 3
    top = controller(FLAT, 0.99, neighbour_every=2)
    assert [top.choose(4, 3) for _ in range(2)] == [3, 2]  # k_max's only neighbour is below


def test_useless_drafts_choose_zero_and_probe_rarely() -> None:
    auto = controller(FLAT, 0.0, probe_min=4, probe_max=16)
    ks = []
    for _ in range(64):
        k = auto.choose(8, 8)
        ks.append(k)
        drafts = max(k, 0)
        auto.record_step(8, k, [8] * drafts, [0] * drafts, 0.1, 1.0)
    drafting = [i for i, k in enumerate(ks) if k > 0]
    assert ks[0] == 0 and SYNC in ks  # probes come after a catch-up step
    assert all(ks[i - 1] == SYNC for i in drafting)
    # a probe after 4, 8, 16, 16 k=0 steps (the 4th, 8th, ... k=0 step is the catch-up)
    assert drafting == [4, 4 + 1 + 8, 13 + 1 + 16, 30 + 1 + 16]
    assert [i for i, k in enumerate(ks) if k == SYNC] == [i - 1 for i in drafting] + [63]
    assert auto.num_probes == len(drafting) + 1  # the last one is due next step


def test_explores_first_and_keeps_the_drafter_in_sync_only_when_it_may_pay() -> None:
    fresh = controller(StepCost(draft=(0, 0, 0, 0, 0, 1.0), verify=(1, 0, 0, 0, 0, 0, 0, 0)))
    assert fresh.uncertain and fresh.choose(64, 8) >= 1  # too dear, but not measured yet
    assert fresh.observes() and fresh.on_prefill(8) and fresh.synced
    useless = controller(FLAT, 0.0)
    assert not useless.observes() and useless.choose(1, 8) == 0
    assert not useless.on_prefill(8) and not useless.synced  # the next draft catches up first
    good = controller(BATCHY, 0.9)
    assert good.observes() and good.on_prefill(8) and good.synced


def warm_step(auto: AutoK, true: StepCost, batch: int, k_max: int, accept: float,
              width: int | None = None) -> int:
    """One auto step of ``batch`` rows against ``true`` costs; drafts accepted at ``accept``
    (the drafter proposes ``width`` when given: fewer than asked)."""
    k = auto.choose(batch, k_max)
    drafts = max(k, 0) if width is None else min(max(k, 0), width)
    auto.record_step(batch, k, [batch] * drafts, [int(batch * accept)] * drafts,
                     true.t_draft(batch, drafts), true.t_verify(batch, drafts + 1, k != 0))
    return k


def test_warm_up_fits_the_cost_model_on_the_runs_own_steps() -> None:
    """No sweep: the first auto steps follow the warm-up plan (catch-up steps, then k = 1 and
    ceil(k_max / 2)), each k's first step unmeasured, and the fit that ends it chooses as the
    true costs would; the drafter is kept in sync from the prefill on."""
    true = StepCost(draft=(0, 0, 0, 0, 0, 0.0002), verify=(0.01, 0.0004, 0, 0, 0.001, 0, 0, 0))
    auto = AutoK(AutoKConfig(warmup_steps=2))
    assert AutoKConfig().warmup_plan(8) == [SYNC] * 3 + [1] * 3 + [4] * 3
    assert AutoKConfig(warmup_ks=(2, 9)).warmup_plan(6) == [SYNC] * 3 + [2] * 3 + [6] * 3
    assert not auto.calibrated and auto.on_prefill(8) and auto.synced
    ks = [warm_step(auto, true, 16, 8, 0.9) for _ in range(9)]
    assert ks == [SYNC] * 3 + [1] * 3 + [4] * 3 and auto.calibrated
    assert len(auto.costs.calibration) == 6  # two measured steps of each k
    want, _ = best_k(expected_by_k(auto.acceptance.conditional(), 8),
                     true.step_times(16, 8, sync=True))
    assert want > 0 and warm_step(auto, true, 16, 8, 0.9) == want
    # drafts that do not pay at any batch size: the fit picks k = 0 and the drafter idles
    idle = AutoK()
    for _ in range(9):
        warm_step(idle, true, 16, 8, 0.0)
    assert idle.calibrated and not idle.observes(8) and warm_step(idle, true, 16, 8, 0.0) == 0


def test_warm_up_catches_up_before_drafting_and_retries_without_drafts() -> None:
    true = StepCost(draft=(0, 0, 0, 0, 0, 0.0002), verify=(0.01, 0.0004, 0, 0, 0.001, 0, 0, 0))
    auto = AutoK(AutoKConfig(warmup_ks=(1, 4), warmup_steps=1))
    assert [warm_step(auto, true, 8, 8, 0.9) for _ in range(2)] == [SYNC, SYNC]
    warm_step(auto, true, 8, 0, 0.9)  # a group with k_max = 0 runs plain: the drafter lags
    assert not auto.synced
    ks = [warm_step(auto, true, 8, 8, 0.9) for _ in range(5)]
    assert ks == [SYNC, 1, 1, 4, 4] and auto.calibrated  # the catch-up is not the plan's
    assert len(auto.costs.calibration) == 3  # the plan's SYNC, 1 and 4: one measured each
    # an n-gram drafter without matches proposes nothing: nothing to fit, the plan restarts
    blank = AutoK()
    ks = [warm_step(blank, true, 8, 8, 0.0, width=0) for _ in range(18)]
    assert not blank.calibrated and ks == 2 * AutoKConfig().warmup_plan(8)
    assert warm_step(blank, true, 8, 8, 0.0, width=2) == SYNC  # proposing again: it fits
    for _ in range(8):
        warm_step(blank, true, 8, 8, 0.0, width=2)
    assert blank.calibrated


def test_probe_notices_when_drafting_pays_again() -> None:
    auto = controller(FLAT, 0.0, history=64, probe_min=2, probe_max=2, memory=64)
    k, steps = 0, 0
    while k <= 0:  # the drafter has become good: every probe's drafts are accepted
        k = auto.choose(8, 8)
        auto.record_step(8, k, [8] * max(k, 0), [8] * max(k, 0), 0.1, 1.0)
        steps += 1
    for _ in range(100):  # deeper positions forget their old rate: the chain grows
        k = auto.choose(8, 8)
        auto.record_step(8, k, [8] * k, [8] * k, 0.1, 1.0)
    assert k == 8 and steps <= 4


def test_cost_fit_recovers_a_linear_cost_and_shrugs_off_bursts() -> None:
    true = StepCost(draft=(1e-4, 1e-6, 5e-4, 2e-6, 1e-3, 3e-5),
                    verify=(5e-3, 2e-4, 2e-5, 1e-4, 2e-3, 1e-5, 1e-3, 2e-5))
    samples = [StepMeasure(b, k, k > 0, true.t_draft(b, k), true.t_verify(b, k + 1, k > 0))
               for b in (1, 4, 16, 64) for k in (0, 1, 2, 4, 8)]
    bursts = [StepMeasure(s.batch, s.k, s.sync, s.draft_s * 3, s.verify_s * 3)
              for s in samples[::7]]
    model = CostModel()
    fit = model.calibrate(samples + bursts)
    for b, k in ((2, 3), (32, 6), (64, 0)):
        assert fit.step_time(b, k) == pytest.approx(true.step_time(b, k), rel=1e-3)
    times = fit.step_times(8, 8)
    assert np.all(np.diff(times) >= 0)
    with pytest.raises(ValueError):
        fit_relative(np.ones((3, 2)), np.array([1.0, 0.0, 1.0]))
    with pytest.raises(ValueError, match="chain lengths"):
        CostModel().calibrate(samples[:5:5])  # one k


def test_cost_fit_from_one_batch_size_is_constant_in_the_batch() -> None:
    """A run's first steps are at one batch size: the batch terms cannot be told apart from
    the constant ones, so the fit is constant in B (the best k at the measured batch is taken
    everywhere) and exact at the measured batch; the catch-up terms need a plain k = 0 step
    next to the catch-up ones, else a plain step is taken to cost a catch-up one."""
    true = StepCost(draft=(1e-4, 1e-6, 5e-4, 2e-6, 1e-3, 3e-5),
                    verify=(5e-3, 2e-4, 2e-5, 1e-4, 2e-3, 1e-5, 1e-3, 2e-5))

    def measured(b: int, k: int, sync: bool) -> StepMeasure:
        return StepMeasure(b, k, sync, true.t_draft(b, k), true.t_verify(b, k + 1, sync))

    steps = [measured(16, k, True) for k in (0, 1, 4) for _ in range(2)]
    assert identified_terms(steps) == (False, False)
    model = CostModel(refit_every=1000)
    fit = model.calibrate(steps)
    for k in (0, 1, 4, 6):
        assert fit.step_time(16, k, True) == pytest.approx(true.step_time(16, k, True), rel=1e-6)
        assert fit.step_time(1, k) == pytest.approx(fit.step_time(64, k), rel=1e-9)
    assert fit.step_time(16, 0, sync=False) == pytest.approx(true.step_time(16, 0, sync=True))
    # a first plain step identifies the catch-up terms: refitted at once, not 1000 steps on
    version = model.version
    model.add(measured(16, 0, False))
    assert model.version == version + 1 and model.terms == (False, True)
    assert model.cost.step_time(16, 0) == pytest.approx(true.step_time(16, 0), rel=1e-6)
    model.add(measured(16, 0, False))
    assert model.version == version + 1  # nothing new: no refit
    # a batch size one octave away at one k identifies nothing; at a second k it does
    model.add(measured(2, 1, True))
    model.add(measured(2, 1, True))
    assert model.version == version + 1
    model.add(measured(2, 4, True))
    assert model.version == version + 2 and model.terms == (True, True)
    for b, k in ((2, 3), (16, 4)):
        assert model.cost.step_time(b, k) == pytest.approx(true.step_time(b, k), rel=1e-3)
    # the batch terms from two batch sizes of one octave stay unidentified
    near = [measured(b, k, True) for b in (16, 31) for k in (0, 1, 4)]
    assert identified_terms(near) == (False, False)


@pytest.fixture(scope="module")
def engine() -> SpecEngine:
    eng = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", seed=0)
    eng.core.auto_k = controller(TAIL, probe_min=2, probe_max=4)
    return eng


def arith(n: int) -> list[list[int]]:
    return [encode(p) for p in heldout_prompts(n, seed=3)]


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_greedy_auto_equals_k0_while_k_changes(engine: SpecEngine, cuda_graphs: bool) -> None:
    eng = engine if not cuda_graphs else SpecEngine(
        DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", seed=0, cuda_graphs=True,
        graph_buckets=(1, 2, 4, 8, 16, 32, 64, 128))
    if cuda_graphs:
        eng.core.auto_k = controller(TAIL, probe_min=2, probe_max=4)
    # TAIL: 96 sequences do not draft (the drafter catches up), the long tail drafts
    prompts = arith(96)
    params = [SamplingParams(temperature=0.0, max_tokens=8 + (i % 5) * 12) for i in range(96)]
    base = eng.generate(prompts, k=0, sampling=params)
    outs = eng.generate(prompts, k="auto", sampling=params)
    assert [o.token_ids for o in outs] == [o.token_ids for o in base]
    st = eng.stats
    hist = st.auto_k_steps
    assert sum(hist) == st.num_steps and hist[0] > 0 and sum(hist[1:]) > 0
    assert st.num_draft_tokens > 0 and st.num_accepted_tokens > 0
    assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks


def test_auto_with_step_api_and_warm_up() -> None:
    """The warm-up on the requests' own steps, auto and fixed-k requests side by side."""
    eng = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", seed=0)
    eng.core.auto_k = AutoK(AutoKConfig(warmup_ks=(2,), warmup_steps=1))
    prompts = arith(3)
    sp = SamplingParams(temperature=0.0, max_tokens=24)
    base = eng.generate(prompts, k=0, sampling=sp)
    ids = [eng.add_request(prompts[0], sp, k="auto", k_max=4),
           eng.add_request(prompts[1], sp, k=2), eng.add_request(prompts[2], sp)]
    assert not eng.core.auto_k.calibrated  # no sweep before the first step
    done = {}
    while eng.has_unfinished():
        for out in eng.step():
            if out.output is not None:
                done[out.request_id] = out.output.token_ids
    assert [done[i] for i in ids] == [o.token_ids for o in base]
    assert sum(eng.stats.auto_k_steps) > 0 and len(eng.stats.auto_k_steps) <= 5
    assert eng.core.auto_k.calibrated  # fitted by the auto request's first 4 steps


@pytest.mark.parametrize("kwargs, match", [
    (dict(k="autoo"), "or \"auto\""), (dict(k=-1), "or \"auto\""), (dict(k=17), "or \"auto\""),
    (dict(k=2.5), "or \"auto\""), (dict(k=True), "or \"auto\""),
    (dict(k="auto", k_max=-1), "k_max"), (dict(k="auto", k_max=17), "k_max"),
    (dict(k="auto", k_max="8"), "k_max"), (dict(k="auto", tree=[(0,)]), "no tree"),
])
def test_bad_k_is_rejected_and_engine_unchanged(engine: SpecEngine, kwargs: dict,
                                                 match: str) -> None:
    prompts = arith(2)
    with pytest.raises(ValueError, match=match):
        engine.generate(prompts, **kwargs)
    with pytest.raises(ValueError, match=match):
        engine.add_request(prompts[0], **kwargs)
    assert not engine.has_unfinished()
    assert len(engine.generate(prompts, k="auto", sampling=SamplingParams(max_tokens=4))) == 2


def test_auto_needs_a_drafter_and_resolves() -> None:
    plain = SpecEngine(DEFAULT_TARGET, device="cpu")
    with pytest.raises(ValueError, match="needs a drafter"):
        plain.generate(arith(1), k="auto")
    assert plain.generate(arith(1), k="auto", k_max=0)[0].token_ids  # nothing to choose
    assert resolve_k("auto") == (8, True) and resolve_k(3) == (3, False)


def test_sampled_auto_follows_the_policy(models, eagle_dir) -> None:  # noqa: F811
    """Chi-square of the (t2, t3) law (test_sampling_lossless) with k chosen per step: probes
    every 1-2 steps mix k = 0, catch-up and drafting steps."""
    hf, target, _ = models
    engine = SpecEngine(target, draft=str(eagle_dir), device="cpu", dtype="float32",
                        max_model_len=32, max_batch_size=2048, kv_cache_tokens=2048 * 32,
                        seed=7)
    engine.core.auto_k = controller(BATCHY, probe_min=1, probe_max=2)
    params = SamplingParams(max_tokens=3, temperature=1.0)
    counts = run_joint(engine, params, NUM_SEQS, k="auto", k_max=2)
    hist = engine.stats.auto_k_steps
    assert hist[0] > 0 and sum(hist[1:]) > 0
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    p = chi_square_p(counts, exact_joint(hf, params), NUM_SEQS)
    assert p > P_MIN, f"chi-square p = {p:.2e}"
    assert PROMPT  # the law is of this prompt's tokens 2 and 3


def test_cli_and_server_schema_accept_auto() -> None:
    from pydantic import ValidationError

    from specengine.cli import _parser
    from specengine.server.schemas import GenerateRequest

    args = _parser().parse_args(["generate", "--k", "auto", "--k-max", "4"])
    assert (args.k, args.k_max) == ("auto", 4)
    assert _parser().parse_args(["generate", "--k", "2"]).k == 2
    for bad in ("autox", "17", "-1"):
        with pytest.raises(SystemExit):
            _parser().parse_args(["generate", "--k", bad])
    assert GenerateRequest(prompt="Q:1+1=", k="auto").k == "auto"
    with pytest.raises(ValidationError):
        GenerateRequest(prompt="Q:1+1=", k="fast")


def test_cpu_step_clock_counts_the_engine_threads_cpu_time(monkeypatch) -> None:
    """Off CUDA a step's phases are the engine thread's CPU time, not wall time: on a shared
    machine wall time is mostly other jobs' turns, which would make the cost fit noise."""
    from specengine.core import graphs
    from specengine.core.run_stats import StepTimes

    ticks = iter([1.0, 1.5, 3.5, 4.25])
    monkeypatch.setattr(graphs.time, "thread_time", lambda: next(ticks))
    monkeypatch.setattr(graphs.time, "perf_counter", lambda: 1e9)  # wall time: never read
    clock, times = graphs.StepClock(), StepTimes()
    clock.start()
    clock.drafted()
    clock.verified()
    clock.synced(times)
    clock.end(times)
    assert (times.draft, times.verify, times.bookkeeping) == (0.5, 2.0, 0.75)


def test_a_rollouts_shrinking_batch_is_fitted_with_its_batch_terms() -> None:
    """A rollout's batch shrinks from its size to 1 as sequences end. The rule runs its k
    and now and then a neighbour: two drafting lengths per batch octave, which identify the
    batch terms, so the fit's step times at the full batch are the true ones (a fit constant
    in B reads the cheap late steps as cheap long chains), and the k chosen for the next
    full batch is the truly best one; one chain length per octave does not."""
    true = StepCost(draft=(2e-4, 1e-5, 2e-4, 1e-5, 1e-4, 2e-5),
                    verify=(1e-3, 1e-4, 6e-5, 1e-5, 3e-4, 1e-5, 0, 0))
    assert identified_terms([StepMeasure(b, k, True, 1e-3, 1e-3)
                             for b in (32, 8) for k in (3, 4)])[0]
    assert not identified_terms([StepMeasure(b, 3, True, 1e-3, 1e-3) for b in (32, 8)]
                                + [StepMeasure(32, 4, True, 1e-3, 1e-3)])[0]
    auto = AutoK(AutoKConfig(neighbour_every=4))
    for _ in range(4):  # four rollouts: batch 32 down to 1 over 48 steps each
        for batch in np.linspace(32, 1, 48).round().astype(int):
            warm_step(auto, true, int(batch), 8, 0.8)
    assert auto.costs.terms[0]
    fitted, want = auto.costs.cost.step_times(32, 8, True), true.step_times(32, 8, True)
    assert fitted == pytest.approx(want, rel=0.02)
    best, _ = best_k(expected_by_k(auto.acceptance.conditional(), 8), want)
    assert auto.rates(32, 8)[0] == best
