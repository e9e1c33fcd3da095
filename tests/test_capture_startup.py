"""Graphs captured up front (``capture="startup"``, issue 23), the step's phase clock, the
restaged draft counts' own host row, the replay checks (``GraphRunner.debug``) and the strict
capture emulator itself (``tests/replaying_graph.py``). On the CPU the capture runs through
the emulator, passed as the graph factory."""

from __future__ import annotations

import functools
import gc
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from replaying_graph import ReplayingGraph, StaleCapture
from test_static_path import BUCKETS, arith_prompts, mixed_params

import specengine.engine as engine_module
from specengine import SamplingParams, SpecEngine
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.config import EngineConfig
from specengine.core import graphs as graphs_module
from specengine.core.auto_k import DEFAULT_K_MAX
from specengine.core.batch import NUM_DRAFT, BatchState
from specengine.core.graphs import (
    DEFAULT_CAPTURE_KS,
    CudaGraph,
    GraphInputMismatch,
    GraphRunner,
    StepClock,
    build_graph_runner,
)
from specengine.core.step_types import VerifyShape


def emulated(monkeypatch: pytest.MonkeyPatch, factory: Any = ReplayingGraph) -> None:
    """Engines built from now on capture through ``factory`` (the CPU emulator)."""
    monkeypatch.setattr(engine_module, "build_graph_runner",
                        functools.partial(_build, factory=factory))


def _build(*args: Any, factory: Any) -> GraphRunner:
    runner = build_graph_runner(*args)
    runner.graph_factory, runner.capture, runner.debug = factory, True, True
    return runner


def staggered(n: int, ends: list[int]) -> list[SamplingParams]:
    """``n`` greedy requests; ``ends[j]`` of them stop after j + 1 steps of 3 tokens (k = 2,
    every draft accepted) and the rest at the last step, so the batch shrinks through every
    bucket on its way to one row."""
    lengths = []
    for j, count in enumerate(ends):
        lengths += [1 + 3 * j] * count
    lengths += [1 + 3 * len(ends)] * (n - len(lengths))
    return [SamplingParams(temperature=0.0, max_tokens=m, ignore_eos=True)
            for m in reversed(lengths)]


def test_a_batch_shrinking_from_256_to_1_captures_nothing_after_start(
        monkeypatch: pytest.MonkeyPatch, tiny_checkpoint: Path) -> None:
    # The checkpoint drafts for itself (a small LM): every draft is accepted, 3 tokens a step.
    rng = np.random.default_rng(0)
    prompts = [rng.integers(1, 128, size=3 + i % 4).tolist() for i in range(256)]
    params = staggered(256, [56, 100, 50, 30, 10, 5, 2, 1, 1])  # 256, 200, 100, ... 1 rows
    kw: dict[str, Any] = dict(device="cpu", dtype="float32", max_model_len=96,
                              kv_cache_tokens=256 * 48, max_batch_size=256)
    want = SpecEngine(tiny_checkpoint, str(tiny_checkpoint), cuda_graphs=False,
                      **kw).generate(prompts, k=2, sampling=params)
    emulated(monkeypatch)
    engine = SpecEngine(tiny_checkpoint, str(tiny_checkpoint), cuda_graphs=True,
                        capture="startup", capture_ks=(0, 1, 2), **kw)
    runner = engine.graphs
    captured = runner.num_captures
    # every bucket x k: the verify pass, and the small LM's pass at catch-up widths 1 and 2
    assert captured == 9 * (1 + 2 * 3)
    stats = runner.graph_stats
    assert stats.num_startup == captured and stats.num_lazy == 0 and stats.startup_s > 0
    got = engine.generate(prompts, k=2, sampling=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert runner.num_captures == captured  # nothing captured inside a step
    # every bucket's verify graph was replayed by the run (beyond its capture's one replay)
    replayed = {key[1] for key, (graph, *_) in runner._graphs.items()
                if key[0] == "verify" and key[2] == 3 and graph.replays > 1}
    assert replayed == set(runner.buckets)
    assert runner.num_runs["lm-draft"] > 0


@pytest.mark.parametrize("tree", [None, [(0,), (1,), (0, 0), (0, 1), (0, 0, 0)]])
def test_eagle3_startup_equals_eager(monkeypatch: pytest.MonkeyPatch, tree: list | None) -> None:
    # 7 prompts, at most 4 running; sampled, so seeds and draft positions matter too.
    prompts, params = arith_prompts(7), mixed_params(7, 1.0, 5)
    kw: dict[str, Any] = dict(device="cpu", dtype="float32", graph_buckets=BUCKETS,
                              max_batch_size=4)
    want = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=False, **kw).generate(
        prompts, k=3, sampling=params, tree=tree)
    emulated(monkeypatch)
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=True, capture="startup",
                        capture_ks=(0, 1, 2, 3), **kw)
    runner = engine.graphs
    captured = runner.num_captures
    kinds = {key[0] for key in runner._graphs}
    assert kinds == {"verify", "draft", "observe"}
    # buckets up to the capacity (4): 3 x (k = 0: verify + catch-up; k > 0: three passes)
    assert captured == 3 * (2 + 3 * 3)
    got = engine.generate(prompts, k=3, sampling=params, tree=tree)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert engine.stats.num_accepted_tokens > 0
    if tree is None:
        assert runner.num_captures == captured
    else:  # a tree is the request's: its shapes are captured at first use
        assert {key[0] for key in runner._graphs} - kinds == {"draft-tree"}
        assert runner.graph_stats.num_lazy == runner.num_captures - captured > 0


