"""Rejection sampling: the Triton kernel equals the reference exactly, and both are lossless.

Distribution tests draw 1e5 rows (same logits, different seeds) from the vectorised reference
and compare the emitted tokens with the exact processed target law by chi-square; the kernel is
held to identical outputs on random inputs, plus one (smaller) chi-square test of its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from lossless import processed_law

try:
    from scipy.stats import chisquare

    HAS_SCIPY = True
except ImportError:  # scipy is optional: the chi-square tests skip without it, the rest run
    HAS_SCIPY = False

    def chisquare(*args, **kwargs):
        return pytest.importorskip("scipy.stats").chisquare(*args, **kwargs)

from specengine.core.chain_sampler import sampled_chain_sample
from specengine.kernels import reference as ref
from specengine.kernels.rejection_sampling import default_vocab_parts
from specengine.kernels.rejection_sampling import rejection_sample as kernel

IMPLS = {"reference": ref.rejection_sample, "kernel": kernel}


@pytest.fixture(autouse=True)
def _chi_square_skips_before_sampling(request: pytest.FixtureRequest) -> None:
    """Without scipy a distribution test skips in its setup, before drawing its 1e5 rows
    (tens of seconds each), not at its first chi-square."""
    if not HAS_SCIPY and "distribution" in request.node.name:
        pytest.importorskip("scipy.stats")


P_MIN = 1e-3


def params(bsz: int, temp=1.0, top_k=-1, top_p=1.0, seed0: int = 0, offset: int = 7):
    return (torch.full((bsz,), temp), torch.full((bsz,), top_k, dtype=torch.int32),
            torch.full((bsz,), top_p), torch.arange(seed0, seed0 + bsz, dtype=torch.int64),
            torch.full((bsz,), offset, dtype=torch.int64))


def run(impl, logits, drafts, nd, q=None, temp=1.0, top_k=-1, top_p=1.0, parents=None, seed0=0):
    bsz = logits.shape[0]
    t, k, p, s, o = params(bsz, temp, top_k, top_p, seed0)
    return IMPLS[impl](logits, drafts, torch.as_tensor(nd, dtype=torch.int32), q, t, k, p, s, o,
                       parents)


def processed(logits: torch.Tensor, temp: float, top_k: int, top_p: float) -> np.ndarray:
    """Exact target law in float64, independently of the implementation (sort-based)."""
    return processed_law(logits, temp, top_k, top_p).numpy()


def chi2(samples: torch.Tensor, p: np.ndarray) -> None:
    counts = np.bincount(samples.numpy(), minlength=len(p))
    assert counts[p == 0].sum() == 0, "a token outside the top-k / top-p set was emitted"
    keep = p > 0
    expected = p[keep] / p[keep].sum() * counts.sum()
    assert chisquare(counts[keep], expected).pvalue > P_MIN, (counts, expected)


def one_hot(bsz: int, n_rows: int, vocab: int, tokens: list[list[int]]) -> torch.Tensor:
    logits = torch.zeros(bsz, n_rows, vocab)
    for b, row in enumerate(tokens):
        for j, t in enumerate(row):
            logits[b, j, t] = 40.0  # p(t) rounds to 1 in float32
    return logits


# ------------------------------------------------------------------ deterministic cases


@pytest.mark.parametrize("impl", IMPLS)
def test_chain_one_hot(impl: str) -> None:
    targets = [[1, 2, 3, 4], [1, 2, 3, 4], [5, 6, 7, 8], [9, 9, 9, 9], [3, 1, 4, 1]]
    logits = one_hot(5, 4, 10, targets)
    drafts = torch.tensor([[1, 2, 3], [1, 0, 3], [5, 6, 7], [1, 1, 1], [3, 1, 4]])
    nd = [3, 3, 2, 0, 3]
    for temp in (1.0, 0.0):
        out, acc, lp, rows = run(impl, logits, drafts, nd, temp=temp)
        assert acc.tolist() == [3, 1, 2, 0, 3]
        assert out.tolist() == [[1, 2, 3, 4], [1, 2, -1, -1], [5, 6, 7, -1], [9, -1, -1, -1],
                                [3, 1, 4, 1]]
        assert rows.tolist() == [[0, 1, 2, 3], [0, 1, -1, -1], [0, 1, 2, -1], [0, -1, -1, -1],
                                 [0, 1, 2, 3]]
        assert torch.all(lp[out >= 0] > -1e-6) and torch.all(lp[out < 0] == 0)


@pytest.mark.parametrize("impl", IMPLS)
def test_greedy_and_sampled_rows_mixed(impl: str) -> None:
    g = torch.Generator().manual_seed(1)
    logits = torch.randn(4, 3, 12, generator=g)
    drafts = logits[:, :2].argmax(-1)
    t, k, p, s, o = params(4)
    t[::2] = 0.0
    out, acc, lp, _ = IMPLS[impl](logits, drafts, torch.full((4,), 2, dtype=torch.int32), None,
                                  t, k, p, s, o, None)
    assert acc[0] == 2 and acc[2] == 2
    assert out[0].tolist() == logits[0].argmax(-1).tolist()
    raw = torch.log_softmax(logits[0], -1)
    torch.testing.assert_close(lp[0], raw.gather(1, out[0][:, None])[:, 0])


@pytest.mark.parametrize("impl", IMPLS)
def test_tree_one_hot(impl: str) -> None:
    # node: 0  1  2  3  4      tree 0 -> {1, 2}, 1 -> {3}, 2 -> {4}
    parents = torch.tensor([-1, 0, 0, 1, 2], dtype=torch.int32)
    tokens = torch.tensor([[5, 6, 7, 8], [5, 6, 7, 8], [5, 6, 7, 8]])
    targets = [[6, 0, 8, 0, 0], [6, 7, 0, 0, 0], [6, 7, 0, 0, 0]]
    logits = one_hot(3, 5, 10, targets)
    for temp in (1.0, 0.0):
        out, acc, _, rows = run(impl, logits, tokens, [4, 4, 0], temp=temp, parents=parents)
        assert acc.tolist() == [2, 1, 0]
        assert out.tolist() == [[6, 8, 0, -1, -1], [6, 0, -1, -1, -1], [6, -1, -1, -1, -1]]
        assert rows.tolist() == [[0, 2, 4, -1, -1], [0, 2, -1, -1, -1], [0, -1, -1, -1, -1]]


# ------------------------------------------------------------------ kernel == reference


def random_case(bsz, n_rows, vocab, seed, tree=False, with_q=False):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, n_rows, vocab, generator=g) * 2
    idx = torch.arange(bsz)
    parents, q = None, None
    if tree:
        parents = torch.tensor([-1] + [int(torch.randint(0, i, (1,), generator=g))
                                       for i in range(1, n_rows)], dtype=torch.int32)
        nd = (torch.rand(bsz, generator=g) < 0.8).int() * (n_rows - 1)
        drafts = logits[:, parents[1:].long()].argmax(-1)  # often the parent's favourite
    else:
        nd = torch.randint(0, n_rows, (bsz,), generator=g).int()
        drafts = logits[:, :-1].argmax(-1)
    drafts = torch.where(torch.rand(drafts.shape, generator=g) < 0.5, drafts,
                         torch.randint(0, vocab, drafts.shape, generator=g))
    if with_q:
        q = torch.softmax(logits[:, :-1] + torch.randn(bsz, n_rows - 1, vocab, generator=g), -1)
        drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(bsz, -1)
    temp = torch.tensor([0.0, 1.0, 0.7, 1.3, 0.5, 1.0, 0.8, 1.0])[idx % 8]
    top_k = torch.tensor([-1, -1, 5, 0, 40, 3, -1, 1], dtype=torch.int32)[idx % 8]
    top_p = torch.tensor([1.0, 1.0, 1.0, 0.8, 0.9, 0.5, 0.95, 1.0])[idx % 8]
    seeds = torch.randint(-2**62, 2**62, (bsz,), generator=g)
    offsets = torch.randint(0, 100_000, (bsz,), generator=g)
    return logits, drafts, nd, q, temp, top_k, top_p, seeds, offsets, parents


def assert_same(args) -> None:
    want, got = ref.rejection_sample(*args), kernel(*args)
    assert torch.equal(want[0], got[0]), (want[0], got[0])
    assert torch.equal(want[1], got[1])
    assert torch.equal(want[3], got[3])
    torch.testing.assert_close(want[2], got[2], atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize(("vocab", "bsz", "n_rows"), [(100, 16, 4), (8193, 8, 3)])
@pytest.mark.parametrize("mode", ["chain", "chain_q", "tree"])
def test_kernel_equals_reference(vocab: int, bsz: int, n_rows: int, mode: str) -> None:
    assert_same(random_case(bsz, n_rows, vocab, seed=vocab + len(mode), tree=mode == "tree",
                            with_q=mode == "chain_q"))


@pytest.mark.parametrize("impl", ["ref", "kernel"])
@pytest.mark.parametrize("mode", ["chain", "chain_q", "tree"])
def test_low_precision_logits_sample_as_their_float32_upcast(impl: str, mode: str) -> None:
    """The engine hands the LM head's bf16/fp16 logits to the sampler without a float32 copy:
    the sampler's results must be those of the exact upcast."""
    # 8 rows: each of random_case's 8 settings (greedy, temperatures, top-k, top-p) once
    args = list(random_case(8, 4, 300, seed=11, tree=mode == "tree", with_q=mode == "chain_q"))
    fn = ref.rejection_sample if impl == "ref" else kernel
    for dtype in (torch.bfloat16, torch.float16):
        low = args[0].to(dtype)
        want = fn(low.float(), *args[1:])
        got = fn(low, *args[1:])
        for w, g in zip(want, got):
            assert torch.equal(w, g)


