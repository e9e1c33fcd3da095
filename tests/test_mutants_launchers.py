"""Issue 29: the launchers' host checks that the bad-input tables of the kernel tests left out.

Each test hands a launcher one input the kernel would misread (a cache not contiguous along
head_dim, head dims that differ, a head dim below 16, a longer ``qo_indptr``, a tensor on
another device, an infinite scale or temperature, a tree with a partial draft count,
non-contiguous per-row vectors) and expects the named refusal; ``mutation/mutate.py --area
launchers`` shows that each one fails when its check is removed or bent. The ``meta`` device
stands in for "another device" on a machine without a GPU: every check reads only metadata,
which a meta tensor has.
"""

from __future__ import annotations

import pytest
import torch

from specengine.kernels.attention import paged_attention
from specengine.kernels.kv_cache import reshape_and_cache
from specengine.kernels.rejection_sampling import rejection_sample


def attention_args(d: int = 32, cache_d: int | None = None, hkv: int = 2,
                   device: str = "cpu") -> dict:
    """Two sequences (contexts 5 and 9, 2 and 3 queries), block size 16, causal."""
    g = torch.Generator().manual_seed(0)
    cache_d = d if cache_d is None else cache_d
    k = torch.randn(4, 16, hkv, cache_d, generator=g)
    v = torch.randn(4, 16, hkv, cache_d, generator=g)
    args = dict(q=torch.randn(5, 4, d, generator=g), k_cache=k, v_cache=v,
                block_tables=torch.tensor([[0, -1], [1, 2]], dtype=torch.int32),
                context_lens=torch.tensor([5, 9], dtype=torch.int32),
                qo_indptr=torch.tensor([0, 2, 5], dtype=torch.int32), tree_mask=None,
                scale=d**-0.5)
    return {n: a.to(device) if isinstance(a, torch.Tensor) else a for n, a in args.items()}


def test_attention_args_are_valid(device: str) -> None:
    assert paged_attention(**attention_args(device=device)).shape == (5, 4, 32)


def test_attention_cache_must_be_contiguous_along_head_dim() -> None:
    a = attention_args()
    for name in ("k_cache", "v_cache"):
        wide = torch.zeros(4, 16, 2, 64)
        wide[..., ::2] = a[name]
        b = dict(a, **{name: wide[..., ::2]})  # stride(3) == 2
        with pytest.raises(ValueError, match=f"{name} must be contiguous along head_dim"):
            paged_attention(**b)


def test_attention_head_dims_must_agree_and_be_at_least_16() -> None:
    with pytest.raises(ValueError, match="q head_dim 16 differs from the cache's 32"):
        paged_attention(**attention_args(d=16, cache_d=32))
    with pytest.raises(ValueError, match="head_dim must be a power of two >= 16, got 8"):
        paged_attention(**attention_args(d=8))


def test_attention_qo_indptr_must_have_exactly_b_plus_1_entries() -> None:
    a = attention_args()
    longer = torch.tensor([0, 2, 5, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"qo_indptr must have B\+1 = 3 entries, got 4"):
        paged_attention(**dict(a, qo_indptr=longer))


@pytest.mark.parametrize("name", ["k_cache", "v_cache", "block_tables", "context_lens",
                                  "qo_indptr"])
def test_attention_inputs_must_share_the_device_of_q(name: str) -> None:
    a = attention_args()
    b = dict(a, **{name: a[name].to("meta")})
    with pytest.raises(ValueError, match=f"{name} is on meta but q is on cpu"):
        paged_attention(**b)


@pytest.mark.parametrize("scale", [float("inf"), float("nan")])
def test_attention_scale_must_be_finite(scale: float) -> None:
    with pytest.raises(ValueError, match="scale must be finite"):
        paged_attention(**dict(attention_args(), scale=scale))


def sampler_args(bsz: int = 2, n_rows: int = 3, vocab: int = 10, tree: bool = False,
                 device: str = "cpu") -> list:
    g = torch.Generator().manual_seed(1)
    parents = torch.tensor([-1, 0, 0], dtype=torch.int32) if tree else None
    args = [torch.randn(bsz, n_rows, vocab, generator=g),
            torch.randint(0, vocab, (bsz, n_rows - 1), generator=g),
            torch.full((bsz,), n_rows - 1, dtype=torch.int32), None,
            torch.ones(bsz), torch.full((bsz,), -1, dtype=torch.int32), torch.ones(bsz),
            torch.arange(bsz, dtype=torch.int64), torch.zeros(bsz, dtype=torch.int64),
            parents]
    return [a.to(device) if isinstance(a, torch.Tensor) else a for a in args]


def test_sampler_args_are_valid(device: str) -> None:
    for tree in (False, True):
        out, num_acc, _, _ = rejection_sample(*sampler_args(tree=tree, device=device),
                                              check_values=True)
        assert out.shape == (2, 3) and num_acc.shape == (2,)


@pytest.mark.parametrize(("pos", "name"), [(2, "num_draft_tokens"), (4, "temperature"),
                                           (5, "top_k"), (6, "top_p"), (7, "seeds"),
                                           (8, "offsets")])
def test_sampler_row_vectors_must_be_contiguous(pos: int, name: str) -> None:
    a = sampler_args()
    a[pos] = torch.stack([a[pos], a[pos]], 1)[:, 0]  # same values, stride 2
    with pytest.raises(ValueError, match=f"{name} must be contiguous"):
        rejection_sample(*a, check_values=False)


@pytest.mark.parametrize("temp", [float("inf"), float("nan")])
def test_sampler_temperature_must_be_finite(temp: float, device: str) -> None:
    a = sampler_args(device=device)
    a[4] = torch.tensor([1.0, temp], device=device)
    with pytest.raises(ValueError, match="temperature must be finite"):
        rejection_sample(*a, check_values=True)


def test_sampler_tree_drafts_all_nodes_or_none(device: str) -> None:
    a = sampler_args(tree=True, device=device)
    a[2] = torch.tensor([2, 1], dtype=torch.int32, device=device)  # 3 rows: 2 drafts or 0
    with pytest.raises(ValueError, match="num_draft_tokens of a tree must be 0 or N-1 = 2"):
        rejection_sample(*a, check_values=True)
    a[2] = torch.tensor([0, 2], dtype=torch.int32, device=device)
    rejection_sample(*a, check_values=True)


def test_kv_write_slots_must_be_on_the_cache_device() -> None:
    kc = torch.zeros(4, 2, 2, 8)
    key = torch.ones(3, 2, 8)
    with pytest.raises(ValueError, match="slot_mapping is on meta but the cache is on cpu"):
        reshape_and_cache(key, key, kc, kc.clone(), torch.tensor([0, 1, 2], device="meta"))
    assert not kc.any()
