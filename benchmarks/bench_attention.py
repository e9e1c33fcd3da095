"""Paged attention kernel speed at 8B shapes against the HBM floor and in-process baselines.

Shapes: Llama-3.1-8B / Qwen3-8B attention (32 q heads, 8 kv heads, head_dim 128), bf16, paged
cache with scattered blocks. Modes: decode (q_len 1), chain verification (k+1 = 2..8 new tokens,
causal) and tree verification (8-64 nodes, random trees of depth <= 8, packed mask). Every
sequence of a configuration has the same context length.

Per configuration it reports the kernel time (``benchlib.time_ms``: warm-up calls, then the
median of CUDA-event timings of single calls with L2 flushed), the bytes a perfect kernel must
move (K/V of context + new tokens, q read, o write), the achieved GB/s, the HBM floor (bytes /
peak bandwidth) and time / floor; and the same time for two baselines run in this process on
the same data:

* ``sdpa``: gather the pages into dense ``[B, Hkv, L, D]`` K/V, then
  ``torch.nn.functional.scaled_dot_product_attention`` (GQA, bool mask for chains/trees);
* ``flex``: the same gather, then compiled FlexAttention with a block mask (context + tree bits).

Baseline times include the gather, since a paged cache must be gathered to use them.
Outputs: a table on stdout, ``OUT/attention.json`` and ``OUT/attention.png`` (``--out``,
default ``benchmarks/out``).

Usage::

    python benchmarks/bench_attention.py                      # full sweep on a GPU
    python benchmarks/bench_attention.py --batches 1 32 --contexts 4096 --modes decode tree
    python benchmarks/bench_attention.py --smoke              # tiny run, works without CUDA
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
import warnings
from pathlib import Path

import benchlib
import torch
from tqdm import tqdm

if not torch.cuda.is_available():  # the interpreter must be chosen before kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

log = logging.getLogger("bench_attention")

HQ, HKV, HEAD_DIM = 32, 8, 128  # Llama-3.1-8B and Qwen3-8B attention


class Case:
    """Inputs of one configuration, shared by the kernel and the baselines."""

    def __init__(self, batch: int, ctx: int, q_len: int, mode: str, block_size: int,
                 dtype: torch.dtype, device: str, seed: int = 0,
                 heads: tuple[int, int, int] = (HQ, HKV, HEAD_DIM)) -> None:
        from specengine.kernels import reference

        g = torch.Generator().manual_seed(seed)
        self.batch, self.ctx, self.q_len, self.mode = batch, ctx, q_len, mode
        self.hq, self.hkv, self.head_dim = heads  # q heads, kv heads, head_dim
        hq, hkv, head_dim = heads
        kv_len = ctx + q_len
        per_seq = -(-kv_len // block_size)
        num_blocks = batch * per_seq
        self.k_cache = torch.randn(num_blocks, block_size, hkv, head_dim, dtype=dtype,
                                   device=device)
        self.v_cache = torch.randn_like(self.k_cache)
        perm = torch.randperm(num_blocks, generator=g).to(device=device, dtype=torch.int32)
        self.block_tables = perm.view(batch, per_seq)  # [B, max_blocks], scattered pages
        self.context_lens = torch.full((batch,), ctx, dtype=torch.int32, device=device)
        self.qo_indptr = torch.arange(0, (batch + 1) * q_len, q_len, dtype=torch.int32,
                                      device=device)
        self.q = torch.randn(batch * q_len, hq, head_dim, dtype=dtype, device=device)
        if mode == "tree":
            self.dense = reference.random_tree_mask(q_len, g, max_depth=8).to(device)  # [n, n]
            packed = reference.pack_tree_mask(self.dense)
            self.tree_mask = packed.repeat(batch, 1)  # [T, words]
        else:
            self.dense = torch.ones(q_len, q_len, dtype=torch.bool, device=device).tril()
            self.tree_mask = None
        self.scale = head_dim**-0.5
        # Full mask over keys [q_len, ctx + q_len]: whole context, then the causal/tree part.
        self.full_mask = torch.cat(
            [torch.ones(q_len, ctx, dtype=torch.bool, device=device), self.dense], dim=1)

    def bytes_moved(self) -> int:
        el = self.k_cache.element_size()
        kv = 2 * self.batch * (self.ctx + self.q_len) * self.hkv * self.head_dim * el
        qo = 2 * self.q.numel() * el
        return kv + qo

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dense K/V ``[B, Hkv, L, D]`` gathered through the block tables."""
        bs = self.k_cache.shape[1]
        kv_len = self.ctx + self.q_len
        t = torch.arange(kv_len, device=self.q.device)
        slots = self.block_tables.long()[:, t // bs] * bs + t % bs  # [B, L]
        k = self.k_cache.view(-1, self.hkv, self.head_dim)[slots].transpose(1, 2)
        v = self.v_cache.view(-1, self.hkv, self.head_dim)[slots].transpose(1, 2)
        return k, v

    def q_dense(self) -> torch.Tensor:  # [B, Hq, q_len, D]
        return self.q.view(self.batch, self.q_len, self.hq, self.head_dim).transpose(1, 2)


def run_triton(c: Case, num_splits: int | None):
    from specengine.kernels.attention import paged_attention

    def fn():
        return paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens,
                               c.qo_indptr, c.tree_mask, c.scale, max_q_len=c.q_len,
                               num_splits=num_splits)
    return fn


