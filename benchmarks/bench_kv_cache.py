"""KV-cache kernels against the HBM roofline: ``reshape_and_cache`` and ``compact_kv``.

Shapes are Llama-3.1-8B's (32 layers, 8 KV heads, head_dim 128, bf16, block size 16):

* ``reshape_and_cache`` — one layer's write of the step's new K/V: batch × (k+1) tokens, with
  k+1 = 2..8, read from slices of a fused qkv projection output (as the model produces them)
  and scattered over randomly permuted block tables. Per step the model makes 32 such calls.
* ``compact_kv`` — after verification, the accepted tree path of every sequence (1..7 accepted
  draft tokens) moves from slot ``ctx + node`` to ``ctx + depth`` in all 64 caches (K and V of
  every layer) with one launch.

For every configuration: time per call, bytes moved (each copied row read once and written once,
plus the index arrays), achieved GB/s, the HBM floor (bytes / peak bandwidth: H100 3.35 TB/s,
H200 4.8 TB/s, B200 8 TB/s from the device name, or ``--peak-gbps``) and time / floor. The
baselines run in the same process on the same data: a vLLM-style PyTorch fallback
(``index_put_`` / ``index_copy_`` per layer) and, for compact_kv, one gather + one scatter over
the stacked ``[2 * layers, slots, Hkv, D]`` cache.

Timings are with a warm L2 by default (many back-to-back calls between two CUDA events, so the
per-call launch cost is included); ``--flush-l2`` times every call alone after overwriting a
buffer larger than L2. At small batches the data fit in L2, so GB/s above the HBM peak is
possible without ``--flush-l2``.

Usage::

    python benchmarks/bench_kv_cache.py                      # CUDA, full sweep
    python benchmarks/bench_kv_cache.py --batches 1 64 256 --flush-l2
    python benchmarks/bench_kv_cache.py --smoke              # tiny shapes, CPU host kernels
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

PEAK_GBPS = {"B200": 8000.0, "H200": 4800.0, "H100": 3350.0}  # HBM, by device-name substring
DEFAULT_OUT = Path(__file__).resolve().parent / "results" / "kv_cache.json"

LLAMA_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, num_q_heads=32, block_size=16)
SMOKE = dict(num_layers=2, num_kv_heads=2, head_dim=64, num_q_heads=4, block_size=16)


# --------------------------------------------------------------------------------------------
# Setup
# --------------------------------------------------------------------------------------------


def peak_gbps(device: torch.device, override: float | None) -> float | None:
    if override is not None:
        return override
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    for key, gbps in PEAK_GBPS.items():
        if key in name:
            return gbps
    return None


MAX_NEW = 64  # room per sequence past its context: new tokens / draft-tree nodes


def blocks_per_seq(ctx_max: int, block_size: int) -> int:
    return math.ceil((ctx_max + MAX_NEW) / block_size)


class Layout:
    """Random, scattered block tables for ``batch`` sequences of up to ``ctx_max + MAX_NEW``
    tokens, drawn from one random permutation of the pool."""

    def __init__(self, rng: np.random.Generator, batch: int, ctx_max: int, block_size: int,
                 num_blocks: int) -> None:
        self.block_size = block_size
        per_seq = blocks_per_seq(ctx_max, block_size)
        assert batch * per_seq <= num_blocks, "cache too small for the layout"
        self.tables = rng.permutation(num_blocks)[: batch * per_seq].reshape(batch, per_seq)
        self.ctx = rng.integers(0, ctx_max + 1, size=batch)

    def slots(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return self.tables[seq, pos // self.block_size] * self.block_size + pos % self.block_size


def new_token_slots(layout: Layout, tokens_per_seq: int) -> np.ndarray:
    batch = len(layout.ctx)
    seq = np.repeat(np.arange(batch), tokens_per_seq)
    pos = layout.ctx[seq] + np.tile(np.arange(tokens_per_seq), batch)
    return layout.slots(seq, pos)


def accepted_path_moves(layout: Layout, rng: np.random.Generator, accepted: int,
                        tree_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's pairs for ``accepted`` draft tokens per sequence: accepted node ``n`` at
    depth ``d`` (root excluded, pairs with ``n == d`` dropped) moves ctx + n -> ctx + d."""
    src, dst = [], []
    for b, ctx in enumerate(layout.ctx):
        nodes = np.sort(rng.choice(np.arange(1, tree_size), size=accepted, replace=False))
        depth = np.arange(1, accepted + 1)
        keep = nodes != depth
        src.append(layout.slots(np.full(keep.sum(), b), ctx + nodes[keep]))
        dst.append(layout.slots(np.full(keep.sum(), b), ctx + depth[keep]))
    return np.concatenate(src), np.concatenate(dst)


