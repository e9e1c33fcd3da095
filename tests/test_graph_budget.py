"""The graph budget (``max_graphs``, ``max_graph_bytes``; ``core.graphs.GraphBudget``): a shape
past it runs eagerly on the static buffers (same outputs as eager and as the unlimited run),
warned once, counted in ``graph_stats``; startup capture stops there; a drafter's catch-up is
never captured over a verify pass that runs eagerly. On the CPU the captures go through the
strict emulator (``tests/replaying_graph.py``); bytes come from a stubbed allocator figure."""

from __future__ import annotations

import logging
from typing import Any

import pytest
import torch
from replaying_graph import ReplayingGraph
from test_capture_startup import emulated
from test_static_path import BUCKETS, arith_prompts, mixed_params

from specengine import SpecEngine
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.config import EngineConfig
from specengine.core import graphs as graphs_module
from specengine.core.graphs import CaptureRecord, GraphBudget, GraphRunner, GraphStats

KW: dict[str, Any] = dict(device="cpu", dtype="float32", graph_buckets=BUCKETS,
                          max_batch_size=4)


def tokens(outs: list) -> list[list[int]]:
    return [o.token_ids for o in outs]


# ---- the decision -----------------------------------------------------------------------------
def test_the_budget_decides_on_count_and_bytes() -> None:
    assert GraphBudget().refuses(10**6, 10**15, 10**15) is None  # no limit
    count = GraphBudget(max_graphs=3)
    assert count.refuses(2, 0, 0) is None
    assert "max_graphs=3" in count.refuses(3, 0, 0)  # type: ignore[operator]
    size = GraphBudget(max_bytes=100)
    assert size.refuses(0, 0, 100) is None  # reaching the limit exactly fits
    assert size.refuses(5, 60, 40) is None
    assert "max_graph_bytes=100" in size.refuses(5, 60, 41)  # type: ignore[operator]
    assert size.refuses(5, 100, 0) is not None  # spent: even a capture estimated at 0
    assert GraphBudget(max_bytes=0).refuses(0, 0, 0) is not None  # no bytes: no graph
    assert GraphBudget(max_graphs=0).refuses(0, 0, 0) is not None
    for bad in (dict(max_graphs=-1), dict(max_bytes=-1), dict(max_graphs=True),
                dict(max_bytes=1.5)):
        with pytest.raises(ValueError, match="GraphBudget"):
            GraphBudget(**bad)  # type: ignore[arg-type]


def test_engine_options_are_checked_and_reach_the_runner() -> None:
    for bad in (dict(max_graphs=-1), dict(max_graph_bytes=-5), dict(max_graphs=2.0),
                dict(max_graph_bytes=True), dict(max_graphs="3")):
        with pytest.raises(ValueError, match="max_graph"):
            EngineConfig(model="m", **bad)  # type: ignore[arg-type]
    assert EngineConfig(model="m").max_graphs is None
    assert EngineConfig(model="m").max_graph_bytes is None
    engine = SpecEngine(DEFAULT_TARGET, cuda_graphs=True, max_graphs=3, max_graph_bytes=7,
                        **KW)
    assert engine.graphs.budget == GraphBudget(3, 7)
    # On the CPU no default byte limit: a capture reserves nothing there.
    assert SpecEngine(DEFAULT_TARGET, cuda_graphs=True, **KW).graphs.budget == GraphBudget()


def test_stats_keep_refused_and_captured_shapes_apart() -> None:
    record = CaptureRecord(("verify", 2), 0.1, 0, False)
    assert GraphStats((record,), (("verify", 4),)).num_refused == 1
    with pytest.raises(ValueError, match="refused once"):
        GraphStats((record,), (("verify", 2),))
    with pytest.raises(ValueError, match="refused once"):
        GraphStats((), (("verify", 4), ("verify", 4)))


# ---- the runner ---------------------------------------------------------------------------------
def test_a_refused_shape_runs_eagerly_warned_once(caplog: pytest.LogCaptureFixture) -> None:
    runner = GraphRunner(None, (2,), True, torch.device("cpu"),  # type: ignore[arg-type]
                         graph_factory=ReplayingGraph, budget=GraphBudget(max_graphs=1))
    buf = torch.ones(2)
    runs = []

    def eager_pass() -> torch.Tensor:
        runs.append(1)
        return buf * 3

    runner.run_graph(("p", 2), 2, lambda: buf * 2)
    with caplog.at_level(logging.WARNING, logger="specengine.core.graphs"):
        outs = [runner.run_graph(("q", 2), 2, eager_pass) for _ in range(3)]
    assert len(runs) == 3  # run every time, never warmed up or captured
    buf.add_(1)  # each call's outputs are its own, read from the buffers then
    assert [o.tolist() for o in outs] == [[3.0, 3.0]] * 3
    assert runner.run_graph(("q", 2), 2, eager_pass).tolist() == [6.0, 6.0]
    assert runner.num_captures == 1 and list(runner._graphs) == [("p", 2)]
    assert runner.graph_stats.refused == (("q", 2),)
    warned = [r for r in caplog.records if "runs eagerly" in r.getMessage()]
    assert len(warned) == 1 and "max_graphs=1" in warned[0].getMessage()
    assert runner.run_graph(("p", 2), 2, lambda: buf * 2).tolist() == [4.0, 4.0]  # replayed


