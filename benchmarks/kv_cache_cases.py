"""Workloads and implementations timed by ``bench_kv_cache.py``.

Block tables are random permutations of the pool (scattered pages, as after many allocations
and frees); the accepted paths are the moves the engine makes after a tree verification. Each
``*_impls`` returns the kernel and the PyTorch baselines as zero-argument callables over the
same tensors.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable

import numpy as np
import torch

MAX_NEW = 64  # room per sequence past its context: new tokens / draft-tree nodes


def blocks_per_seq(ctx_max: int, block_size: int) -> int:
    return math.ceil((ctx_max + MAX_NEW) / block_size)


class Layout:
    """Random, scattered block tables for ``batch`` sequences of up to ``ctx_max + MAX_NEW``
    tokens, drawn from one random permutation of the pool."""

    def __init__(self, rng: np.random.Generator, batch: int, ctx_max: int, block_size: int,
                 num_blocks: int) -> None:
        self.block_size = block_size
        per_seq = blocks_per_seq(ctx_max, block_size)
        assert batch * per_seq <= num_blocks, "cache too small for the layout"
        self.tables = rng.permutation(num_blocks)[: batch * per_seq].reshape(batch, per_seq)
        self.ctx = rng.integers(0, ctx_max + 1, size=batch)

    def slots(self, seq: np.ndarray, pos: np.ndarray) -> np.ndarray:
        return self.tables[seq, pos // self.block_size] * self.block_size + pos % self.block_size


def new_token_slots(layout: Layout, tokens_per_seq: int) -> np.ndarray:
    batch = len(layout.ctx)
    seq = np.repeat(np.arange(batch), tokens_per_seq)
    pos = layout.ctx[seq] + np.tile(np.arange(tokens_per_seq), batch)
    return layout.slots(seq, pos)


def accepted_path_moves(layout: Layout, rng: np.random.Generator, accepted: int,
                        tree_size: int) -> tuple[np.ndarray, np.ndarray]:
    """The engine's pairs for ``accepted`` draft tokens per sequence: accepted node ``n`` at
    depth ``d`` (root excluded, pairs with ``n == d`` dropped) moves ctx + n -> ctx + d."""
    src, dst = [], []
    for b, ctx in enumerate(layout.ctx):
        nodes = np.sort(rng.choice(np.arange(1, tree_size), size=accepted, replace=False))
        depth = np.arange(1, accepted + 1)
        keep = nodes != depth
        src.append(layout.slots(np.full(keep.sum(), b), ctx + nodes[keep]))
        dst.append(layout.slots(np.full(keep.sum(), b), ctx + depth[keep]))
    return np.concatenate(src), np.concatenate(dst)


def check_kernels(device: torch.device, dtype: torch.dtype) -> None:
    """The kernels equal the reference on this device before anything is timed."""
    from specengine.kernels import kv_cache, reference

    gen = torch.Generator().manual_seed(0)
    k_cache = torch.randn(16, 16, 2, 64, generator=gen).to(dtype).to(device)
    v_cache = torch.randn(16, 16, 2, 64, generator=gen).to(dtype).to(device)
    qkv = torch.randn(40, 8 * 64, generator=gen).to(dtype).to(device)
    key, value = qkv[:, 256:384].view(40, 2, 64), qkv[:, 384:].view(40, 2, 64)
    slots = torch.randperm(256, generator=gen)[:40].to(device)
    caches = [k_cache.clone(), v_cache.clone()]
    kv_cache.reshape_and_cache(key, value, k_cache, v_cache, slots)
    reference.reshape_and_cache(key, value, *caches, slots)
    src = torch.tensor([5, 9, 12, 40, 41, 47], device=device)
    dst = torch.tensor([1, 2, 5, 33, 34, 35], device=device)
    kv_cache.compact_kv([k_cache], [v_cache], src, dst)
    reference.compact_kv([caches[0]], [caches[1]], src, dst)
    if not (torch.equal(k_cache, caches[0]) and torch.equal(v_cache, caches[1])):
        sys.exit(f"the KV kernels disagree with kernels/reference.py on {device}")


def reshape_impls(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                  v_cache: torch.Tensor, slots: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The kernel and the vLLM-style PyTorch fallbacks (one layer)."""
    from specengine.kernels import kv_cache

    k_flat = k_cache.view(-1, *k_cache.shape[2:])
    v_flat = v_cache.view(-1, *v_cache.shape[2:])

    def index_put() -> None:
        k_flat.index_put_((slots,), key)
        v_flat.index_put_((slots,), value)

    def index_copy() -> None:
        k_flat.index_copy_(0, slots, key)
        v_flat.index_copy_(0, slots, value)

    return {
        "kernel": lambda: kv_cache.reshape_and_cache(key, value, k_cache, v_cache, slots),
        "torch_index_put": index_put,
        "torch_index_copy": index_copy,
    }


def compact_impls(kv: torch.Tensor, k_caches: list[torch.Tensor], v_caches: list[torch.Tensor],
                  src: torch.Tensor, dst: torch.Tensor) -> dict[str, Callable[[], None]]:
    """The kernel (one launch), a per-cache PyTorch loop (gather, then scatter: 2 launches per
    cache) and one gather + scatter over the stacked [2 * layers, slots, Hkv, D] cache."""
    from specengine.kernels import kv_cache

    flats = [c.view(-1, *c.shape[2:]) for c in (*k_caches, *v_caches)]
    stacked = kv.view(kv.shape[0] * kv.shape[1], -1, *kv.shape[4:])

    def per_layer() -> None:
        for f in flats:
            f.index_copy_(0, dst, f.index_select(0, src))

    def stacked_copy() -> None:
        stacked.index_copy_(1, dst, stacked.index_select(1, src))

    return {
        "kernel": lambda: kv_cache.compact_kv(k_caches, v_caches, src, dst),
        "torch_per_layer": per_layer,
        "torch_stacked": stacked_copy,
    }
