"""Instruction counts of the loops of a compiled kernel (SASS from ``compile_kernels.py --asm``).

A loop is the instructions from a label to a backward branch to it (``nvdisasm -c`` output);
for each innermost loop this prints its length and how many of its instructions are of a few
kinds that cost the sampling kernels their time (MUFU.EX2 / MUFU.LG2: exp / log; F2I / I2F
with a 64-bit side: 64-bit conversions; LDG: global loads; STG: stores). Divide by the tokens
one thread handles per iteration to get a per-token figure (benchmarks/RESULTS.md, issue 35).

    python3 scripts/sass_loops.py benchmarks/out/asm/_keep_threshold_kernel.sm_90a.*.sass
"""

from __future__ import annotations

import argparse
import re
import sys
from dataclasses import dataclass
from pathlib import Path

_INSTR = re.compile(r"^\s*/\*([0-9a-f]{4,})\*/\s+(.*?);")
_LABEL = re.compile(r"^(\.L_x_\d+):")
_BRANCH = re.compile(r"\bBRA\s+`?\(?(\.L_x_\d+)\)?")
KINDS = {
    "exp": re.compile(r"\bMUFU\.EX2\b"),
    "log": re.compile(r"\bMUFU\.LG2\b"),
    "cvt64": re.compile(r"\b(F2I|I2F)\.[^ ]*64\b|\bF2I\.S64\b|\bF2I\.U64\b"),
    "load": re.compile(r"\bLDG\b"),
    "store": re.compile(r"\bSTG\b"),
}


@dataclass(frozen=True)
class Loop:
    """Instructions ``start`` .. ``end`` (indices into the kernel's instruction list)."""

    label: str
    start: int
    end: int
    counts: dict[str, int]

    @property
    def length(self) -> int:
        return self.end - self.start + 1


def loops(sass: str) -> list[Loop]:
    """Innermost loops of one kernel's SASS, in program order."""
    instrs: list[str] = []
    labels: dict[str, int] = {}
    branches: list[tuple[int, str]] = []
    for line in sass.splitlines():
        if m := _LABEL.match(line.strip()):
            labels[m.group(1)] = len(instrs)
        elif m := _INSTR.match(line):
            text = m.group(2)
            if b := _BRANCH.search(text):
                branches.append((len(instrs), b.group(1)))
            instrs.append(text)
    found = [(labels[t], at, t) for at, t in branches if t in labels and labels[t] <= at]
    inner = [x for x in found
             if not any(y is not x and x[0] <= y[0] and y[1] <= x[1] for y in found)]
    out = []
    for start, end, label in sorted(inner):
        body = instrs[start:end + 1]
        counts = {k: sum(bool(rx.search(i)) for i in body) for k, rx in KINDS.items()}
        out.append(Loop(label, start, end, counts))
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("sass", type=Path, nargs="+")
    opts = parser.parse_args(argv)
    for path in opts.sass:
        print(path.name)
        for loop in loops(path.read_text()):
            kinds = " ".join(f"{k}={v}" for k, v in loop.counts.items())
            print(f"  {loop.label:<10} {loop.length:>5} instructions  {kinds}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
