"""A request's state while it is being generated."""

from __future__ import annotations

import enum

from specengine.sampling import SamplingParams


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


class Sequence:
    """Tokens, KV blocks and counters of one request.

    Invariant between steps: the KV of ``token_ids[:num_cached_tokens]`` is in the cache and
    ``num_cached_tokens == len(token_ids) - 1`` while running (the newest token is fed to the
    next step), 0 while waiting.
    """

    def __init__(self, seq_id: int, prompt: list[int], params: SamplingParams, seed: int,
                 eos_token_ids: tuple[int, ...]) -> None:
        self.seq_id = seq_id
        self.token_ids: list[int] = list(prompt)
        self.num_prompt_tokens = len(prompt)
        self.params = params
        self.seed = seed
        stop = set(params.stop_token_ids)
        if not params.ignore_eos:
            stop.update(eos_token_ids)
        self.stop_token_ids = frozenset(stop)
        self.logprobs: list[float] = []
        #: per output token, the weight version that produced it (``stamp``)
        self.token_weight_versions: list[int] = []
        self.block_table: list[int] = []
        self.num_cached_tokens = 0
        self.status = SeqStatus.WAITING
        self.finish_reason: str | None = None
        self.num_steps = 0
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_generated(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def last_token(self) -> int:
        return self.token_ids[-1]

    def stamp(self, version: int) -> None:
        """Record ``version`` for every output token not stamped yet. Called once after each
        step that appended (weights change only between steps, so all of a step's tokens
        come from one version); keeping it out of :meth:`append` keeps the step's hot loop
        unchanged."""
        missing = self.num_generated - len(self.token_weight_versions)
        if missing > 0:
            self.token_weight_versions.extend([version] * missing)

    def append(self, tokens: list[int], logprobs: list[float], max_model_len: int) -> None:
        """Add this step's emitted tokens, stopping at the first stop token, at ``max_tokens``
        or at ``max_model_len`` (nothing after that point is kept)."""
        n = len(tokens)
        if (self.num_generated + n < self.params.max_tokens
                and len(self.token_ids) + n < max_model_len
                and self.stop_token_ids.isdisjoint(tokens)):  # the common case: no end here
            self.token_ids.extend(tokens)
            self.logprobs.extend(logprobs)
            return
        for token, logprob in zip(tokens, logprobs):
            self.token_ids.append(token)
            self.logprobs.append(logprob)
            if token in self.stop_token_ids:
                self.finish_reason = "stop"
            elif self.num_generated >= self.params.max_tokens or len(self) >= max_model_len:
                self.finish_reason = "length"
            if self.finish_reason is not None:
                self.status = SeqStatus.FINISHED
                return
