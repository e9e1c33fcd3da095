"""KV-cache writes and step metadata from ``specengine._C`` (compaction: test_compact_kv.py).

The host launchers (``specengine.kernels.kv_cache``, source in ``kernels/``) run the same
element routines as the CUDA kernels (``csrc/kv_ops.h``), so these CPU tests check the GPU's
indexing too; every result is compared bit for bit with the plain-PyTorch specification in
``specengine.kernels.reference``. The ``gpu`` tests run the CUDA launchers against the same
specification.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from kv_helpers import (
    assert_same,
    needs_cuda_kernels,
    rand,
    scattered_tables,
    slot_of,
    vec_bytes,
)

from specengine import _C
from specengine.kernels import kv_cache as kv
from specengine.kernels import reference as ref

# --------------------------------------------------------------------------------------------
# reshape_and_cache
# --------------------------------------------------------------------------------------------

# (dtype, Hkv, D) chosen so head_bytes alone allows each vector width; the addresses and the
# strides of the layouts below can only lower it.
VEC_CASES = [
    (torch.float8_e4m3fn, 2, 3),  # 3-byte heads: VEC 1
    (torch.bfloat16, 3, 1),  # 2 bytes: VEC 2
    (torch.float32, 2, 3),  # 12 bytes: VEC 4
    (torch.float16, 2, 4),  # 8 bytes: VEC 8
    (torch.bfloat16, 2, 8),  # 16 bytes: VEC 16
    (torch.float16, 8, 128),  # Llama-8B heads: VEC 16
    (torch.float32, 4, 64),
]


def test_vec_cases_cover_every_width() -> None:
    widths = {vec_bytes(d * torch.empty(0, dtype=dt).element_size()) for dt, _, d in VEC_CASES}
    assert widths == {1, 2, 4, 8, 16}


def make_kv_inputs(layout: str, t: int, h: int, d: int, dtype: torch.dtype,
                   gen: torch.Generator, device: str = "cpu") -> tuple[torch.Tensor, torch.Tensor]:
    """key/value [t, h, d] in one of several memory layouts (all unit stride along d)."""
    if layout == "contiguous":
        return rand((t, h, d), dtype, gen, device), rand((t, h, d), dtype, gen, device)
    if layout == "fused_qkv":  # slices of one [t, (hq + 2h) * d] projection output
        hq = 2 * h
        qkv = rand((t, (hq + 2 * h) * d), dtype, gen, device)
        key = qkv[:, hq * d:(hq + h) * d].view(t, h, d)
        value = qkv[:, (hq + h) * d:].view(t, h, d)
        assert not key.is_contiguous() or t == 1
        return key, value
    if layout == "head_strided":  # every head padded to 2d + 1 elements, odd start offset
        base = rand((t, h, 2 * d + 1), dtype, gen, device)
        return base[:, :, 1:d + 1], base[:, :, d + 1:2 * d + 1]
    if layout == "head_major":  # [h, t, d] transposed: token stride d, head stride t * d
        return (rand((h, t, d), dtype, gen, device).transpose(0, 1),
                rand((h, t, d), dtype, gen, device).transpose(0, 1))
    if layout == "odd_offset":  # one element into the buffer: misaligned base address
        flat = rand((2 * t * h * d + 1,), dtype, gen, device)
        return (flat[1:1 + t * h * d].view(t, h, d),
                flat[1 + t * h * d:].view(t, h, d))
    raise AssertionError(layout)


def random_slot_mapping(rng: random.Random, num_blocks: int, block_size: int,
                        lens_new: list[tuple[int, int]], pad_every: int) -> torch.Tensor:
    """Slots of new tokens (ctx .. ctx + n - 1 per sequence) on scattered tables, with -1
    padding tokens sprinkled in."""
    tables = scattered_tables(rng, num_blocks, [c + n for c, n in lens_new], block_size)
    slots = []
    for table, (ctx, n) in zip(tables, lens_new):
        for pos in range(ctx, ctx + n):
            slots.append(slot_of(table, pos, block_size))
            if pad_every and rng.randrange(pad_every) == 0:
                slots.append(-1)
    return torch.tensor(slots, dtype=torch.int64)


@pytest.mark.parametrize("dtype,h,d", VEC_CASES)
@pytest.mark.parametrize("layout",
                         ["contiguous", "fused_qkv", "head_strided", "head_major", "odd_offset"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_reshape_and_cache_matches_reference(dtype: torch.dtype, h: int, d: int, layout: str,
                                             slot_dtype: torch.dtype) -> None:
    rng = random.Random(f"{dtype}-{h}-{d}-{layout}-{slot_dtype}")  # str seeds are stable
    gen = torch.Generator().manual_seed(rng.randrange(2**31))
    num_blocks, block_size = 24, 4
    lens_new = [(rng.randrange(0, 12), rng.randrange(1, 9)) for _ in range(5)]
    slots = random_slot_mapping(rng, num_blocks, block_size, lens_new, pad_every=3)
    slots = torch.cat([torch.tensor([-1, -7]), slots]).to(slot_dtype)  # leading padding too
    t = slots.shape[0]
    key, value = make_kv_inputs(layout, t, h, d, dtype, gen)
    k_cache = rand((num_blocks, block_size, h, d), dtype, gen)
    v_cache = rand((num_blocks, block_size, h, d), dtype, gen)
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    ref.reshape_and_cache(key, value, k_exp, v_exp, slots)
    kv.reshape_and_cache(key, value, k_cache, v_cache, slots)
    assert_same(k_cache, k_exp)
    assert_same(v_cache, v_exp)
    # The write really happened (and K did not land in V).
    flat_k = k_cache.view(-1, h, d)
    s = int(slots[slots >= 0][0])
    first_real = int((slots >= 0).nonzero()[0])
    assert_same(flat_k[s], key[first_real])
    assert_same(v_cache.view(-1, h, d)[s], value[first_real])


def test_reshape_and_cache_all_padding_and_empty() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = rand((4, 2, 2, 8), torch.float16, gen)
    before = cache.clone()
    key = rand((3, 2, 8), torch.float16, gen)
    kv.reshape_and_cache(key, key, cache, cache, torch.full((3,), -1, dtype=torch.int32))
    kv.reshape_and_cache(key[:0], key[:0], cache, cache, torch.empty(0, dtype=torch.int64))
    assert_same(cache, before)


@pytest.mark.parametrize("slot_dtype,bad_slot", [(torch.int32, 8), (torch.int32, 108),
                                                 (torch.int32, 2**31 - 1), (torch.int64, 8),
                                                 (torch.int64, 2**40)])
def test_reshape_and_cache_out_of_range_writes_nothing(slot_dtype: torch.dtype,
                                                       bad_slot: int) -> None:
    gen = torch.Generator().manual_seed(1)
    k_cache = rand((4, 2, 2, 8), torch.bfloat16, gen)  # 8 slots
    v_cache = rand((4, 2, 2, 8), torch.bfloat16, gen)
    kb, vb = k_cache.clone(), v_cache.clone()
    key = rand((3, 2, 8), torch.bfloat16, gen)
    slots = torch.tensor([0, 5, bad_slot], dtype=slot_dtype)  # valid tokens come first
    with pytest.raises(IndexError, match=r"slot_mapping\[2\] = .* out of range .* 8 slots"):
        kv.reshape_and_cache(key, key, k_cache, v_cache, slots)
    assert_same(k_cache, kb)
    assert_same(v_cache, vb)


def test_reshape_and_cache_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(2)
    kc = rand((4, 2, 2, 8), torch.float16, gen)
    vc = rand((4, 2, 2, 8), torch.float16, gen)
    key = rand((3, 2, 8), torch.float16, gen)
    slots = torch.tensor([0, 1, 2])
    before = kc.clone()
    cases = [
        (ValueError, "k_cache must be", (key, key, kc[0], vc, slots)),
        (ValueError, "must be contiguous", (key, key, kc.transpose(1, 2), vc.transpose(1, 2),
                                            slots)),
        (ValueError, "same shape and dtype", (key, key, kc, vc.float(), slots)),
        (ValueError, "same shape and dtype", (key, key, kc, vc[:3], slots)),
        (ValueError, r"key must be \[T, 2, 8\]", (key[:, :1], key, kc, vc, slots)),
        (ValueError, r"value must be \[T, 2, 8\]", (key, key.reshape(3, 16), kc, vc, slots)),
        (TypeError, "key dtype torch.float32 differs", (key.float(), key, kc, vc, slots)),
        (ValueError, "contiguous along head_dim",
         (key, rand((3, 8, 2), torch.float16, gen).transpose(1, 2), kc, vc, slots)),
        (ValueError, "key has 3 tokens but value has 2", (key, key[:2], kc, vc, slots)),
        (TypeError, "int32 or int64", (key, key, kc, vc, slots.float())),
        (TypeError, "int32 or int64", (key, key, kc, vc, slots.to(torch.int16))),
        (ValueError, r"shape \(3,\)", (key, key, kc, vc, slots[:2])),
        (ValueError, r"shape \(3,\)", (key, key, kc, vc, slots.view(3, 1))),
    ]
    for exc, match, args in cases:
        with pytest.raises(exc, match=match):
            kv.reshape_and_cache(*args)
    assert_same(kc, before)


# --------------------------------------------------------------------------------------------
# compute_slot_mapping / build_block_tables
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("seed", range(5))
def test_step_metadata_matches_reference(seed: int) -> None:
    rng = random.Random(seed)
    block_size = rng.choice([1, 4, 16])
    num_seqs = rng.randrange(1, 7)
    lens = [rng.randrange(0, 40) for _ in range(num_seqs)]
    tables = scattered_tables(rng, 200, lens, block_size)
    max_blocks = max(len(t) for t in tables) + rng.randrange(0, 3)
    bt = _C.build_block_tables(tables, max_blocks)
    assert bt.dtype == np.int32 and bt.shape == (num_seqs, max_blocks)
    for row, table in zip(bt, tables):
        assert row[:len(table)].tolist() == table
        assert (row[len(table):] == _C.block_table_pad).all() and _C.block_table_pad == -1
    seq_ids, positions = [], []
    for s, n in enumerate(lens):
        for pos in rng.sample(range(n), min(n, 9)):
            seq_ids.append(s)
            positions.append(pos)
    order = list(range(len(seq_ids)))
    rng.shuffle(order)
    seq_ids = [seq_ids[i] for i in order]
    positions = [positions[i] for i in order]
    pad_at = sorted(rng.sample(range(len(seq_ids) + 1), 2)) if seq_ids else [0]
    for i in reversed(pad_at):
        seq_ids.insert(i, -1)
        positions.insert(i, rng.randrange(0, 1000))  # ignored for padding
    seq_t = torch.tensor(seq_ids, dtype=torch.int64)
    pos_t = torch.tensor(positions, dtype=torch.int32)
    got = _C.compute_slot_mapping(torch.from_numpy(bt), seq_t, pos_t, block_size)
    assert got.dtype == np.int64 and got.shape == (len(seq_ids),)
    keep = seq_t >= 0
    expected = ref.slot_mapping(torch.from_numpy(bt), seq_t[keep], pos_t[keep], block_size)
    assert got[keep.numpy()].tolist() == expected.tolist()
    assert (got[~keep.numpy()] == -1).all()
    # Same answer from numpy inputs and plain lists.
    again = _C.compute_slot_mapping(bt, np.asarray(seq_ids), positions, block_size)
    assert again.tolist() == got.tolist()


def test_compute_slot_mapping_errors() -> None:
    bt = _C.build_block_tables([[3, 5], [7]], 2)  # row 1 column 1 is padding
    ok = _C.compute_slot_mapping(bt, [0, 0, 1], [0, 5, 3], 4)
    assert ok.tolist() == [12, 21, 31]
    cases = [
        (ValueError, r"token 1: seq_id 2 is out of range", [0, 2], [0, 0], 4),
        (ValueError, r"token 0: seq_id -2 is out of range", [-2], [0], 4),
        (ValueError, r"token 0 \(sequence 0\) has negative position -1", [0], [-1], 4),
        (ValueError, r"needs block-table column 2 but block_tables has only 2", [0], [8], 4),
        (ValueError, r"column 1, which holds no block \(-1\)", [1], [4], 4),
        (ValueError, "block_size must be positive", [0], [0], 0),
        (ValueError, "differ in length: 2 vs 1", [0, 0], [0], 4),
        (TypeError, "positions must hold integers", [0], [0.5], 4),
        (ValueError, "seq_ids must be 1-D", [[0]], [0], 4),
    ]
    for exc, match, seqs, pos, bs in cases:
        with pytest.raises(exc, match=match):
            _C.compute_slot_mapping(bt, seqs, pos, bs)
    with pytest.raises(ValueError, match="block_tables must be 2-D"):
        _C.compute_slot_mapping(np.array([3, 5]), [0], [0], 4)
    empty = _C.compute_slot_mapping(bt, [], [], 4)
    assert empty.shape == (0,)


def test_build_block_tables_errors() -> None:
    assert _C.build_block_tables([], 3).shape == (0, 3)
    assert _C.build_block_tables([[], [1]], 1).tolist() == [[-1], [1]]
    with pytest.raises(ValueError, match="block table 1 has 3 blocks, more than max_blocks = 2"):
        _C.build_block_tables([[0], [1, 2, 3]], 2)
    with pytest.raises(ValueError, match="entry 1 = -1 is not a valid block id"):
        _C.build_block_tables([[0, -1]], 2)
    with pytest.raises(ValueError, match="is not a valid block id"):
        _C.build_block_tables([[2**31]], 1)
    with pytest.raises(ValueError, match="max_blocks must be >= 0"):
        _C.build_block_tables([[0]], -1)
    with pytest.raises(TypeError, match="must hold integers"):
        _C.build_block_tables([[0.5]], 1)


# --------------------------------------------------------------------------------------------
# CUDA launchers (same specification)
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,h,d", VEC_CASES)
@pytest.mark.parametrize("layout", ["contiguous", "fused_qkv", "head_strided", "odd_offset"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_reshape_and_cache_cuda(dtype: torch.dtype, h: int, d: int, layout: str,
                                slot_dtype: torch.dtype) -> None:
    needs_cuda_kernels()
    rng = random.Random(h * 100 + d)
    gen = torch.Generator().manual_seed(h * 100 + d)
    block_size = 16
    lens_new = [(rng.randrange(0, 200), rng.randrange(1, 9)) for _ in range(40)]
    # Every sequence's blocks, plus spare blocks that nothing writes (they must stay as they
    # are): 40 sequences of up to 208 tokens need up to 520 blocks.
    num_blocks = sum(-(-(c + n) // block_size) for c, n in lens_new) + 8
    slots = random_slot_mapping(rng, num_blocks, block_size, lens_new, pad_every=4)
    slots = slots.to(slot_dtype).cuda()
    key, value = make_kv_inputs(layout, slots.shape[0], h, d, dtype, gen, "cuda")
    k_cache = rand((num_blocks, block_size, h, d), dtype, gen, "cuda")
    v_cache = rand((num_blocks, block_size, h, d), dtype, gen, "cuda")
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    ref.reshape_and_cache(key, value, k_exp, v_exp, slots)
    kv.reshape_and_cache(key, value, k_cache, v_cache, slots)
    torch.cuda.synchronize()
    assert_same(k_cache, k_exp)
    assert_same(v_cache, v_exp)


@pytest.mark.gpu
def test_reshape_and_cache_cuda_skips_out_of_range() -> None:
    needs_cuda_kernels()
    gen = torch.Generator().manual_seed(0)
    k_cache = rand((4, 2, 2, 8), torch.float16, gen, "cuda")
    v_cache = rand((4, 2, 2, 8), torch.float16, gen, "cuda")
    k_exp, v_exp = k_cache.clone(), v_cache.clone()
    key = rand((3, 2, 8), torch.float16, gen, "cuda")
    kv.reshape_and_cache(key, key, k_cache, v_cache,
                         torch.tensor([1, 8, 2**20], device="cuda"))  # documented: skipped
    ref.reshape_and_cache(key[:1], key[:1], k_exp, v_exp, torch.tensor([1], device="cuda"))
    torch.cuda.synchronize()
    assert_same(k_cache, k_exp)
    assert_same(v_cache, v_exp)
