"""Training EAGLE-3 heads: the loop shared with online adaptation (``draft_trainer``), prompt
files (``data``), fresh heads (``head_init``) and ``specengine train-draft``
(``offline``). ``train_draft`` is imported on first use: the engine imports
``draft_trainer`` through ``drafters/adapt_train.py``, and ``offline`` imports the
engine."""

from __future__ import annotations

from typing import Any

__all__ = ["TrainDraftConfig", "train_draft"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from specengine.train import offline as module

        return getattr(module, name)
    raise AttributeError(f"module 'specengine.train' has no attribute {name!r}")
