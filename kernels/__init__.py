"""Triton / CUDA kernels of specengine (installed as ``specengine.kernels``)."""

from __future__ import annotations

from .debug import value_checks, value_checks_enabled

__all__ = ["value_checks", "value_checks_enabled"]
