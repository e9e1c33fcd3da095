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

Timings (``benchlib.time_ms``, after warm-up calls) are with a warm L2 by default: the median
over 5 runs of back-to-back calls between two CUDA events, so the per-call launch cost is
included; ``--flush-l2`` times every call alone after overwriting a buffer larger than L2 and
reports the median. At small batches the data fit in L2, so GB/s above the HBM peak is possible
without ``--flush-l2``. Outputs: the table, ``OUT/kv_cache.json`` and ``OUT/kv_cache.png``
(``--out``, default ``benchmarks/out``). Workloads and baselines: ``kv_cache_cases.py``.

Usage::

    python benchmarks/bench_kv_cache.py                      # CUDA, full sweep
    python benchmarks/bench_kv_cache.py --batches 1 64 256 --flush-l2
    python benchmarks/bench_kv_cache.py --smoke              # tiny shapes, CPU host kernels
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import benchlib
import numpy as np
import torch
from kv_cache_cases import (
    MAX_NEW,
    Layout,
    accepted_path_moves,
    blocks_per_seq,
    check_kernels,
    compact_impls,
    new_token_slots,
    reshape_impls,
)
from tqdm import tqdm

LLAMA_8B = dict(num_layers=32, num_kv_heads=8, head_dim=128, num_q_heads=32, block_size=16)
SMOKE = dict(num_layers=2, num_kv_heads=2, head_dim=64, num_q_heads=4, block_size=16)


def time_impls(args: argparse.Namespace, impls: dict[str, Callable[[], None]], op: str,
               nbytes: int, peak: float | None, **extra: object) -> list[dict]:
    """One row per implementation: time, bytes, GB/s, floor, ratio, time / the kernel's."""
    rows, kernel_ms = [], None
    for impl, fn in impls.items():  # "kernel" first
        ms = benchlib.time_ms(fn, warmup=args.warmup, iters=args.iters, flush_l2=args.flush_l2,
                              back_to_back=not args.flush_l2)
        kernel_ms = kernel_ms or ms
        rows.append({"op": op, "impl": impl, **extra, "time_us": ms * 1e3, "bytes": nbytes,
                     **benchlib.roofline(nbytes, ms, peak), "time_vs_kernel": ms / kernel_ms})
    return rows


def bench_reshape_and_cache(args: argparse.Namespace, shape: dict, kv: torch.Tensor,
                            peak: float | None) -> list[dict]:
    rng = np.random.default_rng(0)
    h, d, hq = shape["num_kv_heads"], shape["head_dim"], shape["num_q_heads"]
    k_cache, v_cache = kv[0, 0], kv[1, 0]
    elem = kv.element_size()
    rows = []
    configs = [(b, n) for b in args.batches for n in args.new_tokens]
    for batch, n in tqdm(configs, desc="reshape_and_cache"):
        layout = Layout(rng, batch, args.context, shape["block_size"], kv.shape[2])
        slots = torch.from_numpy(new_token_slots(layout, n)).to(kv.device)
        t = slots.numel()
        qkv = torch.randn(t, (hq + 2 * h) * d, device=kv.device).to(kv.dtype)
        key = qkv[:, hq * d:(hq + h) * d].view(t, h, d)  # strided slices, as the model has them
        value = qkv[:, (hq + h) * d:].view(t, h, d)
        nbytes = 4 * t * h * d * elem + t * slots.element_size()  # K, V read + written; slots
        rows += time_impls(args, reshape_impls(key, value, k_cache, v_cache, slots),
                           "reshape_and_cache", nbytes, peak, batch=batch, tokens_per_seq=n,
                           num_tokens=t)
    return rows


