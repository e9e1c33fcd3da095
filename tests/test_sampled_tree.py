"""Trees whose children were drawn from the draft's ``q`` without replacement (the reference
``rejection_sample`` with ``tree_parents`` and ``draft_probs``): recursive rejection sampling.

The emitted tokens follow the target's law (chi-square over 3e4 rows, each with its own draws
of the children), and the probability that each child is kept equals the one an independent
float64 enumeration of every ordered draw gives: a sampler that rejected every child, or
judged a later sibling against ``p`` instead of the residual, stays lossless and fails there.
"""

from __future__ import annotations

import itertools

import numpy as np
import pytest
import torch
from lossless import processed_law

from specengine.kernels import reference as ref

try:
    import scipy.stats as scipy_stats
except ImportError:  # optional: the chi-square tests skip without it, the rest run (the GPU
    scipy_stats = None  # machines' tests included)

needs_scipy = pytest.mark.skipif(scipy_stats is None, reason="chi-square tests need scipy")

DRAWS = 30_000
P_MIN = 1e-3
PARENTS = [-1, 0, 0, 0, 1, 1]  # three children at the root, two under node 1
VOCAB = 6


def draw_without_replacement(q: torch.Tensor, num: int, g: torch.Generator) -> torch.Tensor:
    """``[R, num]`` tokens drawn one after another from ``q [R, V]`` without replacement (the
    exponential race: the order of ``q / E`` is a draw without replacement). Past ``q``'s
    support the remaining ranks are tokens of probability 0, as a drafter's race gives them."""
    e = torch.empty_like(q).exponential_(generator=g)
    return (q / e).argsort(dim=-1, descending=True)[:, :num]


def sampled_tree_inputs(q_root: torch.Tensor, q_one: torch.Tensor, seed: int):
    """Drafts ``[DRAWS, 5]`` (nodes 1-3 from ``q_root``, nodes 4-5 from ``q_one``) and their
    ``draft_probs [DRAWS, 5, V]`` (each node carries the distribution it was drawn from)."""
    g = torch.Generator().manual_seed(seed)
    root = draw_without_replacement(q_root.expand(DRAWS, -1), 3, g)
    one = draw_without_replacement(q_one.expand(DRAWS, -1), 2, g)
    probs = torch.stack([q_root] * 3 + [q_one] * 2)[None].expand(DRAWS, -1, -1)
    return torch.cat([root, one], 1), probs


def run(logits, drafts, probs, temp=1.0, top_k=-1, top_p=1.0):
    bsz = logits.shape[0]
    return ref.rejection_sample(
        logits, drafts, torch.full((bsz,), 5, dtype=torch.int32), probs,
        torch.full((bsz,), temp), torch.full((bsz,), top_k, dtype=torch.int32),
        torch.full((bsz,), top_p), torch.arange(bsz, dtype=torch.int64),
        torch.full((bsz,), 11, dtype=torch.int64), torch.tensor(PARENTS, dtype=torch.int32))


def chi2(samples: torch.Tensor, law: np.ndarray) -> None:
    counts = np.bincount(samples.numpy(), minlength=len(law))
    assert counts[law == 0].sum() == 0, "a token the target never emits was emitted"
    keep = law > 0
    assert scipy_stats.chisquare(counts[keep], law[keep] / law[keep].sum() * counts.sum()
                                 ).pvalue > P_MIN, (counts, law)


def exact_keep(p: np.ndarray, q: np.ndarray, num: int) -> np.ndarray:
    """``[num]``: the probability that the ``i``-th child is the one kept, over every ordered
    draw of ``num`` children from ``q`` without replacement (float64, by enumeration)."""
    keep = np.zeros(num)
    support = [t for t in range(len(q)) if q[t] > 0]
    for order in itertools.permutations(support, min(num, len(support))):
        left, prob = 1.0, 1.0
        for t in order:  # the probability of this order
            prob *= q[t] / left
            left -= q[t]
        r, taken, reach = p.copy(), np.zeros(len(q), bool), 1.0
        for i, t in enumerate(order):
            big_q = np.where(taken, 0.0, q)
            big_q /= big_q.sum()
            a = min(1.0, r[t] / big_q[t])
            keep[i] += prob * reach * a
            reach *= 1 - a
            r = np.maximum(r - big_q, 0.0)
            if r.sum() <= 0:
                break
            r /= r.sum()
            taken[t] = True
    return keep


