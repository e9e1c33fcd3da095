"""Per-request sampling parameters, range-checked where they are built (``__post_init__``)
against what the engine can hold, so a bad value is refused at admission and never reaches a
step, where it would fail every request in flight."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

#: seeds travel to the samplers as int64 tensors
MAX_SEED = 1 << 63
#: the largest int32: token ids, top-k and lengths reach the kernels as int32
MAX_INT32 = (1 << 31) - 1
#: the largest int64: weight versions and policy lags are compared with int64 stamps
MAX_INT64 = (1 << 63) - 1
#: samples per prompt: every sample is a sequence with its own request id and KV; a group is
#: a GRPO group (tens), and this bound keeps one call from queueing millions of sequences
MAX_N = 1024
#: positive temperatures outside [MIN_TEMPERATURE, MAX_TEMPERATURE] are refused: the sampler
#: scales float32 logits by 1 / temperature, and past these (float32 overflow of 1 / t, or
#: 1 / t rounding to 0 against a drafter's -inf logits) that gives inf or NaN probabilities
MIN_TEMPERATURE = 1e-4
MAX_TEMPERATURE = 1e4
#: distinct stop ids of one request: the step checks every emitted token against each running
#: sequence's stop ids in one array as wide as the longest list (``SeqArena.stop_ids``), so one
#: request with thousands would slow (and widen the memory of) every other request's steps
MAX_STOP_TOKEN_IDS = 256
#: stop strings of one request and the longest one, in characters: each step that emits text
#: scans the new text plus a tail of (longest - 1) characters once per string (vLLM's scan)
MAX_STOP_STRINGS = 32
MAX_STOP_STRING_CHARS = 1024
#: top-N alternatives per generated token (``SamplingParams.logprobs``; OpenAI and vLLM's cap)
MAX_TOP_LOGPROBS = 20
#: penalties are refused unless left at these values (vLLM's defaults: off)
PENALTY_DEFAULTS = {"repetition_penalty": 1.0, "presence_penalty": 0.0,
                    "frequency_penalty": 0.0}


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # True is not a count


def check_int(name: str, value: object, low: int, high: int, what: str | None = None) -> None:
    """Raise ``ValueError`` naming ``name``, the value and what is allowed (``what``, else
    the range) unless ``value`` is an int (not a bool) in ``[low, high]``."""
    if not _is_int(value) or not low <= value <= high:  # type: ignore[operator]
        raise ValueError(f"{name} must be {what or f'an int in [{low}, {high}]'}, "
                         f"got {value!r}")


def check_float(name: str, value: object, what: str, ok: Callable[[float], bool]) -> None:
    """Raise ``ValueError`` naming ``name``, the value and ``what`` is allowed unless ``value``
    is a finite int or float (not a bool) with ``ok(value)``."""
    if (isinstance(value, bool) or not isinstance(value, (int, float))
            or not math.isfinite(value) or not ok(value)):
        raise ValueError(f"{name} must be {what}, got {value!r}")


@dataclass(frozen=True)
class SamplingParams:
    """How one request is sampled (vLLM semantics).

    ``temperature`` 0 is greedy; otherwise in [1e-4, 1e4] (``MIN_TEMPERATURE`` /
    ``MAX_TEMPERATURE``: beyond them the float32 sampler would produce inf / NaN).
    ``top_k`` ≤ 0 and ``top_p`` = 1 switch those filters off; ``top_k`` is an int in
    [-1, 2**31 - 1], and a value ≥ the vocabulary keeps every token; top-k is applied before
    top-p (a float in (0, 1]). ``max_tokens`` is an int in [1, 2**31 - 1]: the engine stops a
    sequence at ``max_tokens`` generated tokens or at ``max_model_len`` tokens in all, whichever
    comes first (so a huge value means "until a stop token or the context is full").
    ``stop_token_ids`` (at most 256 distinct ids in the vocabulary, checked by the engine; and
    the checkpoint's EOS unless ``ignore_eos``) end a sequence; the stop token itself is part of
    the output, with its logprob, since an RL loss trains on it. ``seed`` (an int in [0, 2**63))
    fixes this request's random stream (same seed, same output); None draws one from the
    engine's generator. ``max_policy_lag`` (an int in [0, 2**63 - 1]) overrides the engine's for
    this request: after a weight update it is finished or restarted (the engine's
    ``policy_lag_action``) once its oldest token is more than that many versions behind; None
    uses the engine's. ``n`` (an int in [1, 1024], ``MAX_N``) samples of the prompt form a group
    (GRPO): ``generate`` returns n outputs per prompt, prompt-major, each with its
    ``sample_index``; sample i's seed is derived from ``seed``
    (``specengine.core.prefix_cache.sample_seed``) and the group's prompt KV is computed once and
    shared. A value out of range, NaN / inf, or a bool where a number belongs raises
    ``ValueError`` naming the field, the value and the allowed range.
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
    stop: tuple[str, ...] = ()
    include_stop_str_in_output: bool = False
    min_tokens: int = 0
    min_p: float = 0.0
    logprobs: int | None = None
    repetition_penalty: float = 1.0
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0

    def __post_init__(self) -> None:
        check_int("n (samples per prompt)", self.n, 1, MAX_N,
                  f"an int >= 1 (at most {MAX_N})")
        check_float("temperature", self.temperature, f"a finite number >= 0: 0 (greedy) or in "
                    f"[{MIN_TEMPERATURE:g}, {MAX_TEMPERATURE:g}]",
                    lambda t: t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE)
        check_int("top_k", self.top_k, -1, MAX_INT32,
                  f"an int in [-1, {MAX_INT32}] (<= 0 disables it)")
        check_float("top_p", self.top_p, "in (0, 1]", lambda p: 0 < p <= 1)
        check_int("max_tokens", self.max_tokens, 1, MAX_INT32,
                  f"an int >= 1 (at most {MAX_INT32}; generation also stops at max_model_len)")
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(f"ignore_eos must be a bool, got {self.ignore_eos!r}")
        if self.seed is not None:
            check_int("seed", self.seed, 0, MAX_SEED - 1, "an int in [0, 2**63) or None")
        if self.max_policy_lag is not None:
            check_int("max_policy_lag", self.max_policy_lag, 0, MAX_INT64,
                      f"an int in [0, {MAX_INT64}] (weight versions) or None (the engine's)")
        stops = self.stop_token_ids
        # bytes-like objects iterate as ints: refused, not read as token ids
        if (isinstance(stops, (str, bytes, bytearray, memoryview))
                or not hasattr(stops, "__iter__")):
            raise ValueError(f"stop_token_ids must be a sequence of int token ids, got "
                             f"{stops!r}")
        stops = tuple(stops)
        for i, t_id in enumerate(stops):
            # the vocabulary bound is the engine's (validate_requests); int32 holds every one
            check_int(f"stop_token_ids[{i}]", t_id, 0, MAX_INT32,
                      f"a token id, an int in [0, {MAX_INT32}]")
        if len(stops) > MAX_STOP_TOKEN_IDS and len(set(stops)) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids holds {len(set(stops))} distinct ids; at most "
                             f"{MAX_STOP_TOKEN_IDS} (MAX_STOP_TOKEN_IDS) are allowed")
        object.__setattr__(self, "stop_token_ids", stops)
        object.__setattr__(self, "stop", _check_stop_strings(self.stop))
        if not isinstance(self.include_stop_str_in_output, bool):
            raise ValueError(f"include_stop_str_in_output must be a bool, got "
                             f"{self.include_stop_str_in_output!r}")
        check_int("min_tokens", self.min_tokens, 0, self.max_tokens,
                  f"an int in [0, max_tokens = {self.max_tokens}]")
        check_float("min_p", self.min_p, "in [0, 1] (0 disables it)", lambda p: 0 <= p <= 1)
        if self.logprobs is not None:
            check_int("logprobs", self.logprobs, 0, MAX_TOP_LOGPROBS,
                      f"None or an int in [0, {MAX_TOP_LOGPROBS}] (top alternatives per token)")
        for name, default in PENALTY_DEFAULTS.items():
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or value != default:
                raise ValueError(f"{name} is not supported (got {value!r}): penalties are not "
                                 f"implemented; leave it at {default}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _check_stop_strings(stop: object) -> tuple[str, ...]:
    """``stop`` as a tuple of strings (a single str is one stop string, as in vLLM / OpenAI),
    or ``ValueError`` naming what is wrong."""
    if isinstance(stop, str):
        stop = (stop,)
    if isinstance(stop, bytes) or not hasattr(stop, "__iter__"):
        raise ValueError(f"stop must be a string or a sequence of strings, got {stop!r}")
    stop = tuple(stop)  # type: ignore[arg-type]
    if len(stop) > MAX_STOP_STRINGS:
        raise ValueError(f"stop holds {len(stop)} strings; at most {MAX_STOP_STRINGS} "
                         "(MAX_STOP_STRINGS) are allowed")
    for i, s in enumerate(stop):
        if not isinstance(s, str) or not s:
            raise ValueError(f"stop[{i}] must be a non-empty str, got {s!r}")
        if len(s) > MAX_STOP_STRING_CHARS:
            raise ValueError(f"stop[{i}] has {len(s)} characters; at most "
                             f"{MAX_STOP_STRING_CHARS} (MAX_STOP_STRING_CHARS) are allowed")
    return stop