# --------------------------------------------------------------------------------------------
# Timing
# --------------------------------------------------------------------------------------------


def time_call(fn: Callable[[], None], device: torch.device, iters: int, warmup: int,
              flush: torch.Tensor | None) -> float:
    """Seconds per call."""
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        times = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)
    torch.cuda.synchronize(device)
    if flush is None:
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        torch.cuda.synchronize(device)
        return start.elapsed_time(end) / 1e3 / iters
    times = []
    for _ in range(iters):
        flush.add_(1)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize(device)
        times.append(start.elapsed_time(end) / 1e3)
    return statistics.median(times)


def row(op: str, impl: str, seconds: float, nbytes: int, peak: float | None,
        **extra: object) -> dict:
    floor = nbytes / (peak * 1e9) if peak else None
    return {
        "op": op, "impl": impl, **extra,
        "time_us": seconds * 1e6,
        "bytes": nbytes,
        "gbps": nbytes / seconds / 1e9 if seconds > 0 else None,
        "hbm_floor_us": floor * 1e6 if floor is not None else None,
        "ratio_to_floor": seconds / floor if floor else None,
    }


# --------------------------------------------------------------------------------------------
# Benchmarks
# --------------------------------------------------------------------------------------------


def check_kernels(device: torch.device, dtype: torch.dtype) -> None:
    """The kernels equal the reference on this device before anything is timed."""
    from specengine.kernels import kv_cache, reference

    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(16, 16, 2, 64, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(16, 16, 2, 64, generator=gen).to(dtype).to(device)
    qkv = torch.randn(40, 8 * 64, generator=gen).to(dtype).to(device)
    key, value = qkv[:, 256:384].view(40, 2, 64), qkv[:, 384:].view(40, 2, 64)
    slots = torch.randperm(256, generator=gen)[:40].to(device)
    caches = [k_cache.clone(), v_cache.clone()]
    kv_cache.reshape_and_cache(key, value, k_cache, v_cache, slots)
    reference.reshape_and_cache(key, value, *caches, slots)
    src = torch.tensor([5, 9, 12, 40, 41, 47], device=device)
    dst = torch.tensor([1, 2, 5, 33, 34, 35], device=device)
    kv_cache.compact_kv([k_cache], [v_cache], src, dst)
    reference.compact_kv([caches[0]], [caches[1]], src, dst)
    if not (torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])):
        sys.exit(f"the KV kernels disagree with kernels/reference.py on {device}")


