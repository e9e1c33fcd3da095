"""CPU threads: the engine picks a count that does not thrash small machines, unless the user
chose one (``OMP_NUM_THREADS``, ``torch.set_num_threads`` or ``num_threads=``)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from specengine import SpecEngine
from specengine import threads as th


@pytest.fixture(autouse=True)
def fresh_threads(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """As in a new process: no OMP_NUM_THREADS, torch at its own default (here: 3, a count
    the rule never picks), nothing set by an engine yet. Restores torch's count afterwards."""
    before = torch.get_num_threads()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    torch.set_num_threads(3)
    monkeypatch.setattr(th, "_TORCH_AT_IMPORT", 3)
    monkeypatch.setattr(th, "_last_set", None)
    yield
    torch.set_num_threads(before)


def _engine(ckpt: Path, **kwargs: object) -> SpecEngine:
    return SpecEngine(ckpt, device="cpu", max_model_len=64, kv_cache_tokens=256, **kwargs)


@pytest.mark.parametrize(("cores", "expected"), [(1, 1), (2, 1), (3, 1), (4, 2), (8, 4),
                                                 (64, 4)])
def test_default_rule(cores: int, expected: int) -> None:
    assert th.default_num_threads(cores) == expected


def test_default_rule_refuses_no_cores() -> None:
    with pytest.raises(ValueError, match="cores must be >= 1"):
        th.default_num_threads(0)


@pytest.mark.parametrize(("cores", "expected"), [(2, 1), (8, 4)])
def test_engine_applies_the_default_on_cpu(tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
                                           cores: int, expected: int) -> None:
    monkeypatch.setattr(th, "available_cores", lambda: cores)
    _engine(tiny_checkpoint)
    assert torch.get_num_threads() == expected


def test_omp_num_threads_is_respected(tiny_checkpoint: Path,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "3")
    _engine(tiny_checkpoint)
    assert torch.get_num_threads() == 3


def test_torch_set_num_threads_by_the_user_is_respected(tiny_checkpoint: Path) -> None:
    torch.set_num_threads(2)
    _engine(tiny_checkpoint)
    assert torch.get_num_threads() == 2


def test_explicit_num_threads_wins(tiny_checkpoint: Path,
                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    _engine(tiny_checkpoint, num_threads=2)
    assert torch.get_num_threads() == 2
    # The engine's own setting is not mistaken for the user's: a later default engine applies
    # the rule again.
    monkeypatch.delenv("OMP_NUM_THREADS")
    monkeypatch.setattr(th, "available_cores", lambda: 2)
    _engine(tiny_checkpoint)
    assert torch.get_num_threads() == 1


def test_cli_threads_flag(tiny_checkpoint: Path) -> None:
    from specengine.cli import main

    assert main(["generate", "--model", str(tiny_checkpoint), "--prompt-ids", "1 2 3",
                 "--k", "0", "--max-tokens", "2", "--threads", "2", "--device", "cpu"]) == 0
    assert torch.get_num_threads() == 2


_MALLINFO = """
import ctypes, sys
from specengine.threads import keep_freed_memory
libc = ctypes.CDLL("libc.so.6")
class Info(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks",
                "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc.mallinfo2.restype = Info
libc.malloc.restype = ctypes.c_void_p
def big_block():  # (mapped on its own, heap kept after free) for a 64 MiB block
    p = libc.malloc(64 << 20)
    ctypes.memset(p, 1, 64 << 20)
    mapped = libc.mallinfo2().hblkhd >= 64 << 20
    libc.free(ctypes.c_void_p(p))
    return mapped, libc.mallinfo2().fordblks >= 64 << 20
print(big_block(), keep_freed_memory(), big_block())
"""


def test_keep_freed_memory_keeps_large_blocks_on_the_heap() -> None:
    """By default glibc maps a 64 MiB block on its own and unmaps it when freed (fresh pages,
    page faults, every time); after ``keep_freed_memory`` it comes from the heap and stays
    there for reuse. A user's MALLOC_* tunable wins: nothing is changed."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("glibc's mallopt")
    env = {k: v for k, v in os.environ.items() if not k.startswith("MALLOC_")}
    out = subprocess.run([sys.executable, "-c", _MALLINFO], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert " ".join(out) == "(True, False) True (False, True)"
    env["MALLOC_TRIM_THRESHOLD_"] = "131072"
    out = subprocess.run([sys.executable, "-c", _MALLINFO], env=env, capture_output=True,
                         text=True, check=True).stdout.split()
    assert " ".join(out) == "(True, False) False (True, False)"
