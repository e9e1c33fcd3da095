"""The CPU engine's batched attention equals the reference it is derived from."""

from __future__ import annotations

import pytest
import torch

from specengine.kernels import reference
from specengine.model.torch_attention import (
    build_pass_plan,
    padded_paged_attention,
    plan_attention,
    plan_write_kv,
)


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


def _uniform_case(tree: bool, hq: int, hkv: int, seed: int) -> tuple:
    """Every sequence feeds the same number of queries (a decode or verify pass): the plan's
    unpadded path; sequences of different contexts, one at context 0."""
    g = torch.Generator().manual_seed(seed)
    bs, d, num_blocks, n = 16, 32, 64, 4
    ctx = [0, 3, 16, 29, 47]
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.zeros(len(ctx), 6, dtype=torch.int32)  # zero-filled, as the static path's
    for b, c in enumerate(ctx):
        nb = -(-(c + n) // bs)
        tables[b, :nb] = perm[6 * b: 6 * b + nb].int()
    indptr = torch.arange(len(ctx) + 1, dtype=torch.int32) * n
    q = torch.randn(len(ctx) * n, hq, d, generator=g)
    mask = None
    if tree:
        m = reference.pack_tree_mask(reference.random_tree_mask(n, g))
        mask = m.repeat(len(ctx), 1)
    return (q, k_cache, v_cache, tables, torch.tensor(ctx, dtype=torch.int32), indptr, mask,
            d**-0.5)


@pytest.mark.parametrize("tree", [False, True])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 4), (4, 2)])
def test_uniform_pass_matches_reference(tree: bool, hq: int, hkv: int) -> None:
    args = _uniform_case(tree, hq, hkv, seed=hq + 2 * tree)
    plan = build_pass_plan(args[3], args[4], args[5], args[6],
                           torch.zeros(args[0].shape[0], dtype=torch.long), 4, 16)
    assert plan is not None and (plan.q_index is None) == (not tree)  # the unpadded path
    torch.testing.assert_close(plan_attention(*args[:3], plan, args[-1]),
                               reference.paged_attention(*args), atol=1e-5, rtol=1e-5)


def test_plan_writes_only_real_slots() -> None:
    """``plan_write_kv`` is ``reference.reshape_and_cache``: negative slots write nothing."""
    g = torch.Generator().manual_seed(3)
    k_cache, v_cache = torch.randn(2, 8, 4, 2, 8, generator=g)
    k, v = torch.randn(2, 6, 2, 8, generator=g)
    slots = torch.tensor([5, -1, 0, 31, -1, 17])
    plan = build_pass_plan(torch.zeros(2, 2, dtype=torch.int32), torch.zeros(2, dtype=torch.int32),
                           torch.tensor([0, 3, 6], dtype=torch.int32), None, slots, 3, 4)
    assert plan is not None
    want_k, want_v = k_cache.clone(), v_cache.clone()
    reference.reshape_and_cache(k, v, want_k, want_v, slots)
    plan_write_kv(k, v, k_cache, v_cache, plan)
    assert torch.equal(k_cache, want_k) and torch.equal(v_cache, want_v)


def test_torch_backend_builds_one_plan_per_pass() -> None:
    """The torch backend's plan rides in the metadata; the kernels' backend has none (they read
    the metadata on the device)."""
    from specengine.model.attention import (
        AttentionMetadata,
        KernelAttentionBackend,
        TorchAttentionBackend,
        with_pass_plan,
    )

    args = _uniform_case(False, 4, 2, seed=0)
    meta = AttentionMetadata(slot_mapping=torch.zeros(args[0].shape[0], dtype=torch.long),
                             block_tables=args[3], context_lens=args[4], qo_indptr=args[5],
                             max_q_len=4)
    kv_cache = torch.stack([args[1], args[2]])[:, None]  # [2, L=1, blocks, 16, Hkv, D]
    assert with_pass_plan(meta, KernelAttentionBackend(), kv_cache) is meta
    planned = with_pass_plan(meta, TorchAttentionBackend(), kv_cache)
    assert planned.plan is not None
    backend = TorchAttentionBackend()
    torch.testing.assert_close(backend.attend(args[0], args[1], args[2], planned, args[-1]),
                               backend.attend(args[0], args[1], args[2], meta, args[-1]))


def test_engine_passes_build_their_plan_once(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the engine (bundled 4-layer target, k=0): one plan per forward pass, none
    rebuilt per layer, and no layer falls back to planning for itself."""
    from specengine import SamplingParams, SpecEngine
    from specengine.assets import DEFAULT_TARGET
    from specengine.model import torch_attention

    calls = {"plan": 0, "fallback": 0}
    real = torch_attention.build_pass_plan

    def counted(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["plan"] += 1
        return real(*args, **kwargs)

    monkeypatch.setattr(torch_attention, "build_pass_plan", counted)
    monkeypatch.setattr(torch_attention, "padded_paged_attention",
                        lambda *a, **k: calls.__setitem__("fallback", 1))
    engine = SpecEngine(DEFAULT_TARGET, device="cpu", dtype="float32", max_batch_size=4)
    outs = engine.generate([[5, 6, 7], [8, 9]], k=0,
                           sampling=SamplingParams(temperature=0.0, max_tokens=4,
                                                   ignore_eos=True))
    passes = 1 + max(o.num_steps for o in outs) - 1  # the prefill, then one per decode step
    assert calls == {"plan": passes, "fallback": 0}
