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
from specengine.kernels.rejection_sampling import rejection_sample, vocab_chunks
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


def kept_sets(logits, temperature, top_k, top_p, log_min_p=None, vocab_parts=None):
    """(kept by the kernel's cut, kept by the sort-based definition), both [B, V] bool."""
    tau, mass, top = keep_threshold(logits, temperature, top_k, top_p, log_min_p,
                                    vocab_parts=vocab_parts)
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
    """One program per row, and (the tie-heavy rows) split as the launcher splits 8 rows: 33
    parts asked, 25 of 6,144 tokens (whole 2,048-token blocks)."""
    logits, temperature, top_k, top_p = rows_case(8, 151936, seed=9, ties=False)
    got, want = kept_sets(logits, temperature, top_k, top_p, vocab_parts=1)
    assert_same_sets(got, want)
    assert vocab_chunks(8, 151936, torch.device("cpu"), None) == (25, 6144)
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
    # the largest allowed vocabulary (one row in one program: the interpreter runs it)
    keep_threshold(wide[:1, 1:], temperature[:1], top_k[:1], top_p[:1], vocab_parts=1)
    with pytest.raises(ValueError, match="vocab_parts"):
        keep_threshold(logits, temperature, top_k, top_p, vocab_parts=0)


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


# ------------------------------------------------------------------ split search (small batch)
# At small batch the first pass of a row's first search (and its snap and compaction) runs in
# several programs per row over whole 2,048-token parts (``vocab_chunks``), merged with
# integer sums; the rest runs in the row's program. The cut must not depend on the split.


def split_and_one_program(logits, temperature, top_k, top_p, log_min_p=None, parts=4):
    """Kept sets of the split search and of one program per row, both held to the reference
    and to each other: the same tau, max and (top-p: exact integer) kept mass."""
    one = keep_threshold(logits, temperature, top_k, top_p, log_min_p, vocab_parts=1)
    tau, mass, top = keep_threshold(logits, temperature, top_k, top_p, log_min_p,
                                    vocab_parts=parts)
    z = logits.float() * temperature.reciprocal()[:, None]
    got = z >= tau[:, None]
    assert_same_sets(got, z >= ref.keep_threshold(z, top_k, top_p, log_min_p)[:, None])
    assert torch.equal(one[0], tau) and torch.equal(one[2], top)
    # top-p's kept mass is W(tau) * 2**-44 either way; a top-k cut's is a float32 sum in
    # another order (a part's mass above the bracket plus the buffer's)
    torch.testing.assert_close(one[1], mass, rtol=1e-6, atol=0)
    torch.testing.assert_close(mass, torch.where(got, torch.exp(z - top[:, None]), 0.0).sum(1),
                               rtol=1e-5, atol=0)
    return got


