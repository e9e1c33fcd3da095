"""Scaling out (docs/design.md §12): :class:`RolloutPool`, data-parallel rollout
workers on Ray, each a ``SpecEngine`` in its own actor, updated together by one learner.

Needs Ray: ``pip install "specengine[ray]"``.
"""

from __future__ import annotations

try:
    import ray  # noqa: F401
except ImportError as e:  # say what to install instead of a bare ModuleNotFoundError
    raise ImportError('specengine.distributed needs Ray: pip install "specengine[ray]" '
                      '(or pip install ray)') from e

from specengine.distributed.calls import DonorDiedError, PoolCall, WorkerDiedError
from specengine.distributed.pool import RolloutPool
from specengine.distributed.sharding import assign, prompt_groups

__all__ = ["DonorDiedError", "PoolCall", "RolloutPool", "WorkerDiedError", "assign",
           "prompt_groups"]
