"""``specengine train-draft``: the command line of :func:`specengine.train.train_draft`
(``train/offline.py``). ``specengine/cli.py`` adds the parser and calls :func:`main`."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from specengine.train.data import DEFAULT_PROMPT_COLUMN


def _positive(low: int):  # noqa: ANN202 - an argparse type
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low:
            raise argparse.ArgumentTypeError(f"must be >= {low}, got {value}")
        return value

    return parse


def _temperatures(text: str) -> tuple[float, ...]:
    try:
        out = tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of "
                                         "numbers") from None
    if not out or any(not t >= 0 for t in out):
        raise argparse.ArgumentTypeError(f"temperatures must be >= 0, got {text!r}")
    return out


def _tree_sizes(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of tree "
                                         "sizes") from None


def add_parser(sub: argparse._SubParsersAction, formatter: type[argparse.HelpFormatter]
               ) -> None:
    from specengine.config import DTYPES
    from specengine.train.offline import AUTO_SAMPLES, HEAD_DTYPES, HEAD_INITS, TRAIN_DTYPES
    from specengine.train.offline import TrainDraftConfig as C

    t = sub.add_parser(
        "train-draft", formatter_class=formatter,
        help="train an EAGLE-3 head (or the checkpoint's MTP layer) for a policy on its own "
             "rollouts",
        description="Roll out the prompts with the engine (the policy itself), keep the "
                    "target features its drafter's catch-up pass computes, train an EAGLE-3 "
                    "head with the unrolled loss of online adaptation, write it in the "
                    "published layout to --out and evaluate it on held-out prompts "
                    "(docs/design.md §18, offline training). --arch mtp trains the target "
                    "checkpoint's own MTP layer the same way and writes the checkpoint, its "
                    "mtp.* weights trained, to --out (serve it with --model OUT --draft mtp).")
    t.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="target checkpoint dir, HF layout (default: the bundled arithmetic "
                        "model)")
    t.add_argument("--prompts", type=Path, required=True, metavar="FILE",
                   help="prompts: .txt (one per line), .jsonl ('prompt' field or chat "
                        "'messages') or .parquet (--prompt-column)")
    t.add_argument("--out", type=Path, required=True, metavar="HEAD_DIR",
                   help="where the trained head (and checkpoints, eval.json) go")
    t.add_argument("--eval-prompts", type=Path, default=None, metavar="FILE",
                   help="held-out evaluation prompts from this file (e.g. the task's held-out "
                        "split; --holdout caps their number) instead of a split of --prompts "
                        "(default: a split of --prompts)")
    t.add_argument("--prompt-column", default=DEFAULT_PROMPT_COLUMN,
                   help="JSONL field / Parquet column of the prompts (strings or chats)")
    t.add_argument("--arch", choices=("eagle3", "mtp"), default=C.arch,
                   help="eagle3: an EAGLE-3 head; mtp: the target's own MTP layer (a target "
                        "with mtp_num_hidden_layers: 1), written as a copy of the checkpoint")
    t.add_argument("--init", type=Path, default=None, metavar="HEAD_DIR",
                   help="warm-start from this EAGLE-3 head (default: a fresh head); --arch "
                        "mtp: from this checkpoint's mtp.* weights (default: the target's)")
    t.add_argument("--samples-per-prompt", type=_positive(1), default=None,
                   help="samples per prompt and pass (default: 1 when greedy, "
                        f"{AUTO_SAMPLES} when sampling: they share the prompt's prefill)")
    t.add_argument("--temperature", type=float, default=C.temperature,
                   help="rollout temperature (0 = greedy)")
    t.add_argument("--max-tokens", type=_positive(1), default=C.max_tokens,
                   help="most new tokens per rollout")
    t.add_argument("--rollout-tokens", type=_positive(0), default=C.rollout_tokens,
                   help="data budget: roll out until this many tokens were generated, making "
                        "more passes over the prompts (new seeds) when they are few; 0: one "
                        "pass over the prompts")
    t.add_argument("--greedy-rollout-tokens", type=_positive(0),
                   default=C.greedy_rollout_tokens,
                   help="when sampling, add greedy rollouts of the same prompts until this many "
                        "tokens (one pass at most), shuffled in with the sampled set: for "
                        "greedy drafting (a small gain measured), no effect on sampled "
                        "acceptance; 0: none")
    t.add_argument("--gen-k", type=_positive(0), default=None,
                   help="draft length while generating (default: 0, the drafter only catches "
                        "up: every position is recorded at the least cost)")
    t.add_argument("--draft-vocab-size", type=_positive(1), default=C.draft_vocab_size,
                   help="fresh head: keep the most frequent generated tokens (capped at the "
                        "target's vocab)")
    t.add_argument("--head-init", choices=HEAD_INITS, default=C.head_init,
                   help="fresh head: 'random' from scratch, 'target' starts lm_head (draft "
                        "vocabulary rows) and the final norm from the target's")
    t.add_argument("--norm-before-residual", action="store_true",
                   help="fresh head: its residual is the normalised target feature "
                        "(hidden_norm(g), as vLLM / speculators heads), not the raw one: for "
                        "targets with massive activations")
    t.add_argument("--steps", type=_positive(1), default=C.steps,
                   help="training budget in optimiser steps, whatever the number of prompts")
    t.add_argument("--epochs", type=_positive(1), default=None,
                   help="instead of --steps: this many passes over the generated set "
                        "(default: none, --steps is the budget)")
    t.add_argument("--lr", type=float, default=C.lr, help="peak learning rate (Adam)")
    t.add_argument("--batch-tokens", type=_positive(1), default=C.batch_tokens,
                   help="positions per optimiser step")
    t.add_argument("--ttt-steps", type=_positive(1), default=C.ttt_steps,
                   help="unrolled draft steps of the loss")
    t.add_argument("--soft-labels", type=_positive(0), default=C.soft_labels,
                   help="train on the policy's top-N distribution of each generated token "
                        "(recorded as the rollouts run, at most 20), renormalised over the "
                        "draft vocabulary: far less noise than the sampled token at T=1; "
                        "0: the sampled tokens")
    t.add_argument("--tv-weight", type=float, default=C.tv_weight,
                   help="add this multiple of each draft's rejection probability, "
                        "1 - sum min(p, q), to the loss: what sampled drafting's acceptance "
                        "is (the cross-entropy stays); 0: the cross-entropy alone")
    t.add_argument("--seed", type=_positive(0), default=C.seed,
                   help="seed of the held-out split, rollout order and samples, head init and "
                        "batch order")
    t.add_argument("--holdout", type=_positive(0), default=None,
                   help="held-out prompts for the evaluation (default: min(64, a tenth of "
                        "--prompts; all of --eval-prompts)")
    t.add_argument("--save-every", type=_positive(0), default=C.save_every,
                   help="checkpoint every N steps (0: none)")
    t.add_argument("--resume", action="store_true",
                   help="continue the run in --out from its last checkpoint")
    t.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    t.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto = cuda when available")
    t.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="engine dtype: auto = bfloat16 on CUDA, float32 on CPU")
    t.add_argument("--threads", type=_positive(1), default=None,
                   help="torch CPU threads (default: the engine's policy)")
    t.add_argument("--eval-max-tokens", type=_positive(1), default=None,
                   help="most new tokens per evaluation rollout (default: --max-tokens)")
    t.add_argument("--eval-temperatures", type=_temperatures,
                   default=",".join(f"{x:g}" for x in C.eval_temperatures),
                   help="comma-separated temperatures of the held-out evaluation (0 = greedy)")
    t.add_argument("--eval-trees", type=_tree_sizes,
                   default=",".join(str(n) for n in C.eval_trees),
                   help="the head's best trees (trees.json) evaluated too, by drafts per tree, "
                        "comma-separated ('': none)")
    t.add_argument("--curve-points", type=_positive(0), default=C.curve_points,
                   help="held-out greedy acceptance measured this many times during training "
                        "(replayed by the head on greedy held-out rollouts; 0: none)")
    t.add_argument("--head-dtype", choices=HEAD_DTYPES, default=C.head_dtype,
                   help="dtype of the written head (auto: the target's)")
    t.add_argument("--train-dtype", choices=TRAIN_DTYPES, default=C.train_dtype,
                   help="compute dtype of the training loss (autocast; Adam masters and the "
                        "evaluation stay float32): auto = bfloat16 on a CUDA GPU with bf16 and "
                        "on a CPU with AVX512-BF16 or AMX, else float32")
    t.add_argument("--no-progress", action="store_true", help="no progress bars")


def main(args: argparse.Namespace, default_model: Path) -> int:
    """Run ``specengine train-draft`` with parsed ``args``; returns the exit status."""
    from specengine.train.offline import TrainDraftConfig, format_table, train_draft

    try:
        temps = args.eval_temperatures
        cfg = TrainDraftConfig(
            model=args.model or default_model, prompts=args.prompts, out=args.out,
            prompt_column=args.prompt_column, arch=args.arch, init=args.init,
            eval_prompts=args.eval_prompts,
            samples_per_prompt=args.samples_per_prompt, temperature=args.temperature,
            max_tokens=args.max_tokens, rollout_tokens=args.rollout_tokens, gen_k=args.gen_k,
            greedy_rollout_tokens=args.greedy_rollout_tokens,
            draft_vocab_size=args.draft_vocab_size, head_init=args.head_init,
            steps=args.steps, epochs=args.epochs, lr=args.lr,
            batch_tokens=args.batch_tokens, ttt_steps=args.ttt_steps, seed=args.seed,
            soft_labels=args.soft_labels, tv_weight=args.tv_weight,
            holdout=args.holdout, save_every=args.save_every, resume=args.resume,
            overwrite=args.overwrite, device=None if args.device == "auto" else args.device,
            dtype=args.dtype, num_threads=args.threads, eval_max_tokens=args.eval_max_tokens,
            eval_temperatures=_temperatures(temps) if isinstance(temps, str) else temps,
            eval_trees=(_tree_sizes(args.eval_trees) if isinstance(args.eval_trees, str)
                        else args.eval_trees),
            curve_points=args.curve_points, head_dtype=args.head_dtype,
            train_dtype=args.train_dtype,
            norm_before_residual=args.norm_before_residual,
            progress=not args.no_progress)
        handler = logging.StreamHandler(sys.stdout)  # the plan, estimate and curve
        handler.setFormatter(logging.Formatter("%(message)s"))
        log = logging.getLogger("specengine.train")
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
        try:
            res = train_draft(cfg)
        finally:
            log.removeHandler(handler)
            log.propagate = True
    except ValueError as e:  # bad input (CheckpointError too): a message, not a traceback
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"trained on {res.num_seqs} rollouts ({res.num_tokens} generated tokens"
          + (f"; {res.num_greedy_seqs} greedy rollouts, {res.num_greedy_tokens} tokens, among "
             "them" if res.num_greedy_seqs else "")
          + f") of {res.num_train_prompts} prompts: {res.num_steps} steps"
          + (f", loss {res.losses[0][1]:.3f} -> {res.losses[-1][1]:.3f}" if res.losses else "")
          + f"; generate {res.generate_s:.0f} s, train {res.train_s:.0f} s, "
            f"evaluate {res.eval_s:.0f} s")
    if cfg.arch == "mtp":
        print(f"wrote the checkpoint with the trained MTP layer to {res.out} (use it with "
              f"--model {res.out} --draft mtp)")
    else:
        from specengine.drafters.head_trees import load_head_trees

        trees = load_head_trees(res.out)
        sizes = [n for n in (trees.sizes if trees is not None else ()) if n <= 16]
        print(f"wrote the EAGLE-3 head to {res.out} (use it with --draft {res.out}"
              + (f"; --tree {sizes[-1]} verifies its best tree of {sizes[-1]} drafts "
                 f"({trees.path}) instead of a chain, worth it on a GPU at small batch"
                 if sizes else "") + ")")
    if res.evaluation is not None:
        print(format_table(res.evaluation))
        print(f"evaluation written to {res.out / 'eval.json'}")
    return 0
