"""Graph-timed kernel measurement: what the engine runs (CUDA-graph replays), not the launcher.

One eager call between two events at small sizes times the Python launcher, and a working set
that fits in L2 times the cache, not HBM. So a case here is measured as follows:

* **Copies.** The case's inputs are built ``n`` times (distinct memory) so that the bytes the
  calls touch add up to at least ``4 x L2`` (H200: 60 MB, so >= 240 MB), fewer when one copy is
  already that large, and never past a memory cap per case. Calls rotate among the copies, so
  each one finds its inputs evicted from L2 by the others.
* **Graph.** One CUDA graph holds ``calls`` back-to-back calls of the public launcher, copy
  ``i % n`` for call ``i``; each replay is timed between two events and the time per call is
  the median over replays. This is the device time between kernels of a replayed step.
* **Eager beside it.** The same rotation of calls issued from Python back to back (events
  around each run of ``calls`` calls): where it exceeds the graph time, the launcher is the
  bottleneck, not the kernel.
* **Floor.** Bytes counted exactly per case over the device-to-device copy bandwidth measured
  at the start of the same run (:func:`copy_bandwidth`), not the datasheet peak.

Dry mode (no CUDA: CPU tensors, the Triton interpreter) runs the same code: the copies, the
warm-up, the eager rotation and the "replay" of the recorded call list, timed by the wall
clock, with no graph captured. Its figures are meaningless as speed; it checks the plumbing.
"""

from __future__ import annotations

import math
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

L2_MULTIPLE = 4  # working set per case >= 4 x L2
DRY_L2_BYTES = 1 << 20  # stand-in L2 on the CPU, so dry runs still build several copies


def l2_bytes() -> int:
    """The device's L2 size (H200: 60 MB); :data:`DRY_L2_BYTES` without CUDA."""
    if not torch.cuda.is_available():
        return DRY_L2_BYTES
    return int(torch.cuda.get_device_properties(torch.cuda.current_device()).L2_cache_size)


def num_copies(touch_bytes: int, copy_bytes: int, *, l2: int, max_copies: int,
               mem_cap_bytes: int) -> int:
    """Copies so that ``copies x touch_bytes >= L2_MULTIPLE x l2``, at most ``max_copies`` and
    at most what ``mem_cap_bytes`` holds at ``copy_bytes`` each (at least 1)."""
    if touch_bytes <= 0:
        raise ValueError(f"touch_bytes must be positive, got {touch_bytes}")
    want = math.ceil(L2_MULTIPLE * l2 / touch_bytes)
    fit = mem_cap_bytes // max(copy_bytes, 1)
    return max(1, min(want, max_copies, fit))


@dataclass(frozen=True)
class Timing:
    """One case's times, in microseconds per call."""

    # median over replays of (replay time / calls); without a graph (dry run, capture failed:
    # ``graph_error`` says) the same call list replayed from Python, or None
    graph_us: float | None
    eager_us: float  # median over runs of back-to-back eager calls (launcher included)
    copies: int
    calls: int  # calls per replay (and per eager run)
    replays: int
    graph_error: str | None = None  # why no graph time (capture failed, or a dry run)
    # per kernel name, microseconds per call in eager runs (``profile=True``), or
    # {"error": why} when the profiler could not say
    kernels: dict[str, Any] | None = None

    @property
    def best_us(self) -> float:
        """The graph time, else the eager one (what targets are judged on)."""
        return self.graph_us if self.graph_us is not None else self.eager_us


class _Clock:
    """CUDA events on a GPU, the wall clock (after the work) without one."""

    def __init__(self, cuda: bool) -> None:
        self.cuda = cuda

    def start(self) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return ev
        return time.perf_counter()

    def stop(self, start: Any) -> Any:
        if self.cuda:
            ev = torch.cuda.Event(enable_timing=True)
            ev.record()
            return (start, ev)
        return time.perf_counter() - start

    def elapsed_us(self, mark: Any) -> float:
        if self.cuda:
            start, end = mark
            return start.elapsed_time(end) * 1e3
        return mark * 1e6


def calls_per_run(n_copies: int, est_us: float, *, target_span_us: float = 300.0,
                  min_calls: int = 16, max_calls: int = 64) -> int:
    """Calls per replay: enough for a replay to last ~``target_span_us`` (event resolution is
    ~0.5 us), a whole number of rotations, at most ``max_calls`` unless the copies need more."""
    want = min(max(min_calls, math.ceil(target_span_us / max(est_us, 1e-3))), max_calls)
    return max(n_copies, math.ceil(want / n_copies) * n_copies)


