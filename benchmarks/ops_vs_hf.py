"""Operators per decode step: specengine's CPU path (bundled pair) against transformers.

Counts every aten operator dispatched (a ``TorchDispatchMode``; views and allocations
included, as each is Python-to-C++ dispatch work on the CPU) over a whole greedy ``generate``
of ``--max-tokens`` new tokens at batch ``--batch``, once with ``T`` new tokens and once with
1, and divides the difference by the extra steps: the operators of one decode step with
prefill and start-up taken out. transformers' batched ``generate`` is one forward of the batch
per step; specengine's k=0 / EAGLE-3 k=3 steps are ``Engine.step`` calls (a step of k=3 makes
up to 4 tokens per sequence, so its figure is also given per generated token of the batch).
Load-independent (counts, not times). ``--by-op`` prints the most frequent operators.

    OMP_NUM_THREADS=1 python benchmarks/ops_vs_hf.py --batch 16 --max-tokens 64
"""

from __future__ import annotations

import argparse
import collections
import json
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OpCounter(TorchDispatchMode):
    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops[str(func.overloadpacket.__name__)] += 1
        return func(*args, **(kwargs or {}))


def count(fn) -> collections.Counter[str]:
    with OpCounter() as c:
        fn()
    return c.ops


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--by-op", type=int, default=12)
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/ops_vs_hf.json"))
    args = p.parse_args()
    torch.set_num_threads(1)
    from hf_peer import HFGenerate

    from specengine import SamplingParams, SpecEngine
    from specengine.arith_task import EOS, PAD, VOCAB, encode, heldout_prompts
    from specengine.cli import DEFAULT_DRAFT, DEFAULT_TARGET

    prompts = [encode(s) for s in heldout_prompts(args.batch, seed=7)]
    eos = VOCAB.index(EOS)
    hf = HFGenerate(str(DEFAULT_TARGET), "cpu", VOCAB.index(PAD), eos)
    eng = SpecEngine(DEFAULT_TARGET, draft=str(DEFAULT_DRAFT), device="cpu", dtype="float32",
                     max_batch_size=args.batch)
    rows = []

    def ours(k: int, n: int):
        params = SamplingParams(temperature=0.0, max_tokens=n, seed=0)
        res = {}

        def go():
            outs = eng.generate(prompts, k=k, sampling=params)
            res["tokens"] = sum(len(o.token_ids) for o in outs)
            res["steps"] = max(o.num_steps for o in outs)
        return go, res

    for name, k in (("transformers generate", None), ("specengine k=0", 0),
                    ("specengine EAGLE-3 k=3", 3)):
        got = {}
        for n in (1, args.max_tokens):
            if k is None:
                res = {}

                def go(n=n, res=res):
                    outs = hf(prompts, n)
                    res["tokens"] = sum(len(o) for o in outs)
                    res["steps"] = max(len(o) for o in outs)
            else:
                go, res = ours(k, n)
            go()  # warm-up
            ops = count(go)
            got[n] = (ops, dict(res))
        (o1, r1), (on, rn) = got[1], got[args.max_tokens]
        steps = rn["steps"] - r1["steps"]
        tokens = rn["tokens"] - r1["tokens"]
        diff = collections.Counter({op: on[op] - o1.get(op, 0) for op in on})
        total = sum(diff.values())
        rows.append(dict(config=name, steps=steps, tokens=tokens,
                         ops_per_step=total / max(1, steps),
                         ops_per_batch_token=total / max(1, tokens) * args.batch,
                         top={op: round(c / max(1, steps), 1)
                              for op, c in diff.most_common(args.by_op)}))
        print(json.dumps(rows[-1]), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(batch=args.batch, rows=rows), indent=1))


if __name__ == "__main__":
    main()
