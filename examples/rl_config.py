"""The configuration of one ``rl_loop.py`` run, shared by the learner and the engine process
(which receives it pickled, so it lives in a module both can import)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specengine.cli import DEFAULT_DRAFT, DEFAULT_TARGET


@dataclass(frozen=True)
class LoopConfig:
    """One RL run. ``draft`` None picks the bundled EAGLE-3 head if present, else ``"ngram"``.
    On CUDA the learner uses GPU 0 and the engine GPU 1 when there are two; ``backend`` None is
    then NCCL, and gloo otherwise (NCCL cannot pair two ranks on one GPU; gloo goes through host
    copies). ``workers`` 0 runs one engine process; N > 0 runs the rollouts on a
    ``RolloutPool`` of N Ray workers (one engine each, a GPU each on CUDA), all updated by
    one send; ``backend`` None is then gloo, as Ray may place a worker on the learner's GPU."""

    model: str = str(DEFAULT_TARGET)
    draft: str | None = None
    steps: int = 40
    num_prompts: int = 16  # P prompts per step
    group_size: int = 8  # G samples per prompt
    k: int = 3
    temperature: float = 2.0
    max_tokens: int = 64
    lr: float = 1e-4  # Adam lr of the weight matrices
    gain_lr: float = 2e-2  # Adam lr of the 1-D gains (norm weights)
    clip_eps: float = 0.2
    seed: int = 0
    device: str = "cpu"
    backend: str | None = None
    timeout_s: float = 120.0
    eval_prompts: int = 0  # held-out prompts scored before and after training (0: skip)
    workers: int = 0  # 0: one engine process; N: a RolloutPool of N Ray workers
    # Online adaptation of the EAGLE-3 head: adapt after every N finished rollouts (0: off),
    # adapt_draft_steps optimiser steps at adapt_draft_lr each time (draft_options adapt_*).
    adapt_draft_every: int = 0
    adapt_draft_steps: int = 8
    adapt_draft_lr: float = 3e-4

    def __post_init__(self) -> None:
        for name in ("steps", "num_prompts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are relative to the group), "
                             f"got {self.group_size}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (sampled rollouts), got {self.temperature}")
        if not (min(self.lr, self.gain_lr) > 0 and 0 < self.clip_eps < 1
                and self.eval_prompts >= 0 and self.workers >= 0):
            raise ValueError("need lr > 0, gain_lr > 0, 0 < clip_eps < 1, eval_prompts >= 0, "
                             "workers >= 0")
        if self.adapt_draft_every < 0 or self.adapt_draft_steps < 1 or not (
                self.adapt_draft_lr > 0):
            raise ValueError("need adapt_draft_every >= 0, adapt_draft_steps >= 1 and "
                             "adapt_draft_lr > 0")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    @property
    def dist_backend(self) -> str:
        two_gpus = self.device == "cuda" and torch.cuda.device_count() > 1 and not self.workers
        return self.backend or ("nccl" if two_gpus else "gloo")


def pick_draft(cfg: LoopConfig) -> str:
    """The configured drafter, else the bundled EAGLE-3 head if it exists, else n-grams."""
    if cfg.draft is not None:
        return cfg.draft
    return str(DEFAULT_DRAFT) if DEFAULT_DRAFT.is_dir() else "ngram"
