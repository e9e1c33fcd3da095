"""Fused rejection sampler vs the memory floor and a vectorised PyTorch baseline.

For B x k x V it times ``kernels.rejection_sampling.rejection_sample`` with its value checks off
(as under CUDA-graph capture: they cost a device→host sync that is not the kernels' work) and the
baseline, both with ``benchlib.time_ms`` (warm-up calls, then the median of CUDA-event timings of
single calls with L2 flushed). Bytes are what any sampler must read — the logits once, plus the
draft probabilities when given (the outputs are negligible) — and the table reports GB/s, the
HBM floor (bytes / peak bandwidth: H100 3.35 TB/s, H200 4.8 TB/s, B200 8 TB/s by device name, or
--peak-gbps) and time / floor. With top-p the kernel makes a few more passes over each row (its
threshold search, no sort); they show up as time above the floor, and ``cut ms`` times that
cut alone for the same B x (k+1) rows (``kernels/keep_threshold.py``: the row statistics of
pass 1, then the top-p search). The baseline (same process) does what
a straightforward PyTorch sampler does: softmax, sort + cumsum for top-p, multinomial draws,
gathers for acceptance. Outputs: the table, ``OUT/rejection_sampling.json`` and ``.png``
(``--out``, default ``benchmarks/out``).

Usage::

    python benchmarks/bench_rejection_sampling.py                       # GPU sweep
    python benchmarks/bench_rejection_sampling.py --smoke               # tiny, CPU interpreter
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import benchlib
import torch
from tqdm import tqdm


def inputs(bsz: int, k: int, vocab: int, with_q: bool, top_p: float, device: str, *,
           dtype: torch.dtype = torch.float32, top_k: int = -1, seed: int = 0) -> tuple:
    """``rejection_sample``'s positional arguments for ``bsz`` chains of ``k`` drafts: logits
    ``[B, k+1, V]`` in ``dtype`` (drawn in float32), draft probabilities when ``with_q``, every
    row sampled at temperature 1 with ``top_k`` / ``top_p``."""
    g = torch.Generator(device=device).manual_seed(seed)
    logits32 = torch.randn(bsz, k + 1, vocab, device=device, generator=g) * 3
    q = torch.softmax(logits32[:, :-1] + 0.5, -1) if with_q else None
    drafts = logits32[:, :-1].argmax(-1)
    logits = logits32.to(dtype)
    del logits32
    return (logits, drafts, torch.full((bsz,), k, dtype=torch.int32, device=device), q,
            torch.ones(bsz, device=device), torch.full((bsz,), top_k, dtype=torch.int32,
                                                        device=device),
            torch.full((bsz,), top_p, device=device),
            torch.arange(bsz, dtype=torch.int64, device=device),
            torch.zeros(bsz, dtype=torch.int64, device=device), None)


def torch_baseline(logits, drafts, nd, q, temperature, top_k, top_p, seeds, offsets, parents):
    """Sort/softmax-based sampler (chains): what the fused kernel replaces."""
    z = logits.float() / temperature[:, None, None]
    if bool((top_p < 1).any()):
        zs, order = z.sort(-1, descending=True)
        ps = zs.softmax(-1)
        drop = (ps.cumsum(-1) - ps) >= top_p[:, None, None]
        z = z.scatter(-1, order, zs.masked_fill(drop, float("-inf")))
    p = z.softmax(-1)  # [B, N, V]
    px = p[:, :-1].gather(-1, drafts[..., None])[..., 0]
    qx = q.gather(-1, drafts[..., None])[..., 0] if q is not None else torch.ones_like(px)
    accept = torch.rand_like(px) * qx <= px
    resid = (p[:, :-1] - q).clamp(min=0) if q is not None else p[:, :-1].scatter(
        -1, drafts[..., None], 0.0)
    dist = torch.cat([resid, p[:, -1:]], 1).flatten(0, 1)
    dist = torch.where(dist.sum(-1, keepdim=True) > 0, dist, p.flatten(0, 1))
    tokens = torch.multinomial(dist, 1).view(p.shape[:2])
    first_reject = torch.where(~accept, torch.arange(px.shape[1], device=p.device),
                               px.shape[1]).min(-1).values
    return tokens, first_reject


def bench(args: argparse.Namespace, peak: float | None) -> list[dict]:
    from specengine.kernels.keep_threshold import keep_threshold
    from specengine.kernels.rejection_sampling import rejection_sample

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = []
    grid = [(b, k, v, tp, q) for v in args.vocabs for tp in args.top_p for q in (False, True)
            for k in args.ks for b in args.batches]
    for bsz, k, vocab, top_p, with_q in tqdm(grid, desc="rejection sampling"):
        x = inputs(bsz, k, vocab, with_q, top_p, device)
        kw = dict(warmup=args.warmup, iters=args.iters)
        ms = benchlib.time_ms(lambda x=x: rejection_sample(*x, check_values=False), **kw)
        base_ms = benchlib.time_ms(lambda x=x: torch_baseline(*x), **kw)
        logits, q = x[0], x[3]
        n = bsz * (k + 1)
        cut = (logits.flatten(0, 1), torch.ones(n, device=device),
               torch.full((n,), -1, dtype=torch.int32, device=device),
               torch.full((n,), top_p, device=device))
        cut_ms = benchlib.time_ms(lambda cut=cut: keep_threshold(*cut), **kw)
        nbytes = logits.numel() * logits.element_size()
        if with_q:
            nbytes += q.numel() * q.element_size()
        rows.append(dict(batch=bsz, k=k, vocab=vocab, top_p=top_p, draft_probs=with_q, ms=ms,
                         torch_ms=base_ms, cut_ms=cut_ms, bytes=nbytes,
                         **benchlib.roofline(nbytes, ms, peak)))
    return rows


def print_table(rows: list[dict]) -> None:
    fmt = benchlib.fmt
    print(f"{'B':>4} {'k':>2} {'V':>7} {'top_p':>5} {'q':>2} {'MB':>8} {'ms':>8} {'GB/s':>7} "
          f"{'floor ms':>8} {'ratio':>6} {'torch ms':>8} {'x kern':>6} {'cut ms':>8}")
    for r in rows:
        print(f"{r['batch']:>4} {r['k']:>2} {r['vocab']:>7} {r['top_p']:>5} "
              f"{int(r['draft_probs']):>2} {r['bytes'] / 1e6:8.2f} {r['ms']:8.3f} "
              f"{fmt(r['gbps'], '7.1f')} {fmt(r['floor_ms'], '8.4f')} {fmt(r['ratio'], '6.2f')} "
              f"{r['torch_ms']:8.3f} {r['torch_ms'] / r['ms']:6.2f} {r['cut_ms']:8.3f}")


def plot(rows: list[dict], peak: float | None, name: str, out_dir: Path) -> None:
    plt = benchlib.pyplot()
    if plt is None:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for key in sorted({(r["vocab"], r["k"], r["top_p"]) for r in rows if not r["draft_probs"]}):
        sel = [r for r in rows if (r["vocab"], r["k"], r["top_p"]) == key and not r["draft_probs"]]
        ax.plot([r["batch"] for r in sel], [r["gbps"] for r in sel], marker="o",
                label=f"V={key[0]} k={key[1]} top_p={key[2]}")
    if peak:
        ax.axhline(peak, color="k", ls="--", label=f"peak {peak:.0f} GB/s")
    ax.set(xscale="log", xlabel="batch", ylabel="GB/s", title=f"rejection sampling ({name})")
    ax.legend(fontsize=6)
    benchlib.save_figure(fig, out_dir, "rejection_sampling")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 64, 128, 256])
    ap.add_argument("--ks", type=int, nargs="+", default=[1, 3, 7])
    ap.add_argument("--vocabs", type=int, nargs="+", default=[151936, 32000])
    ap.add_argument("--top-p", type=float, nargs="+", default=[1.0, 0.9])
    ap.add_argument("--warmup", type=int, default=5, help="untimed calls before timing")
    ap.add_argument("--iters", type=int, default=20, help="timed calls (median reported)")
    ap.add_argument("--peak-gbps", type=float, default=None)
    ap.add_argument("--out", type=Path, default=benchlib.DEFAULT_OUT,
                    help="folder for rejection_sampling.json and .png")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: Triton interpreter)")
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        if not args.smoke:
            sys.exit("bench_rejection_sampling: no CUDA device; use --smoke for a tiny CPU run")
        os.environ["TRITON_INTERPRET"] = "1"
    if args.smoke:
        args.batches, args.ks, args.vocabs, args.top_p = [2], [1], [1000], [1.0]
        args.warmup, args.iters = 1, 1
    name = benchlib.device_name()
    peak = benchlib.peak_gbps(name, args.peak_gbps)
    print(f"device: {name}  peak: {peak} GB/s" + ("" if peak else " (--peak-gbps for the floor)"))
    rows = bench(args, peak)
    print_table(rows)
    result = dict(device=name, peak_gbps=peak, torch=torch.__version__, smoke=args.smoke,
                  timing=f"median of {args.iters} calls after {args.warmup} warm-up calls",
                  rows=rows)
    benchlib.write_json(result, args.out, "rejection_sampling")
    plot(rows, peak, name, args.out)


if __name__ == "__main__":
    main()
