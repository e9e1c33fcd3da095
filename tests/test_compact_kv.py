"""Accepted-path compaction (``kv_cache.compact_kv``) equals ``reference.compact_kv`` bit for bit.

The host launcher runs the element routines of the CUDA kernel (``csrc/kv_ops.h``), so these CPU
tests check the GPU's indexing too; the ``gpu`` tests run the CUDA launcher.
"""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch
from kv_helpers import assert_same, bits, needs_cuda_kernels, rand, scattered_tables, slot_of

from specengine.kernels import kv_cache as kv
from specengine.kernels import reference as ref


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


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,h,d", COMPACT_CASES + [(torch.bfloat16, 8, 128)])
@pytest.mark.parametrize("slot_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("num_seqs", [1, 7, 64])
def test_compact_kv_cuda(dtype: torch.dtype, h: int, d: int, slot_dtype: torch.dtype,
                         num_seqs: int) -> None:
    needs_cuda_kernels()
    rng = random.Random(num_seqs * 31 + d)
    gen = torch.Generator().manual_seed(num_seqs)
    num_blocks, block_size, num_layers = 512, 16, 4
    src, dst, _ = accepted_moves(rng, num_blocks, block_size, num_seqs, max_tree=40)
    k_caches, v_caches = make_caches(num_layers, (num_blocks, block_size, h, d), dtype, gen,
                                     "cuda")
    compact_matches_reference(k_caches, v_caches, src, dst, slot_dtype, "cuda")


@pytest.mark.gpu
def test_compact_kv_cuda_long_overlapping_path() -> None:
    needs_cuda_kernels()
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


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("dtype,h,d", [(torch.float16, 1, 1), (torch.bfloat16, 2, 64)])
def test_compact_kv_cache_equals_reference_per_layer(dtype: torch.dtype, h: int, d: int,
                                                      device: str) -> None:
    """The whole-cache launcher (layer addresses made once) moves every layer's K and V as
    the reference does layer by layer, and refuses bad input writing nothing."""
    if device == "cuda":
        needs_cuda_kernels()
    rng = random.Random(h * 10 + d)
    gen = torch.Generator().manual_seed(h)
    num_layers, num_blocks, block_size = 3, 64, 4
    src, dst, moving = accepted_moves(rng, num_blocks, block_size, 8)
    kvt = rand((2, num_layers, num_blocks, block_size, h, d), dtype, gen, device)
    exp = kvt.clone()
    run_compact(ref.compact_kv, [exp[0, i] for i in range(num_layers)],
                [exp[1, i] for i in range(num_layers)], src, dst, torch.int64, device)
    host = np.array([src, dst])
    # From the host twice (the second call reuses the addresses made by the first), then from
    # the device with the pairs that do not move masked as -1 (the verify pass's form).
    masked = torch.tensor([[s if s != t else -1 for s, t in zip(src, dst)], dst], device=device)
    for slots in (host, host, masked):
        got = kvt.clone()
        kv.compact_kv_cache(got, slots)
        assert_same(got, exp)
    assert moving and not torch.equal(bits(kvt), bits(exp))
    before = kvt.clone()
    cases = [
        (ValueError, r"kv must be \[2, num_layers", (kvt[0], np.array([src, dst]))),
        (ValueError, "kv must be contiguous", (kvt.transpose(2, 3), np.array([src, dst]))),
        (ValueError, r"slots must be \[2, N\] int64", (kvt, np.array(src))),
        (ValueError, r"slots must be \[2, N\] int64", (kvt, np.array([src, dst], np.int32))),
        (ValueError, r"slots must be \[2, N\] int64", (kvt, torch.tensor([src, dst]).int())),
        (ValueError, r"slots must be \[2, N\] int64",
         (kvt, torch.tensor([src, dst], device="meta"))),
        (IndexError, "compact_kv: dst_slots", (kvt, np.array([[0], [10 ** 6]]))),
    ]
    for exc, match, args in cases:
        with pytest.raises(exc, match=match):
            kv.compact_kv_cache(*args)
    assert_same(kvt, before)


def test_host_slot_checks_that_the_cuda_launcher_runs_first() -> None:
    """``_C.check_compact_kv`` (what ``compact_kv_cache`` runs on host slots before the CUDA
    launch, whose kernel can only skip a bad pair) refuses what the host kernel refuses and
    passes what it accepts; negative pairs are padding."""
    from specengine import _C

    def check(src: list[int], dst: list[int], num_slots: int = 16) -> None:
        a = np.ascontiguousarray(np.array([src, dst], dtype=np.int64))
        _C.check_compact_kv(a.ctypes.data, a.ctypes.data + 8 * len(src), True, len(src),
                            num_slots)

    check([5, 6, 2], [3, 4, 2])  # ordered, distinct, in range (the last pair stays)
    check([-1, 9], [2, -1])  # padding pairs are skipped
    with pytest.raises(IndexError, match=r"dst_slots\[1\] = 16"):
        check([5, 6], [3, 16])
    with pytest.raises(IndexError, match=r"src_slots\[0\] = 40"):
        check([40], [3])
    with pytest.raises(ValueError, match="repeats an earlier destination"):
        check([5, 6], [3, 3])
    with pytest.raises(ValueError, match="must be ordered"):
        check([5, 3], [3, 1])  # the second pair reads slot 3 after the first wrote it
