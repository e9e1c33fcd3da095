"""The rejection sampler's kept set, found by counting passes (no sort), is exactly the one the
sort-based definition (``reference.keep_threshold``) keeps: min-p → top-k → top-p, every tie of
the last kept value kept. Checked token for token on random rows, rows made of few distinct
values (many exact ties, the cut inside a tie group), top_p near 1 and tiny, small and
Qwen-sized vocabularies, float32 and float16 logits (Triton interpreter on the CPU)."""

from __future__ import annotations

import pytest
import torch

from specengine.kernels import reference as ref
from specengine.kernels.keep_threshold import keep_threshold
from specengine.kernels.rejection_sampling import rejection_sample
from specengine.kernels.sampling_checks import MAX_VOCAB

TOP_P = [1.0, 0.9, 0.5, 0.99, 0.999999, 1e-6, 1e-3, 0.3]
TOP_K = [-1, -1, 0, 5, -1, 40, -1, 1, -1, 3]


def rows_case(bsz: int, vocab: int, seed: int, ties: bool):
    g = torch.Generator().manual_seed(seed)
    if ties:  # a handful of distinct values: most tokens tie with many others
        logits = torch.randint(-6, 3, (bsz, vocab), generator=g).float() * 0.75
        logits[0] = 0.0  # one row of a single value
    else:
        logits = torch.randn(bsz, vocab, generator=g) * 3
    i = torch.arange(bsz)
    temperature = torch.tensor([1.0, 0.7, 1.3, 0.5, 1.0, 2.0])[i % 6]
    top_k = torch.tensor(TOP_K, dtype=torch.int32)[i % len(TOP_K)]
    top_p = torch.tensor(TOP_P)[i % len(TOP_P)]
    return logits, temperature, top_k, top_p


def kept_sets(logits, temperature, top_k, top_p, log_min_p=None):
    """(kept by the kernel's cut, kept by the sort-based definition), both [B, V] bool."""
    tau, mass, top = keep_threshold(logits, temperature, top_k, top_p, log_min_p)
    z = logits.float() * temperature.reciprocal()[:, None]  # as the samplers scale
    want = z >= ref.keep_threshold(z, top_k, top_p, log_min_p)[:, None]
    got = z >= tau[:, None]
    # The kept mass the sampler normalises by is that set's: exp(z - max) summed over it.
    assert torch.equal(top, z.max(1).values)
    torch.testing.assert_close(mass, torch.where(got, torch.exp(z - top[:, None]), 0.0).sum(1),
                               rtol=1e-5, atol=0)
    return got, want


def assert_same_sets(got: torch.Tensor, want: torch.Tensor) -> None:
    bad = (got != want).any(1).nonzero()[:, 0].tolist()
    assert not bad, f"rows {bad}: kept {got[bad].sum(1).tolist()} want {want[bad].sum(1).tolist()}"


