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


def test_blocks_per_sm_arithmetic() -> None:
    """Hand-computed occupancy at the sm_90a / sm_100a limits (65,536 registers in 4
    sub-partitions, 256-register warp units, 228 KB shared memory with 1 KB reserved per
    block and 227 KB per block at most, 2,048 threads, 32 blocks)."""
    blocks = _script_module().blocks_per_sm
    # 164 registers -> 168 x 32 = 5,376 per warp; 16,384 // 5,376 = 3 warps per
    # sub-partition, 12 per SM, 3 blocks of 4 warps (shared memory: 233,472 // 40,448 = 5).
    assert blocks(164, 4, 39_424) == (3, "registers")
    # 249 -> 256 x 32 = 8,192 per warp: 2 per sub-partition, 8 per SM: 2 blocks of 4 warps.
    assert blocks(249, 4, 73_728) == (2, "registers")
    assert blocks(255, 8, 0) == (1, "registers")
    # 64 registers, 4 warps (8 blocks by registers, 16 by threads); 100,000 B + 1 KB rounds
    # up to 101,120 B: 233,472 // 101,120 = 2 blocks.
    assert blocks(64, 4, 100_000) == (2, "smem")
    assert blocks(64, 4, 114 * 1024) == (1, "smem")  # 2 would fit but for the runtime's 1 KB
    assert blocks(64, 4, 227 * 1024) == (1, "smem")  # the most one block may use
    assert blocks(64, 4, 227 * 1024 + 1) == (0, "smem")  # cannot launch at all
    # 41 registers -> 1,312 per warp, rounded up to 1,536: 10 warps per sub-partition, 40
    # per SM, 20 blocks of 2 warps (24 without the 256-register unit).
    assert blocks(41, 2, 0) == (20, "registers")
    # 200 -> 6,400 per warp: 2 per sub-partition, 8 per SM (65,536 // 6,400 would say 10).
    assert blocks(200, 1, 0) == (8, "registers")
    assert blocks(32, 4, 2048) == (16, "threads")  # 2,048 threads // 128
    assert blocks(16, 1, 0) == (32, "blocks")  # 64 by threads and registers, capped at 32
    with pytest.raises(ValueError, match="registers >= 1"):
        blocks(0, 4, 0)


@pytest.mark.skipif(_ptxas_path() is None, reason="Triton's bundled ptxas is unavailable")
def test_compile_moe_combine_kernel_for_sm90(tmp_path: Path) -> None:
    module = _script_module()
    out = tmp_path / "table.json"
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", "_moe_combine_kernel", "--targets", "90",
         "--jobs", "1", "--json", str(out)],
        env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    table = json.loads(out.read_text())
    assert table["errors"] == []
    rows = table["rows"]
    assert rows and {r["target"] for r in rows} == {"sm_90a"}
    assert {r["kernel"] for r in rows} == {"_moe_combine_kernel"}
    for row in rows:
        assert isinstance(row["registers"], int) and 0 < row["registers"] <= 255, row
        assert row["spill_stores"] == 0 and row["spill_loads"] == 0, row
        assert row["shared_bytes"] >= 0
        assert (row["blocks_per_sm"], row["occupancy_limit"]) == module.blocks_per_sm(
            row["registers"], row["num_warps"], row["shared_bytes"])
        assert row["blocks_per_sm"] >= 1
    assert table["triton"]
    assert "sm_90a" in proc.stdout and "_moe_combine_kernel" in proc.stdout  # the printed table
    assert "blocks/SM" in proc.stdout


def _sass_loops_module():
    spec = importlib.util.spec_from_file_location("sass_loops_under_test",
                                                  ROOT / "scripts" / "sass_loops.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def test_sass_loops_finds_innermost_loops() -> None:
    sass = """
        /*0000*/                   MOV R1, c[0x0][0x28] ;
.L_x_0:
        /*0010*/                   LDG.E R2, desc[UR4][R4.64] ;
.L_x_1:
        /*0020*/                   MUFU.EX2 R3, R2 ;
        /*0030*/                   F2I.FTZ.S64.FLOOR R6, R3 ;
        /*0040*/              @!P0 BRA `(.L_x_1) ;
        /*0050*/              @!P1 BRA `(.L_x_0) ;
        /*0060*/                   BRA `(.L_x_2) ;
.L_x_2:
        /*0070*/                   EXIT ;
"""
    (inner,) = _sass_loops_module().loops(sass)  # the outer loop and the forward branch: no
    assert (inner.label, inner.length) == (".L_x_1", 3)
    assert inner.counts == {"exp": 1, "log": 0, "cvt64": 1, "load": 0, "store": 0}


def _sm90_sass(tmp_path: Path, only: str, kernel: str) -> str:
    """The sm_90a SASS of ``kernel`` as ``compile_kernels.py --only ONLY`` compiles it (one
    variant), in a process of its own (this one runs the interpreter's kernels)."""
    asm = tmp_path / "asm"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--only", only, "--targets", "90", "--jobs", "1",
         "--json", str(tmp_path / "table.json"), "--asm", str(asm)],
        env=dict(os.environ, OMP_NUM_THREADS="1"), cwd=ROOT, capture_output=True, text=True,
        timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    (sass,) = asm.glob(f"{kernel}.sm_90a.*.sass")
    return sass.read_text()


