"""Training an EAGLE-3 head in place on its rollout buffer (``drafters/adapt.py``) with the
loss of ``drafters/adapt_math.py``: the optimiser and batching of ``drafters/draft_trainer.py``
(float32 masters, Adam, state kept across calls; shared with ``train-draft``),
:class:`DraftAdapter` (what ``SpecEngine.adapt_draft`` and the automatic mode call) and
the checks of the ``adapt_*`` draft options."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import Tensor

from specengine.drafters.adapt import BufferedSeq, FeatureBuffer
from specengine.drafters.adapt_math import HeadMath
from specengine.drafters.draft_trainer import DraftTrainer, HeadOptimizer

if TYPE_CHECKING:
    from specengine.core.sequence import Sequence
    from specengine.drafters.eagle3 import Eagle3Drafter

logger = logging.getLogger(__name__)

DEFAULT_ADAPT_BUFFER_TOKENS = 32768
# Chosen on the bundled pair (benchmarks/bench_adapt.py, RESULTS.md "Training a draft"): a
# spoilt head goes from < 0.3 to 0.72-0.74 acceptance per draft on 64 prompts' rollouts, where
# 50 steps at 1e-3 reached 0.69-0.72 (0.54 in the run) with a fifth more steps.
DEFAULT_ADAPT_STEPS = 40
DEFAULT_ADAPT_LR = 3e-3
DEFAULT_ADAPT_BATCH_TOKENS = 8192


def check_adapt_options(buffer_tokens: object, every: object, steps: object,
                        lr: object, batch_tokens: object) -> None:
    """The EAGLE-3 drafter's ``adapt_*`` draft options, each with a clear error."""
    for name, v, low in (("adapt_buffer_tokens", buffer_tokens, 0), ("adapt_every", every, 0),
                         ("adapt_steps", steps, 1), ("adapt_batch_tokens", batch_tokens, 1)):
        if isinstance(v, bool) or not isinstance(v, int) or v < low:
            raise ValueError(f"draft option {name} must be an int >= {low}, got {v!r}")
    if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (
            math.isfinite(lr) and lr > 0):
        raise ValueError(f"draft option adapt_lr must be a finite number > 0, got {lr!r}")


@dataclass(frozen=True)
class AdaptResult:
    """One ``adapt_draft`` call: the EAGLE-3 loss before and after the ``steps`` optimiser
    steps on the first step's batch (the whole buffer when it holds at most
    ``adapt_batch_tokens`` positions), what it trained on and how long it took."""

    steps: int
    num_seqs: int
    num_tokens: int  # positions with a depth-0 target (the policy's produced tokens)
    loss_before: float
    loss_after: float
    seconds: float

    def __post_init__(self) -> None:
        if self.steps < 1 or self.num_seqs < 1 or self.seconds < 0:
            raise ValueError(f"inconsistent AdaptResult {self}")