def setup(seed: int):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(1, 6, VOCAB, generator=g) * 1.5
    q_root = torch.softmax(logits[0, 0] + torch.randn(VOCAB, generator=g), 0)
    q_one = torch.softmax(torch.randn(VOCAB, generator=g) * 2, 0)
    return logits, q_root, q_one


@needs_scipy
@pytest.mark.parametrize(("temp", "top_k", "top_p"), [(1.0, -1, 1.0), (0.8, 4, 0.9)])
def test_sampled_tree_distribution(temp: float, top_k: int, top_p: float) -> None:
    """The first token follows p_root, the second the row of the node the first moved to."""
    logits, q_root, q_one = setup(21)
    drafts, probs = sampled_tree_inputs(q_root, q_one, 22)
    out, acc, lp, rows = run(logits.expand(DRAWS, -1, -1), drafts, probs, temp, top_k, top_p)
    chi2(out[:, 0], processed_law(logits[0, 0], temp, top_k, top_p).numpy())
    for node in (1, 2, 3):
        sel = rows[:, 1] == node
        assert sel.sum() > 500
        chi2(out[sel, 1], processed_law(logits[0, node], temp, top_k, top_p).numpy())
    # the logprobs are the target's, whichever way the token came
    law = processed_law(logits[0, 0], temp, top_k, top_p)
    assert torch.allclose(lp[:, 0].double(), law[out[:, 0]].log(), atol=1e-5)


def test_sampled_tree_keeps_each_child_as_often_as_recursive_rejection_does() -> None:
    """P(child i kept) at the root (and under node 1) equals the float64 enumeration, to 4.5
    binomial standard deviations."""
    logits, q_root, q_one = setup(23)
    drafts, probs = sampled_tree_inputs(q_root, q_one, 24)
    out, acc, _, rows = run(logits.expand(DRAWS, -1, -1), drafts, probs)
    p = torch.softmax(logits[0].double(), -1).numpy()
    for parent, kids, q in ((0, [1, 2, 3], q_root), (1, [4, 5], q_one)):
        at = (rows[:, 1] == 1) if parent == 1 else torch.ones(DRAWS, dtype=torch.bool)
        n = int(at.sum())
        want = exact_keep(p[parent], q.double().numpy(), len(kids))
        assert want.sum() > 0.5  # a drafter worth having: most steps keep a child
        nxt = rows[at, 1 + (parent == 1)]
        for i, c in enumerate(kids):
            got = float((nxt == c).float().mean())
            sd = (want[i] * (1 - want[i]) / n) ** 0.5
            assert abs(got - want[i]) < 4.5 * sd + 1e-4, (parent, c, got, want[i])


@needs_scipy
def test_children_past_the_drafts_support_are_skipped() -> None:
    """q with two tokens for three children: the third is a token of probability 0 (what a
    drafter's race gives past the support). It is never kept and leaves the residual alone,
    so the law stays exact."""
    logits, _, q_one = setup(25)
    q_root = torch.zeros(VOCAB)
    q_root[[1, 4]] = torch.tensor([0.7, 0.3])
    drafts, probs = sampled_tree_inputs(q_root, q_one, 26)
    assert probs[0, 0, drafts[:, 2]].eq(0).all()
    out, _, _, rows = run(logits.expand(DRAWS, -1, -1), drafts, probs)
    assert (rows[:, 1] != 3).all()
    chi2(out[:, 0], processed_law(logits[0, 0], 1.0, -1, 1.0).numpy())


