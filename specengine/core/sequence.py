"""A request's state while it is being generated."""

from __future__ import annotations

import enum
from typing import TYPE_CHECKING

import numpy as np

from specengine.sampling import SamplingParams

if TYPE_CHECKING:
    from specengine.core.seq_arena import SeqArena
    from specengine.core.stop_strings import StopStrings


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


_COUNTERS = ("num_steps", "num_draft_tokens", "num_accepted_tokens")


class Sequence:
    """Tokens, KV blocks and counters of one request.

    Invariant between steps: the KV of ``token_ids[:num_cached_tokens]`` is in the cache and
    ``num_cached_tokens == len(token_ids) - 1`` while running (the newest token is fed to the
    next step), 0 while waiting.

    Storage: plain lists while waiting or finished; while running the sequence is *attached*
    to a slot of the engine's :class:`~specengine.core.seq_arena.SeqArena`, which is then the
    only copy of its tokens, logprobs, per-token versions, counters and KV block table (a step
    appends every sequence's tokens at once and grows every short table at once). The
    accessors below read whichever holds them; :meth:`token_slice` and :meth:`token_array`
    read a part without copying the whole list.
    """

    def __init__(self, seq_id: int, prompt: list[int], params: SamplingParams, seed: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.seq_id = seq_id
        self._token_ids: list[int] = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.params = params
        self.seed = seed
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(eos_token_ids)
        self.stop_token_ids = frozenset(stop)
        self._logprobs: list[float] = []
        #: per output token, the weight version that produced it
        self._versions: list[int] = []
        self._counters = [0, 0, 0]
        self._block_table: list[int] = []
        self.num_cached_tokens = 0
        #: prompt tokens its first prefill took from the prefix cache (vLLM's
        #: ``num_cached_tokens`` of a request)
        self.num_prefix_cached_tokens = 0
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        #: stop-string state (``specengine.stop_strings``; set by the engine when
        #: ``params.stop`` is non-empty)
        self.stop_strings: StopStrings | None = None
        #: with ``params.logprobs``: per output token, {id: raw logprob} of the top N and of
        #: the token itself (``specengine.token_logprobs``)
        self.top_logprobs: list[dict[int, float]] = []
        self.arena: SeqArena | None = None
        self.slot = -1

    # ---- arena attachment ------------------------------------------------------------------
    def attach(self, arena: SeqArena) -> int:
        """Move the lists into a slot of ``arena`` (the sequence starts running)."""
        if self.arena is not None:
            raise RuntimeError(f"seq {self.seq_id} is already attached to slot {self.slot}")
        s = arena.take(self._token_ids, self.num_prompt_tokens, self.params.max_tokens,
                       self.stop_token_ids)
        p, n = self.num_prompt_tokens, len(self._token_ids)
        arena.logprobs[s, p:n] = self._logprobs
        arena.versions[s, p:n] = self._versions if len(self._versions) == n - p else 0
        arena.counters[:, s] = self._counters
        arena.set_blocks(s, self._block_table)
        arena.has_stop_strings[s] = self.stop_strings is not None
        self.arena, self.slot = arena, s
        return s

    def detach(self) -> None:
        """Copy the slot back into lists and give the slot back (finished or preempted)."""
        a, s = self.arena, self.slot
        if a is None:
            return
        n, p = int(a.lens[s]), self.num_prompt_tokens
        self._token_ids = a.tokens[s, :n].tolist()
        self._logprobs = a.logprobs[s, p:n].tolist()
        self._versions = a.versions[s, p:n].tolist()
        self._counters = a.counters[:, s].tolist()
        self._block_table = a.blocks_of(s)
        a.give_back(s)
        self.arena, self.slot = None, -1

    # ---- KV blocks -----------------------------------------------------------------------------
    @property
    def block_table(self) -> list[int]:
        """The KV blocks holding this sequence's tokens, in order (a copy while attached:
        change it by assigning or with :meth:`add_blocks`, never in place)."""
        a = self.arena
        if a is None:
            return self._block_table
        return a.blocks_of(self.slot)

    @block_table.setter
    def block_table(self, ids: list[int]) -> None:
        if self.arena is None:
            self._block_table = list(ids)
        else:
            self.arena.set_blocks(self.slot, ids)

    @property
    def num_blocks(self) -> int:
        """``len(block_table)`` without a copy."""
        a = self.arena
        return len(self._block_table) if a is None else int(a.num_blocks[self.slot])

    def add_blocks(self, ids: list[int] | np.ndarray) -> None:
        """Append ``ids`` to the block table."""
        if self.arena is None:
            self._block_table.extend(int(b) for b in ids)
        else:
            counts = np.array([len(ids)], dtype=np.int64)
            self.arena.add_blocks(np.array([self.slot]), counts, np.asarray(ids, np.int32))

    # ---- tokens ------------------------------------------------------------------------------
    def __len__(self) -> int:
        a = self.arena
        return len(self._token_ids) if a is None else int(a.lens[self.slot])

    @property
    def token_ids(self) -> list[int]:
        """All tokens, prompt first (a copy while attached: prefer :meth:`token_slice`)."""
        a = self.arena
        if a is None:
            return self._token_ids
        return a.tokens[self.slot, : a.lens[self.slot]].tolist()

    @token_ids.setter
    def token_ids(self, tokens: list[int]) -> None:
        if self.arena is not None:
            raise RuntimeError(f"seq {self.seq_id} is running: its tokens live in the arena")
        self._token_ids = list(tokens)

    def token_slice(self, start: int, end: int | None = None) -> list[int]:
        """``token_ids[start:end]`` without copying the rest."""
        a = self.arena
        if a is None:
            return self._token_ids[start:end]
        n = int(a.lens[self.slot])
        return a.tokens[self.slot, :n][start:end].tolist()

    def token_array(self) -> np.ndarray:
        """All tokens as an int64 array (a view of the slot while attached: do not keep it
        across steps)."""
        a = self.arena
        if a is None:
            return np.asarray(self._token_ids, dtype=np.int64)
        return a.tokens[self.slot, : a.lens[self.slot]]

    @property
    def logprobs(self) -> list[float]:
        a = self.arena
        if a is None:
            return self._logprobs
        return a.logprobs[self.slot, self.num_prompt_tokens: a.lens[self.slot]].tolist()

    @property
    def token_weight_versions(self) -> list[int]:
        a = self.arena
        if a is None:
            return self._versions
        return a.versions[self.slot, self.num_prompt_tokens: a.lens[self.slot]].tolist()

    @property
    def num_generated(self) -> int:
        return len(self) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_slice(self.num_prompt_tokens)

    @property
    def last_token(self) -> int:
        a = self.arena
        if a is None:
            return self._token_ids[-1]
        return int(a.tokens[self.slot, a.lens[self.slot] - 1])

    def _counter(i: int) -> property:  # noqa: N805 -- a property factory in the class body
        def get(self: Sequence) -> int:
            a = self.arena
            return self._counters[i] if a is None else int(a.counters[i, self.slot])

        def put(self: Sequence, value: int) -> None:
            if self.arena is None:
                self._counters[i] = value
            else:
                self.arena.counters[i, self.slot] = value

        return property(get, put)

    num_steps = _counter(0)
    num_draft_tokens = _counter(1)
    num_accepted_tokens = _counter(2)
    del _counter

    def append(self, tokens: list[int], logprobs: list[float], max_model_len: int) -> None:
        """Add this step's emitted tokens, stopping at the first stop token, at ``max_tokens``
        or at ``max_model_len`` (nothing after that point is kept). Detached sequences only:
        the engine appends attached ones all at once (``core.step.append_step``)."""
        if self.arena is not None:
            raise RuntimeError(f"seq {self.seq_id} is running: the step appends its tokens")
        for token, logprob in zip(tokens, logprobs):
            self._token_ids.append(token)
            self._logprobs.append(logprob)
            if token in self.stop_token_ids:
                self.finish_reason = "stop"
            elif self.num_generated >= self.params.max_tokens or len(self) >= max_model_len:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                self.status = SeqStatus.FINISHED
                return

    def finish(self, reason: str) -> None:
        self.finish_reason = reason
        self.status = SeqStatus.FINISHED
