"""The host-overhead benchmark's instruments (benchmarks/step_profiler.py) on known sequences
of operations: what counts as a launch, a blocking sync, a compute region; and the verdicts
against the issue's targets (benchmarks/host_overhead_report.py)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import triton
import triton.language as tl

BENCH = Path(__file__).resolve().parent.parent / "benchmarks"
sys.path.insert(0, str(BENCH))

from host_overhead_report import host_target_us, verdicts  # noqa: E402
from step_profiler import StepProfiler  # noqa: E402

HERE = (str(Path(__file__).resolve().parent) + "/",)  # this file plays the engine's part


def _foreign(src: str):
    """A function whose code lives in a file outside the project roots."""
    scope: dict = {}
    exec(compile(src, "/elsewhere/user_code.py", "exec"), scope)
    return scope["f"]


@triton.jit
def _add_one(x_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=mask) + 1.0, mask=mask)


def test_counts_kernels_not_views_or_allocations():
    a = torch.randn(4, 4)
    with StepProfiler(regions=False, roots=HERE) as p:
        b = a @ a  # mm
        c = b.t().contiguous()  # view + clone
        d = c.view(16) + 1  # view + add
        torch.empty(8)  # allocation only
        a.unsqueeze(0).expand(2, 4, 4)  # views only
        d.sum()  # sum
    assert p.counts.aten_kernels == 4
    assert p.counts.ops == {"aten.mm": 1, "aten.clone": 1, "aten.add": 1, "aten.sum": 1}
    assert p.counts.launches == 4 and p.counts.syncs == 0


def test_syncs_counted_once_and_only_from_project_files():
    t = torch.arange(6.0)
    foreign = _foreign("def f(t):\n    return t.tolist(), t.sum().item(), bool(t[1] > 0)\n")
    with StepProfiler(regions=False, roots=HERE) as p:
        t.tolist()
        t.sum().item()  # .item() reaches aten._local_scalar_dense: still one sync
        if t[2] > 0:  # __bool__
            pass
        int(t[3])
        foreign(t)  # three more reads, none from the project
    assert p.counts.syncs == 4
    sites = p.counts.sync_sites
    assert sum(sites.values()) == 4
    assert {s.split()[-1] for s in sites} == {"tolist", "item", "__bool__", "__int__"}
    assert all(s.startswith("tests/test_host_overhead.py:") for s in sites)


def test_triton_and_c_kernels_are_launches_and_interpreter_ops_are_not():
    from specengine.kernels.kv_cache import reshape_and_cache

    x = torch.zeros(100)
    k = torch.randn(3, 2, 8)
    v = torch.randn(3, 2, 8)
    kc, vc = torch.zeros(4, 16, 2, 8), torch.zeros(4, 16, 2, 8)
    slots = torch.tensor([5, 17, 40])
    with StepProfiler(regions=False, roots=HERE) as p:
        _add_one[(4,)](x, 100, BLOCK=32)
        _add_one[(4,)](x, 100, BLOCK=32)
        reshape_and_cache(k, v, kc, vc, slots)
    assert p.counts.triton == 2
    assert p.counts.c_kernels == 1
    assert p.counts.ops["_add_one"] == 2 and p.counts.ops["reshape_and_cache_host"] == 1
    assert torch.equal(x, torch.full((100,), 2.0))  # the wrapped launches really ran
    assert torch.equal(kc.view(-1, 2, 8)[slots], k)
    # the interpreter's own tensor work is not counted; reshape_and_cache's .contiguous() on
    # a contiguous tensor launches nothing
    assert p.counts.aten_kernels == 0


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.lin = torch.nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.relu(self.lin(x))


def test_layer_scope_counts_launches_per_layer_call():
    layers = torch.nn.ModuleList(_Layer() for _ in range(3))
    x = torch.randn(2, 8)
    with StepProfiler(regions=False, roots=HERE) as p:
        p.layers.attach(layers)
        h = x * 2  # outside any layer
        for layer in layers:
            h = layer(h)
    assert p.layers.calls == 3
    per_layer = p.layers.per_layer()
    assert per_layer is not None and per_layer == p.layers.launches / 3
    assert p.counts.aten_kernels == p.layers.launches + 1
    assert p.layers.launches >= 6  # at least the linear and the relu of every layer
    assert not layers[0]._forward_hooks and not layers[0]._forward_pre_hooks  # detached


def test_compute_regions_cover_module_calls_and_not_loose_ops():
    model = torch.nn.Sequential(_Layer(), _Layer())
    x = torch.randn(2, 8)
    with StepProfiler(dispatch=False, roots=HERE) as p:
        for _ in range(50):
            x + 1
    assert p.counts.compute_s == 0.0
    with StepProfiler(dispatch=False, roots=HERE) as p:
        import time

        t0 = time.perf_counter()
        model(x)  # nested module calls: one region
        wall = time.perf_counter() - t0
    assert 0.0 < p.counts.compute_s <= wall


def test_everything_is_restored_after_exit():
    from triton.runtime.jit import JITFunction

    from specengine import _C

    before = (torch.Tensor.tolist, JITFunction.run, _C.reshape_and_cache_host)
    with StepProfiler(roots=HERE):
        assert torch.Tensor.tolist is not before[0]
    assert (torch.Tensor.tolist, JITFunction.run, _C.reshape_and_cache_host) == before
    assert "__bool__" not in vars(torch.Tensor) and "item" not in vars(torch.Tensor)
    with StepProfiler(regions=False, roots=HERE) as p:
        pass
    torch.ones(3).sum().item()  # after exit: nothing counts
    assert p.counts.syncs == 0 and p.counts.aten_kernels == 0


@pytest.mark.parametrize(("batch", "host", "expect"), [(16, 331.9, "PASS"), (16, 332.1, "MISS"),
                                                       (256, 811.0, "PASS"), (1, 303.0, "MISS")])
def test_host_verdict_follows_the_per_sequence_budget(batch, host, expect):
    assert verdicts(dict(batch=batch, host_us=host))["host"] == expect
    assert host_target_us(batch) == 300 + 2 * batch
    assert host_target_us(batch, stretch=True) == 100 + 0.5 * batch


def test_launch_verdicts_eager_per_layer_and_graphed():
    assert verdicts(dict(batch=1, launches_per_layer=12.0))["launches"] == "PASS"
    assert verdicts(dict(batch=1, launches_per_layer=12.5))["launches"] == "MISS"
    graphed = dict(batch=1, graphs=True, graph_replays=2, launches=3, copies=3)
    assert verdicts(graphed)["launches"] == "PASS"  # only copies into static inputs
    assert verdicts({**graphed, "launches": 4})["launches"] == "MISS"
    assert verdicts(dict(batch=1))["host"] == "-"


def test_run_pass_stops_after_the_steps_and_leaves_the_engine_usable():
    """The benchmark wraps ``EngineCore.step`` and ``EngineCore.decode_step`` on the
    instance, times only steps that decode, and ends ``generate`` from inside it once enough
    steps were measured: the engine must come back whole."""
    from bench_host_overhead import run_pass

    from specengine import SamplingParams, SpecEngine
    from specengine.cli import DEFAULT_DRAFT, DEFAULT_TARGET

    engine = SpecEngine(DEFAULT_TARGET, draft=str(DEFAULT_DRAFT), kernel_backend="torch",
                        max_batch_size=4)
    prompts = [[3, 4, 5, 6], [7, 8, 9]]
    params = SamplingParams(temperature=0.0, max_tokens=8)
    expected = [o.token_ids for o in engine.generate(prompts, k=3, sampling=params)]
    timed = run_pass(engine, prompts, 3, None, steps=3, counting=False)
    counted = run_pass(engine, prompts, 3, None, steps=3, counting=True)
    assert len(timed) == len(counted) == 3
    assert all(r["batch"] == 2 for r in timed + counted)
    assert all(r["counts"].compute_s > 0 and r["counts"].launches == 0 for r in timed)
    assert all(r["counts"].launches > 0 and r["layer_calls"] > 0 for r in counted)
    assert "decode_step" not in vars(engine.core)  # the class's methods again
    assert "step" not in vars(engine.core)
    assert engine.scheduler.has_unfinished() is False
    again = [o.token_ids for o in engine.generate(prompts, k=3, sampling=params)]
    assert again == expected