def test_greedy_rows_of_a_sampled_tree_follow_the_argmax() -> None:
    """Greedy rows (one-hot q at the drafter's argmax) keep the child that is the target's
    argmax, wherever it sits among its siblings, and emit the argmax."""
    logits, q_root, q_one = setup(27)
    bsz = 6
    drafts, probs = sampled_tree_inputs(q_root, q_one, 28)
    drafts, probs = drafts[:bsz].clone(), probs[:bsz].clone()
    top = int(logits[0, 0].argmax())
    for b in range(bsz):
        drafts[b, :3] = torch.tensor([(top + 1) % VOCAB, top, (top + 2) % VOCAB]) \
            if b % 2 else torch.tensor([(top + 1) % VOCAB, (top + 2) % VOCAB, (top + 3) % VOCAB])
    out, acc, _, rows = run(logits.expand(bsz, -1, -1), drafts, probs, temp=0.0)
    assert (out[:, 0] == top).all()
    assert rows[1::2, 1].eq(2).all() and acc[0::2].eq(0).all()


def test_a_chain_shaped_sampled_tree_draws_what_the_sampled_chain_draws() -> None:
    """One child per node: the same uniforms, residuals and races as the chain, token for
    token (outputs, counts and logprobs equal), with filters and a draft vocabulary."""
    g = torch.Generator().manual_seed(29)
    bsz, vocab, vd = 512, 50, 20
    logits = torch.randn(bsz, 4, vocab, generator=g) * 2
    to_target = torch.randperm(vocab, generator=g)[:vd]
    draft_index = torch.full((vocab,), -1, dtype=torch.int32)
    draft_index[to_target] = torch.arange(vd, dtype=torch.int32)
    q = torch.softmax(logits[:, :3, to_target] + torch.randn(bsz, 3, vd, generator=g) * 0.5, -1)
    drafts = to_target[torch.multinomial(q.view(-1, vd), 1, generator=g).view(bsz, 3)]
    temp = torch.where(torch.arange(bsz) % 5 == 0, 0.0, 0.9)
    args = (torch.full((bsz,), 3, dtype=torch.int32), q, temp,
            torch.where(torch.arange(bsz) % 3 == 0, 8, -1).int(), torch.full((bsz,), 0.95),
            torch.arange(bsz, dtype=torch.int64), torch.full((bsz,), 5, dtype=torch.int64))
    chain = ref.rejection_sample(logits, drafts, *args, None, draft_index=draft_index)
    tree = ref.rejection_sample(logits, drafts, *args, torch.tensor([-1, 0, 1, 2]),
                                draft_index=draft_index)
    for a, b in zip(chain, tree):
        assert torch.equal(a, b)
    assert (chain[1] == 0).sum() > 50 and (chain[1] >= 2).sum() > 50  # kept and rejected


def test_the_engine_verifies_sampled_trees_with_the_heads_distributions() -> None:
    """On the bundled pair, a sampled request's tree reaches the verify pass with each node's
    ``q`` (the children were drawn); a greedy batch's tree carries none (point masses) and
    stays token for token equal to k=0. The sampled batch keeps drafts (not a sampler that
    rejects them all)."""
    from specengine import SamplingParams, SpecEngine
    from specengine.arith_task import encode, heldout_prompts
    from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

    engine = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", dtype="float32",
                        max_model_len=128, seed=3)
    verifier = engine.graphs.verifier
    seen: list[tuple[bool, bool]] = []
    sampler = verifier.sampler

    def spy(logits, drafts, num_draft, probs, parents, params, draft_index=None):
        seen.append((parents is not None, probs is not None))
        return sampler(logits, drafts, num_draft, probs, parents, params, draft_index)

    verifier.sampler = spy
    tree = [(0,), (1,), (0, 0), (1, 0), (0, 0, 0)]
    prompts = [encode(p) for p in heldout_prompts(6)]
    engine.generate(prompts, sampling=SamplingParams(temperature=1.0, max_tokens=24), k=3,
                    tree=tree)
    assert (True, True) in seen and (True, False) not in seen
    st = engine.stats
    assert st.accepted_per_position[0] > 0.5 * st.proposed_per_position[0]
    seen.clear()
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    spec = engine.generate(prompts, sampling=greedy, k=3, tree=tree)
    assert seen and all(t and not p for t, p in seen)
    plain = engine.generate(prompts, sampling=greedy, k=0)
    assert [o.token_ids for o in spec] == [o.token_ids for o in plain]


