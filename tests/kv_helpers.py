"""Helpers shared by the KV-op tests: bitwise comparison, random tensors, paged layouts."""

from __future__ import annotations

import random

import pytest
import torch

from specengine import _C

INT_VIEW = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def bits(t: torch.Tensor) -> torch.Tensor:
    """Bitwise view (NaN-safe, exact) for comparisons."""
    return t.contiguous().view(INT_VIEW[t.element_size()])


def assert_same(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.shape == expected.shape and actual.dtype == expected.dtype
    assert torch.equal(bits(actual).cpu(), bits(expected).cpu())


def rand(shape: tuple[int, ...], dtype: torch.dtype, gen: torch.Generator,
         device: str = "cpu") -> torch.Tensor:
    return torch.randn(shape, generator=gen).to(dtype).to(device)


def vec_bytes(*values: int) -> int:
    """Python mirror of csrc/kv_ops.h choose_vec_bytes: largest power of two <= 16 dividing all."""
    acc = 16
    for v in values:
        acc |= v
    return acc & -acc


# --------------------------------------------------------------------------------------------
# Paged layout helpers
# --------------------------------------------------------------------------------------------


def scattered_tables(rng: random.Random, num_blocks: int, lens: list[int],
                     block_size: int) -> list[list[int]]:
    """Each sequence gets its blocks from a random permutation of the pool (no sharing)."""
    perm = list(range(num_blocks))
    rng.shuffle(perm)
    tables, used = [], 0
    for n in lens:
        need = -(-n // block_size)
        tables.append(perm[used:used + need])
        used += need
    assert used <= num_blocks
    return tables


def slot_of(table: list[int], pos: int, block_size: int) -> int:
    return table[pos // block_size] * block_size + pos % block_size


def needs_cuda_kernels() -> None:
    """Skips the calling test when ``specengine._C`` was built without CUDA kernels."""
    if not _C.has_cuda_kernels:
        pytest.skip("specengine._C was built without CUDA kernels")
