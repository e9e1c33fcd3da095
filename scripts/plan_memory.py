"""Print the memory plan of an engine on a card (``specengine.core.memory_plan``).

    python scripts/plan_memory.py --model DIR [--draft DIR] --gpu-memory-gb 80 --k-max 8 --sample

Only the checkpoints' ``config.json`` files are read: no weights, no GPU. ``--measure`` (CUDA
only) also loads the target with dummy weights and measures the peak of one forward at the
largest shape (the engine's own dry run at start, ``memory_plan.dry_run_largest_shape``), to
check the plan's eager activation figure on a real card.
"""

from __future__ import annotations

import argparse
import sys

from specengine.config import DTYPES, MAX_K, EngineConfig
from specengine.core.graphs import DEFAULT_BUCKETS
from specengine.core.memory_plan import GIB, DrafterFacts, plan_memory
from specengine.model.config import ModelConfig


def _buckets(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(b) for b in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not comma-separated ints") from None


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", required=True, help="target checkpoint dir (its config.json)")
    p.add_argument("--draft", default=None,
                   help="EAGLE-3 head or small-LM dir, mtp, ngram or suffix (default: none)")
    p.add_argument("--gpu-memory-gb", type=float, default=80.0,
                   help="the card's total memory in GiB (an 80 GB H100 reports ~79.2)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9)
    p.add_argument("--dtype", choices=tuple(DTYPES), default="bfloat16")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the model's max_position_embeddings")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-num-batched-tokens", type=int, default=16384)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--graph-buckets", type=_buckets, default=DEFAULT_BUCKETS)
    p.add_argument("--no-cuda-graphs", action="store_true", help="plan an eager engine")
    p.add_argument("--k-max", type=int, default=None,
                   help=f"longest chain requests ask for, 1..{MAX_K} (default: the engine's, "
                        "the largest captured k)")
    p.add_argument("--sample", action=argparse.BooleanOptionalAction, default=None,
                   help="drafts carry their distributions (--no-sample: point masses; default: "
                        "the drafter's own, sampled for an EAGLE-3 head)")
    p.add_argument("--measure", action="store_true",
                   help="CUDA only: measure the largest shape's peak in a dry run")
    return p


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    target = ModelConfig.from_dir(args.model)
    cfg = EngineConfig(
        model=args.model, draft=args.draft, device="cuda", dtype=args.dtype,
        block_size=args.block_size,
        max_model_len=args.max_model_len or target.max_position_embeddings,
        max_batch_size=args.max_batch_size, max_num_batched_tokens=args.max_num_batched_tokens,
        kernel_backend="triton", cuda_graphs=not args.no_cuda_graphs,
        graph_buckets=args.graph_buckets, gpu_memory_utilization=args.gpu_memory_utilization,
        draft_options=() if args.sample is None else (("sample", args.sample),))
    e = cfg.torch_dtype.itemsize
    drafter = DrafterFacts.from_draft(cfg.draft, target, e)
    plan = plan_memory(target, cfg, int(args.gpu_memory_gb * GIB), drafter, k_max=args.k_max)
    print(plan.format())
    if args.measure:
        print(f"measured largest-shape peak {_measure(cfg, drafter) / GIB:9.3f} GiB")
    return 0


def _measure(cfg: EngineConfig, drafter: DrafterFacts | None) -> int:
    import torch

    from specengine.core.memory_plan import dry_run_largest_shape
    from specengine.model.attention import make_attention_backend
    from specengine.model.loader import build_model

    if not torch.cuda.is_available():
        raise SystemExit("--measure needs a CUDA device")
    model = build_model(cfg.model, cfg.torch_dtype, torch.device("cuda"), "dummy")
    return dry_run_largest_shape(model, cfg, make_attention_backend(cfg.kernel_backend),
                                 drafter)


if __name__ == "__main__":
    sys.exit(main())