@needs_scipy
def test_sample_children_draws_without_replacement_from_q() -> None:
    """The drafter's children: the first two follow q(a)·q(b)/(1 - q(a)) (chi-square over
    every ordered pair), never repeat while q has support, map to target ids, and are drawn
    again the same for the same (seed, position); greedy rows take the top ranks in order
    with a one-hot q."""
    from specengine.drafters.drafting import sample_children

    rows, vd = 40_000, 5
    q = torch.tensor([0.4, 0.25, 0.2, 0.1, 0.05])
    logits = q.log().expand(rows, -1)
    temp = torch.where(torch.arange(rows) < 8, 0.0, 1.0)
    to_target = torch.tensor([7, 3, 11, 0, 5])
    args = (torch.full((rows,), -1), torch.ones(rows), torch.arange(rows, dtype=torch.int64),
            torch.full((rows,), 9, dtype=torch.int64), to_target)
    ids, probs = sample_children(logits, 3, temp, *args)
    again, _ = sample_children(logits, 3, temp, *args)
    assert torch.equal(ids, again)
    assert (ids[:8] == to_target[:3]).all() and (probs[:8, 0] == 1).all()
    assert torch.allclose(probs[8:], q.expand(rows - 8, -1), atol=1e-6)
    col = {int(t): i for i, t in enumerate(to_target)}
    cols = torch.tensor([[col[int(t)] for t in r] for r in ids[8:].tolist()])
    assert (cols[:, 0] != cols[:, 1]).all() and (cols[:, 1] != cols[:, 2]).all() \
        and (cols[:, 0] != cols[:, 2]).all()
    pair = (cols[:, 0] * vd + cols[:, 1]).numpy()
    qn = q.double().numpy()
    law = np.array([qn[a] * qn[b] / (1 - qn[a]) if a != b else 0.0
                    for a in range(vd) for b in range(vd)])
    chi2(torch.from_numpy(pair), law)


# ------------------------------------------------------------------ the Triton kernel


def kernel_case(bsz: int, n_rows: int, vocab: int, seed: int, draft_vocab: int | None = None,
                parents: list[int] | None = None):
    """``random_case``'s tree inputs (random parents, mixed greedy / temperature / top-k /
    top-p rows) with each node's children drawn without replacement from the node's own q
    (over a draft vocabulary that is a scattered subset of the target's when ``draft_vocab``:
    ``draft_index`` maps target ids to its columns). The q favour the target's tokens, so
    rows keep children, reject some and keep a later sibling. ``parents``: this tree instead
    of a random one."""
    from test_rejection_sampling import random_case

    args = list(random_case(bsz, n_rows, vocab, seed, tree=True))
    if parents is not None:
        args[-1] = torch.tensor(parents, dtype=torch.int32)
    args[2] = torch.where(torch.arange(bsz) == 3, 0, n_rows - 1).int()  # one row drafts none
    g = torch.Generator().manual_seed(seed + 7)
    args[0] = args[0] * 2  # peaked rows, as a model's: children are kept
    logits, parents = args[0], args[-1].tolist()
    to_target, index = torch.arange(vocab), None
    if draft_vocab is not None:
        to_target = torch.randperm(vocab, generator=g)[:draft_vocab].sort().values
        index = torch.full((vocab,), -1, dtype=torch.int32)
        index[to_target] = torch.arange(draft_vocab, dtype=torch.int32)
        logits[:, :, to_target] += 2.0  # most of the target's mass where the drafter can go
    base = logits[:, :, to_target] * 1.5
    q_node = torch.softmax(base + torch.randn(base.shape, generator=g), -1)  # [B, N, W]
    q_node[..., 0] = 0.0  # an id it never proposes
    q_node = q_node / q_node.sum(-1, keepdim=True)
    drafts = torch.zeros(bsz, n_rows - 1, dtype=torch.int64)
    probs = torch.zeros(bsz, n_rows - 1, len(to_target))
    for node in range(n_rows):
        kids = [c for c in range(1, n_rows) if parents[c] == node]
        if kids:
            order = draw_without_replacement(q_node[:, node], len(kids), g)
            for i, c in enumerate(kids):
                drafts[:, c - 1] = to_target[order[:, i]]
                probs[:, c - 1] = q_node[:, node]
    args[1], args[3] = drafts, probs
    return args, index


