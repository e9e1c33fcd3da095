"""Rollout speed on a real model: tokens per second by batch size, k and drafter.

The target is a real checkpoint (``--model DIR``; ``--gguf PATH`` or nothing builds
SmolLM2-135M-Instruct with ``specengine.assets.smollm2`` into ``--cache-dir``), drafting with
a trained EAGLE-3 head (``--draft HEAD_DIR``) and optionally the drafters that need no
training (``--drafters ngram,suffix``); ``--trees 16,32`` adds rows of the head's own best
static trees of those sizes (``HEAD_DIR/trees.json``, written by ``train-draft``: the greedy
tree at temperature 0, else the sampled one), labelled ``k=tree16``, verified at the tree's
depth. For every (engine, batch, k) row: one warm-up
``generate`` of the same shape (graph captures, kernel compilation and the ``k="auto"`` cost
fit happen there), then one timed ``generate`` between two device synchronisations. Each row
is written to ``OUT/rows.jsonl`` as soon as it is measured (a run cut short keeps what it
measured), the markdown table to ``OUT/table.md`` and stdout at the end. ``k=0`` rows run on
an engine without a drafter (plain decoding, what a user without speculation runs); CUDA
graphs are the engine's default (on with CUDA). ``--budget-s`` stops starting rows that
would not finish in time.

Prompts: ``--prompts FILE``, a ``.txt`` with one prompt per line or a ``.jsonl`` whose lines
hold ``{"messages": [...]}`` (rendered with the checkpoint's chat template) or
``{"prompt": "..."}``; default: a few built-in chat prompts. They are cycled to fill a batch.
The warm-up runs the same prompts (another seed), so the suffix drafter has indexed their
earlier completions when the timed run starts, as in RL when epochs revisit prompts.

Usage::

    python benchmarks/bench_real_model.py --draft HEAD_DIR --batch 1,8,64,256 --k 0,3,auto
    python benchmarks/bench_real_model.py --draft HEAD_DIR --batch 1,8 --k 0,3 --trees 16,32
    python benchmarks/bench_real_model.py --device cpu --batch 1 --k 0 --max-tokens 4  # dry
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import sys
import time
from pathlib import Path
from typing import Any

import torch
from benchlib import DEFAULT_OUT, device_name

from specengine.config import DEFAULT_K_MAX, MAX_K

DEFAULT_CHATS = [
    "What is the capital of France? Answer in one sentence.",
    "Write a short poem about the sea.",
    "Explain what a hash table is to a ten-year-old.",
    "List five fruits and one fact about each.",
    "How do I reverse a list in Python? Show code.",
    "Summarize the plot of Romeo and Juliet in three sentences.",
    "What are the benefits of regular exercise?",
    "Translate 'good morning, how are you?' into Spanish and French.",
]
COLUMNS = ("batch", "drafter", "k", "tokens", "seconds", "tokens_per_s", "speedup", "steps",
           "mean_accepted_length", "acceptance_per_position", "auto_k_steps",
           "graphs_captured")


def _csv(text: str) -> list[str]:
    items = [t.strip() for t in text.split(",") if t.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: give a comma-separated list")
    return items


def _batches(text: str) -> list[int]:
    try:
        out = [int(t) for t in _csv(text)]
    except ValueError:
        raise argparse.ArgumentTypeError(f"--batch {text!r}: integers, e.g. 1,8,64") from None
    if any(b < 1 for b in out):
        raise argparse.ArgumentTypeError(f"--batch {text!r}: every batch must be >= 1")
    return out


def _ks(text: str) -> list[int | str]:
    out: list[int | str] = []
    for t in _csv(text):
        if t == "auto":
            out.append(t)
            continue
        try:
            k = int(t)
        except ValueError:
            raise argparse.ArgumentTypeError(f"--k {t!r}: an integer or 'auto'") from None
        if not 0 <= k <= MAX_K:
            raise argparse.ArgumentTypeError(f"--k {k}: must be in [0, {MAX_K}] or 'auto'")
        out.append(k)
    return out


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--model", type=Path, default=None, metavar="DIR",
                     help="target checkpoint (default: SmolLM2-135M-Instruct, built if needed)")
    src.add_argument("--gguf", type=Path, default=None, metavar="PATH",
                     help="build SmolLM2-135M-Instruct from this GGUF file (the pinned one)")
    p.add_argument("--cache-dir", type=Path, default=None, metavar="DIR",
                   help="where --gguf / the default builds (default: $SPECENGINE_CACHE or "
                        "~/.cache/specengine)")
    p.add_argument("--draft", type=Path, default=None, metavar="HEAD_DIR",
                   help="EAGLE-3 head: rows 'eagle3' at every k > 0 and auto")
    p.add_argument("--drafters", type=_csv, default=[], metavar="LIST",
                   help="also these drafters that need no training (ngram, suffix)")
    p.add_argument("--prompts", type=Path, default=None, metavar="FILE",
                   help=".txt (one per line) or .jsonl (messages or prompt per line)")
    p.add_argument("--batch", type=_batches, default=[1, 8, 64, 256], metavar="LIST")
    p.add_argument("--k", type=_ks, default=[0, 3, "auto"], metavar="LIST",
                   help="k=0 rows run without a drafter; the others with each drafter")
    p.add_argument("--trees", type=_batches, default=[], metavar="LIST",
                   help="sizes of the head's own trees (HEAD_DIR/trees.json) to measure")
    p.add_argument("--k-max", type=int, default=DEFAULT_K_MAX, help="largest k auto picks")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--warmup-tokens", type=int, default=None,
                   help="tokens per prompt of the warm-up generate (default: --max-tokens)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--device", default=None, help="default: cuda when available")
    p.add_argument("--dtype", default="auto")
    p.add_argument("--kv-cache-tokens", type=int, default=None,
                   help="default: from free GPU memory (1 GiB on CPU)")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="default: the longest prompt + --max-tokens + the longest chain (so "
                        "the KV cache is not sized for the model's whole context)")
    p.add_argument("--budget-s", type=float, default=None,
                   help="start no row that the last row's time says would end past this")
    p.add_argument("--out", type=Path, default=DEFAULT_OUT / "real_model", metavar="DIR")
    args = p.parse_args(argv)
    bad = sorted(set(args.drafters) - {"ngram", "suffix"})
    if bad:
        p.error(f"--drafters {','.join(bad)}: only ngram and suffix (a head is --draft)")
    if any(k != 0 for k in args.k) and args.draft is None and not args.drafters:
        p.error(f"--k {','.join(map(str, args.k))}: k > 0 needs --draft HEAD_DIR or "
                "--drafters ngram,suffix (or --k 0)")
    args.tree_paths = {}
    if args.trees:
        from specengine.train.trees import tree_paths

        if args.draft is None:
            p.error("--trees: the trees are a head's own, give --draft HEAD_DIR")
        kind = "greedy" if args.temperature == 0 else "sampled"
        try:
            args.tree_paths = {f"tree{n}": tree_paths(args.draft, kind, n) for n in args.trees}
        except ValueError as e:
            p.error(f"--trees: {e}")
    return args


def resolve_model(args: argparse.Namespace) -> Path:
    if args.model is not None:
        return args.model
    from specengine.assets.smollm2 import BuildError, build

    try:
        return build(args.cache_dir, gguf=args.gguf)
    except BuildError as e:
        raise SystemExit(f"error: {e}") from None


def load_prompts(path: Path | None, tokenizer: Any) -> list[list[int]]:
    """Prompts as token ids (chat messages rendered by the checkpoint's template)."""
    return [tokenizer.encode(p, "prompt") if isinstance(p, str) else p
            for p in read_prompts(path, tokenizer)]


def read_prompts(path: Path | None, tokenizer: Any) -> list[list[int] | str]:
    """Prompts as token ids (chat messages rendered by the checkpoint's template) or text."""
    template = tokenizer.chat_template if tokenizer is not None else None

    def chat(messages: list[dict[str, Any]], where: str) -> list[int]:
        if template is None:
            raise SystemExit(f"{where}: chat messages need a checkpoint with a chat template")
        return tokenizer.encode(template.render(messages), where, add_special_tokens=False)

    if path is None:
        if template is None:
            raise SystemExit("the checkpoint has no chat template: give --prompts FILE.txt")
        return [chat([{"role": "user", "content": c}], "prompt") for c in DEFAULT_CHATS]
    lines = [ln for ln in path.read_text().splitlines() if ln.strip()]
    if path.suffix == ".txt":
        return list(lines)
    if path.suffix != ".jsonl":
        raise SystemExit(f"--prompts {path}: a .txt or .jsonl file")
    out: list[list[int] | str] = []
    for i, line in enumerate(lines, 1):
        rec = json.loads(line)
        if "messages" in rec:
            out.append(chat(rec["messages"], f"{path}:{i}"))
        elif isinstance(rec.get("prompt"), str):
            out.append(rec["prompt"])
        else:
            raise SystemExit(f"{path}:{i}: a line holds 'messages' or 'prompt'")
    if not out:
        raise SystemExit(f"--prompts {path}: no prompts")
    return out


def engine_plan(args: argparse.Namespace) -> list[tuple[str, Any, list[int | str]]]:
    """(drafter label, draft argument, ks) per engine, in order."""
    plan: list[tuple[str, Any, list[int | str]]] = []
    if 0 in args.k:
        plan.append(("none", None, [0]))
    drafting = [k for k in args.k if k != 0]
    if args.draft is not None and (drafting or args.tree_paths):
        plan.append(("eagle3", str(args.draft), drafting + list(args.tree_paths)))
    if drafting:
        plan += [(name, name, drafting) for name in args.drafters]
    return plan


def measure(engine: Any, prompts: list, k: int | str, params: Any, warm: Any,
            k_max: int, tree: list | None = None) -> tuple[Any, float]:
    """``k``: an int, "auto", or a tree's label with ``tree`` its paths (verified at its
    depth)."""
    kw: dict[str, Any] = {"k": k, "k_max": k_max} if tree is None else {
        "k": max(len(p) for p in tree), "tree": tree}
    engine.generate(prompts, sampling=warm, **kw)  # warm-up: same shapes
    sync = torch.cuda.synchronize if engine.device.type == "cuda" else (lambda: None)
    sync()
    t0 = time.perf_counter()
    engine.generate(prompts, sampling=params, **kw)
    sync()
    return engine.stats, time.perf_counter() - t0


def row_of(st: Any, seconds: float, *, batch: int, drafter: str, k: int | str,
           engine: Any, base_tps: float | None, args: argparse.Namespace) -> dict:
    tps = st.num_generated_tokens / seconds if seconds > 0 else 0.0
    graphs = engine.graphs.graph_stats
    return dict(
        device=device_name() if engine.device.type == "cuda" else "cpu", batch=batch,
        drafter=drafter, k=k, k_max=args.k_max if k == "auto" else None,
        temperature=args.temperature, max_tokens=args.max_tokens,
        tokens=st.num_generated_tokens, seconds=seconds, tokens_per_s=tps,
        speedup=tps / base_tps if base_tps else None, steps=st.num_steps,
        mean_accepted_length=st.mean_accepted_length,
        acceptance_per_position=[round(r, 4) for r in st.acceptance_rate_per_position],
        auto_k_steps=list(st.auto_k_steps) if k == "auto" else None,
        graphs_captured=len(graphs.captures), graphs_refused=graphs.num_refused,
        cuda_graphs=engine.config.cuda_graphs)


def markdown(rows: list[dict]) -> str:
    def cell(v: object, col: str) -> str:
        if col == "auto_k_steps" and isinstance(v, list):  # steps by chosen k, nonzero only
            return " ".join(f"k{k}:{n}" for k, n in enumerate(v) if n)
        if isinstance(v, float):
            return f"{v:.4g}"
        if isinstance(v, list):
            return " ".join(f"{x:.2f}" if isinstance(x, float) else str(x) for x in v)
        return "" if v is None else str(v)

    lines = ["| " + " | ".join(COLUMNS) + " |", "|" + "---|" * len(COLUMNS)]
    lines += ["| " + " | ".join(cell(r.get(c), c) for c in COLUMNS) + " |" for r in rows]
    return "\n".join(lines)


def run(args: argparse.Namespace) -> list[dict]:
    from tqdm import tqdm

    from specengine import SamplingParams, SpecEngine

    started = time.monotonic()
    model = resolve_model(args)
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed)
    warm = SamplingParams(temperature=args.temperature, seed=args.seed + 1,
                          max_tokens=args.warmup_tokens or args.max_tokens)
    from specengine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(model)
    if tokenizer is None:
        raise SystemExit(f"{model} has no tokenizer.json: prompts are text")
    prompts = load_prompts(args.prompts, tokenizer)
    max_model_len = args.max_model_len or (max(map(len, prompts)) + args.max_tokens + MAX_K + 1)
    plan = engine_plan(args)
    total = sum(len(ks) for _, _, ks in plan) * len(args.batch)
    args.out.mkdir(parents=True, exist_ok=True)
    rows: list[dict] = []
    base: dict[int, float] = {}  # batch -> k=0 tokens/s
    last_row_s = 0.0
    skipped = 0
    bar = tqdm(total=total, desc="rows", unit="row")
    with open(args.out / "rows.jsonl", "w") as sink:
        for drafter, draft, ks in plan:
            if args.budget_s is not None and time.monotonic() - started > args.budget_s:
                skipped += len(ks) * len(args.batch)
                continue
            need_k = max([k if isinstance(k, int) else args.k_max if k == "auto" else 0
                          for k in ks])
            engine = SpecEngine(model, draft=draft, device=args.device, dtype=args.dtype,
                                max_batch_size=max(args.batch), seed=args.seed,
                                kv_cache_tokens=args.kv_cache_tokens,
                                max_model_len=max_model_len,
                                capture_ks=tuple(range(need_k + 1)))
            with engine:
                for batch in args.batch:
                    batch_prompts = [prompts[i % len(prompts)] for i in range(batch)]
                    for k in ks:
                        elapsed = time.monotonic() - started
                        if args.budget_s is not None and elapsed + last_row_s > args.budget_s:
                            skipped += 1
                            bar.update(1)
                            continue
                        t0 = time.monotonic()
                        st, seconds = measure(engine, batch_prompts, k, params, warm,
                                              args.k_max, args.tree_paths.get(k))
                        last_row_s = time.monotonic() - t0
                        row = row_of(st, seconds, batch=batch, drafter=drafter, k=k,
                                     engine=engine, base_tps=base.get(batch), args=args)
                        if k == 0:
                            base[batch] = row["tokens_per_s"]
                        row["model"] = str(model)
                        rows.append(row)
                        sink.write(json.dumps(row) + "\n")
                        sink.flush()
                        bar.update(1)
                        tqdm.write(f"batch {batch} {drafter} k={k}: "
                                   f"{row['tokens_per_s']:.1f} tok/s, tau "
                                   f"{row['mean_accepted_length']:.2f}")
            # The next engine sizes its KV cache from free memory: hand this one's back.
            del engine
            gc.collect()
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
    bar.close()
    table = markdown(rows)
    if skipped:
        table += f"\n\n{skipped} rows not run: --budget-s {args.budget_s} reached"
    (args.out / "table.md").write_text(table + "\n")
    print(table)
    print(f"wrote {args.out / 'rows.jsonl'} and {args.out / 'table.md'}")
    return rows


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING)
    run(parse_args(argv))
    return 0


if __name__ == "__main__":
    sys.exit(main())
