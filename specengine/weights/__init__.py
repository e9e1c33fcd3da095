"""Weight updates (docs/design.md §4): the learner's :class:`WeightSender` (``sender``), the
engine's receiving side (``receiver``), the weight-sync group (``group``) and the protocol's
plain-data pieces (``protocol``)."""

from __future__ import annotations

from specengine.weights.protocol import WeightSyncError
from specengine.weights.sender import DEFAULT_BUCKET_BYTES, SharedWeights, WeightSender

__all__ = ["DEFAULT_BUCKET_BYTES", "SharedWeights", "WeightSender", "WeightSyncError"]
