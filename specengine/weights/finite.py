"""The finite-values check of every weight update (docs/design.md §4).

A NaN or Inf weight passes every shape and dtype rule and then silently ruins every
completion (one NaN in a norm turns every logit into NaN and greedy decoding into token 0),
so every update path refuses one before committing. The check runs where the tensors live
(on the device for a device update): one ``all()`` reduction per tensor (or per received
piece, folded into its tensor's flag with a logical and), all flags read back with one host
sync at the end, so the cost is a pass over the update's bytes and one sync, not one sync
per tensor. Integer and bool tensors (e.g. an EAGLE-3 head's ``d2t`` / ``t2d``) are skipped.
Values are checked as they will be written where that is known before the write (the staged
copy of a network update, after its cast); elsewhere as given.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from specengine.weights.protocol import WeightSyncError

# Dtypes without an Inf (and without ``torch.isfinite``): only NaN can be wrong there.
_NO_INF = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e4m3fnuz",
                                             "float8_e5m2fnuz") if hasattr(torch, n))


def checks_dtype(dtype: torch.dtype) -> bool:
    """Whether values of ``dtype`` can be non-finite."""
    return dtype.is_floating_point or dtype.is_complex


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    if t.dtype in _NO_INF:
        return (t == t).all()  # NaN is the one value unequal to itself
    return torch.isfinite(t).all()


class FiniteCheck:
    """Per-name "all finite" flags, kept as device tensors until :meth:`first_bad` reads them
    (once per device). Names keep the order they were first added in, so the first bad one
    reported is the first in the update's order."""

    def __init__(self) -> None:
        self._flags: dict[str, torch.Tensor] = {}

    def add(self, name: str, tensor: torch.Tensor) -> None:
        """Fold ``tensor``'s values (the whole tensor or one piece of it) into ``name``'s flag;
        integer and bool tensors are skipped."""
        if not checks_dtype(tensor.dtype) or tensor.numel() == 0 or tensor.is_meta:
            return  # no values to check (a meta tensor fails later, at its copy)
        flag = _all_finite(tensor.detach())
        prev = self._flags.get(name)
        self._flags[name] = flag if prev is None else prev & flag.to(prev.device)

    def first_bad(self) -> str | None:
        """The first name with a non-finite value, or None: one host read per device."""
        names = list(self._flags)
        ok: dict[str, bool] = {}
        by_device: dict[torch.device, list[str]] = {}
        for n in names:
            by_device.setdefault(self._flags[n].device, []).append(n)
        for group in by_device.values():
            values = torch.stack([self._flags[n] for n in group]).tolist()
            ok.update(zip(group, values))
        return next((n for n in names if not ok[n]), None)

    def raise_if_bad(self) -> None:
        """Raise :class:`WeightSyncError` naming the first non-finite tensor."""
        bad = self.first_bad()
        if bad is not None:
            raise WeightSyncError(non_finite_message(bad))


def non_finite_message(name: str) -> str:
    return (f"non-finite values (NaN or Inf) in {name!r}: weight update refused (pass "
            f"check_finite=False to skip this check)")


def check_finite_tensors(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Raise :class:`WeightSyncError` naming the first tensor holding a NaN or Inf."""
    check = FiniteCheck()
    for name, t in named_tensors:
        check.add(name, t)
    check.raise_if_bad()
