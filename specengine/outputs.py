"""What ``SpecEngine.generate`` and ``SpecEngine.step`` return."""

from __future__ import annotations

from dataclasses import dataclass

#: "error": the request alone failed inside a step (``GenerationOutput.error`` says why;
#: docs/design.md §1), every other request went on
FINISH_REASONS = ("stop", "length", "abort", "policy_lag", "error")


@dataclass(frozen=True)
class GenerationOutput:
    """One finished request.

    ``logprobs[i]`` is the log-probability of ``token_ids[i]`` under the policy's distribution
    after temperature, top-k and top-p (raw ``log_softmax`` for greedy requests): the quantity
    an RL loss needs, identical whether the token came from a draft or not.
    """

    prompt_token_ids: tuple[int, ...]
    token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    finish_reason: str  # "stop", "length", "abort" (SpecEngine.abort), "policy_lag", "error"
    num_steps: int  # target forward passes that produced tokens for this request (prefill incl.)
    num_draft_tokens: int
    num_accepted_tokens: int
    weight_version: int = 0
    text: str | None = None
    token_weight_versions: tuple[int, ...] = ()
    sample_index: int = 0  # which of its prompt's ``SamplingParams.n`` samples
    #: why the request failed (exactly when ``finish_reason == "error"``); its tokens are the
    #: ones made before the failing step
    error: str | None = None
    #: what stopped it (vLLM's ``stop_reason``): the stop string that matched
    #: (``SamplingParams.stop``; ``text`` is cut there), or the stop token id of
    #: ``stop_token_ids`` that ended it; None for EOS, a length limit or any other finish
    stop_reason: str | int | None = None
    #: with ``SamplingParams.logprobs = N``: per generated token, {token id: logprob} of the
    #: N most likely tokens and the generated one under the policy's raw distribution
    #: (log-softmax of the logits at that position, before temperature and filters); else ()
    top_logprobs: tuple[dict[int, float], ...] = ()
    #: prompt tokens whose KV its first prefill took from the prefix cache (vLLM's
    #: ``num_cached_tokens``; a group sample borrowing a sibling's pass counts 0)
    num_cached_tokens: int = 0

    def __post_init__(self) -> None:
        if not 0 <= self.num_cached_tokens <= len(self.prompt_token_ids):
            raise ValueError(f"num_cached_tokens must be in [0, {len(self.prompt_token_ids)}] "
                             f"(the prompt's length), got {self.num_cached_tokens!r}")
        if not isinstance(self.sample_index, int) or self.sample_index < 0:
            raise ValueError(f"sample_index must be an int >= 0, got {self.sample_index!r}")
        if len(self.token_ids) != len(self.logprobs):
            raise ValueError("token_ids and logprobs must have the same length")
        if self.token_weight_versions and len(self.token_weight_versions) != len(self.token_ids):
            raise ValueError("token_weight_versions must have one entry per token (or none)")
        if self.finish_reason not in FINISH_REASONS:
            raise ValueError(f"finish_reason must be one of {FINISH_REASONS}, got "
                             f"{self.finish_reason!r}")
        if (self.finish_reason == "error") != (self.error is not None):
            raise ValueError(f"error is set exactly when finish_reason is 'error' (got "
                             f"finish_reason {self.finish_reason!r}, error {self.error!r})")
        if self.error is not None and (not isinstance(self.error, str) or not self.error):
            raise ValueError(f"error must be a non-empty str, got {self.error!r}")
        if self.top_logprobs and len(self.top_logprobs) != len(self.token_ids):
            raise ValueError("top_logprobs must have one entry per token (or none)")
        if self.stop_reason is not None and self.finish_reason != "stop":
            raise ValueError(f"stop_reason is set only when finish_reason is 'stop' (got "
                             f"{self.finish_reason!r}, stop_reason {self.stop_reason!r})")


