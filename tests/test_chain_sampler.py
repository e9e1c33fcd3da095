"""The CPU backend's sampled chain path (``core.chain_sampler``) equals the reference rejection
sampler output for output, bit for bit (ids, accepted counts, logprobs, row ids), on random
batches mixing greedy and sampled rows, temperatures, top-k / top-p / min-p, point-mass and
probabilistic drafts (with and without a draft vocabulary), ``-inf`` logits and ties; it runs
one sampling race per batch row, no sort for rows without filters, and the engine's sampler
takes it for sampled chain steps on the CPU torch backend."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from specengine.core.chain_sampler import sampled_chain_sample
from specengine.core.sampler import Sampler, SamplingTensors
from specengine.kernels import reference as ref
from specengine.kernels.reference import rejection_sample

MODES = ["point", "probs", "draft_vocab"]


def _case(seed: int, bsz: int, n_rows: int, vocab: int, mode: str, filters: bool):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(bsz, n_rows, vocab, generator=g) * 2
    logits[0, :, :2] = logits[0, :, :2].amax(-1, keepdim=True) + 1  # a tie: first index wins
    logits[1 % bsz, :, 3] = float("-inf")  # a masked token (min_tokens)
    p = torch.softmax(logits, -1)
    # Drafts mostly drawn from the target itself (long accepted runs), some from nowhere.
    drafts = torch.multinomial(p[:, :-1].reshape(-1, vocab), 1, generator=g).view(bsz, -1)
    drafts = torch.where(torch.rand(drafts.shape, generator=g) < 0.2,
                         torch.randint(0, vocab, drafts.shape, generator=g), drafts)
    if n_rows > 1:
        drafts[-1, 0] = 3 if bsz > 1 else drafts[-1, 0]  # a masked draft: always refused
    num_draft = torch.randint(0, n_rows, (bsz,), generator=g)
    temp = torch.tensor([0.0, 1.0, 0.7, 1.5])[torch.randint(0, 4, (bsz,), generator=g)]
    temp[0] = 1.0
    top_k = torch.full((bsz,), -1, dtype=torch.int32)
    top_p = torch.ones(bsz)
    log_min_p = torch.full((bsz,), float("-inf"))
    if filters:
        top_k = torch.tensor([-1, 0, 3, vocab, vocab + 1, 20])[
            torch.randint(0, 6, (bsz,), generator=g)].int()
        top_p = torch.tensor([1.0, 0.9, 0.5])[torch.randint(0, 3, (bsz,), generator=g)]
        log_min_p = torch.where(torch.rand(bsz, generator=g) < 0.3,
                                torch.log(torch.tensor(0.05)), float("-inf"))
    index = probs = None
    if mode == "probs":
        probs = torch.softmax(torch.randn(bsz, n_rows - 1, vocab, generator=g), -1)
    elif mode == "draft_vocab":  # a reduced vocabulary: every other target id, 3 missing
        index = torch.full((vocab,), -1, dtype=torch.int32)
        index[::2] = torch.arange((vocab + 1) // 2, dtype=torch.int32)
        probs = torch.softmax(torch.randn(bsz, n_rows - 1, (vocab + 1) // 2, generator=g), -1)
    if probs is not None and n_rows > 1:  # drafts drawn from q where q has mass
        q = probs if index is None else probs[..., index.clamp(min=0).long()] * (index >= 0)
        drafts = torch.multinomial(q.reshape(-1, vocab) + 1e-9, 1, generator=g).view(bsz, -1)
    seeds = torch.randint(0, 2**62, (bsz,), generator=g)
    offsets = torch.randint(0, 10**6, (bsz,), generator=g)
    return (logits, drafts, num_draft, probs, temp, top_k, top_p, seeds, offsets, log_min_p,
            index)


def _check(args) -> tuple:
    *head, log_min_p, index = args
    want = rejection_sample(*head, None, log_min_p, draft_index=index)
    got = sampled_chain_sample(*head, log_min_p, index)
    for r, x in zip(want, got):
        assert r.dtype == x.dtype and r.shape == x.shape
        assert torch.equal(r, x), (r, x)
    return got


@pytest.mark.parametrize(("mode", "n_rows"), [("point", 1)] + [
    (m, n) for m in MODES for n in (2, 4, 6)])  # (no drafts: no draft distributions)
@pytest.mark.parametrize("filters", [False, True])
def test_equals_the_reference_bit_for_bit(mode: str, n_rows: int, filters: bool) -> None:
    accepted = 0
    for seed in range(3):
        got = _check(_case(seed, 12, n_rows, 37, mode, filters))
        accepted += int(got[1].sum())
    if n_rows > 1:  # acceptances and refusals both happen: each branch is compared
        assert 0 < accepted < 12 * 3 * (n_rows - 1)


def test_equals_the_reference_over_several_random_blocks() -> None:
    """A vocabulary past one 4 x RNG_GROUP block, not a multiple of it, and a larger batch
    (sums and races over long rows)."""
    for mode in MODES:
        _check(_case(5, 6, 4, 5000, mode, filters=True))
        _check(_case(6, 6, 3, 5000, mode, filters=False))


_PHILOX_MULTIPLIERS = (0xD2511F53, 0xCD9E8D57)


class _Ops(TorchDispatchMode):
    """Records each operator called and the elements of its first output (and whether it is
    a product by a Philox round multiplier: the random-number work)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, int, torch.dtype]] = []
        self.philox = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        first = out[0] if isinstance(out, (tuple, list)) else out
        name = str(func.overloadpacket.__name__)
        if isinstance(first, torch.Tensor):
            self.calls.append((name, first.numel(), first.dtype))
            if name == "mul" and any(a in _PHILOX_MULTIPLIERS for a in args
                                     if isinstance(a, int)):
                self.philox += first.numel()
        return out

    def elements(self, name: str, dtype: torch.dtype) -> int:
        return sum(n for f, n, d in self.calls if f == name and d == dtype)

    def names(self) -> set[str]:
        return {f for f, _, _ in self.calls}


