"""The README's fenced code blocks, found by the heading above them, and run as written."""

from __future__ import annotations

import re
from pathlib import Path

README = (Path(__file__).resolve().parent.parent / "README.md").read_text()


def readme_block(heading: str, lang: str = "python") -> str:
    """The first fenced ``lang`` block after the line starting with ``heading`` (give a
    trailing newline to match the whole heading line)."""
    at = README.index(f"\n{heading}")
    match = re.compile(rf"```{lang}\n(.*?)```", re.S).search(README, at)
    assert match is not None, f"no ```{lang} block under {heading!r}"
    return match.group(1)


def run_readme_blocks(*headings: str) -> dict[str, object]:
    """Run the Python blocks under ``headings`` in order in one namespace; return it."""
    ns: dict[str, object] = {"__name__": "readme_example"}
    for heading in headings:
        exec(compile(readme_block(heading), f"README.md ({heading.strip()})", "exec"), ns)
    return ns
