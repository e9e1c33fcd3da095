"""Online adaptation of an EAGLE-3 head: the rollout buffer it trains on (issue 14 item 3).

Every entry the head's catch-up pass writes is one training example already computed by the
rollout: the target's features ``f_p`` of position ``p`` (read by the verify pass or the
prefill) and the token ``x_{p+1}`` that followed it (the policy's own). :class:`FeatureBuffer`
copies them, on the device and without reading anything back, into a preallocated ring of
``capacity`` entries (the token budget), with each entry's sequence id, position and prompt
length kept on the host. ``specengine.drafters.adapt_train`` turns the buffer's sequences
into the EAGLE-3 training loss.

Eviction is FIFO over entries: the ring keeps the newest ``capacity`` positions, so after a
policy update it fills with the current policy's rollouts first (what the head must follow;
a reservoir would keep stale ones with the same weight as new). A sequence is trained on from
position 0 up to its first missing position only: a sequence whose first entries were
overwritten is skipped (its later entries would see an attention context they never have at
inference), and its remaining entries are dead until the ring overwrites them. A position
written twice (a re-prefill after preemption, a KV recompute after a weight update) keeps its
newest features.

A sequence that ends in a step writes no head entry (it drafts no more), but the positions it
verified in that step are training data like any other: :func:`capture_finished` (eager) and
:func:`capture_static` buffer them too, from the position after the sequence's last buffered
one (``FeatureBuffer.next_position``) up to its last kept token, so every position whose next
token is known reaches training.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specengine.core.sequence import SeqStatus, Sequence
from specengine.core.step_types import ForwardOutput
from specengine.core.transfer import to_device

if TYPE_CHECKING:
    from specengine.core.step_types import VerifyOutput, VerifyShape
    from specengine.drafters.feature_drafter import FeatureDrafter


@dataclass(frozen=True)
class BufferedSeq:
    """One sequence's usable entries: ring rows of positions ``0 .. len(rows) - 1``."""

    seq_id: int
    rows: np.ndarray  # [L] int64 ring indices, position order
    num_prompt_tokens: int


class FeatureBuffer:
    """Ring of ``capacity`` head entries (features ``[F]`` and fed token) on ``device``."""

    def __init__(self, capacity: int, device: torch.device) -> None:
        if not isinstance(capacity, int) or isinstance(capacity, bool) or capacity < 1:
            raise ValueError(f"the adaptation buffer needs a token budget >= 1, got "
                             f"{capacity!r}")
        self.capacity, self.device = capacity, device
        self.feats: Tensor | None = None  # [capacity, F], allocated at the first write
        self.tokens = torch.zeros(capacity, dtype=torch.int64, device=device)
        # the policy's distributions of the tokens are not recorded online (hard targets)
        self.soft_ids: Tensor | None = None
        self.soft_logps: Tensor | None = None
        self.seq_ids = np.full(capacity, -1, dtype=np.int64)
        self.positions = np.zeros(capacity, dtype=np.int64)
        self.prompt_lens = np.zeros(capacity, dtype=np.int64)
        self.stamps = np.zeros(capacity, dtype=np.int64)  # write order (newest wins)
        self.head = 0  # next ring row to write
        self.num_written = 0
        # Per sequence id, the position after its newest buffered one: where the entries of
        # the step in which it ends start (forgotten when the drafter releases it).
        self.next_position: dict[int, int] = {}

    def __len__(self) -> int:
        """Entries held (live or dead)."""
        return min(self.num_written, self.capacity)

    def clear(self) -> None:
        self.seq_ids[:] = -1
        self.head = self.num_written = 0
        self.next_position.clear()

    def forget(self, seq_id: int) -> None:
        """The sequence was released: no more entries of it will come."""
        self.next_position.pop(seq_id, None)

    def add(self, seq_ids: np.ndarray, positions: np.ndarray, prompt_lens: np.ndarray,
            feats: Tensor, tokens: Tensor) -> None:
        """Append entries (host ``seq_ids`` / ``positions`` / ``prompt_lens``, device
        ``feats [n, F]`` / ``tokens [n]``): device-to-device slice copies, no host read."""
        n = len(seq_ids)
        if n == 0:
            return
        if n > self.capacity:  # only the newest capacity entries survive anyway
            cut = n - self.capacity
            seq_ids, positions, prompt_lens = seq_ids[cut:], positions[cut:], prompt_lens[cut:]
            feats, tokens, n = feats[cut:], tokens[cut:], self.capacity
        if self.feats is None:
            # A plain tensor even though the catch-up pass runs in inference mode: the trainer
            # reads it under autograd.
            with torch.inference_mode(False):
                self.feats = torch.zeros(self.capacity, feats.shape[-1], dtype=feats.dtype,
                                         device=self.device)
        idx = (self.head + np.arange(n)) % self.capacity
        first = min(n, self.capacity - self.head)  # the ring wraps at most once per add
        for dst, src in ((slice(self.head, self.head + first), slice(0, first)),
                         (slice(0, n - first), slice(first, n))):
            if src.stop > src.start:
                self.feats[dst].copy_(feats[src])
                self.tokens[dst].copy_(tokens[src])
        self.seq_ids[idx], self.positions[idx], self.prompt_lens[idx] = (
            seq_ids, positions, prompt_lens)
        self.stamps[idx] = self.num_written + np.arange(n)
        self.head = (self.head + n) % self.capacity
        self.num_written += n
        # each call's entries come sequence by sequence, positions ascending: their last ones
        ends = np.flatnonzero(np.r_[seq_ids[1:] != seq_ids[:-1], True])
        self.next_position.update(zip(seq_ids[ends].tolist(), (positions[ends] + 1).tolist()))

    def sequences(self) -> list[BufferedSeq]:
        """Every buffered sequence that starts at position 0, cut at its first gap."""
        live = np.flatnonzero(self.seq_ids >= 0)
        if live.size == 0:
            return []
        # by sequence, then position, newest write last; keep the newest of each position
        order = live[np.lexsort((self.stamps[live], self.positions[live], self.seq_ids[live]))]
        sid, pos = self.seq_ids[order], self.positions[order]
        last = np.ones(order.size, dtype=bool)
        last[:-1] = (sid[1:] != sid[:-1]) | (pos[1:] != pos[:-1])
        order, sid, pos = order[last], sid[last], pos[last]
        out = []
        bounds = np.flatnonzero(np.diff(sid)) + 1
        for rows, ps in zip(np.split(order, bounds), np.split(pos, bounds)):
            gap = np.flatnonzero(ps != np.arange(ps.size))  # positions must run 0, 1, 2 ...
            n = int(gap[0]) if gap.size else ps.size
            if n > 0:
                out.append(BufferedSeq(int(self.seq_ids[rows[0]]), rows[:n],
                                       int(self.prompt_lens[rows[0]])))
        return out