def test_verify_graphs_write_their_hidden_outputs_into_one_allocation(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Every captured verify shape's final hidden and aux hidden states are views of one
    [1 + aux, capacity * (k_max + 1), H] allocation (not each graph's own), which the drafter's
    catch-up graphs read; sampled output still equals the eager engine's."""
    prompts, params = arith_prompts(7), mixed_params(7, 1.0, 5)
    kw: dict[str, Any] = dict(device="cpu", dtype="float32", graph_buckets=BUCKETS,
                              max_batch_size=4)
    want = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=False, **kw).generate(
        prompts, k=3, sampling=params)
    emulated(monkeypatch)
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=True, capture="startup",
                        capture_ks=(0, 2, 3), **kw)
    verify = {key: entry[1] for key, entry in engine.graphs._graphs.items()
              if key[0] == "verify"}
    assert len(verify) == 3 * 3  # buckets 1, 2, 4 x N = 1, 3, 4
    tensors = [t for out in verify.values() for t in (out.hidden, *out.aux_hidden)]
    assert len({t.untyped_storage().data_ptr() for t in tensors}) == 1
    mc, verifier = engine.model_config, engine.graphs.verifier
    one = tensors[0].untyped_storage()
    assert one.nbytes() == (1 + len(engine.drafter.aux_layers)) * 4 \
        * (verifier.max_prob_drafts + 1) * mc.hidden_size * 4  # float32
    for (_, rows, n, *_), out in verify.items():
        assert out.hidden.shape == (rows * n, mc.hidden_size)
    got = engine.generate(prompts, k=3, sampling=params)
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    for a, b in zip(want, got):
        torch.testing.assert_close(torch.tensor(b.logprobs), torch.tensor(a.logprobs),
                                   atol=1e-5, rtol=0)
    assert engine.stats.num_accepted_tokens > 0 and engine.graphs.num_runs["observe"] > 0


def test_startup_capture_freezes_the_garbage_collector(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[tuple[bool, int]] = []

    class Watching(ReplayingGraph):
        def capture(self, fn: Any) -> Any:
            seen.append((gc.isenabled(), gc.get_freeze_count()))
            return super().capture(fn)

    assert gc.isenabled() and gc.get_freeze_count() == 0
    emulated(monkeypatch, Watching)
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", cuda_graphs=True,
                        graph_buckets=(1, 2), max_batch_size=2, capture="startup",
                        capture_ks=(0, 2))
    assert len(seen) == engine.graphs.num_captures == 2 * (2 + 3)
    assert all(not enabled and frozen > 0 for enabled, frozen in seen)
    assert gc.isenabled() and gc.get_freeze_count() == 0  # as it was
    seen.clear()
    engine.generate(arith_prompts(2), k=1, sampling=SamplingParams(max_tokens=4))  # lazy k=1
    assert seen and all(not enabled for enabled, _ in seen)
    assert gc.isenabled()


