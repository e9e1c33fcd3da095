"""The CPU engine's batched attention equals the reference it is derived from."""

from __future__ import annotations

import pytest
import torch

from specengine.kernels import reference
from specengine.model.torch_attention import padded_paged_attention


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (8, 2)])
def test_matches_reference(tree: bool, hq: int, hkv: int) -> None:
    g = torch.Generator().manual_seed(hq + tree)
    bs, d, num_blocks = 16, 32, 64
    ctx = [0, 1, 15, 16, 17, 40]
    q_lens = [5, 1, 3, 0, 7, 40] if not tree else [5, 1, 3, 0, 7, 37]
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(ctx), 8), -1, dtype=torch.int32)
    used = 0
    for b, (c, n) in enumerate(zip(ctx, q_lens)):
        nb = -(-(c + n) // bs)
        tables[b, :nb] = perm[used:used + nb].int()
        used += nb
    tables[3, :2] = tables[2, :2]  # a shared prefix
    indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(indptr[-1]), hq, d, generator=g)
    mask = None
    if tree:
        words = (max(q_lens) + 31) // 32
        mask = torch.zeros(q.shape[0], words, dtype=torch.int32)
        for b, n in enumerate(q_lens):
            if n:
                m = reference.pack_tree_mask(reference.random_tree_mask(n, g))
                mask[indptr[b]:indptr[b + 1], : m.shape[1]] = m
    args = (q, k_cache, v_cache, tables, torch.tensor(ctx, dtype=torch.int32), indptr, mask,
            d**-0.5)
    torch.testing.assert_close(padded_paged_attention(*args), reference.paged_attention(*args),
                               atol=1e-5, rtol=1e-5)


def test_plan_reused_only_for_the_same_metadata() -> None:
    """The per-pass plan (gather indices, mask) is kept between calls: a second layer with the
    same metadata reuses it; metadata rewritten in place behind torch's back (through numpy,
    as the batch state and ``_C`` write, no version bump) or a new block size must not."""
    import specengine.model.torch_attention as ta

    g = torch.Generator().manual_seed(0)
    bs, hkv, d = 4, 2, 8
    k_cache = torch.randn(16, bs, hkv, d, generator=g)
    v_cache = torch.randn(16, bs, hkv, d, generator=g)
    tables = torch.tensor([[0, 1, 2, -1], [3, 4, -1, -1]], dtype=torch.int32)
    ctx = torch.tensor([6, 3], dtype=torch.int32)
    indptr = torch.tensor([0, 2, 3], dtype=torch.int32)
    q = torch.randn(3, 4, d, generator=g)

    def check() -> None:
        args = (q, k_cache, v_cache, tables, ctx, indptr, None, d**-0.5)
        torch.testing.assert_close(padded_paged_attention(*args),
                                   reference.paged_attention(*args), atol=1e-5, rtol=1e-5)

    check()
    first = ta._last_plan
    check()
    assert ta._last_plan is first  # the second layer of a pass: the same plan
    tables.numpy()[0, :3] = [5, 6, 7]  # next step, same buffers, no version bump
    ctx.numpy()[1] = 4
    check()
    assert ta._last_plan is not first
    tables = torch.tensor([[0, 1, 2, 3], [4, 5, 6, 7]], dtype=torch.int32)  # valid for 4 and 2
    check()
    k_cache, v_cache = k_cache.view(32, 2, hkv, d), v_cache.view(32, 2, hkv, d)  # block size 2
    check()  # the same metadata, another block size: another plan
