"""Compile every Triton kernel of ``kernels/`` for sm_90a and sm_100a, with no GPU; fail on spills.

Each configuration runs the real launcher (``paged_attention``, ``rejection_sample``, ...) on
meta-device tensors at Qwen3-8B shapes while ``JITFunction.run`` is replaced by a recorder, so
the grid, constexprs and ``num_warps`` are exactly the ones the launcher picks. Every recorded
launch then goes through Triton's own argument binder and specialisation (as ``JITFunction.run``
does) and ``triton.compile`` for each target; Triton's bundled ptxas reports registers and
spills. Prints one table per target, writes ``benchmarks/out/compile_table.json`` and exits 1
if any kernel fails to compile or spills, or if a launched kernel has no configuration.

A kernel file adds its own configurations with a module-level ``aot_configs()`` returning
``[(label, call), ...]`` where ``call()`` runs its launcher on meta tensors (see
``compile_configs.py`` for the built-in ones).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import io
import json
import logging
import multiprocessing
import os
import re
import subprocess
import sys
import tempfile
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger("compile_kernels")
ROOT = Path(__file__).resolve().parent.parent
TARGETS = (90, 100)
_USED = re.compile(r"Used (\d+) registers")
_SPILL = re.compile(r"(\d+) bytes stack frame, (\d+) bytes spill stores, (\d+) bytes spill loads")


@dataclass(frozen=True)
class Launch:
    """One recorded kernel launch: the JIT function and the arguments the launcher gave it."""

    labels: tuple[str, ...]  # every configuration that launches this exact variant
    kernel: object  # triton.runtime.jit.JITFunction
    args: tuple
    kwargs: dict


@dataclass(frozen=True)
class SmLimits:
    """Per-SM resources that bound how many blocks (Triton programs) run at once. sm_90 and
    sm_100 share them (NVIDIA's Hopper and Blackwell tuning guides, the CUDA C++ programming
    guide's compute-capability table and its occupancy calculator)."""

    registers: int = 65_536  # 32-bit registers per SM, in 4 sub-partitions of 16,384
    sub_partitions: int = 4  # a warp's registers come from one sub-partition
    register_unit: int = 256  # registers are allocated per warp in units of 256
    shared_bytes: int = 228 * 1024  # shared memory per SM (the largest carve-out)
    shared_per_block: int = 227 * 1024  # the most one block may use
    shared_reserved: int = 1024  # the CUDA runtime keeps 1 KB per resident block
    shared_unit: int = 128  # shared memory is allocated in 128-byte units
    max_blocks: int = 32
    max_threads: int = 2048  # 64 warps


SM_LIMITS = {90: SmLimits(), 100: SmLimits()}


def blocks_per_sm(registers: int, num_warps: int, shared_bytes: int,
                  limits: SmLimits = SmLimits()) -> tuple[int, str]:
    """Resident blocks per SM and the resource that bounds them (``threads``, ``registers``,
    ``smem`` or ``blocks``), as the CUDA occupancy calculator computes it:

    - threads: ``max_threads // (32 · num_warps)``;
    - registers: a warp takes ``ceil(32 · registers / 256) · 256`` registers from one
      sub-partition of ``65,536 / 4``; warps that fit = ``4 · (16,384 // per_warp)``, blocks =
      that ``// num_warps``;
    - smem: each block takes its bytes plus the runtime's 1 KB, rounded up to 128 B, of 228 KB;
      a block over 227 KB cannot launch (0);
    - and at most 32 blocks.
    """
    if registers < 1 or num_warps < 1 or shared_bytes < 0:
        raise ValueError(f"need registers >= 1, num_warps >= 1, shared_bytes >= 0; got "
                         f"{registers}, {num_warps}, {shared_bytes}")
    unit = limits.register_unit
    per_warp = -(-32 * registers // unit) * unit
    warps_by_regs = limits.sub_partitions * (limits.registers // limits.sub_partitions
                                             // per_warp)
    bounds = {"threads": limits.max_threads // (32 * num_warps),
              "registers": warps_by_regs // num_warps,
              "blocks": limits.max_blocks}
    if shared_bytes > limits.shared_per_block:
        bounds["smem"] = 0
    elif shared_bytes:
        per_block = -(-(shared_bytes + limits.shared_reserved) // limits.shared_unit)
        bounds["smem"] = limits.shared_bytes // (per_block * limits.shared_unit)
    limiter = min(bounds, key=lambda k: bounds[k])
    return bounds[limiter], limiter


def parse_ptxas_log(text: str) -> dict[str, int]:
    """Registers, stack frame and spill bytes from ``ptxas -v`` output of one entry function."""
    used, spill = _USED.findall(text), _SPILL.findall(text)
    if len(used) != 1 or len(spill) != 1:
        raise ValueError(f"expected one ptxas report, found {len(used)} register and "
                         f"{len(spill)} spill lines in:\n{text}")
    stack, stores, loads = (int(x) for x in spill[0])
    return {"registers": int(used[0]), "stack_bytes": stack, "spill_stores": stores,
            "spill_loads": loads}


def record_launches(call: Callable[[], object]) -> list[tuple[object, tuple, dict]]:
    """Run ``call`` with every Triton launch recorded instead of run: [(kernel, args, kwargs)]."""
    from triton.runtime.jit import JITFunction

    from specengine.kernels import value_checks

    seen: list[tuple[object, tuple, dict]] = []

    def record(self, *args, grid, warmup, **kwargs):
        seen.append((self, args, kwargs))

    original = JITFunction.run
    JITFunction.run = record
    try:
        with value_checks(False):  # meta tensors have no values to check
            call()
    finally:
        JITFunction.run = original
    return seen


def _bind(kernel, args: tuple, kwargs: dict, capability: int):
    """What ``JITFunction.run`` builds before compiling, for ``capability`` instead of the
    current device: (target, ASTSource, options)."""
    from triton import knobs
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature

    target = GPUTarget("cuda", capability, 32)
    backend = make_backend(target)
    kwargs = dict(kwargs)
    kwargs["debug"] = kwargs.get("debug", kernel.debug) or knobs.runtime.debug
    for name in ("instrumentation_mode", "fpsan_homomorphic_casts"):  # as run() in 3.9
        if hasattr(knobs.compilation, name):
            kwargs[name] = getattr(knobs.compilation, name)
    binder = create_function_from_signature(kernel.signature, kernel.params, backend)
    bound, specialization, options = binder(*args, **kwargs)
    options, signature, constexprs, attrs = kernel._pack_args(backend, kwargs, bound,
                                                              specialization, options)
    return target, ASTSource(kernel, signature, constexprs, attrs), options, specialization


def variant_key(kernel, args: tuple, kwargs: dict) -> str:
    """Identity of the compiled variant (same key: same binary)."""
    *_, options, specialization = _bind(kernel, args, kwargs, TARGETS[0])
    return f"{kernel.__name__}|{specialization}|{sorted(options.__dict__.items())}"


def disassemble(cubin: bytes, capability: int) -> str:
    """SASS of a cubin, from the ``nvdisasm`` bundled with Triton next to its ptxas."""
    from triton.backends.nvidia.compiler import get_ptxas

    tool = Path(get_ptxas(capability).path).with_name("nvdisasm")
    with tempfile.NamedTemporaryFile(suffix=".cubin") as f:
        f.write(cubin)
        f.flush()
        return subprocess.run([str(tool), "-c", f.name], capture_output=True, text=True,
                              check=True).stdout


def compile_launch(launch: Launch, capability: int, asm_dir: Path | None = None,
                   asm_name: str = "") -> dict:
    """Compile one launch for sm_<capability>a; its ptxas stats and shared memory. With
    ``asm_dir``, also writes ``<asm_name>.ptx`` and ``<asm_name>.sass`` there."""
    import triton

    target, src, options, _ = _bind(launch.kernel, launch.args, launch.kwargs, capability)
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        compiled = triton.compile(src, target=target, options=options.__dict__)
    if asm_dir is not None:
        asm_dir.mkdir(parents=True, exist_ok=True)
        (asm_dir / f"{asm_name}.ptx").write_text(compiled.asm["ptx"])
        (asm_dir / f"{asm_name}.sass").write_text(disassemble(compiled.asm["cubin"], capability))
    stats = parse_ptxas_log(out.getvalue())
    stats["shared_bytes"] = int(compiled.metadata.shared)
    stats["num_warps"] = int(compiled.metadata.num_warps)
    stats["num_stages"] = int(compiled.metadata.num_stages)
    stats["blocks_per_sm"], stats["occupancy_limit"] = blocks_per_sm(
        stats["registers"], stats["num_warps"], stats["shared_bytes"], SM_LIMITS[capability])
    return stats


def kernel_modules() -> list[str]:
    """Every kernel module of ``kernels/`` except the PyTorch references."""
    names = sorted(p.stem for p in (ROOT / "kernels").glob("*.py"))
    return [n for n in names if not n.startswith(("reference", "_"))]


def entry_kernels(module) -> set[str]:
    """Names of the @triton.jit functions a module launches (written ``name[grid](...)``)."""
    from triton.runtime.jit import JITFunction

    text = Path(module.__file__).read_text()
    return {name for name, obj in vars(module).items()
            if isinstance(obj, JITFunction) and obj.fn.__module__ == module.__name__
            and re.search(rf"\b{re.escape(name)}\[", text)}


def collect() -> tuple[list[Launch], list[str]]:
    """Unique launches of every configuration, and the errors found (uncovered kernels)."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import compile_configs

    configs: list[tuple[str, Callable[[], object]]] = list(compile_configs.builtin_configs())
    entries: set[str] = set()
    for name in kernel_modules():
        module = importlib.import_module(f"specengine.kernels.{name}")
        entries |= {f"{name}.{k}" for k in entry_kernels(module)}
        hook = getattr(module, "aot_configs", None)
        if hook is not None:
            configs += [(f"{name}: {label}", call) for label, call in hook()]
    by_key: dict[str, Launch] = {}
    launched: set[str] = set()
    for label, call in configs:
        for kernel, args, kwargs in record_launches(call):
            launched.add(f"{kernel.fn.__module__.rsplit('.', 1)[-1]}.{kernel.__name__}")
            key = variant_key(kernel, args, kwargs)
            old = by_key.get(key)
            labels = (*old.labels, label) if old else (label,)
            by_key[key] = Launch(labels, kernel, args, kwargs)
    errors = [f"{k}: launched by kernels/ but no configuration compiles it (add it to an "
              "aot_configs() in its module)" for k in sorted(entries - launched)]
    return list(by_key.values()), errors


_LAUNCHES: list[Launch] = []  # set before the pool forks; workers index into it
_ASM_DIR: list[Path] = []  # --asm, likewise


def asm_name(launch: Launch, capability: int) -> str:
    """File stem of a variant's PTX / SASS: kernel, target and its first configuration."""
    label = re.sub(r"[^A-Za-z0-9=+.-]+", "_", launch.labels[0]).strip("_")
    return f"{launch.kernel.__name__}.sm_{capability}a.{label}"


def _work(job: tuple[int, int]) -> tuple[int, int, dict | str, float]:
    index, capability = job
    start = time.perf_counter()
    try:
        launch = _LAUNCHES[index]
        result: dict | str = compile_launch(launch, capability,
                                            _ASM_DIR[0] if _ASM_DIR else None,
                                            asm_name(launch, capability))
    except Exception as e:  # reported in the table; the run fails at the end
        result = f"{type(e).__name__}: {str(e).strip().splitlines()[0][:300]}"
    return index, capability, result, time.perf_counter() - start


def _table(rows: list[dict], capability: int) -> str:
    head = (f"{'kernel':<24} {'configuration':<58} {'regs':>5} {'spill st/ld B':>14} "
            f"{'smem B':>8} {'w/s':>4} {'blocks/SM':>15}")
    lines = [f"== sm_{capability}a ==", head, "-" * len(head)]
    for r in rows:
        if r["target"] != f"sm_{capability}a":
            continue
        if "error" in r:
            lines.append(f"{r['kernel']:<24} {r['config']:<58} FAILED: {r['error']}")
            continue
        spill = f"{r['spill_stores']}/{r['spill_loads']}"
        flag = "  <-- SPILLS" if r["spill_stores"] or r["spill_loads"] else ""
        occupancy = f"{r['blocks_per_sm']} ({r['occupancy_limit']})"
        lines.append(f"{r['kernel']:<24} {r['config'][:58]:<58} {r['registers']:>5} "
                     f"{spill:>14} {r['shared_bytes']:>8} "
                     f"{r['num_warps']:>2}/{r['num_stages']:<1} {occupancy:>15}{flag}")
    return "\n".join(lines)


def prepare_env() -> None:
    """Before any kernel module is imported: compile the GPU variants (``TRITON_INTERPRET``
    also changes launcher choices such as ``_SBLOCK``), and have Triton print ptxas's log on
    every compile, cached or not (it is captured per compile)."""
    os.environ.pop("TRITON_INTERPRET", None)
    os.environ["TRITON_DUMP_PTXAS_LOG"] = "1"
    os.environ["TRITON_ALWAYS_COMPILE"] = "1"
    if "specengine.kernels.attention" in sys.modules:
        raise RuntimeError("kernel modules were imported before prepare_env(): run this as a "
                           "script, not from a process that already loaded the kernels")


def main(argv: list[str] | None = None) -> int:
    """Compile all, print the tables, write the JSON; 0 when nothing failed or spilled."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--targets", type=int, nargs="+", default=list(TARGETS))
    parser.add_argument("--only", default="",
                        help="keep the variants whose 'kernel configuration' contains this")
    parser.add_argument("--jobs", type=int, default=2)
    parser.add_argument("--json", type=Path, default=ROOT / "benchmarks/out/compile_table.json")
    parser.add_argument("--asm", type=Path, default=None,
                        help="also write each variant's PTX and SASS into this folder")
    opts = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    # Triton 3.9 notes that its FP-fusion default will change; the default (fusion on, as on
    # the GPU machines' Triton 3.6) is what launches get, so it is what is compiled here.
    warnings.filterwarnings("ignore", message="TRITON_DEFAULT_FP_FUSION")
    start = time.perf_counter()
    prepare_env()
    launches, errors = collect()
    launches = [x for x in launches
                if any(opts.only in f"{x.kernel.__name__} {label}" for label in x.labels)]
    if not launches:
        log.error("no kernel matches --only %r", opts.only)
        return 1
    _LAUNCHES[:] = launches
    _ASM_DIR[:] = [opts.asm] if opts.asm is not None else []
    jobs = [(i, c) for i in range(len(launches)) for c in opts.targets]
    import triton

    log.info("compiling %d kernel variants for %s with %d processes, Triton %s from %s",
             len(launches), ", ".join(f"sm_{c}a" for c in opts.targets), opts.jobs,
             triton.__version__, Path(triton.__file__).parent)
    results = []
    with contextlib.ExitStack() as stack:
        if opts.jobs > 1:
            pool = stack.enter_context(multiprocessing.get_context("fork").Pool(opts.jobs))
            done = pool.imap_unordered(_work, jobs)
        else:
            done = map(_work, jobs)
        for index, capability, result, seconds in done:
            results.append((index, capability, result, seconds))
            log.info("[%d/%d] %.1f s  sm_%da %s %s", len(results), len(jobs), seconds,
                     capability, launches[index].kernel.__name__, launches[index].labels[0])
    rows = []
    for index, capability, result, seconds in sorted(results, key=lambda r: (r[1], r[0])):
        launch = launches[index]
        more = f" (+{len(launch.labels) - 1} more)" if len(launch.labels) > 1 else ""
        row = {"kernel": launch.kernel.__name__, "config": launch.labels[0] + more,
               "all_configs": list(launch.labels),
               "target": f"sm_{capability}a", "compile_s": round(seconds, 2)}
        row.update(result if isinstance(result, dict) else {"error": result})
        rows.append(row)
        if isinstance(result, str):
            errors.append(f"{row['kernel']} [{row['config']}] on {row['target']}: {result}")
        elif result["spill_stores"] or result["spill_loads"]:
            errors.append(f"{row['kernel']} [{row['config']}] on {row['target']} spills "
                          f"{result['spill_stores']} B stores / {result['spill_loads']} B loads")
    print(f"Triton {triton.__version__}; w/s: num_warps/num_stages; blocks/SM: resident "
          "blocks per SM from registers, warps and shared memory (blocks_per_sm), with the "
          "resource that bounds them", end="\n\n")
    for capability in opts.targets:
        print(_table(rows, capability), end="\n\n")
    opts.json.parent.mkdir(parents=True, exist_ok=True)
    opts.json.write_text(json.dumps({"triton": triton.__version__, "rows": rows,
                                     "errors": errors}, indent=1))
    log.info("%d compiles in %.0f s; table in %s", len(rows), time.perf_counter() - start,
             opts.json)
    for e in errors:
        log.error("FAIL %s", e)
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