def test_kernel_equals_reference_chain_as_tree() -> None:
    """A chain given as a tree (parents j-1) draws the same tokens as the chain path."""
    args = list(random_case(16, 4, 50, seed=3))
    args[2] = torch.where(torch.arange(16) % 2 == 0, 3, 0).int()
    chain = kernel(*args)
    args[-1] = torch.tensor([-1, 0, 1, 2], dtype=torch.int32)
    for impl in IMPLS.values():
        tree = impl(*args)
        for i in (0, 1, 3):
            assert torch.equal(chain[i], tree[i])
        torch.testing.assert_close(chain[2], tree[2])


def test_kernel_equals_reference_qwen_vocab() -> None:
    args = list(random_case(2, 2, 151936, seed=5))
    args[4] = torch.tensor([1.0, 0.0])  # one sampled, one greedy row; no filters (interpreter)
    args[5] = torch.tensor([-1, -1], dtype=torch.int32)
    args[6] = torch.tensor([1.0, 1.0])
    assert_same(args)


@pytest.mark.parametrize("mode", ["chain", "chain_q", "tree"])
def test_vocab_parts_equal_one_pass(mode: str) -> None:
    """Pass 1 split over the vocabulary (small batches: ``_part_kernel`` + the row kernel's
    merge) draws what the reference draws: 5 parts over 8,193 tokens (4 of 2,048 and a
    1-token tail), greedy and sampled rows, top-k / top-p after the merge."""
    args = random_case(8, 3, 8193, seed=21 + len(mode), tree=mode == "tree",
                       with_q=mode == "chain_q")
    want = ref.rejection_sample(*args)
    got = kernel(*args, vocab_parts=5)
    assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
    assert torch.equal(want[3], got[3])
    torch.testing.assert_close(want[2], got[2], atol=1e-4, rtol=1e-4)


