"""Where a head's first draft misses, by the kind of token it had to guess (issue 34 item 3).

Replays the held-out greedy rollouts of a set written by ``ab_draft_head.py rollouts`` (or
train-draft's ``checkpoints/data.safetensors`` held part) with a head's unrolled maths, as
train-draft's curve does, and scores the depth-1 draft (the head's argmax for ``x_{i+2}``
from the target's features of position ``i`` and the token ``x_{i+1}``) against the policy's
greedy token. Tokens are classed by their text: ``digit`` (one decimal digit), ``space``,
``word`` (letters) and ``punct`` (the rest). A digit is ``copy`` when the number it extends
(the digits before it in the response, then it) begins a number of the prompt's last user
turn, else ``compute``; ``-first`` marks a number's first digit.

For comparison, on the same positions: prompt-lookup drafting (the n-gram drafter's rule),
the token that followed the most recent earlier occurrence of the last ``n`` tokens
(n = 1, 2, 3), a miss when there is none.

``--probe SET.safetensors`` asks instead whether the policy itself holds the next-but-one
token: it runs the policy (transformers, fp32) over ``--probe-rollouts`` rollouts of a saved
training set, fits a ridge probe from each of ``--probe-layers`` hidden states at position
``i`` (unit-normalised; ``hidden_states[L]``, 30 = after the final norm for SmolLM2) to
``x_{i+2}`` over the 64 most frequent generated tokens (one class for the rest) on the first
three quarters of them, and scores it on the rest, by the same kinds.

Usage::

    python benchmarks/draft_misses.py --model DIR --head HEAD_DIR --held SET.held.safetensors \\
        [--json OUT.json]
    python benchmarks/draft_misses.py --model DIR --probe SET.safetensors [--json OUT.json]
"""

from __future__ import annotations

import argparse
import json
import re
from collections import Counter
from pathlib import Path

import torch
from torch import Tensor

from specengine.drafters.draft_trainer import DraftTrainer, HeadOptimizer
from specengine.train.head_init import read_head
from specengine.train.offline import GeneratedSet, read_embedding

KINDS = ("word", "space", "punct", "digit", "copy", "copy-first", "compute", "compute-first")
LOOKUPS = (1, 2, 3)


def token_class(text: str) -> str:
    s = text.strip()
    if s.isdigit() and len(s) == 1:
        return "digit"
    if not s:
        return "space"
    return "word" if s.isalpha() else "punct"


def digit_kind(texts: list[str], classes: list[str], j: int, start: int,
               numbers: list[str]) -> str:
    """``copy`` / ``compute`` (``-first``) of the digit at ``j`` (module docstring)."""
    pre, m = "", j - 1
    while m >= start and classes[m] == "digit":
        pre = texts[m].strip() + pre
        m -= 1
    cand = pre + texts[j].strip()
    kind = "copy" if any(n.startswith(cand) for n in numbers) else "compute"
    return kind + ("-first" if not pre else "")


def lookup(tokens: list[int], j: int, n: int) -> int | None:
    """The token after the most recent earlier occurrence of ``tokens[j-n+1 .. j]``."""
    ctx = tokens[j - n + 1: j + 1]
    for m in range(j - 1, n - 2, -1):
        if tokens[m - n + 1: m + 1] == ctx:
            return tokens[m + 1]
    return None


def misses(model: Path, head_dir: Path, held_path: Path) -> dict[str, dict[str, float]]:
    from transformers import AutoTokenizer  # optional: the suite collects without it

    tok = AutoTokenizer.from_pretrained(model)
    held = GeneratedSet.load(held_path)
    embed = read_embedding(model)
    _, head = read_head(head_dir, embed, torch.device("cpu"))
    params = HeadOptimizer(head).masters
    trainer = DraftTrainer(head, embed, torch.device("cpu"), depth=1)
    total: Counter[str] = Counter()
    hits: Counter[tuple[str, str]] = Counter()
    with torch.no_grad():
        for i in range(0, len(held.seqs), 8):
            seqs = held.seqs[i: i + 8]
            feats, ids, valid, _ = trainer.batch(held, seqs)
            logits = trainer.math.unroll(params, feats, ids, valid, 1)[0]
            drafts = head.draft_to_target[logits.argmax(-1)]  # [B, T] target ids
            for b, s in enumerate(seqs):
                n = len(s.rows)
                toks = [int(t) for t in ids[b, :n]]  # toks[j] = x_{j+1}
                texts = [tok.decode([t]) for t in toks]
                classes = [token_class(t) for t in texts]
                first = s.num_prompt_tokens - 1  # toks[first] is the first generated token
                prompt = tok.decode(toks[:first])
                numbers = re.findall(r"\d+", prompt.rsplit("<|im_start|>user", 1)[-1])
                for a in range(s.num_prompt_tokens - 1, n - 1):
                    j = a + 1  # the guessed token x_{a+2} is toks[j]
                    kinds = [classes[j]]
                    if classes[j] == "digit":
                        kinds.append(digit_kind(texts, classes, j, first, numbers))
                    for kind in [*kinds, "all"]:
                        total[kind] += 1
                        hits[kind, "head"] += int(drafts[b, a]) == toks[j]
                        for m in LOOKUPS:
                            hits[kind, f"{m}-gram"] += lookup(toks, a, m) == toks[j]
    return {kind: {"share": total[kind] / total["all"], "count": total[kind],
                   **{src: hits[kind, src] / total[kind]
                      for src in ("head", *(f"{m}-gram" for m in LOOKUPS))}}
            for kind in (*KINDS, "all") if total[kind]}