def test_cuda_graph_capture_keeps_the_allocator_cache(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CudaGraph`` captures with ``capture_begin`` / ``capture_end`` on a side stream in
    thread_local mode, never emptying the caching allocator (``torch.cuda.graph`` does)."""
    calls: list[Any] = []

    class FakeGraph:
        def capture_begin(self, pool: Any = None, capture_error_mode: str = "global") -> None:
            calls.append(("begin", pool, capture_error_mode))

        def capture_end(self) -> None:
            calls.append("end")

        def pool(self) -> tuple[int, int]:
            return (7, 7)

    class FakeStream:
        def wait_stream(self, other: Any) -> None:
            calls.append("wait")

    def refuse(*args: Any) -> None:
        raise AssertionError("the caching allocator was emptied")

    monkeypatch.setattr(torch.cuda, "CUDAGraph", FakeGraph)
    monkeypatch.setattr(torch.cuda, "Stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "current_stream", FakeStream)
    monkeypatch.setattr(torch.cuda, "stream", lambda s: calls.append("on stream") or
                        __import__("contextlib").nullcontext())
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "empty_cache", refuse)
    monkeypatch.setattr(torch.cuda, "graph", refuse)
    monkeypatch.setattr(CudaGraph, "_stream", None)
    graph = CudaGraph(None)
    out = graph.capture(lambda: calls.append("pass") or 5)
    assert out == 5 and graph.pool == (7, 7)
    assert calls == ["wait", "on stream", ("begin", None, "thread_local"), "pass", "end",
                     "wait"]


# ---- the strict emulator itself ---------------------------------------------------------------
class Holder:
    def __init__(self) -> None:
        self.buf = torch.arange(4.0)
        self.scale = 2


def test_emulator_replays_a_pass_of_static_buffers() -> None:
    h = Holder()
    graph = ReplayingGraph(None)
    out = graph.capture(lambda: h.buf * h.scale)
    h.buf.add_(1)  # a static buffer's contents change: the replay reads them
    graph.replay()
    assert out.tolist() == [2.0, 4.0, 6.0, 8.0]


@pytest.mark.parametrize("change", ["python value", "replaced tensor", "value read back"])
def test_emulator_fails_a_pass_whose_python_inputs_changed(change: str) -> None:
    """What a CUDA graph would silently ignore fails the replay."""
    h = Holder()

    def pass_() -> torch.Tensor:
        y = h.buf * h.scale
        return y[: int(h.buf.sum()) % 3 + 1]  # a length read back from a device tensor

    graph = ReplayingGraph(None)
    graph.capture(pass_)
    graph.replay()  # unchanged: fine
    if change == "python value":
        h.scale = 3
    elif change == "replaced tensor":
        h.buf = h.buf.clone()
    else:
        h.buf.add_(1)  # the sum read inside the pass changes
    with pytest.raises(StaleCapture, match="differs from its capture"):
        graph.replay()


def test_a_planted_python_dependency_in_a_captured_pass_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The EAGLE-3 chain's draft pass made to read the batch's row count (a Python value that
    changes between steps of one bucket): a GPU would replay the captured count."""
    from specengine.drafters.static_chain import StaticFeatureChain

    loop = StaticFeatureChain._loop

    def planted(self: StaticFeatureChain, rows: int, k: int, sample: bool) -> Any:
        ids, probs = loop(self, rows, k, sample)
        ids.clamp_(max=2**20 + self.state.num_rows)  # a no-op on the ids; the launch differs
        return ids, probs

    monkeypatch.setattr(StaticFeatureChain, "_loop", planted)
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", cuda_graphs=True,
                        graph_buckets=(4,), max_batch_size=4)
    engine.graphs.graph_factory, engine.graphs.capture = ReplayingGraph, True
    params = [SamplingParams(temperature=0.0, max_tokens=4 + 8 * (i % 2)) for i in range(4)]
    with pytest.raises(Exception) as err:
        out = engine.generate(arith_prompts(4), k=2, sampling=params)
        # a request that failed alone comes back with its error
        raise RuntimeError(" ".join(o.error or "" for o in out))
    assert "differs from its capture" in str(err.value)


