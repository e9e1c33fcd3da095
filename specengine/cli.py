"""``specengine generate``: speculative rollouts from the command line.

With no ``--model`` it runs the bundled default pair (a small arithmetic Qwen3 target and its
EAGLE-3 head, shipped in the package) on held-out prompts of its task, then the same run at
``k=0`` for comparison.
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

ASSETS = Path(__file__).resolve().parent / "assets"
DEFAULT_TARGET = ASSETS / "arith-target"
DEFAULT_DRAFT = ASSETS / "arith-eagle3"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="specengine", description=__doc__.splitlines()[0])
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser("generate", help="generate completions (speculative when --k > 0)")
    g.add_argument("--model", type=Path, default=None, help="target checkpoint dir (HF layout)")
    g.add_argument("--draft", default=None,
                   help="EAGLE-3 head dir, small LM dir, or 'ngram' (default: bundled head "
                        "with the bundled model, none otherwise)")
    g.add_argument("--prompt-ids", action="append", default=None,
                   help='space-separated token ids, e.g. "1 2 3" (repeatable)')
    g.add_argument("--prompt", action="append", default=None,
                   help="prompt text (needs a tokenizer.json; repeatable)")
    g.add_argument("--k", type=int, default=3, help="draft length (0 = plain decoding)")
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-k", type=int, default=-1)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--max-tokens", type=int, default=64)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument("--num-prompts", type=int, default=16,
                   help="bundled model: how many held-out task prompts to run")
    g.add_argument("--device", default=None)
    g.add_argument("--dtype", default="auto")
    g.add_argument("--kernel-backend", default="auto")
    g.add_argument("--no-baseline", action="store_true", help="skip the k=0 comparison run")
    return p


def _run(engine: object, prompts: list, k: int, params: object, label: str) -> list:
    outs = engine.generate(prompts, k=k, sampling=params, use_tqdm=True)  # type: ignore[attr-defined]
    st = engine.stats  # type: ignore[attr-defined]
    # per sequence: one verify (or decode) pass per step, so passes per token = 1 / tau
    per_token = st.num_seq_steps / max(1, st.num_step_tokens)
    print(f"[{label}] {st.num_generated_tokens} tokens in {st.wall_time_s:.2f} s "
          f"({st.tokens_per_second:.1f} tok/s); mean accepted length "
          f"{st.mean_accepted_length:.2f}; target forward passes per generated token "
          f"{per_token:.3f}")
    if k > 0 and st.proposed_per_position:
        rates = ", ".join(f"{r:.2f}" for r in st.acceptance_rate_per_position)
        print(f"[{label}] acceptance rate per draft position: {rates}")
    return outs


def generate_main(args: argparse.Namespace) -> int:
    from specengine import SamplingParams, SpecEngine

    model, draft = args.model, args.draft
    bundled = model is None
    if bundled:
        model = DEFAULT_TARGET
        if draft is None and args.k > 0:
            if not (DEFAULT_DRAFT / "config.json").is_file():
                print(f"bundled EAGLE-3 head missing at {DEFAULT_DRAFT} (train it with "
                      "scripts/train_eagle3.py, or pass --draft / --k 0)", file=sys.stderr)
                return 2
            draft = str(DEFAULT_DRAFT)
        if not model.is_dir():
            print(f"bundled model missing at {model}", file=sys.stderr)
            return 2
    engine = SpecEngine(model, draft=draft, device=args.device, dtype=args.dtype,
                        kernel_backend=args.kernel_backend, seed=args.seed)
    prompts: list = []
    for ids in args.prompt_ids or []:
        prompts.append([int(t) for t in ids.split()])
    prompts.extend(args.prompt or [])
    if not prompts and bundled:
        from specengine.arith_task import heldout_prompts

        prompts = heldout_prompts(args.num_prompts)
    if not prompts:
        print("give --prompt-ids or --prompt", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    outs = _run(engine, prompts, args.k, params, f"k={args.k}")
    for i, out in enumerate(outs[:4]):
        shown = out.text if out.text is not None else " ".join(map(str, out.token_ids))
        prompt = prompts[i] if isinstance(prompts[i], str) else " ".join(map(str, prompts[i]))
        print(f"--- prompt {i}: {prompt!r}\n    completion: {shown!r} ({out.finish_reason})")
    if len(outs) > 4:
        print(f"... {len(outs) - 4} more")
    if args.k > 0 and not args.no_baseline:
        base = _run(engine, prompts, 0, params, "k=0")
        same = sum(a.token_ids == b.token_ids for a, b in zip(outs, base))
        print(f"[k=0] identical completions: {same}/{len(outs)}"
              + (" (greedy: must be all)" if args.temperature == 0 else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    args = _parser().parse_args(argv)
    if args.command == "generate":
        try:
            return generate_main(args)
        except ValueError as e:
            print(f"error: {e}", file=sys.stderr)
            return 2
    return 1


if __name__ == "__main__":
    sys.exit(main())
