"""The package's layout rules (issue 24, docs/design.md §2), checked on the source.

- No runtime import cycles among ``specengine``'s modules (module-level and function-level
  imports; ``if TYPE_CHECKING:`` imports are annotations and do not count).
- Nothing inside the package imports the package root's names (``from specengine import X``).
- No module reads a private attribute (``obj._name``) that only another module defines.
- ``kernels/`` imports nothing of the engine.
- ``lint-imports`` keeps the layer contracts in ``pyproject.toml``, and breaks on a planted
  upward import.
Each rule's checker is also run on a small planted tree, so a checker that sees nothing fails.
"""

from __future__ import annotations

import ast
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PKG = ROOT / "specengine"


def _modules(pkg: Path) -> dict[str, Path]:
    out = {}
    for path in sorted(pkg.rglob("*.py")):
        parts = list(path.relative_to(pkg.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


class _Imports(ast.NodeVisitor):
    """Runtime imports of one module: everything but the body of ``if TYPE_CHECKING:``."""

    def __init__(self) -> None:
        self.nodes: list[ast.Import | ast.ImportFrom] = []

    def visit_If(self, node: ast.If) -> None:
        if "TYPE_CHECKING" in ast.unparse(node.test):
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        self.nodes.append(node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        self.nodes.append(node)


def _runtime_imports(path: Path) -> list[ast.Import | ast.ImportFrom]:
    v = _Imports()
    v.visit(ast.parse(path.read_text()))
    return v.nodes


def import_graph(pkg: Path) -> dict[str, set[str]]:
    """Module → the package's modules it imports at run time (a submodule import also runs
    its parent packages' ``__init__``, so it counts as importing them too)."""
    mods = _modules(pkg)
    graph: dict[str, set[str]] = {}
    for name, path in mods.items():
        is_pkg = path.name == "__init__.py"
        deps: set[str] = set()
        for node in _runtime_imports(path):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = name.split(".") if is_pkg else name.split(".")[:-1]
                    base = base[: len(base) - (node.level - 1)]
                    src = ".".join(base + ([node.module] if node.module else []))
                else:
                    src = node.module or ""
                for alias in node.names:
                    full = f"{src}.{alias.name}"
                    deps.add(full if full in mods else src)
            else:
                deps.update(alias.name for alias in node.names)
        expanded = set()
        for dep in deps:
            parts = dep.split(".")
            expanded.update(".".join(parts[:i]) for i in range(1, len(parts) + 1))
        own_parents = {".".join(name.split(".")[:i]) for i in range(1, name.count(".") + 2)}
        graph[name] = {d for d in expanded if d in mods} - own_parents
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []
    counter = 0
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on_stack.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                elif nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                scc = []
                while True:
                    m = stack.pop()
                    on_stack.discard(m)
                    scc.append(m)
                    if m == node:
                        break
                if len(scc) > 1:
                    cycles.append(sorted(scc))
    return cycles


def root_imports(pkg: Path) -> list[str]:
    """``from specengine import X`` (X not a submodule nor the extension ``_C``) or a bare ``import
    specengine`` inside the package, outside its ``__init__``."""
    root = pkg.name
    mods = _modules(pkg)
    hits = []
    for name, path in mods.items():
        if name == root:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module == root and not node.level:
                hits += [f"{name}:{node.lineno} from {root} import {a.name}"
                         for a in node.names  # a submodule (or the extension) is no root name
                         if a.name != "_C" and f"{root}.{a.name}" not in mods]
            elif isinstance(node, ast.Import):
                hits += [f"{name}:{node.lineno} import {root}" for a in node.names
                         if a.name == root]
    return hits


def _defined_privates(tree: ast.AST) -> set[str]:
    """Private names a module defines: functions, classes, attributes it assigns."""
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            names.add(node.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
            names.add(node.attr)
        elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
            names.add(node.id)
    return {n for n in names if n.startswith("_") and not n.startswith("__")}


def private_reads(pkg: Path) -> list[str]:
    """Reads of ``obj._name`` (obj not ``self`` / ``cls``) or imports of ``_name`` where
    ``_name`` is defined only in other modules of the package (private names of third-party
    objects, such as ``os._exit``, are not the package's and are not counted)."""
    trees = {name: ast.parse(path.read_text()) for name, path in _modules(pkg).items()}
    defined = {name: _defined_privates(tree) for name, tree in trees.items()}
    hits = []
    for name, tree in trees.items():
        elsewhere = set().union(*(d for m, d in defined.items() if m != name)) - defined[name]
        for node in ast.walk(tree):
            if isinstance(node, ast.Attribute) and node.attr in elsewhere:
                if isinstance(node.value, ast.Name) and node.value.id in ("self", "cls"):
                    continue
                hits.append(f"{name}:{node.lineno} {ast.unparse(node)}")
            elif isinstance(node, ast.ImportFrom):
                hits += [f"{name}:{node.lineno} import {a.name}" for a in node.names
                         if a.name in elsewhere]
    return hits


# ---- the rules on the real package ----------------------------------------------------------
def test_no_runtime_import_cycles() -> None:
    graph = import_graph(PKG)
    assert len(graph) > 80 and any(graph.values())  # the scan saw the package
    assert import_cycles(graph) == []


def test_nothing_inside_imports_the_package_root() -> None:
    assert root_imports(PKG) == []


def test_no_module_reads_another_modules_private_attributes() -> None:
    assert private_reads(PKG) == []


def test_kernels_import_nothing_of_the_engine() -> None:
    """Kernels sit at the bottom: only other kernels and the ``_C`` extension."""
    bad = [f"{path.name}: {ast.unparse(node)}"
           for path in sorted((ROOT / "kernels").glob("*.py"))
           for node in ast.walk(ast.parse(path.read_text()))
           if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("specengine")
           and not (node.module or "").startswith("specengine.kernels")
           and [a.name for a in node.names] != ["_C"]]  # the extension sits below everything
    assert bad == []


# ---- each checker finds what it exists for ------------------------------------------------------
def _plant(tmp_path: Path, files: dict[str, str]) -> Path:
    pkg = tmp_path / "pkg"
    for rel, text in files.items():
        (pkg / rel).parent.mkdir(parents=True, exist_ok=True)
        (pkg / rel).write_text(text)
    return pkg


def test_checkers_find_planted_cycles_root_imports_and_private_reads(tmp_path: Path) -> None:
    pkg = _plant(tmp_path, {
        "__init__.py": "",
        "a.py": "from pkg.b import f\n_hidden = 1\n",
        "b.py": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import c\n"
                 "def f():\n    from pkg.a import _hidden\n    return _hidden\n"),
        "c.py": "import pkg.d\n",
        "d.py": "from pkg import thing\nclass K:\n    def __init__(self):\n"
                "        self._mine = 1\n",
        "e.py": "import pkg.d as d\ndef g(k):\n    return k._mine, d.K()._mine\n",
    })
    graph = import_graph(pkg)
    assert import_cycles(graph) == [["pkg.a", "pkg.b"]]  # b -> c is TYPE_CHECKING only
    assert root_imports(pkg) == ["pkg.d:1 from pkg import thing"]
    assert private_reads(pkg) == ["pkg.b:5 import _hidden", "pkg.e:3 k._mine",
                                  "pkg.e:3 d.K()._mine"]


@pytest.fixture(scope="module")
def lint_imports() -> str:
    pytest.importorskip("importlinter", reason="import-linter is in the test extras")
    exe = shutil.which("lint-imports")
    if exe is None:
        pytest.skip("lint-imports is not on PATH")
    return exe


def _lint(exe: str, tree: Path) -> subprocess.CompletedProcess:
    env = {"PYTHONPATH": str(tree), "PATH": str(Path(sys.executable).parent)}
    return subprocess.run([exe, "--config", str(tree / "pyproject.toml")], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def test_layer_contracts_hold_and_break_on_a_planted_upward_import(lint_imports: str,
                                                                    tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    shutil.copytree(PKG, tree / "specengine",
                    ignore=shutil.ignore_patterns("__pycache__", "*.so", "kernels"))
    shutil.copy(ROOT / "pyproject.toml", tree / "pyproject.toml")
    kept = _lint(lint_imports, tree)
    assert kept.returncode == 0, kept.stdout + kept.stderr
    assert "0 broken" in kept.stdout
    # A model module that reaches up into the engine core: the layers contract breaks.
    rope = tree / "specengine" / "model" / "rope.py"
    rope.write_text(rope.read_text() + "\nfrom specengine.core import scheduler  # noqa\n")
    broken = _lint(lint_imports, tree)
    assert broken.returncode != 0
    assert "specengine.model.rope -> specengine.core.scheduler" in broken.stdout
