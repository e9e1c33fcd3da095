"""The engine's sampler front (``core.sampler``): every argument of a step reaches the
rejection sampler on each of its paths, a prefill's sampling tensors hold each request's own
parameters, and the packed step result unpacks to exactly what the sampler emitted."""

from __future__ import annotations

import math
import warnings

import numpy as np
import pytest
import torch
from test_chain_sampler import _case

from specengine import SamplingParams
from specengine.core.sampler import Sampler, SamplerOutput, SamplingTensors, StepResult
from specengine.core.sequence import Sequence
from specengine.kernels.reference import rejection_sample


def _args(seed: int, mode: str):
    """A chain case with draft distributions (``mode``: over the target's vocabulary or a
    reduced one) and a tight min-p on every row, so both change what is emitted."""
    logits, drafts, num_draft, probs, temp, top_k, top_p, seeds, offsets, _, index = _case(
        seed, 12, 4, 37, mode, True)
    log_min_p = torch.full((12,), math.log(0.2))
    return logits, drafts, num_draft, probs, temp, top_k, top_p, seeds, offsets, log_min_p, index


def _assert_equal(got: SamplerOutput, want: tuple) -> None:
    for g, w in zip((got.output_ids, got.num_accepted, got.logprobs, got.row_ids), want):
        assert g.dtype == w.dtype and torch.equal(g, w), (g, w)


@pytest.mark.parametrize("fast", [True, False])
@pytest.mark.parametrize("mode", ["probs", "draft_vocab"])
def test_sampled_chains_follow_draft_distributions_and_min_p_on_every_path(
        fast: bool, mode: str) -> None:
    """The CPU fast path and the general path (captured passes) both emit the reference's
    outputs for rows with min-p and drafts drawn from distributions (over a draft vocabulary
    too): none of ``draft_probs``, ``log_min_p`` or ``draft_index`` is dropped on the way."""
    s = Sampler("torch", torch.device("cpu"))
    s.cpu_fast_paths = fast
    for seed in range(3):
        (logits, drafts, num_draft, probs, temp, top_k, top_p, seeds, offsets, log_min_p,
         index) = _args(seed, mode)
        params = SamplingTensors(temp, top_k, top_p, seeds, offsets, log_min_p)
        got = s(logits, drafts, num_draft, probs, None, params, index)
        want = rejection_sample(logits, drafts, num_draft, probs, temp, top_k, top_p, seeds,
                                offsets, None, log_min_p, draft_index=index)
        _assert_equal(got, want)


def test_trees_are_judged_as_trees_with_min_p() -> None:
    """A tree step goes to the general sampler with its parents and the rows' min-p."""
    logits, drafts, num_draft, _, temp, top_k, top_p, seeds, offsets, log_min_p, _ = _args(
        4, "probs")
    parents = torch.tensor([-1, 0, 0, 1], dtype=torch.int32)
    num_draft = torch.full_like(num_draft, 3)
    # likely drafts (long accepted paths): node 1 and node 2 are the root's best two tokens,
    # node 3 (a child of node 1) is node 1's best: a chain's order would judge them elsewhere
    best = logits.topk(2, -1).indices
    drafts = torch.stack([best[:, 0, 0], best[:, 0, 1], best[:, 1, 0]], 1)
    params = SamplingTensors(temp, top_k, top_p, seeds, offsets, log_min_p)
    got = Sampler("torch", torch.device("cpu"))(logits, drafts, num_draft, None, parents, params)
    _assert_equal(got, rejection_sample(logits, drafts, num_draft, None, temp, top_k, top_p,
                                        seeds, offsets, parents, log_min_p))


def _seq(i: int, prompt_len: int, **kw) -> Sequence:
    return Sequence(i, list(range(1, prompt_len + 1)), SamplingParams(**kw), seed=1000 + i,
                    eos_token_ids=(0,))


def test_prefill_sampling_tensors_hold_each_requests_parameters() -> None:
    """Row ``b`` of a prefill's tensors is request ``b``'s temperature, top-k, top-p, seed,
    the position of its first new token (its length), and log(min-p) (-inf where min-p is
    off), in the documented dtypes, without a warning for requests that leave min-p off."""
    seqs = (_seq(0, 3, temperature=0.7, top_k=5, top_p=0.9, min_p=0.25),
            _seq(1, 6),
            _seq(2, 2, temperature=0.0, top_k=-1, top_p=0.5, min_p=1.0))
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # log(0) would warn (a user's logs) and give -inf
        t = SamplingTensors.from_seqs(seqs, torch.device("cpu"))
    want = {"temperature": ([0.7, 1.0, 0.0], torch.float32),
            "top_k": ([5, SamplingParams().top_k, -1], torch.int64),
            "top_p": ([0.9, 1.0, 0.5], torch.float32),
            "seeds": ([1000, 1001, 1002], torch.int64),
            "offsets": ([3, 6, 2], torch.int64),
            "log_min_p": ([math.log(0.25), float("-inf"), 0.0], torch.float32)}
    for name, (values, dtype) in want.items():
        got = getattr(t, name)
        assert got.dtype == dtype, name
        assert torch.equal(got, torch.tensor(values, dtype=dtype)), (name, got)


def test_packed_step_result_unpacks_to_the_emitted_rows() -> None:
    """``pack`` then ``StepResult.unpack`` of the first ``num_rows`` rows (a padded batch)
    gives back each row's ids, logprobs, judged rows and accepted count, ids as int64."""
    ids = torch.tensor([[5, 7, -1, -1], [9, 2, 4, 8], [1, -1, -1, -1]])
    lps = torch.tensor([[-0.5, -1.25, 0.0, 0.0], [-2.0, -0.125, -3.5, -0.75],
                        [-0.25, 0.0, 0.0, 0.0]])
    rows = torch.tensor([[0, 1, -1, -1], [0, 1, 2, 3], [0, -1, -1, -1]], dtype=torch.int32)
    acc = torch.tensor([1, 3, 0], dtype=torch.int32)
    packed = SamplerOutput(ids, acc, lps, rows).pack()
    assert packed.shape == (3, 13) and packed.dtype == torch.float64
    res = StepResult.unpack(packed.numpy(), 2)
    assert res.output_ids.dtype == res.row_ids.dtype == res.num_accepted.dtype == np.int64
    assert res.logprobs.dtype == np.float64
    assert np.array_equal(res.output_ids, ids[:2].numpy())
    assert np.array_equal(res.logprobs, lps[:2].double().numpy())
    assert np.array_equal(res.row_ids, rows[:2].numpy())
    assert np.array_equal(res.num_accepted, [1, 3])
