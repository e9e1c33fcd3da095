"""How many CPU threads torch uses for the engine's CPU work.

Torch's default is one intra-op thread per physical core. On a small or shared machine that
thrashes: measured on 2 cores, the bundled run was no faster with 2 threads than with 1 when
the machine was quiet, and 3-15x slower when anything else ran, which also hid the speedup of
k=3 over k=0 (README, "CPU threads"). So on
CPU the engine picks :func:`default_num_threads` unless the user chose: ``OMP_NUM_THREADS`` set,
``torch.set_num_threads`` called, or an explicit ``num_threads``. The setting is process-wide
(it is torch's), so it is applied once at engine construction.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)

__all__ = ["apply_thread_policy", "available_cores", "default_num_threads",
           "keep_freed_memory"]

# torch's thread count when specengine first looked, and the last count the engine set: a
# different current value means the user called torch.set_num_threads themselves.
_TORCH_AT_IMPORT = torch.get_num_threads()
_last_set: int | None = None

# The bundled model's matmuls are too small to gain past a few threads.
_MAX_DEFAULT_THREADS = 4


def available_cores() -> int:
    """CPU cores this process may run on (its affinity mask where the OS has one)."""
    if hasattr(os, "sched_getaffinity"):
        return max(1, len(os.sched_getaffinity(0)))
    return max(1, os.cpu_count() or 1)


def default_num_threads(cores: int | None = None) -> int:
    """The engine's CPU thread count for ``cores`` available cores (default: this process's):
    1 on up to 2 cores (measured: a second thread gains nothing when the machine is quiet and
    costs 3-15x when another process runs), else half the cores, at most 4, leaving room for
    the rest of an RL job (a rule, not measured beyond 2 cores)."""
    cores = available_cores() if cores is None else cores
    if cores < 1:
        raise ValueError(f"cores must be >= 1, got {cores}")
    return 1 if cores <= 2 else min(cores // 2, _MAX_DEFAULT_THREADS)


def user_chose_threads() -> bool:
    """True when ``OMP_NUM_THREADS`` is set or ``torch.set_num_threads`` was called by someone
    other than the engine since specengine was imported."""
    if os.environ.get("OMP_NUM_THREADS", "").strip():
        return True
    expected = _TORCH_AT_IMPORT if _last_set is None else _last_set
    return torch.get_num_threads() != expected


def apply_thread_policy(num_threads: int | None, device: torch.device) -> int:
    """Set torch's intra-op thread count for an engine on ``device`` and return the count in
    effect. An explicit ``num_threads`` (an int >= 1) always applies; with None the default
    applies on CPU only, and only when the user has not chosen a count."""
    global _last_set
    if num_threads is not None:
        if isinstance(num_threads, bool) or not isinstance(num_threads, int) or num_threads < 1:
            raise ValueError(f"num_threads must be an int >= 1 or None, got {num_threads!r}")
        chosen = num_threads
    elif device.type != "cpu" or user_chose_threads():
        return torch.get_num_threads()
    else:
        chosen = default_num_threads()
    if torch.get_num_threads() != chosen:
        logger.info("torch CPU threads: %d -> %d", torch.get_num_threads(), chosen)
        torch.set_num_threads(chosen)
    _last_set = chosen
    return chosen


# glibc's mallopt parameters and the values the CPU engine sets (keep_freed_memory).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
MMAP_THRESHOLD = 256 * 2**20
TRIM_THRESHOLD = 512 * 2**20
_MALLOC_ENV = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
               "MALLOC_MMAP_MAX_")
_kept = False


def keep_freed_memory() -> bool:
    """Have glibc's allocator keep freed memory for reuse (process-wide, once; a CPU engine):
    blocks up to 256 MiB come from the heap, and up to 512 MiB of freed heap stays mapped.

    Why: a CPU step allocates and frees tensors of a few MB (the logits, a sampling race over
    the vocabulary) many times. By default glibc serves blocks past its (adaptive) mmap
    threshold with fresh pages and returns freed heap to the OS, so every such tensor costs
    its pages' faults and zeroing again: measured at batch 32 over a 49k vocabulary, a
    sampled step's sampler ran in 43 ms of CPU time by default and 26 ms with this. Returns
    whether it applied (glibc only; not when the user set ``MALLOC_*`` tunables)."""
    global _kept
    if _kept:
        return True
    if any(os.environ.get(k) for k in _MALLOC_ENV):
        return False
    try:
        import ctypes

        libc = ctypes.CDLL("libc.so.6")
        ok = bool(libc.mallopt(_M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and bool(
            libc.mallopt(_M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    except (OSError, AttributeError):  # not glibc
        return False
    _kept = ok
    return ok