@pytest.mark.parametrize("vocab", [100, 2053])
@pytest.mark.parametrize("ties", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_kept_set_equals_sorted_definition(vocab: int, ties: bool, dtype: torch.dtype) -> None:
    logits, temperature, top_k, top_p = rows_case(40, vocab, seed=vocab + ties, ties=ties)
    got, want = kept_sets(logits.to(dtype), temperature, top_k, top_p)
    assert_same_sets(got, want)
    # The cases reach every rule: rows that keep all, one (without ties), or part of the
    # vocabulary.
    kept = want.sum(1)
    assert (kept == vocab).any() and ((kept > 1) & (kept < vocab)).any()
    assert ties or (kept == 1).any()


def test_kept_set_with_min_p_and_masked_tokens() -> None:
    """min-p first, then top-k, then top-p, with -inf logits (tokens masked out)."""
    logits, temperature, top_k, top_p = rows_case(24, 2053, seed=4, ties=False)
    logits[::3, :700] = float("-inf")
    log_min_p = torch.log(torch.tensor([0.0, 0.05, 1e-4, 0.5])[torch.arange(24) % 4])
    got, want = kept_sets(logits, temperature, top_k, top_p, log_min_p)
    assert_same_sets(got, want)


def test_top_p_cut_inside_a_tie_group() -> None:
    """Four values with 10, 20, 30, 40 tokens each: top_p whose mass is reached inside a
    group keeps that whole group (and nothing below it), at either edge of the group."""
    vocab = 100
    logits = torch.cat([torch.full((n,), v) for n, v in [(10, 2.0), (20, 1.0), (30, 0.0),
                                                         (40, -1.0)]])
    w = torch.exp(logits - 2.0).double()
    head = [w[:n].sum() / w.sum() for n in (10, 30, 60)]  # mass of the top 1, 2, 3 groups
    cases = [(0.01, 10), (float(head[0]) * 0.999, 10), (float(head[0]) * 1.001, 30),
             (float(head[1]) * 1.001, 60), (float(head[2]) * 1.001, 100)]
    top_p = torch.tensor([p for p, _ in cases])
    bsz = len(cases)
    got, want = kept_sets(logits.expand(bsz, vocab).contiguous(), torch.ones(bsz),
                          torch.full((bsz,), -1, dtype=torch.int32), top_p)
    assert_same_sets(got, want)
    assert got.sum(1).tolist() == [n for _, n in cases]


def test_kept_set_qwen_vocab() -> None:
    logits, temperature, top_k, top_p = rows_case(8, 151936, seed=9, ties=False)
    got, want = kept_sets(logits, temperature, top_k, top_p)
    assert_same_sets(got, want)
    logits, temperature, top_k, top_p = rows_case(8, 151936, seed=10, ties=True)
    got, want = kept_sets(logits.half(), temperature, top_k, top_p)
    assert_same_sets(got, want)


def test_reference_cut_is_real_valued_top_p() -> None:
    """The definition's fixed-point masses decide as real-valued top-p does (float64 sums of
    float64 weights) on Qwen-sized random rows, top_p near 1 included — the float32 cumsum it
    replaced disagreed on about a fifth of these rows, and 2**32 fixed point on some."""
    g = torch.Generator().manual_seed(1)
    z = torch.randn(24, 151936, generator=g) * torch.tensor([3.0, 1.0])[torch.arange(24) % 2, None]
    top_p = torch.tensor([0.9, 0.5, 0.99, 0.999999])[torch.arange(24) % 4]
    tau = ref.keep_threshold(z, torch.full((24,), -1, dtype=torch.int32), top_p)
    zs = z.sort(-1, descending=True).values
    cum = torch.exp((zs - zs[:, :1]).double()).cumsum(1)
    short = cum < top_p.double()[:, None] * cum[:, -1:]
    assert torch.equal(tau, zs.gather(1, short.sum(1, keepdim=True))[:, 0])


def test_launcher_checks_shapes() -> None:
    logits, temperature, top_k, top_p = rows_case(4, 100, seed=0, ties=False)
    with pytest.raises(ValueError, match="logits"):
        keep_threshold(logits[:, ::2], temperature, top_k, top_p)
    with pytest.raises(ValueError, match="top_k"):
        keep_threshold(logits, temperature, top_k.long(), top_p)
    with pytest.raises(ValueError, match="top_p"):
        keep_threshold(logits, temperature, top_k, top_p[:3])
    wide = torch.zeros(4, MAX_VOCAB)  # V * 2**44 would overflow top-p's int64 sums
    with pytest.raises(ValueError, match="vocabulary 524288"):
        keep_threshold(wide, temperature, top_k, top_p)
    with pytest.raises(ValueError, match="vocabulary 524288"):
        rejection_sample(wide[:, None], torch.zeros(4, 0, dtype=torch.int64),
                         torch.zeros(4, dtype=torch.int32), None, temperature, top_k, top_p,
                         torch.zeros(4, dtype=torch.int64), torch.zeros(4, dtype=torch.int64),
                         None)
    # the largest allowed vocabulary (one row: the interpreter runs it)
    keep_threshold(wide[:1, 1:], temperature[:1], top_k[:1], top_p[:1])


@pytest.mark.parametrize("vocab", [1, 2, 3, 127, 4097])
def test_kept_set_awkward_vocab_sizes(vocab: int) -> None:
    """Rows shorter than one tile, one past a power of two, a single token."""
    for ties in (False, True):
        logits, temperature, top_k, top_p = rows_case(12, vocab, seed=vocab + 7 * ties, ties=ties)
        got, want = kept_sets(logits, temperature, top_k, top_p)
        assert_same_sets(got, want)


def test_top_p_mass_reached_exactly_keeps_only_that_prefix() -> None:
    """3 tokens of weight 1 (z = 0) and 6 of weight exactly 1/2 (exp(-0.6931472) = 0.5 in
    float32): the top 3 hold exactly half the integer mass, so top_p = 0.5 keeps just them
    (the prefix reaches top_p: ``>=``, not ``>``), and the next float32 above 0.5 keeps the
    6 as well; tokens of weight 0 (z = -40: floor(exp(-40) * 2**44) = 0) and -inf never."""
    z = torch.tensor([0.0] * 3 + [-0.6931472] * 6 + [-40.0] * 5 + [float("-inf")] * 2)
    assert torch.exp(z[3]).item() == 0.5
    perm = torch.randperm(len(z), generator=torch.Generator().manual_seed(0))
    logits = z[perm].expand(3, -1).contiguous()
    top_p = torch.tensor([0.5, float(torch.nextafter(torch.tensor(0.5), torch.tensor(1.0))),
                          0.25])
    got, want = kept_sets(logits, torch.ones(3), torch.full((3,), -1, dtype=torch.int32),
                          top_p)
    assert_same_sets(got, want)
    assert got.sum(1).tolist() == [3, 9, 3]


def test_search_buffer_overflow_stays_on_the_row() -> None:
    """All 20,000 tokens within 0.2 of the max: the first pass's bracket holds nearly all of
    them, more than the candidate buffer takes (the interpreter's 4 slots per column of
    4,096), so the search stays on the row for another pass before compacting; the cut is
    still the sort-based one (top-p's integer masses and top-k's counts)."""
    g = torch.Generator().manual_seed(3)
    vocab = 20_000
    logits = 5.0 - 0.2 * torch.rand(6, vocab, generator=g)
    top_p = torch.tensor([0.5, 0.9, 0.99, 1.0, 1.0, 0.3])
    top_k = torch.tensor([-1, -1, -1, 5000, 17, 9000], dtype=torch.int32)
    got, want = kept_sets(logits, torch.ones(6), top_k, top_p)
    assert_same_sets(got, want)
    assert (want.sum(1)[[0, 1, 2, 3, 5]] > 1000).all() and want[4].sum() == 17