@pytest.mark.skipif(_ptxas_path() is None, reason="Triton's bundled ptxas is unavailable")
def test_top_p_search_computes_each_token_once(tmp_path: Path) -> None:
    """Issue 35: in the compiled sm_90a top-p search, each token's load, exp and 64-bit
    conversion happen once per pass (they ran on all 16 pivot lanes: 18 of each and ~455
    instructions per token), and a pass costs under 100 instructions per token. A pass
    handles 4 tiles of 128 tokens per step on 128 threads: 4 tokens per thread per loop."""
    sass = _sm90_sass(tmp_path, "fp32 keep_threshold B", "_keep_threshold_kernel")
    assert len(list((tmp_path / "asm").glob("*.ptx"))) == 1
    loops = _sass_loops_module().loops(sass)
    # the top-p pivot passes (over the row, then over the candidate buffer): the loops with
    # 64-bit conversions (the fixed-point weights) that store nothing (pass 1's tile loop
    # stores each tile's statistics)
    passes = [x for x in loops if x.counts["cvt64"] and x.counts["load"]
              and not x.counts["store"]]
    assert len(passes) == 2, loops
    tokens = 4
    for x in passes:
        assert x.counts["load"] == x.counts["exp"] == x.counts["cvt64"] == tokens, x
        assert x.length <= 100 * tokens, x


@pytest.mark.skipif(_ptxas_path() is None, reason="Triton's bundled ptxas is unavailable")
def test_split_search_pivot_pass_computes_each_token_once(tmp_path: Path) -> None:
    """Issue 35 at small batch: the split search's pivot pass over one part of a row
    (``_search_pivot_kernel``) also loads, exponentiates and converts each token once in its
    top-p loop; with the per-pivot counts the compaction's offsets need it stays under 125
    instructions per token (one program's pass: under 100)."""
    sass = _sm90_sass(tmp_path, "fp32 keep_threshold+min-p B=1 split-vocab",
                      "_search_pivot_kernel")
    loops = _sass_loops_module().loops(sass)
    (top_p,) = [x for x in loops if x.counts["cvt64"] and x.counts["load"]]
    tokens = 4  # 4 tiles of 128 tokens per step on 128 threads
    assert top_p.counts["load"] == top_p.counts["exp"] == top_p.counts["cvt64"] == tokens
    assert top_p.length <= 125 * tokens, top_p


@pytest.mark.skipif(_ptxas_path() is None, reason="Triton's bundled ptxas is unavailable")
def test_sampler_first_pass_costs_one_exp_and_one_conversion_per_token(tmp_path: Path) -> None:
    """Issue 35, the rejection sampler at top_p = 1: pass 1 over a sampled row (here the split
    pass of ``_part_kernel``, the same device code as one program's ``first_pass``) computes
    per token one exp and one 64-bit conversion (its tile mass) and no random numbers or
    logarithms: the two-level draw's tile races run after the pass, over all tiles at once,
    and its token race inside one tile. The token race over every token cost about 100
    instructions per token (Philox and two precise logarithms: 1,605 per loop); now under
    24. A loop is one tile of 2,048 tokens on 128 threads: 16 per thread."""
    sass = _sm90_sass(tmp_path, "_part_kernel bf16 chain k+1=4 B=1 split-vocab", "_part_kernel")
    loops = _sass_loops_module().loops(sass)
    (sampled,) = [x for x in loops if x.counts["cvt64"] and x.counts["load"]]  # the tile loop
    tokens = 16
    # per tile, not per token: the chain child's mass (1 exp, 1 conversion)
    assert tokens <= sampled.counts["exp"] <= tokens + 2, sampled
    assert tokens <= sampled.counts["cvt64"] <= tokens + 2, sampled
    assert sampled.length <= 24 * tokens, sampled
