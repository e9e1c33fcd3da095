#!/usr/bin/env python
"""Rebuild the bundled EAGLE-3 head (``specengine/assets/arith-eagle3``) for the bundled target
with ``specengine train-draft`` (``specengine.train.train_draft``).

The arithmetic task's training prompts (none of them held out by ``arith_task``) are written
to a file; the engine rolls them out with the bundled target and trains a fresh head on its
own features and tokens; the head (draft vocabulary of 19: ``<pad>`` is never generated, so
``d2t`` is exercised) is evaluated on held-out prompts and its ``config.json`` and
``model.safetensors`` copied to ``--out``. The same as::

    python -c "from specengine.arith_task import write_training_prompts as w; \\
               w('arith.txt', 2000)"
    specengine train-draft --prompts arith.txt --out /tmp/arith-head --draft-vocab-size 19 \\
        --max-tokens 64

    python scripts/train_eagle3.py                       # a few minutes on a CPU
    python scripts/train_eagle3.py --num-prompts 200 --epochs 1 --out /tmp/h   # smoke run
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
from pathlib import Path

from specengine.arith_task import write_training_prompts
from specengine.assets import DEFAULT_TARGET
from specengine.train.offline import TrainDraftConfig, format_table, train_draft

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "specengine" / "assets" / "arith-eagle3"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--num-prompts", type=int, default=2000)
    p.add_argument("--steps", type=int, default=TrainDraftConfig.steps)
    p.add_argument("--epochs", type=int, default=None, help="instead of --steps")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args()
    with tempfile.TemporaryDirectory(prefix="arith-eagle3-") as tmp:
        prompts = Path(tmp) / "arith.txt"
        write_training_prompts(prompts, args.num_prompts)
        res = train_draft(model=DEFAULT_TARGET, prompts=prompts, out=Path(tmp) / "head",
                          draft_vocab_size=19, max_tokens=64, steps=args.steps,
                          epochs=args.epochs,
                          seed=args.seed, save_every=0)
        args.out.mkdir(parents=True, exist_ok=True)
        for name in ("config.json", "model.safetensors"):
            shutil.copy(res.out / name, args.out / name)
    print(f"wrote {args.out}: {res.num_steps} steps on {res.num_seqs} rollouts; generate "
          f"{res.generate_s:.0f} s, train {res.train_s:.0f} s")
    if res.evaluation is not None:
        print(format_table(res.evaluation))


if __name__ == "__main__":
    main()