def _philox_work(args) -> tuple[int, set[str]]:
    """Elements the Philox rounds multiplied (by its round multipliers: the tile and token
    races' and the uniforms' lanes) and the operator names of one call, every row sampled."""
    *head, log_min_p, index = args
    head[4] = torch.ones_like(head[4])
    with _Ops() as ops:
        sampled_chain_sample(*head, log_min_p, index)
    return ops.philox, ops.names()


@pytest.mark.parametrize("vocab", [4096, 20_000])
def test_one_draw_per_row_and_no_sort_without_filters(vocab: int) -> None:
    """Random numbers only where they are read: the Philox work is one two-level draw per
    sampled batch row whatever the number of drafts (the reference draws at every node): one
    lane per tile for the tile race, then the G lanes of one tile for the token race,
    whatever the vocabulary (the token race over every token took V / 4 lanes). A step
    without top-k / top-p / min-p sorts nothing."""
    bsz = 8
    tiles = -(-vocab // ref.TILE)  # 2 or 10 tiles of 2,048 tokens
    base = _case(0, bsz, 1, vocab, "point", filters=False)
    elements, ops = _philox_work(base)
    assert "sort" not in ops and "topk" not in ops
    # 2 products per round, 10 rounds, per lane: each lane once
    assert elements == 20 * bsz * (tiles + ref.RNG_GROUP)
    more, ops = _philox_work(_case(0, bsz, 4, vocab, "probs", filters=False))
    assert "sort" not in ops
    # the same one draw per row (not 4), plus the uniforms: 20 products per draft, 3 per row
    assert more - elements == 20 * bsz * 3
    # top-p on one row: that row's node is sorted, and only it
    filt = list(base)
    filt[6] = torch.tensor([0.9] + [1.0] * (bsz - 1))
    with _Ops() as ops:
        sampled_chain_sample(*filt[:9], filt[9], filt[10])
    assert [n for f, n, _ in ops.calls if f == "sort"] == [vocab]


def _params(temps: list[float], top_p: float = 1.0) -> SamplingTensors:
    b = len(temps)
    return SamplingTensors(torch.tensor(temps, dtype=torch.float32), torch.zeros(b).long(),
                           torch.full((b,), top_p), torch.arange(b).long(),
                           torch.full((b,), 3).long())


def test_the_sampler_uses_it_for_sampled_chains_on_the_cpu(monkeypatch) -> None:
    import specengine.core.sampler as sampler_mod

    calls = []
    real = sampler_mod.sampled_chain_sample
    monkeypatch.setattr(sampler_mod, "sampled_chain_sample",
                        lambda *a, **k: calls.append(1) or real(*a, **k))
    logits, drafts, num_draft, *_ = _case(0, 4, 3, 11, "point", False)
    s = Sampler("torch", torch.device("cpu"))
    out = s(logits, drafts, num_draft, None, None, _params([1.0, 0.0, 0.5, 1.0]))
    assert calls == [1]
    p = _params([1.0, 0.0, 0.5, 1.0])
    ref = rejection_sample(logits, drafts, num_draft, None, p.temperature, p.top_k, p.top_p,
                           p.seeds, p.offsets, None, p.log_min_p)
    assert torch.equal(out.output_ids, ref[0]) and torch.equal(out.logprobs, ref[2])
    s(logits, drafts, num_draft, None, torch.tensor([-1, 0, 1], dtype=torch.int32),
      _params([1.0] * 4))  # a tree: the reference
    s(logits, drafts, num_draft, None, None, _params([0.0] * 4))  # all greedy: greedy path
    s.cpu_fast_paths = False  # captured passes: the reference
    s(logits, drafts, num_draft, None, None, _params([1.0] * 4))
    assert calls == [1]