# ---- replay checks (GraphRunner.debug) -----------------------------------------------------
def _runner(debug: bool) -> GraphRunner:
    runner = GraphRunner(None, (2,), True, torch.device("cpu"),  # type: ignore[arg-type]
                         graph_factory=ReplayingGraph)
    runner.debug = debug
    return runner


def test_debug_replays_check_the_inputs_they_are_handed() -> None:
    buf = torch.ones(2)
    runner = _runner(debug=True)
    for scale in (2, 2):
        out = runner.run_graph(("p", 2), 2, lambda scale=scale: buf * scale)
    assert out.tolist() == [2.0, 2.0]
    with pytest.raises(GraphInputMismatch, match="other inputs"):
        runner.run_graph(("p", 2), 2, lambda: buf * 3)  # closure cell: another int
    other = torch.ones(2)
    with pytest.raises(GraphInputMismatch, match="other inputs"):
        runner.run_graph(("p", 2), 2, lambda: other * 2)  # another tensor
    # without the check a replay silently uses the captured inputs, as a CUDA graph does
    silent = _runner(debug=False)
    silent.run_graph(("p", 2), 2, lambda: buf * 2)
    assert silent.run_graph(("p", 2), 2, lambda: buf * 3).tolist() == [2.0, 2.0]


def test_debug_replays_check_their_outputs_stayed_put() -> None:
    buf = torch.ones(2)
    runner = _runner(debug=True)
    fn = lambda: buf * 2  # noqa: E731
    out = runner.run_graph(("p", 2), 2, fn)
    runner.run_graph(("p", 2), 2, fn)
    with torch.inference_mode():  # a consumer re-pointed a captured output
        out.set_(torch.zeros(2).untyped_storage())
    with pytest.raises(GraphInputMismatch, match="outputs moved"):
        runner.run_graph(("p", 2), 2, fn)


def test_debug_mode_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SPECENGINE_GRAPH_DEBUG", "1")
    assert _runner_default().debug
    monkeypatch.setenv("SPECENGINE_GRAPH_DEBUG", "0")
    assert not _runner_default().debug


def _runner_default() -> GraphRunner:
    return GraphRunner(None, (2,), True, torch.device("cpu"))  # type: ignore[arg-type]


# ---- the step's phase clock ------------------------------------------------------------------
class FakeEvent:
    """A CUDA timing event on a fake device clock that advances one second per record; reading
    an interval before the step's sync covered both ends fails (that read would block)."""

    clock = 0
    syncs = 0

    def __init__(self) -> None:
        self.at: int | None = None
        self.sync_at = -1

    def record(self) -> None:
        FakeEvent.clock += 1
        self.at, self.sync_at = FakeEvent.clock, FakeEvent.syncs

    def query(self) -> bool:
        return self.sync_at < FakeEvent.syncs

    def synchronize(self) -> None:
        FakeEvent.syncs += 1

    def elapsed_time(self, end: FakeEvent) -> float:
        assert self.query() and end.query(), "read before a sync covered the events"
        return 1e3 * (end.at - self.at)  # type: ignore[operator]


def test_phase_times_come_from_events_read_at_the_step_sync(
        monkeypatch: pytest.MonkeyPatch) -> None:
    import specengine.core.step as speculate

    to_host = speculate.to_host

    def counted(x: torch.Tensor) -> Any:
        FakeEvent.syncs += 1
        return to_host(x)

    monkeypatch.setattr(speculate, "to_host", counted)
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", cuda_graphs=True,
                        graph_buckets=(4,), max_batch_size=4)
    engine.graphs.clock = StepClock(FakeEvent)
    engine.generate(arith_prompts(4), k=2, sampling=SamplingParams(max_tokens=9))
    syncs = FakeEvent.syncs
    stats = engine.stats  # the run ended: the last step's bookkeeping is read (waited for)
    steps = stats.num_steps
    # one fake second per phase per step: the events' intervals, not host time
    assert steps > 2
    assert stats.time_draft_s == stats.time_verify_s == stats.time_bookkeeping_s == steps
    assert FakeEvent.syncs == syncs + 1  # only the read after the run waited


