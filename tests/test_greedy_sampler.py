"""The CPU backend's greedy chain fast path (``core.greedy_sampler``) equals the reference
rejection sampler output for output, bit for bit (ids, accepted counts, logprobs, row ids), on
random logits with ties, ``-inf`` logits, every number of drafts, drafts that are and are not
the argmax, out-of-vocabulary drafts; and the engine's sampler takes it only for all-greedy
chain steps on the CPU torch backend."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specengine.core.greedy_sampler import greedy_chain_sample
from specengine.core.sampler import Sampler, SamplingTensors
from specengine.kernels.reference import rejection_sample


def _case(seed: int, bsz: int, n_rows: int, vocab: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, n_rows, vocab, generator=g) * 3
    logits[0, :, :2] = logits[0, :, :2].amax(-1, keepdim=True) + 1  # a tie: first index wins
    logits[1 % bsz, 0, 3] = float("-inf")
    argmax = logits.argmax(-1)
    drafts = torch.randint(0, vocab, (bsz, n_rows - 1), generator=g)
    take = torch.rand(bsz, n_rows - 1, generator=g) < 0.7  # mostly the argmax: long accepts
    drafts = torch.where(take, argmax[:, :-1], drafts)
    if bsz > 2 and n_rows > 1:
        drafts[2, 0] = vocab + 5  # out of vocabulary: clamped, as the reference does
    num_draft = torch.randint(0, n_rows, (bsz,), generator=g)
    return logits, drafts, num_draft


def _reference(logits, drafts, num_draft):
    bsz = logits.shape[0]
    return rejection_sample(logits, drafts, num_draft, None, torch.zeros(bsz),
                            torch.zeros(bsz, dtype=torch.long), torch.ones(bsz),
                            torch.arange(bsz), torch.full((bsz,), 7), None)


@pytest.mark.parametrize("n_rows", [1, 2, 4, 8])
@pytest.mark.parametrize("seed", range(4))
def test_equals_the_reference_bit_for_bit(n_rows: int, seed: int) -> None:
    logits, drafts, num_draft = _case(seed, 9, n_rows, 37)
    ref = _reference(logits, drafts, num_draft)
    got = greedy_chain_sample(logits, drafts, num_draft)
    for r, x in zip(ref, got):
        assert r.dtype == x.dtype and r.shape == x.shape
        assert torch.equal(r, x), (r, x)
    if n_rows > 1:  # acceptance happens: a fast path that rejects everything fails here
        assert int(got[1].max()) >= 1


def test_accepts_argmax_drafts_and_stops_at_the_first_miss() -> None:
    logits = torch.tensor([[[0.0, 5.0, 1.0], [4.0, 0.0, 1.0], [0.0, 1.0, 9.0]]])
    out, num_acc, lp, rows = greedy_chain_sample(logits, torch.tensor([[1, 0]]),
                                                 torch.tensor([2]))
    assert out.tolist() == [[1, 0, 2]] and num_acc.tolist() == [2] and rows.tolist() == [[0, 1, 2]]
    assert torch.allclose(lp, torch.log_softmax(logits, -1).amax(-1))
    out, num_acc, _, rows = greedy_chain_sample(logits, torch.tensor([[1, 2]]),
                                                torch.tensor([2]))
    assert out.tolist() == [[1, 0, -1]] and num_acc.tolist() == [1]
    assert rows.tolist() == [[0, 1, -1]]


def _params(temps: list[float]) -> SamplingTensors:
    b = len(temps)
    return SamplingTensors(torch.tensor(temps, dtype=torch.float32), torch.zeros(b).long(),
                           torch.ones(b), torch.arange(b).long(), torch.full((b,), 3).long())


def test_the_sampler_uses_it_only_for_all_greedy_chains(monkeypatch) -> None:
    import specengine.core.sampler as sampler_mod

    calls = []
    real = sampler_mod.greedy_chain_sample
    monkeypatch.setattr(sampler_mod, "greedy_chain_sample",
                        lambda *a: calls.append(1) or real(*a))
    logits, drafts, num_draft = _case(0, 4, 3, 11)
    s = Sampler("torch", torch.device("cpu"))
    s(logits, drafts, num_draft, None, None, _params([0.0] * 4))
    assert len(calls) == 1
    mixed = s(logits, drafts, num_draft, None, None, _params([0.0, 1.0, 0.0, 0.0]))
    tree = s(logits, drafts, num_draft, None, torch.tensor([-1, 0, 0], dtype=torch.int32),
             _params([0.0] * 4))
    assert len(calls) == 1  # a sampled row (chain_sampler), or a tree (the reference)
    assert mixed.output_ids.shape == tree.output_ids.shape == (4, 3)
    assert np.array_equal(mixed.output_ids[0].numpy(), _reference(logits, drafts,
                                                                  num_draft)[0][0].numpy())