def test_vocab_parts_keep_the_lowest_index_of_tied_maxima() -> None:
    """Greedy rows whose maximum appears in three parts (tokens 5000, 2100 and 7000 of parts
    of 2,048): the merge keeps the earliest part's, the lowest index, as one pass does."""
    logits = torch.randn(2, 1, 8193, generator=torch.Generator().manual_seed(0))
    logits[:, 0, [5000, 2100, 7000]] = 9.0
    args = (logits, torch.zeros(2, 0, dtype=torch.int64), torch.zeros(2, dtype=torch.int32),
            None, torch.zeros(2), torch.full((2,), -1, dtype=torch.int32), torch.ones(2),
            torch.arange(2), torch.zeros(2, dtype=torch.int64), None)
    for parts in (1, 5):
        assert kernel(*args, vocab_parts=parts)[0][:, 0].tolist() == [2100, 2100]
    with pytest.raises(ValueError, match="vocab_parts"):
        kernel(*args, vocab_parts=0)


@pytest.mark.parametrize("mode", ["chain_q", "tree"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_split_search_draws_what_one_program_draws(mode: str, dtype: torch.dtype) -> None:
    """At small batch the first pass of each sampled row's top-k / top-p search runs over the
    row's parts too (``_search_part_kernel``): over 3 parts of 4,097 tokens (the last of one
    token) the tokens drawn, acceptances and rows are the reference's, as with one program
    per row; top-p, top-k, both, min-p (which keeps its search in the row's program) and
    greedy rows."""
    args = list(random_case(6, 3, 4097, seed=40 + len(mode), tree=mode == "tree",
                            with_q=mode == "chain_q"))
    args[0] = args[0].to(dtype)
    args[4] = torch.tensor([1.0, 0.7, 1.0, 1.3, 0.0, 1.0])  # temperature (one greedy row)
    args[5] = torch.tensor([-1, 5, 40, -1, -1, 3], dtype=torch.int32)  # top_k
    args[6] = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.9, 0.8])  # top_p
    log_min_p = torch.log(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1e-3]))
    want = ref.rejection_sample(*args, log_min_p)
    for parts in (1, 3):
        got = kernel(*args, log_min_p, vocab_parts=parts)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1]), parts
        assert torch.equal(want[3], got[3])
        torch.testing.assert_close(want[2], got[2], atol=1e-4, rtol=1e-4)