class Costly(ReplayingGraph):
    """A graph whose capture reserves ``cost(fn)`` bytes of a fake allocator."""

    reserved = 0
    cost: Any = staticmethod(lambda fn: 0)

    def capture(self, fn: Any) -> Any:
        Costly.reserved += Costly.cost(fn)
        return super().capture(fn)


@pytest.fixture
def fake_bytes(monkeypatch: pytest.MonkeyPatch) -> type[Costly]:
    monkeypatch.setattr(Costly, "reserved", 0)
    monkeypatch.setattr(graphs_module, "_reserved", lambda device: Costly.reserved)
    return Costly


def test_a_capture_is_estimated_at_its_kinds_last(fake_bytes: type[Costly],
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    costs = {2: 1, 3: 5}  # by the value the pass returns
    monkeypatch.setattr(Costly, "cost", staticmethod(lambda fn: costs[int(fn())]))
    runner = GraphRunner(None, (2, 4), True, torch.device("cpu"),  # type: ignore[arg-type]
                         graph_factory=Costly, budget=GraphBudget(max_bytes=10))
    one = torch.ones(1)
    runner.run_graph(("v", 2), 2, lambda: one * 2)  # 1 B
    runner.run_graph(("w", 2), 2, lambda: one * 3)  # 5 B: 6 in all
    # A "v" is taken to cost what the last "v" did (1 B: fits), not the last capture's 5.
    runner.run_graph(("v", 4), 4, lambda: one * 2)
    assert [c.bytes for c in runner.graph_stats.captures] == [1, 5, 1]
    runner.run_graph(("w", 4), 4, lambda: one * 3)  # 7 + 5 > 10
    assert runner.graph_stats.refused == (("w", 4),)
    assert runner.graph_stats.graph_bytes == 7


# ---- end to end -------------------------------------------------------------------------------
@pytest.mark.parametrize("capture", ["startup", "lazy"])
def test_three_graphs_equal_eager_and_the_unlimited_run(
        monkeypatch: pytest.MonkeyPatch, capture: str) -> None:
    prompts, params = arith_prompts(7), mixed_params(7, 1.0, 5)
    want = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=False, **KW).generate(
        prompts, k=3, sampling=params)
    emulated(monkeypatch)  # captures through the strict emulator, replays checked
    ks = dict(capture=capture, capture_ks=(0, 1, 2, 3))
    unlimited = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=True, **ks, **KW)
    assert tokens(unlimited.generate(prompts, k=3, sampling=params)) == tokens(want)
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=True, max_graphs=3, **ks,
                        **KW)
    runner = engine.graphs
    if capture == "startup":
        # largest first: the 4-row k = 3 step's draft, verify and catch-up passes; the next
        # pass is refused and startup stops there (it does not go on refusing the rest)
        assert sorted(key[:3] for key in runner._graphs) == [
            ("draft", 4, 3), ("observe", 4, 4), ("verify", 4, 4)]
        # (sampled drafts: an EAGLE-3 head samples those of sampled requests by default)
        assert runner.graph_stats.refused == (("draft", 4, 2, True),)
    got = engine.generate(prompts, k=3, sampling=params)
    assert tokens(got) == tokens(want)
    assert [o.logprobs for o in got] == pytest.approx([o.logprobs for o in want], abs=1e-5)
    assert engine.stats.num_accepted_tokens > 0
    stats = runner.graph_stats
    assert runner.num_captures == len(stats.captures) == 3 < unlimited.graphs.num_captures
    assert runner.num_replays > 3  # the captured ones served later steps
    # the smaller buckets' passes ran eagerly, each refused once
    refused = {key[:2] for key in stats.refused}
    assert {("draft", 2), ("verify", 2), ("observe", 2)} <= refused


def test_a_catch_up_is_not_captured_over_an_eager_verify_pass(
        monkeypatch: pytest.MonkeyPatch, fake_bytes: type[Costly]) -> None:
    """The bytes budget refuses a verify pass but would let its catch-up in: the catch-up runs
    eagerly too. Captured, it would read the outputs of the verify pass's run at its capture
    (the emulator's replay checks fail it, a GPU would read freed memory)."""
    monkeypatch.setattr(Costly, "cost", staticmethod(
        lambda fn: 6 if "verify_pass" in fn.__qualname__ else 1))
    prompts, params = arith_prompts(7), mixed_params(7, 0.0, None)
    want = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=False, **KW).generate(
        prompts, k=2, sampling=params)
    emulated(monkeypatch, Costly)
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=True, capture="startup",
                        capture_ks=(2,), max_graph_bytes=14, **KW)
    runner = engine.graphs
    # 4 rows: draft 1 + verify 6 + catch-up 1; 2 rows: draft 1, then verify (9 + 6 > 14) is
    # refused and startup stops.
    assert [c.key[:2] for c in runner.graph_stats.captures] == [
        ("draft", 4), ("verify", 4), ("observe", 4), ("draft", 2)]
    got = engine.generate(prompts, k=2, sampling=params)
    assert tokens(got) == tokens(want)
    reasons = {key[:2]: why for key, why in runner._refused.items()}
    assert "max_graph_bytes=14" in reasons["verify", 2]
    # 9 + 1 <= 14 would fit, but its verify pass runs eagerly
    assert "runs eagerly" in reasons["observe", 2]
    assert runner.graph_stats.graph_bytes <= 14