def later_siblings_kept(rows: torch.Tensor, parents: list[int]) -> int:
    """Steps that kept a child which is not its parent's first: it followed a rejection."""
    first = {p: c for c, p in reversed(list(enumerate(parents))) if c > 0}
    kept = [(int(a), int(b)) for r in rows.tolist() for a, b in zip(r, r[1:]) if b > 0]
    return sum(first[a] != b for a, b in kept)


@pytest.mark.parametrize(("bsz", "parents", "vocab", "draft_vocab", "seed"),
                         [(16, [-1, 0, 0, 0, 1, 1, 2], 100, None, 1),
                          (8, [-1, 0, 0, 1, 1, 1, 2, 4, 4], 2053, None, 2),
                          (12, [-1, 0, 0, 0, 0, 1, 5, 5], 300, 37, 3),
                          (8, [-1, 0, 0, 0, 2], 4097, 1000, 4)])
def test_the_kernel_judges_sampled_children_as_the_reference(bsz, parents, vocab, draft_vocab,
                                                               seed) -> None:
    """The Triton kernel (interpreter) keeps the same children and emits the same tokens,
    rows and logprobs as the reference for sampled trees: awkward vocabularies (tails of the
    2,048-token tiles), q over the target's or a draft vocabulary, greedy and filtered rows;
    some steps keep a later sibling after a rejection (the recursion is exercised)."""
    from specengine.kernels.rejection_sampling import rejection_sample as kernel

    args, index = kernel_case(bsz, len(parents), vocab, seed, draft_vocab, parents)
    want = ref.rejection_sample(*args, draft_index=index)
    got = kernel(*args, draft_index=index, check_values=True)
    for i in (0, 1, 3):
        assert torch.equal(want[i], got[i]), (i, want[i], got[i])
    torch.testing.assert_close(want[2], got[2], atol=1e-4, rtol=1e-4)
    assert later_siblings_kept(want[3], args[-1].tolist()) > 0
    assert (want[1] == 0).any()  # and some steps kept no child


def test_the_kernel_skips_a_repeated_child_as_the_reference_does() -> None:
    """Children [a, b, a] at the root, a likely under q and unlikely under p: after a is
    rejected its repeat has Q = 0 off the taken tokens and is skipped (no second rejection
    that would move the residual again and shrink D), by the kernel as by the reference."""
    from specengine.kernels.rejection_sampling import rejection_sample as kernel

    bsz, vocab = 64, 100
    g = torch.Generator().manual_seed(8)
    logits = torch.randn(bsz, 4, vocab, generator=g)
    logits[:, 0, 7] = -3.0  # a = 7: rarely kept
    q = torch.softmax(torch.randn(vocab, generator=g), 0)
    q[7] = 0.5
    q = q / q.sum()
    drafts = torch.tensor([[7, int(q[:7].argmax()), 7]]).expand(bsz, -1)
    probs = q.expand(bsz, 3, -1)
    args = (logits, drafts, torch.full((bsz,), 3, dtype=torch.int32), probs, torch.ones(bsz),
            torch.full((bsz,), -1, dtype=torch.int32), torch.ones(bsz),
            torch.arange(bsz, dtype=torch.int64), torch.zeros(bsz, dtype=torch.int64),
            torch.tensor([-1, 0, 0, 0], dtype=torch.int32))
    want = ref.rejection_sample(*args)
    got = kernel(*args)
    for a, b in zip(want, got):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    assert (want[1] == 0).sum() > bsz // 4 and (want[3][:, 1] != 3).all()