def test_default_vocab_parts() -> None:
    """About two programs per SM (132 assumed off-GPU) when rows are few; whole 2,048-token
    blocks at least; no split once the rows fill the GPU."""
    cpu = torch.device("cpu")
    assert default_vocab_parts(4, 151_936, cpu) == 66  # B = 1, k + 1 = 4
    assert default_vocab_parts(1, 151_936, cpu) == 75  # ceil(151,936 / 2,048)
    assert default_vocab_parts(264, 151_936, cpu) == 1
    assert default_vocab_parts(2, 100, cpu) == 1


# ------------------------------------------------------------------ draft vocabulary


def draft_vocab_case(bsz: int, n_rows: int, vocab: int, draft_vocab: int, seed: int):
    """A chain case whose drafts come from ``q [B, N-1, Vd]`` over a draft vocabulary that is a
    scattered subset of the target's (``draft_index``: target id -> column, -1 off it), drawn
    from exactly that law; the target's favourites are often outside it."""
    args = list(random_case(bsz, n_rows, vocab, seed))
    g = torch.Generator().manual_seed(seed + 1)
    to_target = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
    index = torch.full((vocab,), -1, dtype=torch.int32)
    index[to_target] = torch.arange(draft_vocab, dtype=torch.int32)
    q = torch.softmax(args[0][:, :-1, to_target] + torch.randn(bsz, n_rows - 1, draft_vocab,
                                                              generator=g), -1)
    q[..., 0] = 0.0  # a draft id it never proposes
    q = q / q.sum(-1, keepdim=True)
    cols = torch.multinomial(q.reshape(-1, draft_vocab), 1, generator=g).view(bsz, -1)
    args[1], args[3] = to_target[cols], q
    return args, index


@pytest.mark.parametrize(("vocab", "draft_vocab", "bsz", "n_rows"),
                         [(100, 37, 16, 4), (2053, 1000, 8, 3), (8193, 4099, 5, 5)])
def test_kernel_equals_reference_draft_vocab(vocab, draft_vocab, bsz, n_rows) -> None:
    """q over a draft vocabulary: the kernel reads q(x) through the map and the residual over
    every target token exactly as the reference does (awkward sizes: no power of two, tails
    of the 4 x 512 race blocks)."""
    args, index = draft_vocab_case(bsz, n_rows, vocab, draft_vocab, seed=vocab)
    want = ref.rejection_sample(*args, draft_index=index)
    for idx in (index, index.long()):
        got = kernel(*args, draft_index=idx, check_values=True)
        assert torch.equal(want[0], got[0]) and torch.equal(want[1], got[1])
        assert torch.equal(want[3], got[3])
        torch.testing.assert_close(want[2], got[2], atol=1e-4, rtol=1e-4)
    # The same law given over the target vocabulary reads the same: equal results.
    full = list(args)
    full[3] = ref.draft_probs_in_target_vocab(args[3], index)
    assert full[3].shape[-1] == vocab
    torch.testing.assert_close(full[3].sum(-1), torch.ones(bsz, n_rows - 1))
    same = ref.rejection_sample(*full)
    assert all(torch.equal(a, b) for a, b in zip(want, same))
    # Some rows were rejected and drew from the residual (the q path is exercised).
    nd = args[2]
    assert ((want[1] < nd) & (args[4] > 0)).any()


