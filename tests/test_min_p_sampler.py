"""min-p and masked (-inf) logits in the rejection sampler: the Triton kernel equals the
reference, and both draw exactly the processed law temperature → min-p → top-k → top-p
(vLLM's order), ``tests/lossless.processed_law``."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
from lossless import processed_law
from test_rejection_sampling import DRAWS, assert_same, chi2, random_case

from specengine.kernels import reference as ref


def log_min_p(values: list[float], bsz: int) -> torch.Tensor:
    """[bsz] float32 log(min_p) cycling through ``values`` (0 → -inf: off)."""
    lm = [math.log(v) if v > 0 else float("-inf") for v in values]
    return torch.tensor([lm[i % len(lm)] for i in range(bsz)], dtype=torch.float32)


@pytest.mark.parametrize(("vocab", "bsz", "n_rows"), [(100, 16, 4), (5000, 8, 3)])
@pytest.mark.parametrize("mode", ["chain", "chain_q", "tree"])
def test_kernel_equals_reference_with_min_p(vocab: int, bsz: int, n_rows: int,
                                            mode: str) -> None:
    """Rows mix min-p off / loose / tight with every top-k / top-p setting of random_case,
    including top-k past what min-p keeps (min-p's cut wins) and within it (top-k's)."""
    args = random_case(bsz, n_rows, vocab, seed=vocab + 3 * len(mode), tree=mode == "tree",
                       with_q=mode == "chain_q")
    assert_same((*args, log_min_p([0.0, 0.05, 0.3, 0.01, 0.9, 0.2, 0.1], bsz)))


def test_kernel_equals_reference_with_masked_logits() -> None:
    """-inf logits (min_tokens masks EOS / stop ids that way) are never kept or emitted."""
    args = list(random_case(16, 4, 300, seed=5))
    logits = args[0].clone()
    logits[:, :, :7] = float("-inf")
    args[0] = logits
    args[1] = torch.where(args[1] < 7, 3, args[1])  # drafts also propose masked ids
    args[1][:, 0] = 2
    for lm in (None, log_min_p([0.0, 0.1], 16)):
        want = ref.rejection_sample(*args, lm)
        assert_same((*args, lm))
        assert not ((want[0] >= 0) & (want[0] < 7)).any()


def test_min_p_changes_the_kept_set() -> None:
    """The argument is used: with a tight min-p the reference never emits a token below the
    cut, which it does without (this fails if min-p were dropped anywhere on the way)."""
    g = torch.Generator().manual_seed(3)
    logits = torch.randn(1, 1, 12, generator=g).expand(20_000, -1, -1)
    bsz = logits.shape[0]
    common = (torch.zeros(bsz, 0, dtype=torch.int64), torch.zeros(bsz, dtype=torch.int32), None,
              torch.ones(bsz), torch.full((bsz,), -1, dtype=torch.int32), torch.ones(bsz),
              torch.arange(bsz), torch.zeros(bsz, dtype=torch.int64), None)
    p = torch.softmax(logits[0, 0].double(), -1)
    below = p < 0.3 * p.max()
    off = ref.rejection_sample(logits, *common)[0][:, 0]
    on = ref.rejection_sample(logits, *common, log_min_p([0.3], bsz))[0][:, 0]
    assert below[off].any() and not below[on].any()


SETTINGS = [(1.0, 0.1, -1, 1.0), (0.8, 0.05, 3, 1.0), (1.2, 0.05, -1, 0.95), (1.0, 0.02, 5, 0.9)]


def run_ref(logits, drafts, nd, q, temp, top_k, top_p, min_p, parents=None):
    bsz = logits.shape[0]
    return ref.rejection_sample(
        logits, drafts, torch.full((bsz,), nd, dtype=torch.int32), q, torch.full((bsz,), temp),
        torch.full((bsz,), top_k, dtype=torch.int32), torch.full((bsz,), top_p),
        torch.arange(bsz, dtype=torch.int64), torch.full((bsz,), 11, dtype=torch.int64),
        parents, log_min_p([min_p], bsz))


@pytest.mark.parametrize(("temp", "min_p", "top_k", "top_p"), SETTINGS)
def test_chain_min_p_distribution(temp: float, min_p: float, top_k: int, top_p: float) -> None:
    """Point-mass drafts (the argmax, then a fixed token) and sampled drafts (q): every
    emitted position follows the processed law, min-p included."""
    g = torch.Generator().manual_seed(21)
    vocab = 9
    logits = (torch.randn(1, 3, vocab, generator=g) * 1.5).expand(DRAWS, -1, -1)
    law = [processed_law(logits[0, j], temp, top_k, top_p, min_p).numpy() for j in range(3)]
    assert all((p == 0).any() and (p > 0).sum() > 1 for p in law[:2]), "min-p must cut some"
    drafts = torch.tensor([[logits[0, 0].argmax(), 2]]).expand(DRAWS, -1)
    out, acc, _, _ = run_ref(logits, drafts, 2, None, temp, top_k, top_p, min_p)
    chi2(out[:, 0], law[0])
    chi2(out[acc >= 1, 1], law[1])
    q = torch.softmax(torch.randn(1, 2, vocab, generator=g), -1).expand(DRAWS, -1, -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(DRAWS, 2)
    out, acc, _, _ = run_ref(logits, drafts, 2, q, temp, top_k, top_p, min_p)
    chi2(out[:, 0], law[0])
    chi2(out[acc >= 1, 1], law[1])


def test_tree_min_p_distribution() -> None:
    g = torch.Generator().manual_seed(22)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1], dtype=torch.int32)
    logits = (torch.randn(1, 6, 7, generator=g) * 1.5).expand(DRAWS, -1, -1)
    drafts = torch.tensor([[3, 3, 5, 0, 1]]).expand(DRAWS, -1)
    temp, min_p, top_k, top_p = SETTINGS[2]
    out, _, _, rows = run_ref(logits, drafts, 5, None, temp, top_k, top_p, min_p, parents)
    chi2(out[:, 0], processed_law(logits[0, 0], temp, top_k, top_p, min_p).numpy())
    for node in (1, 2, 3):
        sel = rows[:, 1] == node
        if sel.sum() > 500:
            chi2(out[sel, 1],
                 processed_law(logits[0, node], temp, top_k, top_p, min_p).numpy())


def test_processed_law_min_p_is_vllms() -> None:
    """The test's own law: min-p drops exactly p < min_p * p_max after temperature."""
    logits = torch.tensor([2.0, 1.0, 0.0, -3.0])
    p = torch.softmax(logits.double() / 0.5, -1)
    law = processed_law(logits, 0.5, -1, 1.0, min_p=0.1)
    keep = p >= 0.1 * p.max()
    assert torch.allclose(law, torch.where(keep, p, 0.0) / p[keep].sum())
    assert np.count_nonzero(law.numpy()) == int(keep.sum()) < 4