def test_the_kernel_draws_sampled_trees_over_vocabulary_parts_with_min_p_in_fp16() -> None:
    """Small batch (pass 1 and the first search split over 3 vocabulary parts), fp16 logits,
    top-k / top-p / min-p: the same outputs as the reference and as one program per row."""
    from specengine.kernels.rejection_sampling import rejection_sample as kernel

    args, index = kernel_case(6, 6, 4097, seed=5, parents=[-1, 0, 0, 0, 1, 1])
    args[0] = args[0].half()
    args[4] = torch.tensor([1.0, 0.7, 1.0, 1.3, 0.0, 1.0])
    args[5] = torch.tensor([-1, 5, 40, -1, -1, 3], dtype=torch.int32)
    args[6] = torch.tensor([0.9, 1.0, 0.5, 0.99, 0.9, 0.8])
    log_min_p = torch.log(torch.tensor([0.0, 0.0, 0.0, 0.0, 0.0, 1e-3]))
    want = ref.rejection_sample(*args, log_min_p)
    for parts in (1, 3):
        got = kernel(*args, log_min_p, vocab_parts=parts)
        for i in (0, 1, 3):
            assert torch.equal(want[i], got[i]), (parts, i)
        torch.testing.assert_close(want[2], got[2], atol=1e-4, rtol=1e-4)


def test_the_kernels_chain_shaped_sampled_tree_draws_what_its_chain_draws() -> None:
    """One child per node on the kernel: the chain path's outputs token for token."""
    from specengine.kernels.rejection_sampling import rejection_sample as kernel

    args, index = kernel_case(12, 4, 300, seed=6, draft_vocab=90, parents=[-1, 0, 1, 2])
    chain = [*args[:-1], None]
    want = kernel(*chain, draft_index=index)
    got = kernel(*args, draft_index=index)
    for a, b in zip(want, got):
        assert torch.equal(a, b)
    assert (want[1] == 0).any() and (want[1] >= 2).any()


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gpu_sampled_tree_kernel_equals_reference(dtype: torch.dtype) -> None:
    """The compiled kernel (scalar stores and barriers between a row's threads, which the
    interpreter does not exercise) keeps the children the reference keeps: 64 sequences of the
    SmolLM2 head's sampled tree of 16 over Qwen's 151,936 tokens, q over a 32,000-id draft
    vocabulary."""
    from specengine.kernels.rejection_sampling import rejection_sample as kernel

    paths = [(0,), (1,), (2,), (3,), (4,), (5,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0),
             (2, 0), (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)]
    parents = [-1] + [([()] + paths).index(p[:-1]) for p in paths]
    args, index = kernel_case(64, len(parents), 151936, seed=9, draft_vocab=32000,
                              parents=parents)
    args = [a.cuda() if isinstance(a, torch.Tensor) else a for a in args]
    args[0] = args[0].to(dtype)
    index = index.cuda()
    want, got = ref.rejection_sample(*args, draft_index=index), kernel(*args, draft_index=index)
    # GPU exp/log/division differ from the CPU's in the last ulp: a near-tie may flip a row.
    mismatch = ((want[0] != got[0]).any(1) | (want[1] != got[1])).sum().item()
    assert mismatch <= 1, mismatch
    assert later_siblings_kept(want[3].cpu(), parents) > 0