def test_draft_vocab_residual_covers_the_target_vocabulary() -> None:
    """A draft with q mass on a token the target rejects draws the residual from tokens the
    draft vocabulary does not have: they are never given q = their column's mass."""
    vocab, draws = 6, 4000
    logits = torch.zeros(draws, 2, vocab)
    logits[:, 0, 1] = -30.0  # p(1) ~ 0: a draft of token 1 is always rejected
    index = torch.tensor([-1, 0, -1, 1, -1, -1], dtype=torch.int32)  # draft vocab {1, 3}
    q = torch.tensor([1.0, 0.0]).expand(draws, 1, 2).contiguous()  # always draft token 1
    drafts = torch.ones(draws, 1, dtype=torch.long)
    for impl in ("reference", "kernel"):
        t, k, p, s, o = params(draws)
        fn = IMPLS[impl]
        d = draws if impl == "reference" else 200
        out, acc, _, _ = fn(logits[:d], drafts[:d], torch.ones(d, dtype=torch.int32), q[:d],
                            t[:d], k[:d], p[:d], s[:d], o[:d], None, draft_index=index)
        assert (acc == 0).all()
        # residual = p without token 1 (q = 0 elsewhere): every other token, uniformly.
        counts = np.bincount(out[:, 0].numpy(), minlength=vocab)
        assert counts[1] == 0 and (counts[[0, 2, 3, 4, 5]] > 0).all(), counts


@pytest.mark.parametrize(("temp", "top_k", "top_p"), [(1.0, -1, 1.0), (0.8, 4, 0.9)])
def test_chain_draft_vocab_distribution(temp: float, top_k: int, top_p: float) -> None:
    """Chi-square: drafts drawn from q over a draft vocabulary missing the target's mode,
    judged through the map, give exactly the processed target law at both positions."""
    g = torch.Generator().manual_seed(15)
    vocab = 9
    logits = torch.randn(1, 3, vocab, generator=g) * 1.5
    keep = [t for t in range(vocab) if t != int(logits[0, 0].argmax()) and t != 4]
    index = torch.full((vocab,), -1, dtype=torch.int32)
    index[keep] = torch.arange(len(keep), dtype=torch.int32)
    q = torch.softmax(torch.randn(1, 2, len(keep), generator=g), -1).expand(DRAWS, -1, -1)
    cols = torch.multinomial(q.reshape(-1, len(keep)), 1, generator=g).view(DRAWS, 2)
    drafts = torch.tensor(keep)[cols]
    logits = logits.expand(DRAWS, -1, -1)
    t, k, p, s, o = params(DRAWS, temp, top_k, top_p)
    out, acc, _, _ = ref.rejection_sample(logits, drafts, torch.full((DRAWS,), 2), q, t, k, p,
                                          s, o, None, draft_index=index)
    assert 0 < (acc >= 1).float().mean() < 1
    chi2(out[:, 0], processed(logits[0, 0], temp, top_k, top_p))
    chi2(out[acc >= 1, 1], processed(logits[0, 1], temp, top_k, top_p))


# ------------------------------------------------------------------ distributions

DRAWS = 100_000
SETTINGS = [(0.7, -1, 1.0), (1.0, 3, 1.0), (1.0, -1, 0.8), (1.3, 4, 0.9)]


