"""Every package of the source tree is installed by a plain (non-editable) ``pip install .``."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _setup_packages() -> set[str]:
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "packages":
            return {ast.literal_eval(e) for e in node.value.elts}  # type: ignore[attr-defined]
    raise AssertionError("setup.py passes no packages=")


def test_setup_lists_every_subpackage() -> None:
    found = {".".join(p.parent.relative_to(ROOT).parts)
             for p in (ROOT / "specengine").rglob("__init__.py")}
    found.add("specengine.kernels")  # installed from kernels/ (package_dir)
    assert (ROOT / "kernels" / "__init__.py").exists()
    assert _setup_packages() == found
