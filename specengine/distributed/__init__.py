"""Scaling out (docs/design.md §12, §19): :class:`RolloutPool`, data-parallel rollout
workers on Ray, each a ``SpecEngine`` in its own actor, updated together by one learner; and
tensor parallelism inside one engine (``tensor_parallel``, which needs no Ray).

The pool needs Ray: ``pip install "specengine[ray]"``. Its names are imported on first use,
so that the tensor-parallel modules (and their spawned worker processes) do not import Ray.
"""

from __future__ import annotations

import importlib
from typing import Any

_POOL_NAMES = {
    "DonorDiedError": "specengine.distributed.calls",
    "PoolCall": "specengine.distributed.calls",
    "WorkerDiedError": "specengine.distributed.calls",
    "RolloutPool": "specengine.distributed.pool",
    "assign": "specengine.distributed.sharding",
    "prompt_groups": "specengine.distributed.sharding",
}


def __getattr__(name: str) -> Any:
    if name not in _POOL_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    try:
        import ray  # noqa: F401
    except ImportError as e:  # say what to install instead of a bare ModuleNotFoundError
        raise ImportError('specengine.distributed needs Ray: pip install "specengine[ray]" '
                          '(or pip install ray)') from e
    return getattr(importlib.import_module(_POOL_NAMES[name]), name)


__all__ = sorted(_POOL_NAMES)