def time_rotated(call: Callable[[Any], object], copies: Sequence[Any], *, replays: int,
                 eager_runs: int, graphs: bool, calls: int | None = None,
                 profile: bool = False) -> Timing:
    """Times ``call(copies[i % n])`` as described in the module docstring.

    ``calls``: calls per replay; default from a first eager estimate (:func:`calls_per_run`).
    ``graphs`` False (dry runs): the recorded call list is replayed from Python instead.
    ``profile``: also a per-kernel breakdown of a few eager runs (:func:`kernel_breakdown`),
    to time apart the launches of one launcher (the MoE's routing, alignment and GEMMs).
    """
    if not copies:
        raise ValueError("need at least one copy of the inputs")
    if replays < 1 or eager_runs < 1:
        raise ValueError(f"need replays >= 1 and eager_runs >= 1, got {replays}, {eager_runs}")
    cuda = torch.cuda.is_available()
    clock = _Clock(cuda)
    n = len(copies)
    for c in copies:  # compiles, autotunes, first-touch allocations
        call(c)
    if cuda:
        torch.cuda.synchronize()
    if calls is None:
        calls = n
        if cuda:  # a first eager pass over the copies estimates the time per call
            t0 = clock.start()
            for c in copies:
                call(c)
            mark = clock.stop(t0)
            torch.cuda.synchronize()
            calls = calls_per_run(n, clock.elapsed_us(mark) / n)
    eager = []
    for _ in range(eager_runs):
        t0 = clock.start()
        for i in range(calls):
            call(copies[i % n])
        eager.append(clock.stop(t0))
    if cuda:
        torch.cuda.synchronize()
    eager_us = statistics.median(clock.elapsed_us(m) for m in eager) / calls

    def body() -> None:
        for i in range(calls):
            call(copies[i % n])

    graph_us, error, kernels = None, None, None
    if graphs and cuda:
        try:
            graph_us = _graph_replays(body, replays, clock) / calls
        except Exception as e:  # noqa: BLE001 - an uncapturable case still has its eager time
            error = f"capture failed: {type(e).__name__}: {e}"[:300]
            try:
                torch.cuda.synchronize()
            except Exception:  # noqa: BLE001 - a sticky error: the next case will say so
                pass
    else:
        # No graph (dry run): the same call list "replayed" from Python, so the path runs.
        marks = []
        for _ in range(replays):
            t0 = clock.start()
            body()
            marks.append(clock.stop(t0))
        if cuda:
            torch.cuda.synchronize()
        graph_us = statistics.median(clock.elapsed_us(m) for m in marks) / calls
        error = "no graph: call list replayed from Python" + ("" if cuda else " (dry run)")
    if profile:
        # Eager calls, not the graph: kernel durations are the same, and CUPTI's tracing of
        # eager launches is the path every PyTorch version supports.
        kernels = kernel_breakdown(body, calls)
    return Timing(graph_us, eager_us, n, calls, replays, error, kernels)


def _graph_replays(body: Callable[[], None], replays: int, clock: _Clock) -> float:
    """Median microseconds of one replay of ``body`` captured in a CUDA graph."""
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as torch.cuda.graphs asks
        body()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        body()
    graph.replay()  # the first replay uploads the graph
    torch.cuda.synchronize()
    marks = []
    for _ in range(replays):
        t0 = clock.start()
        graph.replay()
        marks.append(clock.stop(t0))
    torch.cuda.synchronize()
    times = [clock.elapsed_us(m) for m in marks]
    del graph
    return statistics.median(times)


def kernel_breakdown(run: Callable[[], None], calls: int, repeats: int = 3) -> dict[str, Any]:
    """Microseconds per call of each launch of one call of ``run`` (which makes ``calls``
    identical calls), from the PyTorch profiler over ``repeats`` runs: the kernels (on the
    CPU, the top-level operators) in launch order, labelled ``"NN name"``, so two launches of
    one kernel (the MoE's two grouped GEMMs) stay apart. When the events do not split into
    identical calls, totals per name instead. {"error": why} if the profiler fails."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    cuda = torch.cuda.is_available()
    try:
        activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
        with profile(activities=activities) as p:
            for _ in range(repeats):
                run()
            if cuda:
                torch.cuda.synchronize()
        events = [e for e in p.events()
                  if (e.device_type == DeviceType.CUDA if cuda else e.cpu_parent is None)
                  and not e.name.startswith("[")]
        events.sort(key=lambda e: e.time_range.start)
        n = repeats * calls
        out: dict[str, Any] = {}
        if events and len(events) % n == 0:
            per_call = len(events) // n
            for j in range(min(per_call, 40)):  # the MoE: ~20 kernels a call
                times = [events[i * per_call + j].time_range.elapsed_us() for i in range(n)]
                out[f"{j:02d} {events[j].name[:70]}"] = round(statistics.median(times), 3)
            return out
        for e in events:
            key = e.name[:70]
            out[key] = out.get(key, 0.0) + e.time_range.elapsed_us() / n
        return {k: round(v, 3) for k, v in out.items()} | {"split_by_call": False}
    except Exception as e:  # noqa: BLE001 - the breakdown is extra information, never fatal
        return {"error": f"{type(e).__name__}: {e}"[:200]}


def copy_bandwidth(nbytes: int, *, replays: int = 10) -> tuple[float, Timing]:
    """GB/s of a device-to-device copy of ``nbytes`` (bytes read + written, as the floors
    count them), graph-timed like every case; the wall clock on the CPU (dry runs)."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    src = torch.ones(nbytes, dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    t = time_rotated(lambda c: c[1].copy_(c[0]), [(src, dst)], replays=replays, eager_runs=2,
                     graphs=True, calls=4)
    return 2 * nbytes / (t.best_us * 1e-6) / 1e9, t


def floor_us(nbytes: int, gbps: float) -> float:
    """Microseconds to move ``nbytes`` at ``gbps``."""
    return nbytes / (gbps * 1e9) * 1e6