def run_sdpa(c: Case):
    sdpa = torch.nn.functional.scaled_dot_product_attention
    mask = None if c.q_len == 1 else c.full_mask  # decode sees every key: no mask needed

    def fn():
        k, v = c.gathered()
        return sdpa(c.q_dense(), k, v, attn_mask=mask, scale=c.scale, enable_gqa=True)
    return fn


_FLEX = None


def run_flex(c: Case):
    global _FLEX
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if _FLEX is None:
        if c.q.is_cuda:
            # One compilation per shape: lift dynamo's recompile limit (8 by default, past
            # which it would silently run the unfused eager path), and fail rather than fall
            # back if it is still hit, so a flex time is always the compiled kernel's.
            dynamo = torch._dynamo.config
            for knob, value in (("recompile_limit", 1024), ("cache_size_limit", 1024),
                                ("accumulated_recompile_limit", 8192),
                                ("accumulated_cache_size_limit", 8192),
                                ("fail_on_recompile_limit_hit", True)):
                if hasattr(dynamo, knob):
                    setattr(dynamo, knob, value)
            _FLEX = torch.compile(flex_attention, dynamic=False)
        else:  # smoke run: eager flex (a slow reference path, warns that it is unfused)
            warnings.filterwarnings("ignore", message=".*flex_attention.*")
            _FLEX = flex_attention
    ctx, dense, n = c.ctx, c.dense, c.q_len

    def mask_mod(b, h, q_idx, kv_idx):
        j = kv_idx - ctx
        return (j < 0) | dense[q_idx, j.clamp(0, n - 1)]

    block_mask = create_block_mask(mask_mod, None, None, n, ctx + n, device=c.q.device)

    def fn():
        k, v = c.gathered()
        return _FLEX(c.q_dense(), k, v, block_mask=block_mask, scale=c.scale, enable_gqa=True)
    return fn


def configs(args: argparse.Namespace) -> list[tuple[str, int, int, int]]:
    out = []
    q_lens = {"decode": [1], "chain": args.chain_lens, "tree": args.tree_sizes}
    for batch in args.batches:
        for ctx in args.contexts:
            if batch * ctx > args.max_kv_tokens:
                continue
            for mode in args.modes:
                out += [(mode, batch, ctx, q) for q in q_lens[mode]]
    return out


def bench(args: argparse.Namespace) -> dict:
    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[args.dtype]
    name = benchlib.device_name() if cuda else "cpu (Triton interpreter)"
    peak = benchlib.peak_gbps(name if cuda else "", args.peak_gbps)
    if peak is None:
        log.warning("unknown peak bandwidth for %s: pass --peak-gbps for floor/ratio", name)
    rows = []
    for mode, batch, ctx, q_len in tqdm(configs(args), desc="attention"):
        case = Case(batch, ctx, q_len, mode, args.block_size, dtype, device)
        row: dict = dict(mode=mode, batch=batch, context=ctx, q_len=q_len,
                         bytes=case.bytes_moved())
        fns = {"triton": run_triton(case, args.num_splits)}
        if "sdpa" in args.baselines:
            fns["sdpa"] = run_sdpa(case)
        if "flex" in args.baselines:
            try:
                fns["flex"] = run_flex(case)
            except Exception as e:  # noqa: BLE001 - a baseline that cannot run is reported
                row["flex_error"] = f"{type(e).__name__}: {e}"[:200]
        ref = None
        for impl, fn in fns.items():
            try:
                out = fn()
                dense = out if impl == "triton" else out.transpose(1, 2).reshape(-1, HQ, HEAD_DIM)
                if ref is None:
                    ref = dense.float()
                else:  # the baselines double as a correctness check of the kernel
                    row[f"{impl}_max_diff"] = float((dense.float() - ref).abs().max())
                row[f"{impl}_ms"] = benchlib.time_ms(fn, warmup=args.warmup, iters=args.iters)
            except Exception as e:  # noqa: BLE001
                row[f"{impl}_error"] = f"{type(e).__name__}: {e}"[:200]
        if "triton_ms" in row:
            row.update(benchlib.roofline(row["bytes"], row["triton_ms"], peak))
        rows.append(row)
        del case
        if cuda:
            torch.cuda.empty_cache()
    return dict(device=name, peak_gbps=peak, dtype=args.dtype, block_size=args.block_size,
                shapes=dict(hq=HQ, hkv=HKV, head_dim=HEAD_DIM), torch=torch.__version__,
                timing=f"median of {args.iters} single calls after {args.warmup} warm-up calls"
                       + (", L2 flushed" if cuda else " (wall clock)"), rows=rows)