def test_cpu_phase_times_are_host_times() -> None:
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", cuda_graphs=True,
                        graph_buckets=(4,), max_batch_size=4)
    assert engine.graphs.clock.events is None
    engine.generate(arith_prompts(4), k=2, sampling=SamplingParams(max_tokens=9))
    s = engine.stats
    assert 0 < s.time_draft_s + s.time_verify_s + s.time_bookkeeping_s < s.wall_time_s


# ---- restaged draft counts -------------------------------------------------------------------
def test_restaged_counts_go_through_their_own_host_row(monkeypatch: pytest.MonkeyPatch) -> None:
    """n-gram chains shorter than k restage the counts: from a row of their own, never from
    the step fields' buffer whose copy may be in flight; static still equals eager."""
    restaged: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
    restage = BatchState.restage_num_drafts

    def watched(self: BatchState, num_drafts: np.ndarray) -> None:
        n = len(self.seqs)
        staged = self.host_ints[NUM_DRAFT, :n].copy()
        restage(self, num_drafts)
        assert self._host_restage_t.untyped_storage().data_ptr() != \
            self._host_bytes.untyped_storage().data_ptr()
        restaged.append((staged, self.host_ints[NUM_DRAFT, :n].copy(),
                         self.ints[NUM_DRAFT, :n].numpy().copy()))
        assert (restaged[-1][2] == num_drafts).all()  # the device has the new counts

    monkeypatch.setattr(BatchState, "restage_num_drafts", watched)
    from test_static_path import both_paths

    both_paths(DEFAULT_TARGET, "ngram", arith_prompts(5), 4, mixed_params(5, 1.0, 3),
               replay=True)
    assert restaged  # the n-gram drafter did propose fewer than asked
    for staged, host_after, device in restaged:
        assert (host_after == staged).all()  # the in-flight source was not written
        assert (device <= staged).all() and (device != staged).any()


# ---- options ---------------------------------------------------------------------------------
def test_capture_options() -> None:
    assert DEFAULT_CAPTURE_KS == tuple(range(DEFAULT_K_MAX + 1))
    cpu = EngineConfig.resolve(model="m", device="cpu", dtype="auto", kernel_backend="auto")
    assert cpu.capture == "lazy" and cpu.capture_ks is None
    for bad in (dict(capture="eager"), dict(capture_ks=()), dict(capture_ks=(0, 17)),
                dict(capture_ks=(True,)), dict(capture_ks=[1, 2]), dict(capture_ks=(-1,))):
        with pytest.raises(ValueError, match="capture"):
            EngineConfig(model="m", **bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="capture_ks"):
        SpecEngine(DEFAULT_TARGET, device="cpu", capture_ks=(99,))


def test_startup_without_a_capturing_runner_is_a_no_op() -> None:
    """On the CPU without a graph factory there is nothing to capture: no graph is made."""
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device="cpu", cuda_graphs=True,
                        graph_buckets=(1, 2), max_batch_size=2, capture="startup")
    assert engine.graphs.num_captures == 0 and not engine.graphs._graphs


def test_no_drafter_captures_k0_only(monkeypatch: pytest.MonkeyPatch) -> None:
    emulated(monkeypatch)
    engine = SpecEngine(DEFAULT_TARGET, device="cpu", cuda_graphs=True, graph_buckets=(1, 2),
                        max_batch_size=2, capture="startup")
    assert sorted(engine.graphs._graphs) == [VerifyShape(rows, 1, None, False).graph_keys["verify"]
                                             for rows in (1, 2)]
    assert graphs_module.GraphStats(()).graph_bytes == 0
