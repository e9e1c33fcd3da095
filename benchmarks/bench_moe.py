"""The fused MoE kernel (``kernels/fused_moe.py``) against a plain-PyTorch per-expert loop.

Shapes: Qwen3-30B-A3B (E=128, top-8, H=2048, I=768) and Qwen3-235B-A22B (H=4096, I=1536), one
sparse layer, bf16, for ``T`` tokens per pass: a 1-token decode of B sequences is ``T = B``, a
verify of ``k+1`` tokens per sequence is ``T = B·(k+1)``. Router logits are random, so routing
is uniform at random (real routers are skewed, which touches fewer experts).

Per configuration: time per call of each implementation (``benchlib.time_ms``, after warm-up
calls; back-to-back calls with a warm L2 by default, ``--flush-l2`` times each call alone), the
number of distinct experts the pass touches, the bytes a perfect kernel must read (those
experts' weights plus activations) and the time over that HBM floor. Why MoE changes where
speculation pays: a verify of ``k+1`` tokens touches up to ``k+1`` times the experts of one
decode token, so its weight traffic grows with ``k`` where a dense model's does not.

Implementations: ``fused`` (the Triton kernel, CUDA only: the CPU interpreter is not a timing)
and ``loop`` (``reference_moe.moe_forward``: one gather, two matmuls and an ``index_add_`` per
expert hit, the shape of transformers' eager MoE). Outputs: the table and ``OUT/moe.json``.

Usage::

    python benchmarks/bench_moe.py                       # CUDA, both models
    python benchmarks/bench_moe.py --tokens 1 8 64 --iters 20
    python benchmarks/bench_moe.py --smoke               # CPU, tiny shapes, the loop only
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from pathlib import Path

import benchlib
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repo root: kernels

# name: (E, top-k, H, I)
MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen3-235b-a22b": (128, 8, 4096, 1536)}
SMOKE_MODELS = {"smoke": (12, 2, 64, 32)}


def distinct_experts(ids: torch.Tensor, num_experts: int) -> int:
    """Experts that at least one of the pass's tokens is routed to."""
    return int(torch.bincount(ids.flatten().long(), minlength=num_experts).gt(0).sum())


def floor_bytes(touched: int, hidden: int, inter: int, tokens: int, top_k: int,
                elem: int) -> int:
    """What a perfect kernel reads and writes: the touched experts' ``w13`` and ``w2``
    (3·H·I each), the input and output rows and the router logits."""
    return elem * (touched * 3 * hidden * inter + 2 * tokens * hidden) + 4 * tokens * top_k


def implementations(x: torch.Tensor, logits: torch.Tensor, w13: torch.Tensor,
                    w2: torch.Tensor, top_k: int, cuda: bool) -> dict[str, Callable[[], object]]:
    """``fused`` (CUDA only) then ``loop``, each one whole sparse block after the router."""
    from specengine.kernels import fused_moe, reference

    impls: dict[str, Callable[[], object]] = {}
    if cuda:
        impls["fused"] = lambda: fused_moe.moe_forward(x, logits, w13, w2, top_k, True)
    impls["loop"] = lambda: reference.moe_forward(x, logits, w13, w2, top_k, True)
    return impls


def bench(args: argparse.Namespace) -> list[dict]:
    from specengine.kernels import reference

    cuda = torch.cuda.is_available()
    device = "cuda" if cuda else "cpu"
    dtype = torch.bfloat16 if cuda else torch.float32
    peak = benchlib.peak_gbps(benchlib.device_name(), args.peak_gbps)
    models = SMOKE_MODELS if args.smoke else {m: MODELS[m] for m in args.models}
    rows: list[dict] = []
    for model, (num_experts, top_k, hidden, inter) in models.items():
        g = torch.Generator(device=device).manual_seed(0)
        w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=device,
                          dtype=dtype) * hidden**-0.5
        w2 = torch.randn(num_experts, hidden, inter, generator=g, device=device,
                         dtype=dtype) * inter**-0.5
        for tokens in args.tokens:
            x = torch.randn(tokens, hidden, generator=g, device=device, dtype=dtype)
            logits = torch.randn(tokens, num_experts, generator=g, device=device, dtype=dtype)
            _, ids = reference.route_topk(logits, top_k, True)
            touched = distinct_experts(ids, num_experts)
            nbytes = floor_bytes(touched, hidden, inter, tokens, top_k, x.element_size())
            impls = implementations(x, logits, w13, w2, top_k, cuda)
            if cuda:
                err = (impls["fused"]().float() - impls["loop"]().float()).abs().max().item()
                if err > 0.05:  # a wrong kernel is not timed
                    raise AssertionError(f"{model} T={tokens}: fused differs from the loop by "
                                         f"{err}")
            first_ms = None
            for impl, fn in impls.items():
                ms = benchlib.time_ms(fn, warmup=args.warmup, iters=args.iters,
                                      flush_l2=args.flush_l2, back_to_back=not args.flush_l2)
                first_ms = first_ms or ms
                rows.append({"model": model, "impl": impl, "tokens": tokens,
                             "experts": num_experts, "top_k": top_k, "hidden": hidden,
                             "inter": inter, "distinct_experts": touched,
                             "time_us": ms * 1e3, "bytes": nbytes,
                             **benchlib.roofline(nbytes, ms, peak),
                             "time_vs_first": ms / first_ms})
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    p.add_argument("--tokens", nargs="+", type=int, default=[1, 4, 16, 64, 256])
    p.add_argument("--iters", type=int, default=50)
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--flush-l2", action="store_true")
    p.add_argument("--peak-gbps", type=float, default=None)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (CPU: the loop only)")
    p.add_argument("--out", type=Path, default=benchlib.DEFAULT_OUT)
    args = p.parse_args(argv)
    if args.smoke:
        args.tokens, args.iters, args.warmup = [1, 4, 16], 3, 1
    rows = bench(args)
    cols = ["model", "impl", "tokens", "distinct_experts", "time_us", "gbps", "ratio",
            "time_vs_first"]
    print(" ".join(f"{c:>16}" for c in cols))
    for r in rows:
        print(" ".join(f"{r[c]:>16}" if isinstance(r[c], (str, int)) else
                       benchlib.fmt(r[c], "16.2f") for c in cols))
    device = benchlib.device_name()
    benchlib.write_json({"device": device, "dtype": "bf16" if torch.cuda.is_available()
                                else "fp32", "peak_gbps": benchlib.peak_gbps(device,
                                                                             args.peak_gbps),
                                "rows": rows}, args.out, "moe")
    return 0


if __name__ == "__main__":
    sys.exit(main())
