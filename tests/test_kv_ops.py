"""KV-cache writes, accepted-path compaction and step metadata from ``specengine._C``.

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

from specengine import _C
from specengine.kernels import kv_cache as kv
from specengine.kernels import reference as ref

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


def padded(tables: list[list[int]]) -> torch.Tensor:
    width = max(1, max(len(t) for t in tables))
    out = torch.full((len(tables), width), -1, dtype=torch.int32)
    for i, t in enumerate(tables):
        out[i, :len(t)] = torch.tensor(t, dtype=torch.int32)
    return out


def slot_of(table: list[int], pos: int, block_size: int) -> int:
    return table[pos // block_size] * block_size + pos % block_size


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
# compact_kv
# --------------------------------------------------------------------------------------------


def accepted_moves(rng: random.Random, num_blocks: int, block_size: int, num_seqs: int,
                   max_tree: int = 8) -> tuple[list[int], list[int], int]:
    """Random trees of new tokens at ctx .. ctx + n - 1 and an accepted root-to-leaf path per
    sequence: pair (ctx + node, ctx + depth) per accepted node, sequence by sequence in path
    order. Returns src, dst and the number of pairs that really move."""
    sizes = [(rng.randrange(0, 20), rng.randrange(1, max_tree + 1)) for _ in range(num_seqs)]
    tables = scattered_tables(rng, num_blocks, [c + n for c, n in sizes], block_size)
    src, dst = [], []
    for table, (ctx, n) in zip(tables, sizes):
        parent = [-1] + [rng.randrange(0, i) for i in range(1, n)]  # topological node order
        node = rng.randrange(n)
        path = []
        while node >= 0:
            path.append(node)
            node = parent[node]
        path.reverse()  # root (node 0) first, node indices increasing
        for depth, node in enumerate(path):
            src.append(slot_of(table, ctx + node, block_size))
            dst.append(slot_of(table, ctx + depth, block_size))
    moving = sum(s != d for s, d in zip(src, dst))
    return src, dst, moving


def make_caches(num_layers: int, shape: tuple[int, ...], dtype: torch.dtype,
                gen: torch.Generator, device: str = "cpu") -> tuple[list, list]:
    # Per-layer views of one KVCache-style tensor, as the engine passes them.
    kvt = rand((2, num_layers, *shape), dtype, gen, device)
    return [kvt[0, i] for i in range(num_layers)], [kvt[1, i] for i in range(num_layers)]


def run_compact(fn, k_caches, v_caches, src, dst, slot_dtype, device="cpu") -> None:
    fn(k_caches, v_caches, torch.tensor(src, dtype=slot_dtype, device=device),
       torch.tensor(dst, dtype=slot_dtype, device=device))


def compact_matches_reference(k_caches: list, v_caches: list, src: list[int], dst: list[int],
                              slot_dtype: torch.dtype, device: str = "cpu",
                              ref_pairs: tuple[list[int], list[int]] | None = None) -> tuple:
    """Compacts the caches in place with the kernel, after the reference did so on copies, and
    asserts every cache equals its copy bit for bit; returns the copies (k_exp, v_exp).

    ``ref_pairs``: the (src, dst) the reference gets instead of (src, dst), e.g. without the
    pairs the kernel must skip.
    """
    k_exp = [c.clone() for c in k_caches]
    v_exp = [c.clone() for c in v_caches]
    ref_src, ref_dst = ref_pairs if ref_pairs is not None else (src, dst)
    run_compact(ref.compact_kv, k_exp, v_exp, ref_src, ref_dst, slot_dtype, device)
    run_compact(kv.compact_kv, k_caches, v_caches, src, dst, slot_dtype, device)
    for got, exp in zip(k_caches + v_caches, k_exp + v_exp):
        assert_same(got, exp)
    return k_exp, v_exp


COMPACT_CASES = [  # (dtype, Hkv, D): row bytes allow VEC 1, 2, 4, 8, 16
    (torch.float8_e4m3fn, 1, 3),
    (torch.float16, 1, 1),
    (torch.float32, 3, 1),
    (torch.bfloat16, 2, 2),
    (torch.bfloat16, 2, 64),
    (torch.float32, 2, 16),
]


@pytest.mark.parametrize("dtype,h,d", COMPACT_CASES)
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("seed", range(3))
def test_compact_kv_matches_reference(dtype: torch.dtype, h: int, d: int,
                                      slot_dtype: torch.dtype, seed: int) -> None:
    rng = random.Random(seed * 1000 + h * 10 + d)
    gen = torch.Generator().manual_seed(seed)
    num_blocks, block_size, num_layers = 64, 4, 5
    # Up to 12 sequences: more pairs than one step of the kernel (kCompactPairsPerStep = 32).
    src, dst, moving = accepted_moves(rng, num_blocks, block_size, rng.randrange(1, 13))
    k_caches, v_caches = make_caches(num_layers, (num_blocks, block_size, h, d), dtype, gen)
    k_exp, _ = compact_matches_reference(k_caches, v_caches, src, dst, slot_dtype)
    if moving:  # the compaction did something in every cache
        i = next(i for i in range(len(src)) if src[i] != dst[i])
        assert not torch.equal(bits(k_caches[-1].view(-1, h, d)[dst[i]]),
                               bits(v_caches[-1].view(-1, h, d)[dst[i]]))
        for layer in range(num_layers):
            assert_same(k_caches[layer].view(-1, h, d)[dst[i]],
                        k_exp[layer].view(-1, h, d)[dst[i]])


def test_compact_kv_long_overlapping_path_across_steps() -> None:
    """One sequence, a 40-deep accepted path through an 80-node tree: the pairs span two
    kernel steps and most destinations are sources of earlier-read pairs."""
    rng = random.Random(7)
    gen = torch.Generator().manual_seed(7)
    block_size, ctx = 4, 5
    table = list(range(40))
    rng.shuffle(table)
    nodes = sorted(rng.sample(range(1, 80), 39))
    path = [0] + nodes
    src = [slot_of(table, ctx + n, block_size) for n in path]
    dst = [slot_of(table, ctx + i, block_size) for i in range(len(path))]
    overlaps = set(src) & {d for s, d in zip(src, dst) if s != d}
    assert len(overlaps) > 5  # many slots are both read and written
    k_caches, v_caches = make_caches(3, (40, block_size, 2, 8), torch.float16, gen)
    # A later pair's store landing before an earlier pair's load (here: pairs copied in reverse
    # order) gives another answer: the test tells a safe implementation from an unsafe one.
    naive = k_caches[0].clone().view(-1, 2, 8)
    for s, d in reversed(list(zip(src, dst))):
        naive[d] = naive[s]
    k_exp, _ = compact_matches_reference(k_caches, v_caches, src, dst, torch.int64)
    assert not torch.equal(naive, k_exp[0].view(-1, 2, 8))


def test_compact_kv_skips_negative_and_identity_pairs() -> None:
    gen = torch.Generator().manual_seed(3)
    k_caches, v_caches = make_caches(2, (4, 4, 2, 8), torch.bfloat16, gen)
    src = [-1, 3, 9, 5, 6]
    dst = [0, -1, 9, 1, 2]
    keep = [i for i in range(len(src)) if src[i] >= 0 and dst[i] >= 0]
    k_exp, _ = compact_matches_reference(k_caches, v_caches, src, dst, torch.int32,
                                         ref_pairs=([src[i] for i in keep],
                                                    [dst[i] for i in keep]))
    flat = k_caches[0].view(-1, 2, 8)
    assert_same(flat[1], k_exp[0].view(-1, 2, 8)[5])


@pytest.mark.parametrize(
    "src,dst,exc,match",
    [
        ([4, 5], [1, 1], ValueError, r"dst_slots\[1\] = 1 repeats an earlier destination"),
        ([1, 6], [1, 1], ValueError, "repeats an earlier destination"),  # even a no-op pair
        ([6, 1], [1, 0], ValueError, "moves must be ordered: pair 1 reads slot 1"),
        ([5, 3, 2], [2, 3, 4], ValueError, "pair 2 reads slot 2, which an earlier pair writes"),
        ([2, 64], [1, 3], IndexError, r"src_slots\[1\] = 64 is out of range .* 64 slots"),
        ([2, 5], [1, 2**40], IndexError, r"dst_slots\[1\] = 1099511627776 is out of range"),
    ],
)
def test_compact_kv_invalid_moves_write_nothing(src, dst, exc, match) -> None:
    gen = torch.Generator().manual_seed(4)
    k_caches, v_caches = make_caches(3, (16, 4, 2, 8), torch.float16, gen)
    before = [c.clone() for c in k_caches + v_caches]
    with pytest.raises(exc, match=match) as info:
        run_compact(kv.compact_kv, k_caches, v_caches, src, dst, torch.int64)
    assert str(info.value).startswith("compact_kv: ")
    for got, exp in zip(k_caches + v_caches, before):
        assert_same(got, exp)


def test_compact_kv_write_after_read_is_ordered() -> None:
    # Pair 0 reads slot 9, pair 1 later writes it: fine (reads happen first), unlike the
    # reverse order, which the precondition rejects.
    gen = torch.Generator().manual_seed(5)
    k_caches, v_caches = make_caches(1, (4, 4, 1, 4), torch.float32, gen)
    compact_matches_reference(k_caches, v_caches, [9, 12], [2, 9], torch.int64)


def test_compact_kv_rejects_bad_inputs() -> None:
    gen = torch.Generator().manual_seed(6)
    ks, vs = make_caches(2, (4, 4, 2, 8), torch.float16, gen)
    src = torch.tensor([5, 6])
    dst = torch.tensor([1, 2])
    before = [c.clone() for c in ks + vs]
    cases = [
        (ValueError, "as many K caches as V caches", ([], [], src, dst)),
        (ValueError, "as many K caches as V caches", (ks, vs[:1], src, dst)),
        (ValueError, "same shape, dtype and device", (ks, [vs[0], vs[1][:2]], src, dst)),
        (ValueError, "same shape, dtype and device", (ks, [vs[0], vs[1].float()], src, dst)),
        (ValueError, r"caches\[0\] must be \[num_blocks", ([ks[0][0]], [vs[0]], src, dst)),
        (ValueError, "must be contiguous", ([ks[0].transpose(2, 3)],
                                            [vs[0].transpose(2, 3)], src, dst)),
        (TypeError, "src_slots must be int32 or int64", (ks, vs, src.float(), dst)),
        (ValueError, r"dst_slots must have shape \(2,\)", (ks, vs, src, dst[:1])),
        (ValueError, "src_slots must have shape", (ks, vs, src.view(1, 2), dst.view(1, 2))),
        (TypeError, "same dtype", (ks, vs, src, dst.int())),
    ]
    for exc, match, args in cases:
        with pytest.raises(exc, match=match):
            kv.compact_kv(*args)
    kv.compact_kv(ks, vs, src[:0], dst[:0])  # nothing to move
    for got, exp in zip(ks + vs, before):
        assert_same(got, exp)


# --------------------------------------------------------------------------------------------
# CUDA launchers (same specification)
# --------------------------------------------------------------------------------------------


def _needs_kernels() -> None:
    if not _C.has_cuda_kernels:
        pytest.skip("specengine._C was built without CUDA kernels")


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,h,d", VEC_CASES)
@pytest.mark.parametrize("layout", ["contiguous", "fused_qkv", "head_strided", "odd_offset"])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
def test_reshape_and_cache_cuda(dtype: torch.dtype, h: int, d: int, layout: str,
                                slot_dtype: torch.dtype) -> None:
    _needs_kernels()
    rng = random.Random(h * 100 + d)
    gen = torch.Generator().manual_seed(h * 100 + d)
    num_blocks, block_size = 64, 16
    lens_new = [(rng.randrange(0, 200), rng.randrange(1, 9)) for _ in range(40)]
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
    _needs_kernels()
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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,h,d", COMPACT_CASES + [(torch.bfloat16, 8, 128)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_seqs", [1, 7, 64])
def test_compact_kv_cuda(dtype: torch.dtype, h: int, d: int, slot_dtype: torch.dtype,
                         num_seqs: int) -> None:
    _needs_kernels()
    rng = random.Random(num_seqs * 31 + d)
    gen = torch.Generator().manual_seed(num_seqs)
    num_blocks, block_size, num_layers = 512, 16, 4
    src, dst, _ = accepted_moves(rng, num_blocks, block_size, num_seqs, max_tree=40)
    k_caches, v_caches = make_caches(num_layers, (num_blocks, block_size, h, d), dtype, gen,
                                     "cuda")
    compact_matches_reference(k_caches, v_caches, src, dst, slot_dtype, "cuda")


@pytest.mark.gpu
def test_compact_kv_cuda_long_overlapping_path() -> None:
    _needs_kernels()
    rng = random.Random(11)
    gen = torch.Generator().manual_seed(11)
    block_size, ctx = 16, 3
    table = list(range(64))
    rng.shuffle(table)
    path = [0] + sorted(rng.sample(range(1, 500), 199))
    src = [slot_of(table, ctx + n, block_size) for n in path]
    dst = [slot_of(table, ctx + i, block_size) for i in range(len(path))]
    k_caches, v_caches = make_caches(2, (64, block_size, 8, 128), torch.bfloat16, gen, "cuda")
    compact_matches_reference(k_caches, v_caches, src, dst, torch.int64, "cuda")
