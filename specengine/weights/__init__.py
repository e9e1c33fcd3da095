"""Weight updates (docs/design.md §4): the learner's :class:`WeightSender` (``sender``), the
engine's receiving side (``receiver``), the weight-sync group (``group``), the protocol's
plain-data pieces (``protocol``), the finite-values check (``finite``) and the split of an
operation into a stage off the step loop and a commit between two steps (``staged``)."""

from __future__ import annotations

from specengine.weights.protocol import WeightSyncError
from specengine.weights.sender import DEFAULT_BUCKET_BYTES, SharedWeights, WeightSender
from specengine.weights.staged import StagedUpdate

__all__ = ["DEFAULT_BUCKET_BYTES", "SharedWeights", "StagedUpdate", "WeightSender",
           "WeightSyncError"]
