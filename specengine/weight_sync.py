"""Kept so ``from specengine.weight_sync import WeightSender`` (older RL scripts) still works;
the code lives in ``specengine.weights`` (docs/design.md §2)."""

from __future__ import annotations

from specengine.weights import DEFAULT_BUCKET_BYTES, SharedWeights, WeightSender, WeightSyncError

__all__ = ["DEFAULT_BUCKET_BYTES", "SharedWeights", "WeightSender", "WeightSyncError"]