@pytest.mark.parametrize("vocab", [1, 2, 3, 127, 2049, 4097])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_search_equals_one_program(vocab: int, dtype: torch.dtype) -> None:
    """Random and tie-heavy rows, top-k, top-p, both and neither; vocabularies not a multiple
    of the part (a 1-token last part at 2,049 and 4,097); up to 2,048 tokens a row is one
    part whatever is asked (the races' Philox blocks are whole parts)."""
    parts, _ = vocab_chunks(12, vocab, torch.device("cpu"), 4)
    assert parts == max(1, min(4, -(-vocab // 2048)))
    for ties in (False, True):
        logits, temperature, top_k, top_p = rows_case(12, vocab, seed=vocab + 5 * ties,
                                                      ties=ties)
        split_and_one_program(logits.to(dtype), temperature, top_k, top_p)


def test_split_search_with_min_p_rows() -> None:
    """Rows with min-p on keep their search in the row's program (min-p's cut needs a pass
    over the row first); the rows without it in the same call are split."""
    logits, temperature, top_k, top_p = rows_case(16, 4097, seed=11, ties=False)
    logits[::3, :700] = float("-inf")  # masked tokens: zmin = -inf
    log_min_p = torch.log(torch.tensor([0.0, 0.05, 0.0, 1e-4])[torch.arange(16) % 4])
    split_and_one_program(logits, temperature, top_k, top_p, log_min_p, parts=3)


def test_split_search_tie_group_across_a_part_boundary() -> None:
    """The cut's value held by 17 tokens around token 2,048 (the first part boundary), three
    larger tokens in three parts (the last one the 1-token tail part): top-k and top-p cuts
    inside the group keep all of it, whichever part each tied token is in."""
    vocab = 4097
    g = torch.Generator().manual_seed(2)
    row = torch.randn(vocab, generator=g) * 0.3 - 3.0
    row[2040:2057] = 1.0
    row[[5, 3000, 4096]] = 2.0
    w = torch.exp(row.double() - 2.0)
    top3, group = 3.0, 17 * float(torch.exp(torch.tensor(-1.0, dtype=torch.float64)))
    top_p = torch.tensor([1.0, (top3 + group / 2) / w.sum(), top3 / w.sum() * 0.999,
                          (top3 + group) / w.sum() * 1.001, 1.0], dtype=torch.float32)
    top_k = torch.tensor([4, -1, -1, -1, 20], dtype=torch.int32)
    got = split_and_one_program(row.expand(5, vocab).contiguous(), torch.ones(5), top_k,
                                top_p, parts=3)
    assert got.sum(1)[:3].tolist() == [20, 20, 3] and got.sum(1)[3] > 20
    assert got[4].sum() == 20


def test_split_top_p_mass_reached_exactly() -> None:
    """As ``test_top_p_mass_reached_exactly_keeps_only_that_prefix`` with the 9 weighted
    tokens spread over 3 parts (two on either side of a boundary, one in the 4-token tail
    part) and 4,091 tokens of weight 0: the parts' integer masses add up to exactly half."""
    z = torch.full((4100,), -40.0)
    z[[10, 2500, 4099]] = 0.0
    z[[100, 2047, 2048, 3000, 4096, 2100]] = -0.6931472
    z[[7, 4098]] = float("-inf")
    top_p = torch.tensor([0.5, float(torch.nextafter(torch.tensor(0.5), torch.tensor(1.0))),
                          0.25])
    got = split_and_one_program(z.expand(3, -1).contiguous(), torch.ones(3),
                                torch.full((3,), -1, dtype=torch.int32), top_p, parts=3)
    assert got.sum(1).tolist() == [3, 9, 3]


@pytest.mark.parametrize("n_mid", [16384, 16385])
def test_split_search_buffer_full_and_one_past(n_mid: int) -> None:
    """A bracket of exactly SEARCH_CAP entries after the first pass is compacted (into the
    whole buffer); one more and the search stays on the row. One token at 0, ``n_mid`` at
    -0.5 (the cut's tie group), the rest at -40: top-k 5 and top-p 0.5 keep 1 + n_mid."""
    vocab = 18_000
    z = torch.full((vocab,), -40.0)
    perm = torch.randperm(vocab, generator=torch.Generator().manual_seed(n_mid))
    z[perm[:n_mid]] = -0.5
    z[perm[n_mid]] = 0.0
    got = split_and_one_program(z.expand(2, -1).contiguous(), torch.ones(2),
                                torch.tensor([5, -1], dtype=torch.int32),
                                torch.tensor([1.0, 0.5]), parts=5)
    assert got.sum(1).tolist() == [1 + n_mid] * 2


def test_split_search_merges_every_part() -> None:
    """Each of 4 parts (the last a 1-token tail) holds one of the 4 largest tokens, and the
    first pass's bracket has tokens in every part: a merge that missed any part's counts,
    masses, bracket ends or buffer entries would cut elsewhere. top-k 1..4 and top-p rows."""
    vocab = 6145
    g = torch.Generator().manual_seed(4)
    row = torch.randn(vocab, generator=g)
    row[[700, 2900, 5000, 6144]] = torch.tensor([6.3, 6.2, 6.1, 6.0])
    bsz = 8
    top_k = torch.tensor([1, 2, 3, 4, -1, -1, -1, 50], dtype=torch.int32)
    top_p = torch.tensor([1.0, 1.0, 1.0, 1.0, 0.3, 0.6, 0.9, 1.0])
    got = split_and_one_program(row.expand(bsz, vocab).contiguous(), torch.ones(bsz), top_k,
                                top_p, parts=4)
    assert got.sum(1)[:4].tolist() == [1, 2, 3, 4]
    assert got.sum(1)[-1] == 50


def test_split_search_merges_more_parts_than_one_step() -> None:
    """34 parts (the merges take 32 parts per step; the last part is 1 token): the largest
    tokens sit in parts 0, 31, 32 and 33, so a merge that missed the second step's parts, or
    one part of either step, would cut elsewhere."""
    vocab = 33 * 2048 + 1
    g = torch.Generator().manual_seed(6)
    row = torch.randn(vocab, generator=g)
    row[[100, 31 * 2048 + 5, 32 * 2048 + 7, vocab - 1]] = torch.tensor([6.0, 6.1, 6.2, 6.3])
    top_k = torch.tensor([3, -1], dtype=torch.int32)
    top_p = torch.tensor([1.0, 0.2])
    got = split_and_one_program(row.expand(2, vocab).contiguous(), torch.ones(2), top_k, top_p,
                                parts=34)
    assert got[0].nonzero()[:, 0].tolist() == [31 * 2048 + 5, 32 * 2048 + 7, vocab - 1]
    assert got[1, [100, 31 * 2048 + 5, 32 * 2048 + 7, vocab - 1]].all()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ties", [False, True])
def test_gpu_split_search_equals_one_program(dtype: torch.dtype, ties: bool) -> None:
    """On the GPU at Qwen's vocabulary, 16 rows (split in 15 parts of 10,240 tokens): the
    split cut is one program's bit for bit (the same device arithmetic, integer merges), and
    the reference's up to one near-tie row (the GPU's exp differs from the CPU's in the last
    ulp, which can move a fixed-point weight)."""
    logits, temperature, top_k, top_p = rows_case(16, 151936, seed=13 + ties, ties=ties)
    logits, temperature, top_k, top_p = (x.cuda() for x in (logits.to(dtype), temperature,
                                                            top_k, top_p))
    assert vocab_chunks(16, 151936, logits.device, None)[0] > 1
    one = keep_threshold(logits, temperature, top_k, top_p, vocab_parts=1)
    split = keep_threshold(logits, temperature, top_k, top_p)
    assert torch.equal(one[0], split[0]) and torch.equal(one[2], split[2])
    z = logits.float() * temperature.reciprocal()[:, None]
    want = z >= ref.keep_threshold(z, top_k, top_p)[:, None]
    assert ((z >= split[0][:, None]) != want).any(1).sum().item() <= 1
