"""Training EAGLE-3 heads for your policy: ``specengine train-draft`` (``cli``) and
:func:`train_draft` (``offline``: on-policy rollouts by the engine, then the unrolled loss),
prompt files (``data``) and fresh heads (``head_init``). The loss loop is the one online
adaptation uses (``specengine.drafters.draft_trainer``)."""

from __future__ import annotations

from specengine.train.offline import TrainDraftConfig, train_draft

__all__ = ["TrainDraftConfig", "train_draft"]