@dataclass(frozen=True)
class RequestOutput:
    """One request's progress in one ``SpecEngine.step`` (or its end, from ``abort``).

    ``new_token_ids`` are the tokens this step added (all steps' concatenated are the final
    ``token_ids``); ``output`` is the complete :class:`GenerationOutput` once ``finished``,
    else None. ``restarted`` is True on the first output after the request was restarted
    from its prompt (``policy_lag_action="restart"``): the tokens reported before it are
    void, and concatenation starts again from this output's ``new_token_ids``."""

    request_id: str
    new_token_ids: tuple[int, ...]
    finished: bool
    output: GenerationOutput | None = None
    restarted: bool = False

    def __post_init__(self) -> None:
        if self.finished != (self.output is not None):
            raise ValueError("RequestOutput.output is set exactly when the request finished")


def _ratio(num: int, den: int) -> float:
    return num / den if den else 0.0


@dataclass(frozen=True)
class EngineStats:
    """Counters of the last ``generate`` call, or with the step API of the steps since the
    engine was last idle (docs/design.md §3 ``engine.stats``)."""

    num_steps: int = 0  # speculative (or decode) steps, excluding prefill
    num_generated_tokens: int = 0
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: tuple[int, ...] = ()  # accepted drafts at position j
    proposed_per_position: tuple[int, ...] = ()  # drafts proposed at position j
    num_target_forwards: int = 0  # prefill and verify passes
    num_seq_steps: int = 0  # (sequence, decode/verify step) pairs
    num_step_tokens: int = 0  # tokens kept by those steps
    # Decode steps' phases: device time on CUDA (timing events), the engine thread's CPU time
    # off CUDA (core.graphs.StepClock: on a shared machine wall time is mostly other jobs')
    time_draft_s: float = 0.0
    time_verify_s: float = 0.0  # the verify pass and rejection sampling: one static pass
    time_bookkeeping_s: float = 0.0
    time_prefill_s: float = 0.0
    wall_time_s: float = 0.0
    #: steps of ``k="auto"`` request groups by the k they ran (index = k; catch-up steps: 0)
    auto_k_steps: tuple[int, ...] = ()
    # Prefills (docs/design.md §17): tokens whose KV they had to hold (re-prefills after
    # preemption included), of which reused instead of computed (prefix-cache hits and
    # group samples borrowing a sibling's pass), and block references they shared.
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_shared_blocks: int = 0
    # MoE targets (docs/design.md §21): per pass kind (prefill, 1-token decode, verify of
    # k+1 tokens per sequence) the MoE layer passes, the distinct experts they touched
    # (summed over layers and passes: each expert whose weights a pass read) and the real
    # tokens they routed (padded static rows excluded). Zero for dense models.
    moe_prefill_layer_passes: int = 0
    moe_prefill_experts: int = 0
    moe_prefill_tokens: int = 0
    moe_decode_layer_passes: int = 0
    moe_decode_experts: int = 0
    moe_decode_tokens: int = 0
    moe_verify_layer_passes: int = 0
    moe_verify_experts: int = 0
    moe_verify_tokens: int = 0

    @property
    def experts_per_decode(self) -> float:
        """Distinct experts a 1-token decode pass touched, averaged over layers and passes."""
        return _ratio(self.moe_decode_experts, self.moe_decode_layer_passes)

    @property
    def experts_per_verify(self) -> float:
        """Distinct experts a verify pass touched, averaged over layers and passes."""
        return _ratio(self.moe_verify_experts, self.moe_verify_layer_passes)

    @property
    def experts_per_prefill(self) -> float:
        """Distinct experts a prefill pass touched, averaged over layers and passes."""
        return _ratio(self.moe_prefill_experts, self.moe_prefill_layer_passes)

    @property
    def num_computed_prompt_tokens(self) -> int:
        return self.num_prompt_tokens - self.num_cached_prompt_tokens

    @property
    def mean_accepted_length(self) -> float:
        """Tokens kept per sequence per decode/verify step (accepted drafts + the bonus or
        correction token; EAGLE's tau); 1.0 for plain decoding. Prefill tokens are excluded."""
        return self.num_step_tokens / self.num_seq_steps if self.num_seq_steps else 0.0

    @property
    def acceptance_rate_per_position(self) -> tuple[float, ...]:
        return tuple(a / p if p else 0.0
                     for a, p in zip(self.accepted_per_position, self.proposed_per_position))

    @property
    def tokens_per_second(self) -> float:
        return self.num_generated_tokens / self.wall_time_s if self.wall_time_s > 0 else 0.0