def probe(model: Path, data_path: Path, layers: tuple[int, ...], num_rollouts: int
          ) -> dict[str, dict[str, float]]:
    """Per hidden-state layer, the held-out accuracy of a ridge probe for ``x_{i+2}`` by kind
    of token (module docstring)."""
    import numpy as np
    from ab_draft_head import ridge  # this directory's A/B harness
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    policy = AutoModelForCausalLM.from_pretrained(model, dtype=torch.float32).eval()
    data = GeneratedSet.load(data_path)
    counts = np.asarray(data.counts)
    classes_of = {int(t): j for j, t in enumerate(np.argsort(-counts, kind="stable")[:64])}
    pick = np.random.default_rng(0).choice(len(data.seqs), num_rollouts, replace=False)
    feats: dict[int, list[Tensor]] = {layer: [] for layer in layers}
    labels, kinds, which = [], [], []
    bos = [tok.bos_token_id] if tok.bos_token_id is not None else []
    with torch.no_grad():
        for n, s in enumerate(pick.tolist()):
            seq = data.seqs[s]
            toks = bos + data.tokens[torch.from_numpy(seq.rows)].tolist()  # x_0 .. x_T
            hidden = policy(torch.tensor([toks]), output_hidden_states=True).hidden_states
            texts = [tok.decode([t]) for t in toks]
            cls = [token_class(t) for t in texts]
            first = len(bos) + seq.num_prompt_tokens - 1  # toks[first]: first generated
            numbers = re.findall(r"\d+", tok.decode(toks[:first]).rsplit("<|im_start|>user",
                                                                             1)[-1])
            for i in range(first - 1, len(toks) - 2):
                j = i + 2
                kind = (cls[j],) if cls[j] != "digit" else (
                    "digit", digit_kind(texts, cls, j, first, numbers))
                for layer in layers:
                    feats[layer].append(hidden[layer][0, i])
                labels.append(classes_of.get(toks[j], 64))
                kinds.append(kind)
                which.append(n)
    y = torch.nn.functional.one_hot(torch.tensor(labels), 65).float()
    train = torch.tensor(which) < num_rollouts * 3 // 4
    out: dict[str, dict[str, float]] = {}
    for layer in layers:
        x = torch.stack(feats[layer])
        x = x / x.norm(dim=-1, keepdim=True)
        w = ridge(x[train], y[train], 1e-2)  # [65, H]
        ok = ((x[~train] @ w.T).argmax(-1) == torch.tensor(labels)[~train]).numpy()
        test_kinds = [k for k, t in zip(kinds, train.tolist()) if not t]
        row = {"all": float(ok.mean())}
        for kind in KINDS:
            hit = [o for o, k in zip(ok, test_kinds) if kind in k]
            if hit:
                row[kind] = float(np.mean(hit))
        out[str(layer)] = row
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True)
    ap.add_argument("--head", type=Path, default=None)
    ap.add_argument("--held", type=Path, default=None)
    ap.add_argument("--probe", type=Path, default=None, metavar="SET",
                    help="probe the policy's hidden states on this saved training set instead")
    ap.add_argument("--probe-layers", default="1,8,11,14,17,20,23,26,29,30")
    ap.add_argument("--probe-rollouts", type=int, default=160)
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args(argv)
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.probe is not None:
        layers = tuple(int(x) for x in args.probe_layers.split(","))
        table = probe(args.model, args.probe, layers, args.probe_rollouts)
        kinds = ("all", "word", "digit", "copy", "copy-first", "compute", "compute-first")
        print("| hidden state | " + " | ".join(kinds) + " |")
        print("|---|" + "---|" * len(kinds))
        for layer, r in table.items():
            print(f"| {layer} | " + " | ".join(f"{r.get(k, float('nan')):.2f}" for k in kinds)
                  + " |")
        if args.json is not None:
            args.json.write_text(json.dumps(table, indent=1) + "\n")
        return 0
    if args.head is None or args.held is None:
        ap.error("give --head and --held (or --probe SET)")
    rows = misses(args.model, args.head, args.held)
    cols = ("head", *(f"{m}-gram" for m in LOOKUPS))
    print("| target token | share | count | " + " | ".join(cols) + " |")
    print("|---|---|---|" + "---|" * len(cols))
    for kind, r in rows.items():
        print(f"| {kind} | {r['share']:.2f} | {r['count']} | "
              + " | ".join(f"{r[c]:.2f}" for c in cols) + " |")
    if args.json is not None:
        args.json.write_text(json.dumps(rows, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