@pytest.mark.parametrize(("temp", "top_k", "top_p"), SETTINGS[1:])
def test_chain_point_mass_distribution(temp: float, top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(11)
    logits = torch.randn(1, 3, 8, generator=g).expand(DRAWS, -1, -1)
    drafts = torch.tensor([[logits[0, 0].argmax(), 2]]).expand(DRAWS, -1)
    out, acc, _, _ = run("reference", logits, drafts, torch.full((DRAWS,), 2), temp=temp,
                         top_k=top_k, top_p=top_p)
    chi2(out[:, 0], processed(logits[0, 0], temp, top_k, top_p))
    chi2(out[acc >= 1, 1], processed(logits[0, 1], temp, top_k, top_p))


@pytest.mark.parametrize(("temp", "top_k", "top_p"), SETTINGS[:3:2])
def test_chain_draft_probs_distribution(temp: float, top_k: int, top_p: float) -> None:
    g = torch.Generator().manual_seed(12)
    vocab = 7
    logits = torch.randn(1, 3, vocab, generator=g).expand(DRAWS, -1, -1)
    q = torch.softmax(torch.randn(1, 2, vocab, generator=g), -1)
    q[0, 0, 0] = 0.0  # a token the draft never proposes
    q = (q / q.sum(-1, keepdim=True)).expand(DRAWS, -1, -1)
    drafts = torch.multinomial(q.reshape(-1, vocab), 1, generator=g).view(DRAWS, 2)
    out, acc, _, _ = run("reference", logits, drafts, torch.full((DRAWS,), 2), q=q, temp=temp,
                         top_k=top_k, top_p=top_p)
    chi2(out[:, 0], processed(logits[0, 0], temp, top_k, top_p))
    chi2(out[acc >= 1, 1], processed(logits[0, 1], temp, top_k, top_p))


@pytest.mark.parametrize(("children", "temp", "top_k", "top_p"),
                         [([3, 3, 5], *SETTINGS[2]), ([1, 4, 2], *SETTINGS[3])])
def test_tree_distribution(children: list[int], temp: float, top_k: int, top_p: float) -> None:
    """Duplicate siblings (3, 3) and distinct ones, a second level under node 1."""
    g = torch.Generator().manual_seed(13)
    parents = torch.tensor([-1, 0, 0, 0, 1, 1], dtype=torch.int32)  # node 1 has two children
    logits = torch.randn(1, 6, 6, generator=g).expand(DRAWS, -1, -1)
    drafts = torch.tensor([children + [0, 0]]).expand(DRAWS, -1)
    out, _, _, rows = run("reference", logits, drafts, torch.full((DRAWS,), 5), temp=temp,
                          top_k=top_k, top_p=top_p, parents=parents)
    chi2(out[:, 0], processed(logits[0, 0], temp, top_k, top_p))
    for node in (1, 2, 3):  # second token, given the node the first one moved to
        sel = rows[:, 1] == node
        if sel.sum() > 500:
            chi2(out[sel, 1], processed(logits[0, node], temp, top_k, top_p))


TILE_PEAKS = {0: 2.0, 2047: 1.0, 2048: 2.6, 3001: 0.5, 4096: 3.0, 6144: 1.5, 6148: 2.2}


def tile_row(vocab: int = 3 * ref.TILE + 5) -> torch.Tensor:
    """One row over four tiles (the last of 5 tokens) whose mass sits in every tile at
    different heights: a peak or two per tile, a tail of -2 (a third of the mass), every 7th
    token -inf (masked)."""
    row = torch.full((vocab,), -2.0)
    row[::7] = float("-inf")
    for t, v in TILE_PEAKS.items():
        row[t] = v
    return row


def chi2_binned(samples: torch.Tensor, law: np.ndarray) -> None:
    """chi2 over the peaks one by one and the rest lumped per tile (the tail's tokens are too
    many and too light for one bin each)."""
    bins = np.arange(len(law)) // ref.TILE + len(TILE_PEAKS)
    for i, t in enumerate(TILE_PEAKS):
        bins[t] = i
    counts = np.bincount(bins[samples.numpy()], minlength=bins.max() + 1)
    expected = np.bincount(bins, weights=law, minlength=bins.max() + 1)
    assert counts[expected == 0].sum() == 0, "a token outside the kept set was emitted"
    keep = expected > 0
    assert chisquare(counts[keep], expected[keep] / expected[keep].sum() * counts.sum()
                     ).pvalue > P_MIN, (counts, expected)


@pytest.mark.parametrize("mode", ["point", "probs"])
@pytest.mark.parametrize(("temp", "top_k", "top_p"), [(1.0, -1, 1.0), (0.9, 5, 0.95)])
def test_draws_across_tiles_distribution(mode: str, temp: float, top_k: int,
                                         top_p: float) -> None:
    """The two-level draw over a row of four tiles: the tile race weighs each tile by its
    mass on its own scale (its largest z), the token race runs inside the winner. The first
    token emitted follows the processed law whether the draft (a peak in tile 1, or drawn
    from q) is accepted or its residual drawn, with and without filters (whose draws race
    again over the kept set). Drawn by the CPU engine's chain sampler, which equals the
    reference bit for bit (``test_chain_sampler.py``) and draws only where the walk ends."""
    draws, chunk = 12_000, 4_000
    row = tile_row()
    vocab = len(row)
    law = processed(row, temp, top_k, top_p)
    g = torch.Generator().manual_seed(16)
    q_row = torch.softmax(torch.where(row > -3, row + torch.randn(vocab, generator=g), -9.0), 0)
    outs = []
    for c in range(draws // chunk):
        logits = row.expand(chunk, 2, -1)
        q = None
        if mode == "point":
            drafts = torch.full((chunk, 1), 2048)
        else:
            q = q_row.expand(chunk, 1, -1)
            drafts = torch.multinomial(q_row, chunk, replacement=True, generator=g)[:, None]
        t, k, p, s, o = params(chunk, temp, top_k, top_p, seed0=c * chunk)
        out, acc, _, _ = sampled_chain_sample(logits, drafts, torch.ones(chunk, dtype=torch.int32),
                                              q, t, k, p, s, o)
        assert 0 < (acc == 1).float().mean() < 1  # both branches taken
        outs.append(out[:, 0])
    chi2_binned(torch.cat(outs), law)


def test_kernel_distribution() -> None:
    """The kernel itself (interpreter: fewer draws), point-mass chain under top-p."""
    draws = 240
    g = torch.Generator().manual_seed(14)
    logits = torch.randn(1, 2, 5, generator=g).expand(draws, -1, -1).contiguous()
    drafts = torch.full((draws, 1), int(logits[0, 0].argmax()))
    args = (logits, drafts, torch.ones(draws), None, 0.9, -1, 0.9)
    out, _, _, _ = run("kernel", *args, seed0=10**6)
    chi2(out[:, 0], processed(logits[0, 0], 0.9, -1, 0.9))
    assert torch.equal(out, run("reference", *args, seed0=10**6)[0])


# ------------------------------------------------------------------ randomness, bad inputs


def test_uniforms_never_zero() -> None:
    x = torch.tensor([0, 1, 255, 256, 2**24, 2**31, 2**32 - 257, 2**32 - 1])
    u = ref.uniform_from_bits(x)
    assert torch.all(u > 0) and torch.all(u <= 1) and u[-1] == 1
    e = ref.exponential_from_bits(x)
    assert torch.all(e > 0) and torch.all(torch.isfinite(e))
    words = torch.stack(ref.philox4x32(torch.tensor(5), torch.arange(1 << 16), 3, 1, 0))
    assert torch.all(ref.uniform_from_bits(words) > 0)


@pytest.mark.parametrize("vocab", [1, 9, 511, 513, 2047, 2048, 2049, 2561, 4097, 8193])
def test_race_exponentials_follow_the_counter_layout(vocab: int) -> None:
    """Token i's E is word i // G % 4 of lane i // 4G * G + i % G (the module's layout),
    whatever the vocabulary: rows shorter than a block draw only the lanes their tokens use."""
    group = ref.RNG_GROUP
    seeds = torch.tensor([1, -5, 2**40], dtype=torch.int64)
    pos = torch.tensor([0, 7, 99])
    i = torch.arange(vocab)
    for node in (3, torch.tensor([0, 1, 2])):
        words = ref.philox4x32(seeds[:, None], pos[:, None],
                               node if isinstance(node, int) else node[:, None], 1,
                               i // (4 * group) * group + i % group)
        bits = torch.stack(words, -1).gather(-1, (i // group % 4).expand(3, -1)[..., None])
        assert torch.equal(ref.race_exponentials(seeds, pos, node, vocab),
                           ref.exponential_from_bits(bits[..., 0]))


def test_philox_matches_triton() -> None:
    import triton
    import triton.language as tl

    @triton.jit
    def randint4x_kernel(seed_ptr, out_ptr, BLOCK: tl.constexpr):
        i = tl.arange(0, BLOCK)
        a, b, c, d = tl.randint4x(tl.load(seed_ptr), i)
        for w, word in enumerate((a, b, c, d)):
            tl.store(out_ptr + w * BLOCK + i, word)

    seed = torch.tensor([0x0123456789ABCDEF])
    out = torch.zeros(4 * 16, dtype=torch.int32)
    randint4x_kernel[(1,)](seed, out, 16)
    want = torch.stack(ref.philox4x32(seed, torch.arange(16), 0, 0, 0)).reshape(-1)
    assert torch.equal(out.long() & 0xFFFFFFFF, want)


def test_bad_inputs() -> None:
    args = list(random_case(2, 3, 10, seed=0))
    bad = {
        0: (torch.zeros(2, 3), ValueError, "target_logits"),
        1: (torch.zeros(2, 3, dtype=torch.long), ValueError, "draft_token_ids"),
        2: (torch.tensor([0, 3], dtype=torch.int32), ValueError, "num_draft_tokens"),
        3: (torch.zeros(2, 2, 9), ValueError, "draft_probs"),
        4: (torch.tensor([1.0, -1.0]), ValueError, "temperature"),
        5: (torch.ones(2), TypeError, "top_k"),
        6: (torch.tensor([0.0, 1.0]), ValueError, "top_p"),
        7: (torch.zeros(2, dtype=torch.int32), TypeError, "seeds"),
    }
    for pos, (value, exc, word) in bad.items():
        a = list(args)
        a[pos] = value
        with pytest.raises(exc, match=word):
            kernel(*a)
    a = list(args)
    a[1] = torch.full((2, 2), 10)
    a[2] = torch.tensor([2, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="draft_token_ids"):
        kernel(*a)
    a = list(args)
    a[-1] = torch.tensor([-1, 0, 2], dtype=torch.int32)
    with pytest.raises(ValueError, match="tree_parents"):
        kernel(*a)
    a[-1] = torch.tensor([-1, 0, 1], dtype=torch.int32)
    a[3] = torch.full((2, 1, 10), 0.1)  # a sampled tree's q: one row per node, not fewer
    with pytest.raises(ValueError, match=r"draft_probs must be \[B, N-1, V\]"):
        kernel(*a)
    # A draft-vocabulary map: its shape, dtype, range, and only with draft_probs.
    a = list(args)
    a[3] = torch.full((2, 2, 4), 0.25)
    index = torch.tensor([0, 1, 2, 3, -1, -1, -1, -1, -1, -1], dtype=torch.int32)
    kernel(*a, draft_index=index, check_values=True)
    with pytest.raises(ValueError, match="draft_probs"):
        kernel(*a)  # [B, N-1, 4] needs the map
    for bad_index, exc, word in [(index[:9], ValueError, "draft_index"),
                                 (index.float(), TypeError, "draft_index"),
                                 (torch.where(index == 3, 4, index), ValueError, "-1, 4")]:
        with pytest.raises(exc, match=word):
            kernel(*a, draft_index=bad_index, check_values=True)
    a[3] = None
    with pytest.raises(ValueError, match="needs draft_probs"):
        kernel(*a, draft_index=index)


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("mode", ["chain", "chain_q", "tree"])
def test_gpu_large(dtype: torch.dtype, mode: str) -> None:
    args = list(random_case(64, 6, 151936, seed=7, tree=mode == "tree", with_q=mode == "chain_q"))
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    args[0] = args[0].to(dtype)
    want, got = ref.rejection_sample(*args), kernel(*args)
    # GPU exp/log/division differ from the CPU's in the last ulp: a near-tie may flip a row.
    mismatch = ((want[0] != got[0]).any(1) | (want[1] != got[1])).sum().item()
    assert mismatch <= 1, mismatch