class DraftAdapter:
    """The buffer of an EAGLE-3 drafter and the optimiser that trains its head on it
    (``specengine.drafters.draft_trainer``: the loop ``train-draft`` runs too). ``depth``:
    unrolled draft steps of the loss; ``batch_tokens``: most buffered positions per optimiser
    step (a random subset of sequences when the buffer holds more)."""

    def __init__(self, drafter: Eagle3Drafter, capacity: int, depth: int = 3,
                 batch_tokens: int = 8192, seed: int = 0, math: HeadMath | None = None
                 ) -> None:
        self.drafter = drafter
        self.buffer = FeatureBuffer(capacity, drafter.device)
        self.trainer = DraftTrainer(drafter.module, drafter.embed, drafter.device, depth,
                                    batch_tokens, seed, math)
        self.math = self.trainer.math
        self.optimizer: HeadOptimizer | None = None  # built at the first adapt

    def trainable(self) -> list[BufferedSeq]:
        """Buffered sequences with at least one generated target (``len >= prompt + 1``)."""
        return [s for s in self.buffer.sequences() if len(s.rows) > s.num_prompt_tokens]

    def adapt(self, steps: int, lr: float) -> AdaptResult:
        """Train the head in place for ``steps`` AdamW steps at learning rate ``lr``."""
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 1:
            raise ValueError(f"adapt_draft: steps must be an int >= 1, got {steps!r}")
        if isinstance(lr, bool) or not isinstance(lr, (int, float)) or not (
                math.isfinite(lr) and lr > 0):
            raise ValueError(f"adapt_draft: lr must be a finite number > 0, got {lr!r}")
        seqs = self.trainable()
        if not seqs:
            raise ValueError("adapt_draft: the rollout buffer holds no sequence to train on "
                             f"({len(self.buffer)} entries): run rollouts with k > 0 first")
        t0 = time.perf_counter()
        if self.optimizer is None:
            self.optimizer = HeadOptimizer(self.drafter.module)
        opt = self.optimizer
        opt.sync_in()
        first = self.trainer.pick(seqs)  # the loss is reported on this batch, before and after
        before = 0.0
        for step in range(steps):
            with torch.enable_grad():
                loss = self._objective(first if step == 0 else self.trainer.pick(seqs))
            if step == 0:
                before = float(loss.detach())
            opt.step(loss, float(lr))
        opt.sync_out()
        after = self.loss(first)
        num_tokens = sum(len(s.rows) - s.num_prompt_tokens for s in seqs)
        res = AdaptResult(steps, len(seqs), num_tokens, before, after,
                          time.perf_counter() - t0)
        logger.info("adapted the draft head: %d steps on %d sequences, loss %.4f -> %.4f "
                    "(%.2f s)", steps, len(seqs), before, after, res.seconds)
        return res

    @torch.no_grad()
    def loss(self, seqs: list[BufferedSeq]) -> float:
        """The loss over all of ``seqs``."""
        return float(self._objective(seqs))

    def _objective(self, seqs: list[BufferedSeq]) -> Tensor:
        return self.trainer.objective(self.buffer, seqs,
                                      self.optimizer.masters)  # type: ignore[union-attr]


class OnlineAdaptation:
    """What an EAGLE-3 drafter (a ``FeatureDrafter``) adds for online adaptation: its
    :class:`DraftAdapter` (whose buffer is the catch-up pass's ``capture``), :meth:`adapt`,
    and the automatic mode, counted in :meth:`release` (finished requests)."""

    adapter: DraftAdapter | None = None
    adapt_every = 0

    def init_adaptation(self, buffer_tokens: int, every: int, steps: int, lr: float,
                        batch_tokens: int, math: HeadMath | None = None) -> None:
        self.adapt_every, self.adapt_steps, self.adapt_lr = every, steps, lr
        self._num_finished = 0  # finished requests since the last automatic adaptation
        if buffer_tokens or every:
            self.adapter = DraftAdapter(self,  # type: ignore[arg-type]
                                        buffer_tokens or DEFAULT_ADAPT_BUFFER_TOKENS,
                                        batch_tokens=batch_tokens, math=math)
            self.capture = self.adapter.buffer

    def adapt(self, steps: int = DEFAULT_ADAPT_STEPS, lr: float = DEFAULT_ADAPT_LR
              ) -> AdaptResult:
        """Train the head on the rollout buffer in place (:meth:`DraftAdapter.adapt`)."""
        if self.adapter is None:
            raise ValueError("adapt_draft: this engine keeps no rollout buffer; create it with "
                             "draft_options={'adapt_buffer_tokens': N} (or 'adapt_every': N)")
        result = self.adapter.adapt(steps, lr)
        self.draft_weights_changed()  # type: ignore[attr-defined]  # no cached draft KV
        return result

    def release(self, seq: Sequence) -> None:
        from specengine.core.sequence import SeqStatus

        super().release(seq)  # type: ignore[misc]
        if self.adapt_every and seq.status is SeqStatus.FINISHED:
            self._num_finished += 1
            if self._num_finished >= self.adapt_every:
                self._num_finished = 0
                if self.adapter.trainable():  # type: ignore[union-attr]
                    self.adapt(self.adapt_steps, self.adapt_lr)