def print_table(result: dict) -> None:
    fmt = benchlib.fmt
    head = (f"{'mode':6} {'B':>4} {'ctx':>6} {'q':>3} {'MB':>9} {'triton ms':>10} {'GB/s':>7} "
            f"{'floor ms':>9} {'ratio':>6} {'sdpa ms':>9} {'flex ms':>9}")
    print(f"device: {result['device']}  peak: {result['peak_gbps']} GB/s  dtype: "
          f"{result['dtype']}  block_size: {result['block_size']}")
    print(head)
    print("-" * len(head))
    for r in result["rows"]:
        print(f"{r['mode']:6} {r['batch']:>4} {r['context']:>6} {r['q_len']:>3} "
              f"{r['bytes'] / 1e6:>9.2f} {fmt(r.get('triton_ms'), '10.4f')} "
              f"{fmt(r.get('gbps'), '7.0f')} {fmt(r.get('floor_ms'), '9.4f')} "
              f"{fmt(r.get('ratio'), '6.2f')} {fmt(r.get('sdpa_ms'), '9.4f')} "
              f"{fmt(r.get('flex_ms'), '9.4f')}")
    errors = {k: v for r in result["rows"] for k, v in r.items() if k.endswith("_error")}
    for k, v in errors.items():
        print(f"note: {k}: {v}")


def plot(result: dict, out_dir: Path) -> None:
    plt = benchlib.pyplot()
    if plt is None:
        return
    modes = sorted({r["mode"] for r in result["rows"]})
    fig, axes = plt.subplots(1, len(modes), figsize=(5 * len(modes), 4), squeeze=False)
    for ax, mode in zip(axes[0], modes):
        series: dict[tuple[int, int], list[tuple[int, float]]] = {}
        for r in result["rows"]:
            if r["mode"] == mode and r.get("gbps") is not None:
                series.setdefault((r["batch"], r["q_len"]), []).append((r["context"], r["gbps"]))
        for (batch, q_len), pts in sorted(series.items()):
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"B={batch} q={q_len}")
        if result["peak_gbps"]:
            ax.axhline(result["peak_gbps"], color="k", linestyle="--", label="peak")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("context length")
        ax.set_ylabel("achieved GB/s")
        ax.set_title(f"{mode} ({result['device']})")
        ax.legend(fontsize=6)
    benchlib.save_figure(fig, out_dir, "attention")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 32, 128, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192, 32768])
    p.add_argument("--modes", nargs="+", choices=["decode", "chain", "tree"],
                   default=["decode", "chain", "tree"])
    p.add_argument("--chain-lens", type=int, nargs="+", default=[2, 4, 8],
                   help="k+1 new tokens per chain verification (2..8)")
    p.add_argument("--tree-sizes", type=int, nargs="+", default=[8, 16, 32, 64])
    p.add_argument("--baselines", nargs="*", choices=["sdpa", "flex"], default=["sdpa", "flex"])
    p.add_argument("--dtype", choices=["bf16", "fp16", "fp32"], default="bf16")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-splits", type=int, default=None, help="force split-KV (default auto)")
    p.add_argument("--max-kv-tokens", type=int, default=2**22,
                   help="skip batch x context above this (memory: 4M tokens = 16 GiB bf16 K+V)")
    p.add_argument("--peak-gbps", type=float, default=None,
                   help="peak HBM bandwidth when the device name is not H100/H200/B200")
    p.add_argument("--warmup", type=int, default=10, help="untimed calls before timing")
    p.add_argument("--iters", type=int, default=50, help="timed calls (median reported)")
    p.add_argument("--out", type=Path, default=benchlib.DEFAULT_OUT,
                   help="folder for attention.json and attention.png")
    p.add_argument("--smoke", action="store_true",
                   help="tiny configuration; runs under the Triton interpreter without CUDA")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.smoke:
        args.batches, args.contexts = [1, 2], [40]
        args.chain_lens, args.tree_sizes = [3], [8]
        args.warmup, args.iters = 1, 3
        if not torch.cuda.is_available():
            args.dtype = "fp32"  # the interpreter's tl.dot is wrong for bf16
    elif not torch.cuda.is_available():
        sys.exit("bench_attention needs a CUDA GPU (use --smoke for a tiny interpreter run)")
    result = bench(args)
    result["smoke"] = args.smoke
    print_table(result)
    benchlib.write_json(result, args.out, "attention")
    plot(result, args.out)


if __name__ == "__main__":
    main()
