"""``scripts/compile_kernels.py`` compiles a real kernel for sm_90a and parses ptxas's report.

The script runs in its own process: this session's kernels are the Triton interpreter's
(conftest sets ``TRITON_INTERPRET``), and the script must compile the GPU variants.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "scripts" / "compile_kernels.py"


def _ptxas_path() -> str | None:
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        path = get_ptxas(90).path
    except Exception:  # no NVIDIA backend or no bundled ptxas: nothing to compile with
        return None
    return path if path and os.path.exists(path) else None


def _script_module():
    spec = importlib.util.spec_from_file_location("compile_kernels_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


def test_parse_ptxas_log() -> None:
    parse = _script_module().parse_ptxas_log
    log = ("ptxas info    : Compiling entry function '_k' for 'sm_90a'\n"
           "ptxas info    : Function properties for _k\n"
           "    8 bytes stack frame, 20 bytes spill stores, 12 bytes spill loads\n"
           "ptxas info    : Used 255 registers, used 1 barriers, 392 bytes cmem[0]\n")
    assert parse(log) == {"registers": 255, "stack_bytes": 8, "spill_stores": 20,
                          "spill_loads": 12}
    with pytest.raises(ValueError, match="expected one ptxas report"):
        parse("ptxas info    : 0 bytes gmem\n")
    with pytest.raises(ValueError, match="expected one ptxas report"):
        parse(log + log)  # two entry functions in one module: ambiguous


@pytest.mark.skipif(_ptxas_path() is None, reason="Triton's bundled ptxas is unavailable")
def test_compile_combine_kernel_for_sm90(tmp_path: Path) -> None:
    out = tmp_path / "table.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "_combine_kernel", "--targets", "90",
         "--jobs", "1", "--json", str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = json.loads(out.read_text())
    assert table["errors"] == []
    rows = table["rows"]
    assert rows and {r["target"] for r in rows} == {"sm_90a"}
    assert {r["kernel"] for r in rows} == {"_combine_kernel"}
    for row in rows:
        assert isinstance(row["registers"], int) and 0 < row["registers"] <= 255, row
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        assert row["shared_bytes"] >= 0
    assert "sm_90a" in proc.stdout and "_combine_kernel" in proc.stdout  # the printed table
