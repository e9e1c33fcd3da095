"""Running sequences' tokens, log-probabilities, weight versions and counters in host arrays.

A sequence takes a slot when it starts running (prefill) and gives it back when it finishes or
is preempted (``Sequence.attach`` / ``Sequence.detach`` copy its lists in and out). While it
runs, its slot is the only copy of its tokens, so a step appends every row's emitted tokens
with a few numpy operations (:meth:`SeqArena.append`) instead of a Python loop over sequences:
the stop-token, ``max_tokens`` and ``max_model_len`` cuts, the counters and the per-token
weight versions are all vectorised. Slots are stable while a sequence runs (batch rows are
not: ``core.batch`` moves rows when sequences leave), so drafters may key per-sequence device
state by slot too.

Columns are token positions: ``tokens[s, :lens[s]]`` are the sequence's tokens (prompt
first), ``logprobs`` and ``versions`` are meaningful from ``num_prompt[s]`` on. The width grows
by doubling when a sequence needs more (amortised; never in a steady step).
"""

from __future__ import annotations

import numpy as np

# Counter rows of ``SeqArena.counters``.
NUM_STEPS, NUM_DRAFT, NUM_ACCEPTED = range(3)


class SeqArena:
    """Host storage for up to ``capacity`` running sequences (see the module docstring)."""

    def __init__(self, capacity: int, max_model_len: int, width: int = 256) -> None:
        if capacity < 1 or max_model_len < 1:
            raise ValueError(f"SeqArena needs capacity and max_model_len >= 1, got {capacity}, "
                             f"{max_model_len}")
        self.capacity, self.max_model_len = capacity, max_model_len
        width = max(1, min(width, max_model_len))
        self.tokens = np.zeros((capacity, width), dtype=np.int64)
        self.logprobs = np.zeros((capacity, width), dtype=np.float64)
        self.versions = np.zeros((capacity, width), dtype=np.int64)
        self.lens = np.zeros(capacity, dtype=np.int64)
        self.num_prompt = np.zeros(capacity, dtype=np.int64)
        # The length a sequence ends at: prompt + max_tokens, capped by max_model_len.
        self.limit = np.zeros(capacity, dtype=np.int64)
        self.counters = np.zeros((3, capacity), dtype=np.int64)
        # Scheduling: draft tokens a verify step feeds after the newest token (uncapped), and
        # KV blocks owned (kept current by the scheduler; the batch state sends grown rows).
        self.lookahead = np.zeros(capacity, dtype=np.int64)
        self.num_blocks = np.zeros(capacity, dtype=np.int64)
        self.done = np.zeros(capacity, dtype=bool)  # ended in its last step (not released yet)
        # Takes of each slot so far: a sequence that left and came back to the same slot
        # (preempted, prefilled again) is told apart from one that stayed.
        self.epoch = np.zeros(capacity, dtype=np.int64)
        self.stop_ids = np.full((capacity, 1), -1, dtype=np.int64)  # -1 pads (never a token)
        self._free = list(range(capacity - 1, -1, -1))

    @property
    def width(self) -> int:
        return self.tokens.shape[1]

    @property
    def num_free(self) -> int:
        return len(self._free)

    # ---- slots -----------------------------------------------------------------------------
    def take(self, tokens: list[int], num_prompt: int, max_tokens: int,
             stop_ids: frozenset[int]) -> int:
        """A slot holding ``tokens`` (prompt + generated so far); the caller writes the
        generated tokens' logprobs / versions and the counters."""
        if not self._free:
            raise RuntimeError(f"SeqArena: all {self.capacity} slots are taken")
        n = len(tokens)
        self._grow(n)
        s = self._free.pop()
        self.tokens[s, :n] = tokens
        self.lens[s] = n
        self.num_prompt[s] = num_prompt
        self.limit[s] = min(num_prompt + max_tokens, self.max_model_len)
        self.counters[:, s] = 0
        self.lookahead[s] = self.num_blocks[s] = 0
        self.done[s] = False
        self.epoch[s] += 1
        if len(stop_ids) > self.stop_ids.shape[1]:
            pad = np.full((self.capacity, len(stop_ids) - self.stop_ids.shape[1]), -1, np.int64)
            self.stop_ids = np.concatenate([self.stop_ids, pad], axis=1)
        self.stop_ids[s] = -1
        self.stop_ids[s, :len(stop_ids)] = sorted(stop_ids)
        return s

    def give_back(self, slot: int) -> None:
        self.lens[slot] = 0
        self._free.append(slot)

    def _grow(self, need: int) -> None:
        if need <= self.width:
            return
        width = self.width
        while width < need:
            width *= 2
        width = min(width, max(need, self.max_model_len))
        for name in ("tokens", "logprobs", "versions"):
            old = getattr(self, name)
            new = np.zeros((self.capacity, width), dtype=old.dtype)
            new[:, : old.shape[1]] = old
            setattr(self, name, new)

    # ---- the step ----------------------------------------------------------------------------
    def append(self, slots: np.ndarray, ids: np.ndarray, logprobs: np.ndarray,
               num_emitted: np.ndarray, version: int) -> tuple[np.ndarray, np.ndarray]:
        """Append row ``b``'s first ``num_emitted[b]`` tokens ``ids [B, M]`` (and logprobs) to
        slot ``slots[b]``, stopping after the first stop token, at ``max_tokens`` or at
        ``max_model_len`` (nothing after that point is kept); each kept token records
        ``version``. Returns ``(kept [B], ended [B] int8: 0 running, 1 "stop", 2 "length")``.
        """
        b, m = ids.shape
        lens = self.lens[slots]
        j = np.arange(m)
        emitted = j[None, :] < num_emitted[:, None]  # [B, M]
        stops = self.stop_ids[slots]  # [B, S]
        is_stop = (ids[:, :, None] == stops[:, None, :]).any(-1) & emitted
        # Tokens up to and including the first stop; then at most the room left.
        first_stop = np.where(is_stop.any(1), is_stop.argmax(1) + 1, m + 1)
        room = self.limit[slots] - lens
        kept = np.minimum(np.minimum(num_emitted, first_stop), room)
        self._grow(int((lens + kept).max(initial=0)))
        keep = j[None, :] < kept[:, None]
        rows = np.broadcast_to(slots[:, None], (b, m))[keep]
        cols = (lens[:, None] + j[None, :])[keep]
        self.tokens[rows, cols] = ids[keep]
        self.logprobs[rows, cols] = logprobs[keep]
        self.versions[rows, cols] = version
        self.lens[slots] = lens + kept
        ended = np.where(first_stop == kept, 1, np.where(lens + kept >= self.limit[slots], 2, 0))
        self.done[slots] = ended > 0
        return kept, ended.astype(np.int8)

    def count(self, slots: np.ndarray, num_draft: np.ndarray, num_accepted: np.ndarray) -> None:
        """One more step for every slot, with its drafts proposed and accepted."""
        c = self.counters
        c[NUM_STEPS, slots] += 1
        c[NUM_DRAFT, slots] += num_draft
        c[NUM_ACCEPTED, slots] += num_accepted


__all__ = ["NUM_ACCEPTED", "NUM_DRAFT", "NUM_STEPS", "SeqArena"]
