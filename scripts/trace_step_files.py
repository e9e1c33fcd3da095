"""Which project files one steady EAGLE-3 decode step runs through (issue 24's measure).

Builds the bundled pair on the CPU, runs greedy k=3 over 4 held-out prompts and traces the 5th
decode step with ``sys.setprofile``, listing each file of this repository whose code is called,
in first-call order (paths relative to the tree ``specengine`` is imported from)::

    OMP_NUM_THREADS=1 python scripts/trace_step_files.py
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import specengine
from specengine.arith_task import encode, heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.engine import SpecEngine
from specengine.sampling import SamplingParams

ROOT = Path(specengine.__file__).resolve().parents[1]  # the tree the package is imported from
TRACED_STEP = 5


def main() -> None:
    engine = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT)
    core = engine.core
    decode_step = core.decode_step
    files: list[str] = []
    calls = [0]

    def profile(frame, event, arg) -> None:  # noqa: ANN001 (sys.setprofile's signature)
        if event != "call":
            return
        path = os.path.realpath(frame.f_code.co_filename)
        if path.startswith(str(ROOT)) and os.path.isfile(path):
            rel = os.path.relpath(path, ROOT)
            if rel not in files:
                files.append(rel)

    def traced(*args: object) -> None:
        calls[0] += 1
        if calls[0] != TRACED_STEP:
            decode_step(*args)
            return
        sys.setprofile(profile)
        try:
            decode_step(*args)
        finally:
            sys.setprofile(None)

    core.decode_step = traced  # type: ignore[method-assign]
    prompts = [encode(p) for p in heldout_prompts(4)]
    engine.generate(prompts, k=3, sampling=SamplingParams(temperature=0.0, max_tokens=32))
    print(f"{len(files)} project files in decode step {TRACED_STEP} of {calls[0]}:")
    print("\n".join(files))


if __name__ == "__main__":
    main()
