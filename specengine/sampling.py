"""Per-request sampling parameters."""

from __future__ import annotations

import math
from dataclasses import dataclass

MAX_SEED = 1 << 63


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled (vLLM semantics).

    ``temperature`` 0 is greedy. ``top_k`` ≤ 0 and ``top_p`` = 1 switch those filters off; top-k
    is applied before top-p. ``stop_token_ids`` (and the checkpoint's EOS unless ``ignore_eos``)
    end a sequence; the stop token itself is part of the output, with its logprob, since an RL
    loss trains on it. ``seed`` fixes this request's random stream (same seed, same output);
    None draws one from the engine's generator. ``max_policy_lag`` overrides the engine's for
    this request: after a weight update it is finished or restarted (the engine's
    ``policy_lag_action``) once its oldest token is more than that many versions behind;
    None uses the engine's. ``n`` samples of the prompt form a group (GRPO): ``generate``
    returns n outputs per prompt, prompt-major, each with its ``sample_index``; sample i's seed
    is derived from ``seed`` (``specengine.prefix_cache.sample_seed``) and the group's prompt
    KV is computed once and shared.
    """

    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    max_tokens: int = 256
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    seed: int | None = None
    max_policy_lag: int | None = None
    n: int = 1

    def __post_init__(self) -> None:
        if not isinstance(self.n, int) or isinstance(self.n, bool) or self.n < 1:
            raise ValueError(f"n (samples per prompt) must be an int >= 1, got {self.n!r}")
        if not (isinstance(self.temperature, (int, float)) and math.isfinite(self.temperature)
                and self.temperature >= 0):
            raise ValueError(f"temperature must be a finite number >= 0, got {self.temperature!r}")
        if not isinstance(self.top_k, int) or isinstance(self.top_k, bool):
            raise ValueError(f"top_k must be an int (<= 0 disables it), got {self.top_k!r}")
        if not (isinstance(self.top_p, (int, float)) and 0.0 < self.top_p <= 1.0):
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an int >= 1, got {self.max_tokens!r}")
        if self.seed is not None and (not isinstance(self.seed, int) or isinstance(self.seed, bool)
                                      or not 0 <= self.seed < MAX_SEED):
            # Seeds travel to the samplers as int64 tensors.
            raise ValueError(f"seed must be an int in [0, 2**63) or None, got {self.seed!r}")
        if self.max_policy_lag is not None and (
                not isinstance(self.max_policy_lag, int) or isinstance(self.max_policy_lag, bool)
                or self.max_policy_lag < 0):
            raise ValueError(f"max_policy_lag must be an int >= 0 (weight versions) or None "
                             f"(the engine's), got {self.max_policy_lag!r}")
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0
