"""Plumbing shared by the kernel benchmarks: HBM peak by device, timing, the floor, outputs.

Method (docs/design.md §9): every timed function runs ``warmup`` times first (Triton compilation,
autotuning, allocator and ``torch.compile`` caches all happen there), then each of ``iters``
calls is timed alone between two CUDA events, after a write of 256 MiB that evicts the inputs
from L2, and the median is reported. ``back_to_back`` instead times runs of calls with no
synchronisation between them (warm L2, launch cost included), for launch-bound kernels.
The floor is the bytes a perfect kernel must move over the peak HBM bandwidth.

Imported by the ``bench_*.py`` scripts next to it (``python benchmarks/bench_x.py`` puts this
folder on ``sys.path``).
"""

from __future__ import annotations

import json
import math
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

# Peak HBM bandwidth (GB/s) by device-name substring; H100 PCIe has 2 TB/s.
PEAK_GBPS = {"B200": 8000.0, "H200": 4800.0, "H100": 3350.0}
DEFAULT_OUT = Path(__file__).resolve().parent / "out"
_L2_FLUSH_BYTES = 256 * 2**20  # above the L2 of H100 (50 MiB), H200 and B200
_flush_buf: torch.Tensor | None = None


def device_name() -> str:
    """The CUDA device's name, or a CPU label (smoke runs)."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def peak_gbps(name: str, override: float | None = None) -> float | None:
    """Peak HBM bandwidth of the device called ``name`` (``override`` wins), None if unknown."""
    if override is not None:
        return override
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return 2000.0 if key == "H100" and "PCIe" in name else gbps
    return None


def _flush_l2() -> None:
    global _flush_buf
    if _flush_buf is None:
        _flush_buf = torch.empty(_L2_FLUSH_BYTES // 4, dtype=torch.int32, device="cuda")
    _flush_buf.zero_()


def time_ms(fn: Callable[[], Any], *, warmup: int, iters: int, flush_l2: bool = True,
            back_to_back: bool = False) -> float:
    """Median milliseconds per call of ``fn`` (see the module docstring for the method).

    Without CUDA (smoke runs) it is the median wall time of single calls after the warm-up.
    ``back_to_back`` (CUDA): 5 runs of ``ceil(iters / 5)`` calls, each run between two events;
    the median over runs of the time per call.
    """
    if warmup < 1 or iters < 1:
        raise ValueError(f"need warmup >= 1 and iters >= 1, got {warmup}, {iters}")
    for _ in range(warmup):
        fn()
    if not torch.cuda.is_available():
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(times)
    torch.cuda.synchronize()
    if back_to_back:
        per_run = math.ceil(iters / 5)
        runs = []
        for _ in range(5):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(per_run):
                fn()
            end.record()
            torch.cuda.synchronize()
            runs.append(start.elapsed_time(end) / per_run)
        return statistics.median(runs)
    times = []
    for _ in range(iters):
        if flush_l2:
            _flush_l2()  # queued before `start`, so not timed
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def roofline(nbytes: int, ms: float, peak: float | None) -> dict[str, float | None]:
    """Achieved GB/s, the HBM floor (ms) and time / floor for ``nbytes`` moved in ``ms``."""
    floor_ms = nbytes / (peak * 1e9) * 1e3 if peak else None
    return {
        "gbps": nbytes / (ms * 1e-3) / 1e9 if ms > 0 else None,
        "floor_ms": floor_ms,
        "ratio": ms / floor_ms if floor_ms else None,
    }


def fmt(x: float | None, spec: str) -> str:
    """``format(x, spec)``, or a right-aligned ``-`` of the same width when missing."""
    if x is None or (isinstance(x, float) and math.isnan(x)):
        return "-".rjust(int(spec.split(".")[0]))
    return format(x, spec)


def write_json(result: dict, out_dir: Path, name: str) -> Path:
    """``out_dir/name.json`` (the folder is created)."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.json"
    path.write_text(json.dumps(result, indent=1))
    print(f"wrote {path}")
    return path


def pyplot():  # -> matplotlib.pyplot module, or None
    """``matplotlib.pyplot`` on the Agg backend, or None (with a note) when not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot (pip install -e '.[bench]')")
        return None
    return plt


def save_figure(fig, out_dir: Path, name: str) -> Path:
    """Writes ``out_dir/name.png`` and closes the figure."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    import matplotlib.pyplot as plt

    plt.close(fig)
    print(f"wrote {path}")
    return path
