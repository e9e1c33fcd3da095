"""Counts the calls that block the host on a GPU: device→host reads and blocking host→device
copies, made from the engine's own files (``specengine/``, ``kernels/``).

On the CPU every tensor is a host tensor, so what would block on a GPU is recognised by the
call, not the data: any read of a tensor's values into Python (``tolist``, ``item``, ``cpu``,
``numpy``, ``bool()``/``int()``/``float()``/``index``, ``__array__``) is a device→host copy, and
any copy of host data to a device that is not ``non_blocking`` (``torch.tensor(..., device=)``,
``torch.as_tensor(..., device=)``, ``Tensor.to(device)`` / ``.cuda()``) is a blocking
host→device copy. Calls made by torch or Triton themselves (the interpreter's own conversions)
do not count: only the engine's call sites do.
"""

from __future__ import annotations

import sys
from collections import Counter
from pathlib import Path
from typing import Any

import torch

import specengine
import specengine.kernels

ROOTS = tuple(str(Path(m.__file__).resolve().parent) + "/"
              for m in (specengine, specengine.kernels))
D2H_METHODS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__",
               "__index__", "__array__")


def _site() -> str | None:
    """``file:line`` of the engine frame that made the call, or None (a torch/Triton caller)."""
    frame = sys._getframe(2)
    name = str(Path(frame.f_code.co_filename).resolve())
    return f"{Path(name).name}:{frame.f_lineno}" if name.startswith(ROOTS) else None


def _is_device(x: Any) -> bool:
    if isinstance(x, torch.device):
        return True
    if isinstance(x, str):
        try:
            torch.device(x)
        except RuntimeError:
            return False
        return True
    return False


class HostTransfers:
    """``with HostTransfers() as t: ...``; then ``t.d2h`` and ``t.h2d_blocking`` (Counters of
    call sites)."""

    def __init__(self) -> None:
        self.d2h: Counter[str] = Counter()
        self.h2d_blocking: Counter[str] = Counter()
        self._saved: list[tuple[Any, str, Any]] = []

    def _patch(self, owner: Any, name: str, wrapper: Any) -> None:
        # An inherited method (``Tensor.__bool__`` lives on the C base class) is restored by
        # deleting the patch, not by setting a copy on the subclass.
        own = name in vars(owner)
        self._saved.append((owner, name, getattr(owner, name) if own else None))
        setattr(owner, name, wrapper)

    def __enter__(self) -> HostTransfers:
        for name in D2H_METHODS:
            orig = getattr(torch.Tensor, name)

            def read(t: torch.Tensor, *a: Any, _orig: Any = orig, _name: str = name, **kw: Any):
                site = _site()
                if site is not None:
                    self.d2h[f"{site} {_name}"] += 1
                return _orig(t, *a, **kw)

            self._patch(torch.Tensor, name, read)
        for name in ("tensor", "as_tensor"):
            orig = getattr(torch, name)

            def make(*a: Any, _orig: Any = orig, _name: str = name, **kw: Any) -> torch.Tensor:
                site = _site()
                if site is not None and kw.get("device") is not None:
                    self.h2d_blocking[f"{site} torch.{_name}"] += 1
                return _orig(*a, **kw)

            self._patch(torch, name, make)
        orig_to, orig_cuda = torch.Tensor.to, torch.Tensor.cuda

        def to(t: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
            moves = any(_is_device(x) for x in (*a, kw.get("device")))
            if moves and not kw.get("non_blocking", False):
                site = _site()
                if site is not None:
                    self.h2d_blocking[f"{site} .to"] += 1
            return orig_to(t, *a, **kw)

        def cuda(t: torch.Tensor, *a: Any, **kw: Any) -> torch.Tensor:
            site = _site()
            if site is not None and not kw.get("non_blocking", False):
                self.h2d_blocking[f"{site} .cuda"] += 1
            return orig_cuda(t, *a, **kw)

        self._patch(torch.Tensor, "to", to)
        self._patch(torch.Tensor, "cuda", cuda)
        return self

    def __exit__(self, *exc: object) -> None:
        for owner, name, orig in reversed(self._saved):
            if orig is None:
                delattr(owner, name)
            else:
                setattr(owner, name, orig)
        self._saved.clear()