def reshape_impls(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The kernel and the vLLM-style PyTorch fallbacks (one layer)."""
    from specengine.kernels import kv_cache

    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])

    def index_put() -> None:
        k_flat.index_put_((slots,), key)
        v_flat.index_put_((slots,), value)

    def index_copy() -> None:
        k_flat.index_copy_(0, slots, key)
        v_flat.index_copy_(0, slots, value)

    return {
        "kernel": lambda: kv_cache.reshape_and_cache(key, value, k_cache, v_cache, slots),
        "torch_index_put": index_put,
        "torch_index_copy": index_copy,
    }


def compact_impls(kv: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                  src: torch.Tensor, dst: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The kernel (one launch), a per-cache PyTorch loop (gather, then scatter: 2 launches per
    cache) and one gather + scatter over the stacked [2 * layers, slots, Hkv, D] cache."""
    from specengine.kernels import kv_cache

    flats = [c.view(-1, *c.shape[2:]) for c in (*k_caches, *v_caches)]
    stacked = kv.view(kv.shape[0] * kv.shape[1], -1, *kv.shape[4:])

    def per_layer() -> None:
        for f in flats:
            f.index_copy_(0, dst, f.index_select(0, src))

    def stacked_copy() -> None:
        stacked.index_copy_(1, dst, stacked.index_select(1, src))

    return {
        "kernel": lambda: kv_cache.compact_kv(k_caches, v_caches, src, dst),
        "torch_per_layer": per_layer,
        "torch_stacked": stacked_copy,
    }


def bench_reshape_and_cache(args: argparse.Namespace, shape: dict, kv: torch.Tensor,
                            device: torch.device, peak: float | None,
                            flush: torch.Tensor | None) -> list[dict]:

    rng = np.random.default_rng(0)
    h, d, hq = shape["num_kv_heads"], shape["head_dim"], shape["num_q_heads"]
    k_cache, v_cache = kv[0, 0], kv[1, 0]
    elem = kv.element_size()
    rows = []
    configs = [(b, n) for b in args.batches for n in args.new_tokens]
    for batch, n in tqdm(configs, desc="reshape_and_cache"):
        layout = Layout(rng, batch, args.context, shape["block_size"], kv.shape[2])
        slots = torch.from_numpy(new_token_slots(layout, n)).to(device)
        t = slots.numel()
        qkv = torch.randn(t, (hq + 2 * h) * d, device=device).to(kv.dtype)
        key = qkv[:, hq * d:(hq + h) * d].view(t, h, d)  # strided slices, as the model has them
        value = qkv[:, (hq + h) * d:].view(t, h, d)
        impls = reshape_impls(key, value, k_cache, v_cache, slots)
        nbytes = 4 * t * h * d * elem + t * slots.element_size()  # K, V read + written; slots
        base = None
        for impl, fn in impls.items():
            sec = time_call(fn, device, args.iters, args.warmup, flush)
            r = row("reshape_and_cache", impl, sec, nbytes, peak, batch=batch,
                    tokens_per_seq=n, num_tokens=t)
            if impl == "kernel":
                base = sec
            r["time_vs_kernel"] = sec / base
            rows.append(r)
    return rows


def bench_compact_kv(args: argparse.Namespace, shape: dict, kv: torch.Tensor,
                     device: torch.device, peak: float | None,
                     flush: torch.Tensor | None) -> list[dict]:

    rng = np.random.default_rng(1)
    layers, h, d = shape["num_layers"], shape["num_kv_heads"], shape["head_dim"]
    k_caches = [kv[0, i] for i in range(layers)]
    v_caches = [kv[1, i] for i in range(layers)]
    num_caches = 2 * layers
    row_bytes = h * d * kv.element_size()
    rows = []
    configs = [(b, a) for b in args.batches for a in args.accepted]
    for batch, accepted in tqdm(configs, desc="compact_kv"):
        layout = Layout(rng, batch, args.context, shape["block_size"], kv.shape[2])
        src_np, dst_np = accepted_path_moves(layout, rng, accepted, args.tree_size)
        src = torch.from_numpy(src_np).to(device)
        dst = torch.from_numpy(dst_np).to(device)
        pairs = src.numel()
        if pairs == 0:
            continue
        impls = compact_impls(kv, k_caches, v_caches, src, dst)
        nbytes = 2 * num_caches * pairs * row_bytes + 2 * pairs * src.element_size()
        base = None
        for impl, fn in impls.items():
            sec = time_call(fn, device, args.iters, args.warmup, flush)
            r = row("compact_kv", impl, sec, nbytes, peak, batch=batch, accepted=accepted,
                    num_pairs=pairs, num_caches=num_caches)
            if impl == "kernel":
                base = sec
            r["time_vs_kernel"] = sec / base
            rows.append(r)
    return rows


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def plot(results: dict, path: Path) -> Path | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        print("matplotlib not importable: no plot (pip install -e '.[bench]')")
        return None
    rows = results["rows"]
    peak = results["peak_gbps"]
    fig, axes = plt.subplots(1, 2, figsize=(13, 5))
    for ax, op, key, label in ((axes[0], "reshape_and_cache", "tokens_per_seq", "k+1"),
                               (axes[1], "compact_kv", "accepted", "accepted")):
        op_rows = [r for r in rows if r["op"] == op]
        values = sorted({r[key] for r in op_rows})
        shown = sorted({values[0], values[len(values) // 2], values[-1]}) if values else []
        for impl, style in (("kernel", "-o"), ("torch_index_put", "--x"),
                            ("torch_per_layer", "--x"), ("torch_stacked", ":s")):
            for v in shown:
                pts = sorted((r["batch"], r["gbps"]) for r in op_rows
                             if r["impl"] == impl and r[key] == v)
                if pts:
                    ax.plot(*zip(*pts), style, label=f"{impl}, {label}={v}", markersize=4)
        if peak:
            ax.axhline(peak, color="k", lw=1, label=f"HBM peak {peak:.0f} GB/s")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("batch")
        ax.set_ylabel("GB/s")
        ax.set_title(f"{op} ({results['device']})")
        ax.legend(fontsize=7)
        ax.grid(alpha=0.3, which="both")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path


def print_table(rows: list[dict]) -> None:
    print(f"{'op':<18} {'impl':<17} {'batch':>5} {'n':>3} {'us':>9} {'GB/s':>8} "
          f"{'floor us':>9} {'x floor':>8} {'x kernel':>8}   (n: k+1 or accepted)")
    for r in rows:
        n = r.get("tokens_per_seq", r.get("accepted"))
        floor = f"{r['hbm_floor_us']:9.2f}" if r["hbm_floor_us"] is not None else f"{'-':>9}"
        ratio = f"{r['ratio_to_floor']:8.2f}" if r["ratio_to_floor"] is not None else f"{'-':>8}"
        print(f"{r['op']:<18} {r['impl']:<17} {r['batch']:>5} {n:>3} {r['time_us']:9.2f} "
              f"{r['gbps']:8.1f} {floor} {ratio} {r['time_vs_kernel']:8.2f}")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    p.add_argument("--new-tokens", type=int, nargs="+", default=list(range(2, 9)),
                   help="k+1 new tokens per sequence for reshape_and_cache")
    p.add_argument("--accepted", type=int, nargs="+", default=list(range(1, 8)),
                   help="accepted draft tokens per sequence for compact_kv")
    p.add_argument("--tree-size", type=int, default=16,
                   help="draft tree nodes per sequence the accepted path is drawn from")
    p.add_argument("--context", type=int, default=512, help="max context length per sequence")
    p.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    p.add_argument("--iters", type=int, default=200)
    p.add_argument("--warmup", type=int, default=20)
    p.add_argument("--flush-l2", action="store_true",
                   help="time each call alone after overwriting a 512 MiB buffer")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="HBM bandwidth for the floor (default: from the device name)")
    p.add_argument("--ops", nargs="+", choices=["reshape_and_cache", "compact_kv"],
                   default=["reshape_and_cache", "compact_kv"])
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and few iterations; runs the host kernels without CUDA")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="JSON results (PNG next to it)")
    args = p.parse_args(argv)
    if args.smoke:
        args.batches = [b for b in args.batches if b <= 8] or [1]
        args.new_tokens = args.new_tokens[:2]
        args.accepted = args.accepted[:2]
        args.context = min(args.context, 64)
        args.iters, args.warmup = min(args.iters, 5), min(args.warmup, 1)
    if not max(args.accepted) < args.tree_size <= MAX_NEW or max(args.new_tokens) > MAX_NEW:
        p.error(f"need max(--accepted) < --tree-size <= {MAX_NEW} and --new-tokens <= {MAX_NEW}")
    if min(args.batches + args.new_tokens + args.accepted) < 1:
        p.error("--batches, --new-tokens and --accepted must be >= 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    has_cuda = torch.cuda.is_available()
    if not has_cuda and not args.smoke:
        print("bench_kv_cache.py measures the CUDA kernels, and no CUDA device is available. "
              "Run with --smoke for a tiny run of the host (CPU) kernels.", file=sys.stderr)
        return 2
    from specengine import _C

    if has_cuda and not _C.has_cuda_kernels:
        print("specengine._C was built without CUDA kernels (nvcc not found at build time); "
              "reinstall with nvcc on PATH.", file=sys.stderr)
        return 2
    device = torch.device("cuda" if has_cuda else "cpu")
    dtype = getattr(torch, args.dtype)
    shape = SMOKE if args.smoke else LLAMA_8B
    peak = peak_gbps(device, args.peak_gbps)
    if device.type == "cuda" and peak is None:
        print(f"unknown device {torch.cuda.get_device_name(device)!r}: pass --peak-gbps for the "
              "HBM floor", file=sys.stderr)
    check_kernels(device, dtype)

    num_blocks = max(args.batches) * blocks_per_seq(args.context, shape["block_size"])
    kv = torch.zeros(2, shape["num_layers"], num_blocks, shape["block_size"],
                     shape["num_kv_heads"], shape["head_dim"], dtype=dtype, device=device)
    kv.normal_()
    flush = None
    if args.flush_l2 and device.type == "cuda":
        flush = torch.empty(128 * 2**20, dtype=torch.float32, device=device)  # 512 MiB
    device_name = torch.cuda.get_device_name(device) if has_cuda else "cpu (host kernels)"
    print(f"{device_name}: KV cache {tuple(kv.shape)} {dtype}, "
          f"{kv.numel() * kv.element_size() / 2**30:.2f} GiB; peak {peak} GB/s")

    rows: list[dict] = []
    if "reshape_and_cache" in args.ops:
        rows += bench_reshape_and_cache(args, shape, kv, device, peak, flush)
    if "compact_kv" in args.ops:
        rows += bench_compact_kv(args, shape, kv, device, peak, flush)
    print_table(rows)

    results = {
        "device": device_name,
        "peak_gbps": peak,
        "shape": shape,
        "dtype": args.dtype,
        "context_max": args.context,
        "tree_size": args.tree_size,
        "timing": "per call, L2 flushed" if flush is not None else
                  f"mean of {args.iters} back-to-back calls (warm L2, launch included)"
                  if device.type == "cuda" else "median host call",
        "smoke": args.smoke,
        "torch": torch.__version__,
        "rows": rows,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=2))
    print(f"wrote {args.out}")
    png = plot(results, args.out.with_suffix(".png"))
    if png:
        print(f"wrote {png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
