"""Training an EAGLE-3 head in place on its rollout buffer (``drafters/adapt.py``) with the
loss of ``drafters/adapt_math.py``: the optimiser (float32 masters, AdamW, state kept across
calls), :class:`DraftAdapter` (what ``SpecEngine.adapt_draft`` and the automatic mode call) and
the checks of the ``adapt_*`` draft options."""

from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from specengine.drafters.adapt import BufferedSeq, FeatureBuffer
from specengine.drafters.adapt_math import HeadMath, ttt_loss, ttt_sums

if TYPE_CHECKING:
    from specengine.core.sequence import Sequence
    from specengine.drafters.eagle3 import Eagle3Drafter

logger = logging.getLogger(__name__)

GROUP_SEQS = 16  # sequences per padded forward (sorted by length)
DEFAULT_ADAPT_BUFFER_TOKENS = 32768
DEFAULT_ADAPT_STEPS = 50
DEFAULT_ADAPT_LR = 1e-3
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
    """The buffer of an EAGLE-3 drafter and the optimiser that trains its head on it.
    ``depth``: unrolled draft steps of the loss; ``batch_tokens``: most buffered positions
    per optimiser step (a random subset of sequences when the buffer holds more)."""

    def __init__(self, drafter: Eagle3Drafter, capacity: int, depth: int = 3,
                 batch_tokens: int = 8192, seed: int = 0) -> None:
        self.drafter = drafter
        self.buffer = FeatureBuffer(capacity, drafter.device)
        self.math = HeadMath(drafter.module, drafter.embed)
        self.depth, self.batch_tokens = depth, batch_tokens
        self.optimizer: HeadOptimizer | None = None  # built at the first adapt
        self._rng = np.random.default_rng(seed)

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
        first = self._pick(seqs)  # the loss is reported on this batch, before and after
        before = 0.0
        for step in range(steps):
            with torch.enable_grad():
                loss = self._objective(first if step == 0 else self._pick(seqs))
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
        """The loss of ``seqs``, run in groups of similar length (little padding)."""
        seqs = sorted(seqs, key=lambda s: len(s.rows))
        sums = counts = None
        for i in range(0, len(seqs), GROUP_SEQS):
            s, c = ttt_sums(self.math, self.optimizer.masters,  # type: ignore[union-attr]
                            *self._batch(seqs[i: i + GROUP_SEQS]))
            sums, counts = (s, c) if sums is None else (sums + s, counts + c)
        return ttt_loss(sums, counts)  # type: ignore[arg-type]

    def _pick(self, seqs: list[BufferedSeq]) -> list[BufferedSeq]:
        """A random subset of ``seqs`` of about ``batch_tokens`` positions (all if fewer)."""
        if sum(len(s.rows) for s in seqs) <= self.batch_tokens:
            return seqs
        out, n = [], 0
        for i in self._rng.permutation(len(seqs)):
            if out and n + len(seqs[i].rows) > self.batch_tokens:
                break
            out.append(seqs[i])
            n += len(seqs[i].rows)
        return out

    def _batch(self, seqs: list[BufferedSeq]
               ) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        """Padded ``feats [B, T, F]`` float32, ``ids [B, T + depth]``, ``valid [B, T]`` and
        the per-depth targets (draft ids, -100 where no loss) of ``seqs``."""
        dev, depth = self.buffer.device, self.depth
        t = max(len(s.rows) for s in seqs)
        rows = np.zeros((len(seqs), t), dtype=np.int64)
        lens = np.array([len(s.rows) for s in seqs], dtype=np.int64)
        first = np.array([s.num_prompt_tokens - 1 for s in seqs], dtype=np.int64)
        for b, s in enumerate(seqs):
            rows[b, : len(s.rows)] = s.rows
        j = np.arange(t)
        valid_np = j[None, :] < lens[:, None]
        rows_t = torch.from_numpy(rows).to(dev)
        valid = torch.from_numpy(valid_np).to(dev)
        assert self.buffer.feats is not None
        feats = self.buffer.feats[rows_t].float()
        tok = torch.where(valid, self.buffer.tokens[rows_t], 0)  # tok[:, i] = x_{i+1}
        ids = torch.cat([tok, tok.new_zeros(len(seqs), depth)], dim=1)
        head = self.drafter.module
        to_draft = torch.full((head.vocab_size,), -100, dtype=torch.int64, device=dev)
        to_draft[head.draft_to_target] = torch.arange(head.draft_to_target.numel(), device=dev)
        targets = []
        for d in range(depth):
            # anchor i's depth-d target is x_{i+d+2} = ids[:, i+d+1]; chains start at
            # i >= prompt_len - 1 and the target must exist
            ok = (j[None, :] >= first[:, None]) & (j[None, :] + d + 1 < lens[:, None])
            tg = to_draft[ids[:, d + 1: d + 1 + t]]
            targets.append(torch.where(torch.from_numpy(ok).to(dev), tg, -100))
        return feats, ids, valid, targets


