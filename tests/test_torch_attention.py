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