def capture_eager(buffer: FeatureBuffer, seqs: list[Sequence], positions: list[np.ndarray],
                  feats: Tensor, ids: Tensor) -> None:
    """The entries an eager catch-up pass (``FeatureDrafter.observe``) just wrote."""
    counts = [len(p) for p in positions]
    buffer.add(np.repeat([s.seq_id for s in seqs], counts).astype(np.int64),
               np.concatenate(positions).astype(np.int64),
               np.repeat([s.num_prompt_tokens for s in seqs], counts).astype(np.int64),
               feats, ids)


def finished_entries(buffer: FeatureBuffer, seq: Sequence, num_rows: int) -> int:
    """Entries of ``seq``'s last step to buffer when it ended in that step: its positions
    ``next_position .. len - 2`` (``len - 1 - next_position`` of them: fewer than the
    ``num_rows`` accepted rows when a stop token, ``max_tokens`` or a stop string cut the
    step's tokens). 0 for a running sequence, one never buffered, or counts that do not fit
    the step (a step it was not observed in: its rows are not those positions)."""
    if seq.status is not SeqStatus.FINISHED:
        return 0
    start = buffer.next_position.get(seq.seq_id)
    if start is None:
        return 0
    n = len(seq) - 1 - start
    return n if 0 < n <= num_rows else 0


def capture_finished(buffer: FeatureBuffer, drafter: FeatureDrafter, seqs: tuple[Sequence, ...],
                     target: ForwardOutput, accepted_rows: list[list[int]]) -> None:
    """The entries of the sequences that ended in the eager step just verified
    (:func:`finished_entries`): the target's features of their first accepted rows, each with
    the token that followed."""
    done, positions, rows, tokens = [], [], [], []
    for b, seq in enumerate(seqs):
        n = finished_entries(buffer, seq, len(accepted_rows[b]))
        if n:
            start = len(seq) - 1 - n
            done.append(seq)
            positions.append(np.arange(start, start + n, dtype=np.int64))
            rows.extend(target.qo_indptr[b] + r for r in accepted_rows[b][:n])
            tokens.extend(seq.token_slice(start + 1, start + 1 + n))
    if not done:
        return
    feats = drafter.features(target, to_device(np.array(rows, np.int64), target.hidden.device))
    capture_eager(buffer, done, positions, feats,
                  to_device(np.array(tokens, np.int64), drafter.device))


def capture_static(buffer: FeatureBuffer, drafter: FeatureDrafter, seqs: tuple[Sequence, ...],
                   out: VerifyOutput, shape: VerifyShape, num_accepted: np.ndarray,
                   live: np.ndarray) -> None:
    """The entries the static catch-up pass just wrote (``StaticFeatureChain.observe``): row
    ``b``'s accepted rows ``j = 0 .. num_accepted[b]`` at positions
    ``len - num_accepted - 2 + j`` (a row that ended this step: its first
    :func:`finished_entries` rows). Host arithmetic and one non-blocking index copy."""
    n = shape.num_tokens
    counts = np.where(live, num_accepted + 1, 0).astype(np.int64)
    for b in np.flatnonzero(~live).tolist():
        counts[b] = finished_entries(buffer, seqs[b], int(num_accepted[b]) + 1)
    total = int(counts.sum())
    if total == 0:
        return
    lens = np.fromiter((len(s) for s in seqs), np.int64, len(seqs))
    row = np.repeat(np.arange(len(seqs), dtype=np.int64), counts)
    j = np.arange(total, dtype=np.int64) - np.repeat(np.cumsum(counts) - counts, counts)
    flat = row * n + j  # (row, j) in the pass's [rows, N] outputs
    idx = to_device(np.stack([flat, row * n]), drafter.device)
    sampled = out.sampled
    fed = idx[1] + sampled.row_ids.reshape(-1)[idx[0]].long()  # target row of accepted j
    feats = drafter.features(ForwardOutput(out.hidden, out.aux_hidden, []), fed)
    buffer.add(np.repeat([s.seq_id for s in seqs], counts),
               np.repeat(lens - counts - 1, counts) + j,
               np.repeat([s.num_prompt_tokens for s in seqs], counts).astype(np.int64),
               feats, sampled.output_ids.reshape(-1)[idx[0]])
