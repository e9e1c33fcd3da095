"""The native extension ``specengine._C`` checked against the device an engine will run on.

``_C`` always has the host code (block allocator, step metadata, host KV ops); its CUDA kernels
(``reshape_and_cache_cuda``, ``compact_kv_cuda``) are compiled only when the build found
``nvcc`` and ``SPECENGINE_NO_CUDA`` was not set (setup.py, CMakeLists.txt). An engine on a CUDA
device with a host-only ``_C`` would otherwise first fail deep inside the first verify step
with an ``AttributeError``; :func:`check_native` says so at engine start, with the fix.
"""

from __future__ import annotations

import re
from types import ModuleType

import torch

# The entry points csrc/bindings.cpp defines only under SPECENGINE_WITH_CUDA.
CUDA_ENTRY_POINTS = ("reshape_and_cache_cuda", "compact_kv_cuda")
REBUILD = ("rebuild it with SPECENGINE_NO_CUDA unset and nvcc on PATH: "
           "`bash scripts/install_offline.sh` (no network needed), or "
           "`pip install --no-build-isolation --no-deps -e .`")
_ARCH = re.compile(r"^(?:sm_|compute_)?(\d{2,3})([af]?)(?:-(real|virtual))?$")


def arch_runs_on(arch: str, capability: tuple[int, int]) -> bool:
    """Whether code built for the CMake CUDA architecture ``arch`` ("90a", "100f", "80-real",
    "90") can run on a device of compute ``capability``. Arch-specific ("a") code runs on that
    exact capability, family ("f") and real-only code on the same major at a minor at least as
    high, and plain entries also carry PTX, which the driver compiles for any newer device. An
    entry it cannot read ("all", "native") counts as runnable: only a known mismatch refuses."""
    m = _ARCH.match(arch.strip())
    if m is None:
        return True
    digits, suffix, kind = m.groups()
    major, minor = int(digits[:-1]), int(digits[-1])
    if suffix == "a":
        return tuple(capability) == (major, minor)
    if suffix == "f" or kind == "real":
        return capability[0] == major and capability[1] >= minor
    return tuple(capability) >= (major, minor)


def check_native(device: torch.device | str, native: ModuleType | object | None = None,
                 capability: tuple[int, int] | None = None) -> None:
    """Raises ``RuntimeError`` (saying how to rebuild) when ``native`` (default: the imported
    ``specengine._C``) cannot serve an engine on ``device``: not built at all; on CUDA, built
    without its CUDA kernels, or for architectures none of which runs on the device's compute
    ``capability`` (default: queried from ``device``)."""
    dev = torch.device(device)
    if native is None:
        try:
            import specengine._C as native
        except ImportError as e:
            raise RuntimeError(f"specengine._C is not built ({e}): a source checkout needs an "
                               f"install first; {REBUILD}") from e
    if dev.type != "cuda":
        return
    missing = [name for name in CUDA_ENTRY_POINTS if not hasattr(native, name)]
    if missing:
        raise RuntimeError(f"specengine._C was built without its CUDA kernels (no "
                           f"{', '.join(missing)}), so an engine on {dev} cannot write its KV "
                           f"cache; {REBUILD}")
    archs = tuple(getattr(native, "cuda_archs", ()))
    if not archs:
        return
    if capability is None:
        capability = torch.cuda.get_device_capability(dev)
    if not any(arch_runs_on(a, capability) for a in archs):
        raise RuntimeError(f"specengine._C's CUDA kernels are built for {', '.join(archs)}, "
                           f"none of which runs on {dev} (compute capability "
                           f"{capability[0]}.{capability[1]}); set SPECENGINE_CUDA_ARCHS (e.g. "
                           f"'{capability[0]}{capability[1]}a') and {REBUILD}")