def bench_compact_kv(args: argparse.Namespace, shape: dict, kv: torch.Tensor,
                     peak: float | None) -> list[dict]:
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
        src = torch.from_numpy(src_np).to(kv.device)
        dst = torch.from_numpy(dst_np).to(kv.device)
        pairs = src.numel()
        if pairs == 0:
            continue
        # Each moved row read once and written once in every cache, plus both index arrays.
        nbytes = 2 * num_caches * pairs * row_bytes + 2 * pairs * src.element_size()
        rows += time_impls(args, compact_impls(kv, k_caches, v_caches, src, dst), "compact_kv",
                           nbytes, peak, batch=batch, accepted=accepted, num_pairs=pairs,
                           num_caches=num_caches)
    return rows


def plot(results: dict, out_dir: Path) -> None:
    plt = benchlib.pyplot()
    if plt is None:
        return
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
    benchlib.save_figure(fig, out_dir, "kv_cache")


def print_table(rows: list[dict]) -> None:
    fmt = benchlib.fmt
    print(f"{'op':<18} {'impl':<17} {'batch':>5} {'n':>3} {'MB':>8} {'us':>9} {'GB/s':>8} "
          f"{'floor us':>9} {'ratio':>7} {'x kernel':>8}   (n: k+1 or accepted)")
    for r in rows:
        n = r.get("tokens_per_seq", r.get("accepted"))
        floor_us = r["floor_ms"] * 1e3 if r["floor_ms"] is not None else None
        print(f"{r['op']:<18} {r['impl']:<17} {r['batch']:>5} {n:>3} {r['bytes'] / 1e6:8.3f} "
              f"{r['time_us']:9.2f} {fmt(r['gbps'], '8.1f')} {fmt(floor_us, '9.2f')} "
              f"{fmt(r['ratio'], '7.2f')} {r['time_vs_kernel']:8.2f}")


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
                   help="time each call alone after overwriting a 256 MiB buffer")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="HBM bandwidth for the floor (default: from the device name)")
    p.add_argument("--ops", nargs="+", choices=["reshape_and_cache", "compact_kv"],
                   default=["reshape_and_cache", "compact_kv"])
    p.add_argument("--smoke", action="store_true",
                   help="tiny shapes and few iterations; runs the host kernels without CUDA")
    p.add_argument("--out", type=Path, default=benchlib.DEFAULT_OUT,
                   help="folder for kv_cache.json and kv_cache.png")
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
    device_name = benchlib.device_name() if has_cuda else "cpu (host kernels)"
    peak = benchlib.peak_gbps(device_name if has_cuda else "", args.peak_gbps)
    if has_cuda and peak is None:
        print(f"unknown device {device_name!r}: pass --peak-gbps for the HBM floor",
              file=sys.stderr)
    check_kernels(device, dtype)

    num_blocks = max(args.batches) * blocks_per_seq(args.context, shape["block_size"])
    kv = torch.zeros(2, shape["num_layers"], num_blocks, shape["block_size"],
                     shape["num_kv_heads"], shape["head_dim"], dtype=dtype, device=device)
    kv.normal_()
    print(f"{device_name}: KV cache {tuple(kv.shape)} {dtype}, "
          f"{kv.numel() * kv.element_size() / 2**30:.2f} GiB; peak {peak} GB/s")

    rows: list[dict] = []
    if "reshape_and_cache" in args.ops:
        rows += bench_reshape_and_cache(args, shape, kv, peak)
    if "compact_kv" in args.ops:
        rows += bench_compact_kv(args, shape, kv, peak)
    print_table(rows)

    if not has_cuda:
        timing = f"median of {args.iters} host calls after {args.warmup} warm-up calls"
    elif args.flush_l2:
        timing = f"median of {args.iters} single calls, L2 flushed, after {args.warmup} warm-up"
    else:
        timing = (f"median over 5 runs of back-to-back calls ({args.iters} in all; warm L2, "
                  f"launch included) after {args.warmup} warm-up calls")
    results = {
        "device": device_name,
        "peak_gbps": peak,
        "shape": shape,
        "dtype": args.dtype,
        "context_max": args.context,
        "tree_size": args.tree_size,
        "timing": timing,
        "smoke": args.smoke,
        "torch": torch.__version__,
        "rows": rows,
    }
    benchlib.write_json(results, args.out, "kv_cache")
    plot(results, args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