class OnlineAdaptation:
    """What an EAGLE-3 drafter (a ``FeatureDrafter``) adds for online adaptation: its
    :class:`DraftAdapter` (whose buffer is the catch-up pass's ``capture``), :meth:`adapt`,
    and the automatic mode, counted in :meth:`release` (finished requests)."""

    adapter: DraftAdapter | None = None
    adapt_every = 0

    def init_adaptation(self, buffer_tokens: int, every: int, steps: int, lr: float,
                        batch_tokens: int) -> None:
        self.adapt_every, self.adapt_steps, self.adapt_lr = every, steps, lr
        self._num_finished = 0  # finished requests since the last automatic adaptation
        if buffer_tokens or every:
            self.adapter = DraftAdapter(self,  # type: ignore[arg-type]
                                        buffer_tokens or DEFAULT_ADAPT_BUFFER_TOKENS,
                                        batch_tokens=batch_tokens)
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


class HeadOptimizer:
    """Adam over float32 masters of ``head``'s parameters (bf16 heads get fp32 updates),
    moments kept across calls. ``sync_in`` re-reads a master whose head tensor changed since
    (a ``load_weights`` of the head) and resets its moments; ``sync_out`` copies the masters
    into the head's own tensors in place, so every ``data_ptr`` stays (static buffers and
    CUDA graphs read them). Adam is written out here: ``torch.optim``'s first construction
    imports the compiler stack (seconds on a CPU), more than a whole adaptation of a small
    head takes."""

    BETAS = (0.9, 0.999)
    EPS = 1e-8

    def __init__(self, head: nn.Module) -> None:
        self.params = dict(head.named_parameters())
        self.masters = {n: p.detach().float().clone().requires_grad_(True)
                        for n, p in self.params.items()}
        self.state: dict[str, tuple[Tensor, Tensor, int]] = {}  # name -> (m, v, step)

    @torch.no_grad()
    def sync_in(self) -> None:
        for n, p in self.params.items():
            m = self.masters[n]
            if not torch.equal(m.to(p.dtype), p):
                m.copy_(p.float())
                self.state.pop(n, None)

    @torch.no_grad()
    def sync_out(self) -> None:
        for n, p in self.params.items():
            p.copy_(self.masters[n])

    def step(self, loss: Tensor, lr: float, max_grad_norm: float = 1.0) -> None:
        """Backward of ``loss``, the gradient clipped to ``max_grad_norm`` (global L2), one
        bias-corrected Adam step at ``lr``."""
        for m in self.masters.values():
            m.grad = None
        loss.backward()
        with torch.no_grad():
            grads = {n: m.grad for n, m in self.masters.items() if m.grad is not None}
            norm = torch.linalg.vector_norm(torch.stack(
                [torch.linalg.vector_norm(g) for g in grads.values()]))
            scale = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
            b1, b2 = self.BETAS
            for n, g in grads.items():
                g = g * scale
                mom, var, t = self.state.get(n) or (torch.zeros_like(g), torch.zeros_like(g), 0)
                mom.mul_(b1).add_(g, alpha=1 - b1)
                var.mul_(b2).addcmul_(g, g, value=1 - b2)
                t += 1
                self.state[n] = (mom, var, t)
                denom = (var / (1 - b2 ** t)).sqrt_().add_(self.EPS)
                self.masters[n].addcdiv_(mom, denom, value=-lr / (1 - b1 ** t))
