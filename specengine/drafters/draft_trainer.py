"""The EAGLE-3 head's training loop, shared by online adaptation (``engine.adapt_draft``,
``drafters/adapt_train.py``) and offline training (``specengine train-draft``,
``train/offline.py``): batches of buffered sequences (target features and the policy's
tokens, ``drafters/adapt.py``), the unrolled training-time-test loss of
``drafters/adapt_math.py`` and :class:`HeadOptimizer` (Adam over float32 masters).

Both callers hold their data as a :class:`FeatureSource` (``feats [N, F]``, ``tokens [N]``)
plus :class:`~specengine.drafters.adapt.BufferedSeq` rows into it: the rollout ring itself
for ``adapt_draft``, the generated set (host memory, moved to the device per batch) for
``train-draft``.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
from torch import Tensor, nn

from specengine.drafters.adapt import BufferedSeq
from specengine.drafters.adapt_math import HeadMath, ttt_loss, ttt_sums

GROUP_SEQS = 16  # sequences per padded forward (sorted by length)


class FeatureSource(Protocol):
    """Rows of training entries: ``feats[r]`` the target's features of an entry, ``tokens[r]``
    the token fed with it (``x_{p+1}`` for the entry of position ``p``). Optionally the
    policy's distribution of that token: ``soft_ids[r]`` / ``soft_logps[r]`` ``[K]``, its
    top-K target ids (-1: padding, or no record) and their log-probabilities."""

    feats: Tensor | None
    tokens: Tensor
    soft_ids: Tensor | None
    soft_logps: Tensor | None


class DraftTrainer:
    """Loss of a head over :class:`BufferedSeq` batches and random batches of about
    ``batch_tokens`` positions. ``depth``: unrolled draft steps of the loss."""

    def __init__(self, head: nn.Module, embed: nn.Embedding, device: torch.device,
                 depth: int = 3, batch_tokens: int = 8192, seed: int = 0,
                 math: HeadMath | None = None, tv_weight: float = 0.0) -> None:
        if not tv_weight >= 0.0:
            raise ValueError(f"tv_weight must be >= 0, got {tv_weight}")
        self.head, self.device = head, device
        # weight of the acceptance term of the loss (drafters/adapt_math.py, "Acceptance term")
        self.tv_weight = float(tv_weight)
        # the head's forward as differentiable maths: EAGLE-3's by default, MTP's
        # (``drafters/mtp_math.py``) for an MTP layer
        self.math = math if math is not None else HeadMath(head, embed)
        self.depth, self.batch_tokens = depth, batch_tokens
        self.rng = np.random.default_rng(seed)

    def objective(self, source: FeatureSource, seqs: list[BufferedSeq],
                  params: dict[str, Tensor]) -> Tensor:
        """The loss of ``seqs`` under ``params``."""
        return ttt_loss(*self.sums(source, seqs, params))

    def sums(self, source: FeatureSource, seqs: list[BufferedSeq],
             params: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
        """``ttt_sums`` of ``seqs`` (per-depth loss sums and counts, which add over batches
        of sequences), run in groups of similar length (little padding)."""
        seqs = sorted(seqs, key=lambda s: len(s.rows))
        sums = counts = None
        for i in range(0, len(seqs), GROUP_SEQS):
            group = seqs[i: i + GROUP_SEQS]
            s, c = ttt_sums(self.math, params, *self.batch(source, group),
                            soft=self.soft_targets(source, group), tv_weight=self.tv_weight)
            sums, counts = (s, c) if sums is None else (sums + s, counts + c)
        return sums, counts  # type: ignore[return-value]

    def pick(self, seqs: list[BufferedSeq]) -> list[BufferedSeq]:
        """A random subset of ``seqs`` of about ``batch_tokens`` positions (all if fewer)."""
        if sum(len(s.rows) for s in seqs) <= self.batch_tokens:
            return seqs
        out, n = [], 0
        for i in self.rng.permutation(len(seqs)):
            if out and n + len(seqs[i].rows) > self.batch_tokens:
                break
            out.append(seqs[i])
            n += len(seqs[i].rows)
        return out

    @staticmethod
    def _rows(seqs: list[BufferedSeq]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """``rows [B, T]`` (padded with row 0), ``lens [B]`` and each sequence's first anchor."""
        t = max(len(s.rows) for s in seqs)
        rows = np.zeros((len(seqs), t), dtype=np.int64)
        lens = np.array([len(s.rows) for s in seqs], dtype=np.int64)
        first = np.array([s.num_prompt_tokens - 1 for s in seqs], dtype=np.int64)
        for b, s in enumerate(seqs):
            rows[b, : len(s.rows)] = s.rows
        return rows, lens, first

    @staticmethod
    def _has_target(t: int, lens: np.ndarray, first: np.ndarray, d: int) -> np.ndarray:
        """``[B, T]``: anchor ``i`` has a depth-``d`` target: chains start at ``i >=
        prompt_len - 1`` and the target ``x_{i+d+2}`` (row ``i + d + 1``) must exist."""
        j = np.arange(t)
        return (j[None, :] >= first[:, None]) & (j[None, :] + d + 1 < lens[:, None])

    def soft_targets(self, source: FeatureSource, seqs: list[BufferedSeq]
                     ) -> list[tuple[Tensor, Tensor]] | None:
        """Per depth ``d``, the policy's recorded distribution of each anchor's target
        (anchor ``i``, depth ``d``: the entry of position ``i + d + 1``, whose token is
        ``x_{i+d+2}``) as ``(draft ids [B, T, K], probs [B, T, K])``: only tokens with a draft
        id, renormalised over them (probs all 0: no record, or none has a draft id, or no
        target at that anchor, the hard target's rule). None when ``source`` records none."""
        if source.soft_ids is None or source.soft_logps is None:
            return None
        dev, depth = self.device, self.depth
        rows, lens, first = self._rows(seqs)
        b, t = rows.shape
        rows_src = torch.from_numpy(rows).to(source.soft_ids.device)
        ids = source.soft_ids[rows_src].to(dev).long()  # [B, T, K]
        logps = source.soft_logps[rows_src].to(dev).float()
        to_draft = self.math.to_draft(dev)
        kept = ids >= 0
        if to_draft is not None:
            ids = torch.where(kept, to_draft[ids.clamp_min(0)], -1)
            kept = ids >= 0
        probs = torch.where(kept, logps.exp(), torch.zeros_like(logps))
        probs = probs / probs.sum(-1, keepdim=True).clamp_min(1e-30)  # over the draft ids
        pad_i = ids.new_full((b, depth, ids.shape[-1]), -1)
        pad_p = probs.new_zeros((b, depth, ids.shape[-1]))
        ids, probs = torch.cat([ids, pad_i], 1), torch.cat([probs, pad_p], 1)
        out = []
        for d in range(depth):
            okt = torch.from_numpy(self._has_target(t, lens, first, d)).to(dev)[..., None]
            out.append((ids[:, d + 1: d + 1 + t],
                        torch.where(okt, probs[:, d + 1: d + 1 + t], 0.0)))
        return out

    def batch(self, source: FeatureSource, seqs: list[BufferedSeq]
              ) -> tuple[Tensor, Tensor, Tensor, list[Tensor]]:
        """Padded ``feats [B, T, F]`` float32, ``ids [B, T + depth]``, ``valid [B, T]`` and
        the per-depth targets (draft ids, -100 where no loss) of ``seqs``, on the device."""
        dev, depth = self.device, self.depth
        rows, lens, first = self._rows(seqs)
        t = rows.shape[1]
        j = np.arange(t)
        valid_np = j[None, :] < lens[:, None]
        assert source.feats is not None
        rows_src = torch.from_numpy(rows).to(source.tokens.device)
        valid = torch.from_numpy(valid_np).to(dev)
        feats = source.feats[rows_src].to(dev).float()
        tok = torch.where(valid, source.tokens[rows_src].to(dev), 0)  # tok[:, i] = x_{i+1}
        ids = torch.cat([tok, tok.new_zeros(len(seqs), depth)], dim=1)
        to_draft = self.math.to_draft(dev)
        targets = []
        for d in range(depth):
            # anchor i's depth-d target is x_{i+d+2} = ids[:, i+d+1]; chains start at
            # i >= prompt_len - 1 and the target must exist
            ok = self._has_target(t, lens, first, d)
            tg = ids[:, d + 1: d + 1 + t]
            tg = tg if to_draft is None else to_draft[tg]
            targets.append(torch.where(torch.from_numpy(ok).to(dev), tg, -100))
        return feats, ids, valid, targets


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

    def state_dict(self) -> dict[str, Tensor]:
        """Masters and moments as flat tensors (a training checkpoint)."""
        out = {f"master.{n}": m.detach() for n, m in self.masters.items()}
        for n, (mom, var, t) in self.state.items():
            out[f"m.{n}"], out[f"v.{n}"] = mom, var
            out[f"t.{n}"] = torch.tensor(t, dtype=torch.int64)
        return out

    @torch.no_grad()
    def load_state_dict(self, state: dict[str, Tensor]) -> None:
        """Inverse of :meth:`state_dict` (same head layout)."""
        for n, m in self.masters.items():
            m.copy_(state[f"master.{n}"])
        self.state = {n: (state[f"m.{n}"].to(m.device).clone(),
                          state[f"v.{n}"].to(m.device).clone(), int(state[f"t.{n}"]))
                      for n, m in self.masters.items() if f"t.{n}" in state}
