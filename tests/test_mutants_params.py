"""Issue 29: the edges of ``SamplingParams`` and of a ``generate`` call's shape that the
admission-bound tests left out: ``top_p`` 0, ``stop_token_ids`` given as bytes, repeated stop
ids (their number is bounded by distinct ids), stop ids kept as an immutable tuple, an empty
prompt, and one ``SamplingParams`` per prompt. ``mutation/mutate.py --area params`` shows
each test fails on the change it targets."""

from __future__ import annotations

import pytest
import torch

from specengine.core.kv_cache import KVCache
from specengine.core.requests import validate_requests
from specengine.sampling import MAX_STOP_TOKEN_IDS, SamplingParams


@pytest.mark.parametrize("top_p", [0, 0.0, -0.0])
def test_top_p_zero_is_refused(top_p: float) -> None:
    with pytest.raises(ValueError, match=r"top_p must be in \(0, 1\], got"):
        SamplingParams(top_p=top_p)
    assert SamplingParams(top_p=1e-9).top_p == 1e-9  # any positive mass is a filter


@pytest.mark.parametrize("stops", [b"\x01\x02", bytearray(b"\x01"), memoryview(b"\x01"), "12"])
def test_stop_ids_as_bytes_or_text_are_refused(stops: object) -> None:
    with pytest.raises(ValueError, match="stop_token_ids must be a sequence of int token ids"):
        SamplingParams(stop_token_ids=stops)  # type: ignore[arg-type]


def test_stop_ids_bound_counts_distinct_ids() -> None:
    many = tuple(range(MAX_STOP_TOKEN_IDS)) * 3  # 768 entries, 256 distinct: allowed
    assert len(SamplingParams(stop_token_ids=many).stop_token_ids) == 3 * MAX_STOP_TOKEN_IDS
    with pytest.raises(ValueError, match=f"holds {MAX_STOP_TOKEN_IDS + 1} distinct ids"):
        SamplingParams(stop_token_ids=tuple(range(MAX_STOP_TOKEN_IDS + 1)))


def test_stop_ids_are_kept_as_a_tuple() -> None:
    """A list (or generator) is copied into a tuple: the frozen params stay hashable and the
    caller's later edits of its list change nothing."""
    ids = [3, 4]
    sp = SamplingParams(stop_token_ids=ids)  # type: ignore[arg-type]
    ids.append(5)
    assert sp.stop_token_ids == (3, 4) and isinstance(sp.stop_token_ids, tuple)
    assert SamplingParams(stop_token_ids=iter([7])).stop_token_ids == (7,)  # type: ignore
    assert hash(sp) == hash(SamplingParams(stop_token_ids=(3, 4)))


def validate(batch: list, sampling=None) -> object:
    cache = KVCache(8, 16, 1, 1, 2, torch.float32, "cpu")
    return validate_requests(batch, 0, sampling, None, tokenizer=None, vocab_size=100,
                             max_model_len=100, kv_cache=cache, has_drafter=False)


def test_an_empty_prompt_is_refused() -> None:
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        validate([[1, 2], []])


def test_one_sampling_params_per_prompt() -> None:
    sp = SamplingParams(max_tokens=4)
    assert validate([[1], [2]], [sp, sp]).params == (sp, sp)
    for wrong in ([sp], [sp, sp, sp]):
        with pytest.raises(ValueError, match=r"one SamplingParams or one per prompt \(2\), "
                           f"got {len(wrong)}"):
            validate([[1], [2]], wrong)
