"""The Triton paged attention kernel equals ``reference.paged_attention``.

Without CUDA it runs in the Triton interpreter (conftest sets ``TRITON_INTERPRET``), so shapes
stay small: few heads, short contexts. bf16 and large shapes run only on a GPU (``gpu`` mark).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from specengine.kernels import attention_combine, reference
from specengine.kernels.attention import paged_attention

TOL = {torch.float32: (2e-3, 2e-3), torch.float16: (2e-2, 2e-2), torch.bfloat16: (3e-2, 3e-2)}


def make_case(ctx: list[int], q_lens: list[int], *, hq: int = 4, hkv: int = 2, d: int = 32,
              bs: int = 16, dtype: torch.dtype = torch.float32, mask: str = "causal",
              seed: int = 0, device: str = "cpu") -> tuple:
    """Random inputs with a scattered block table (a random permutation of the pool).

    ``mask``: ``causal`` (tree_mask None), ``tree`` (random trees) or ``chain`` (the causal
    triangle given as packed bits).
    """
    g = torch.Generator().manual_seed(seed)
    needed = [-(-(c + n) // bs) for c, n in zip(ctx, q_lens)]
    num_blocks = sum(needed) + 3  # a few spare blocks the tables never point at
    max_blocks = max(needed + [1]) + 1  # one -1 column of padding at least
    k_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, bs, hkv, d, generator=g).to(dtype)
    perm = torch.randperm(num_blocks, generator=g)
    tables = torch.full((len(ctx), max_blocks), -1, dtype=torch.int32)
    used = 0
    for b, nb in enumerate(needed):
        tables[b, :nb] = perm[used:used + nb].int()
        used += nb
    indptr = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    q = torch.randn(int(indptr[-1]), hq, d, generator=g).to(dtype)
    tree_mask = None
    if mask != "causal":
        words = (max(q_lens) + 31) // 32
        tree_mask = torch.zeros(q.shape[0], words, dtype=torch.int32)
        for b, n in enumerate(q_lens):
            if n:
                dense = (reference.random_tree_mask(n, g, max_depth=8) if mask == "tree"
                         else torch.ones(n, n, dtype=torch.bool).tril())
                packed = reference.pack_tree_mask(dense)
                tree_mask[indptr[b]:indptr[b + 1], :packed.shape[1]] = packed
    ctx_t = torch.tensor(ctx, dtype=torch.int32)
    args = (q, k_cache, v_cache, tables, ctx_t, indptr, tree_mask, d**-0.5)
    return tuple(a.to(device) if isinstance(a, torch.Tensor) else a for a in args)


def check(args: tuple, **kw) -> torch.Tensor:
    out = paged_attention(*args, **kw)
    ref = reference.paged_attention(*args)
    atol, rtol = TOL[args[0].dtype]
    assert out.dtype == args[0].dtype and out.shape == args[0].shape
    n = int(args[5][-1])  # rows past qo_indptr[-1] are unspecified
    torch.testing.assert_close(out[:n].float(), ref[:n].float(), atol=atol, rtol=rtol)
    return out


# Context lengths around block boundaries (block 16), an empty one and a long one.
CTX = [0, 1, 15, 16, 17, 300]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize(("hq", "hkv"), [(2, 2), (8, 2), (8, 1)])
def test_ragged_causal_gqa(dtype: torch.dtype, hq: int, hkv: int) -> None:
    # Decode (1), short verify chains, a q_len 0 sequence, ragged everything.
    check(make_case(CTX, [3, 1, 0, 5, 2, 1], hq=hq, hkv=hkv, dtype=dtype, seed=hq))


@pytest.mark.parametrize("num_splits", [1, 2, 5])
@pytest.mark.parametrize("mask", ["causal", "tree"])
def test_forced_splits(num_splits: int, mask: str) -> None:
    # 5 splits over contexts of 0-1 tiles leaves most splits empty: the combine must skip them.
    q_lens = [4, 1, 2, 6, 1, 3]
    check(make_case(CTX, q_lens, hq=4, hkv=1, mask=mask, seed=num_splits),
          num_splits=num_splits)


@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("bs", [16, 32])
def test_random_trees(num_splits: int, bs: int) -> None:
    # Trees of up to 64 nodes (two mask words), depth <= 8, GQA 4, next to a decode row.
    ctx = [0, bs - 1, bs + 1, 70]
    q_lens = [64, 17, 33, 1]
    check(make_case(ctx, q_lens, hq=4, hkv=1, bs=bs, mask="tree", seed=bs + num_splits),
          num_splits=num_splits)


def test_tree_fp16() -> None:
    check(make_case([5, 40], [24, 9], hq=8, hkv=1, mask="tree", dtype=torch.float16, seed=3))


@pytest.mark.parametrize("num_splits", [1, 2])
def test_chain_mask_equals_causal(num_splits: int) -> None:
    # A k+1 chain given as packed bits is the causal triangle: same output as tree_mask=None.
    args = make_case([20, 33, 7], [8, 2, 5], mask="chain", seed=11)
    out_chain = check(args, num_splits=num_splits)
    out_causal = paged_attention(*args[:6], None, args[7], num_splits=num_splits)
    torch.testing.assert_close(out_chain, out_causal, atol=1e-6, rtol=1e-6)


@pytest.mark.parametrize(("d", "bs"), [(64, 16), (128, 32), (256, 16)])
def test_head_dims(d: int, bs: int) -> None:
    check(make_case([0, bs + 1, 50], [2, 1, 4], hq=2, hkv=1, d=d, bs=bs, seed=d))


def test_prefill_long_causal() -> None:
    # A few hundred queries: many query tiles, the causal early stop, mixed with a decode row.
    check(make_case([0, 37, 90], [200, 130, 1], hq=2, hkv=1, seed=5))


def test_block_larger_than_key_tile() -> None:
    # block_size 128 > the 64-key tile: a tile covers part of one page.
    check(make_case([0, 130, 300], [3, 1, 2], hq=2, hkv=1, bs=128, seed=7), num_splits=2)


def test_shared_blocks() -> None:
    # Two sequences pointing at the same blocks and given the same queries agree exactly.
    q, k, v, tables, ctx, indptr, _, scale = make_case([45, 45], [3, 3], seed=9)
    tables[1] = tables[0]
    q[3:] = q[:3]
    args = (q, k, v, tables, ctx, indptr, None, scale)
    out = check(args)
    torch.testing.assert_close(out[:3], out[3:], atol=0, rtol=0)


def test_strided_q() -> None:
    # q as a view into a fused qkv buffer: token and head strides differ from a contiguous q.
    q, k, v, tables, ctx, indptr, _, scale = make_case([10, 20], [3, 2], hq=4, hkv=2, seed=4)
    qkv = torch.randn(q.shape[0], 8, q.shape[2])
    qkv[:, :4] = q
    check((qkv[:, :4], k, v, tables, ctx, indptr, None, scale))


def test_max_q_len_given_and_empty_inputs() -> None:
    args = make_case([10, 3], [4, 2], seed=2)
    ref = reference.paged_attention(*args)
    out = paged_attention(*args, max_q_len=6)  # an upper bound is fine
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    out = paged_attention(*args, max_q_len=np.int64(4))  # e.g. max() over a numpy array
    torch.testing.assert_close(out, ref, atol=2e-3, rtol=2e-3)
    with pytest.raises(TypeError, match="max_q_len must be an int"):
        paged_attention(*args, max_q_len=4.0)
    with pytest.raises(ValueError, match="max_q_len=3 is below"):
        paged_attention(*args, max_q_len=3)
    q, k, v, tables, ctx, _, _, scale = args
    none = torch.zeros(3, dtype=torch.int32)  # both sequences have no queries
    assert paged_attention(q[:0], k, v, tables, ctx, none, None, scale).shape == (0, 4, 32)


def test_fully_masked_tree_row_is_zero() -> None:
    # No context and a row without bits: the reference gives NaN, the kernel a defined 0.
    q, k, v, tables, _, indptr, mask, scale = make_case([0], [3], mask="chain", seed=1)
    mask[1] = 0
    out = paged_attention(q, k, v, tables, torch.zeros(1, dtype=torch.int32), indptr, mask,
                          scale, num_splits=2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("num_splits", [1, 3])
def test_tree_16_nodes_fp16_two_query_tiles(num_splits: int) -> None:
    """16-node trees at GQA 4 (64 rows): the 16-bit tree tile holds 32 rows, so each tree is
    two query tiles that must each see the whole context and their own mask rows; contexts off
    the 64-key tile and the 16-slot page, a 9-node tree and a decode row beside them."""
    check(make_case([0, 63, 65, 131, 7], [16, 16, 9, 16, 1], hq=8, hkv=2, mask="tree",
                    dtype=torch.float16, seed=16 + num_splits), num_splits=num_splits)


def test_tree_tile_fits_two_blocks_per_sm() -> None:
    """The 16-bit tree tile is capped at 32 rows and 4 warps (64 rows needed 8 warps and 180-208
    registers: one block per SM); causal tiles keep 64 rows, fp32 its own 32."""
    from specengine.kernels.attention import tiles

    tree = tiles(16, 4, 128, ieee=False, tree=True)
    assert (tree.block_m, tree.qt, tree.num_warps) == (32, 8, 4)
    assert tiles(16, 4, 128, ieee=False, tree=False).block_m == 64
    assert tiles(16, 4, 128, ieee=True, tree=True).block_m == 32
    assert tiles(1, 64, 128, ieee=False, tree=True).block_m == 64  # one whole query per tile


def test_split_counters_reset_between_launches() -> None:
    """The folded combine: the last split of each tile merges, then zeroes its counter, so
    launches with other split counts reusing the counters still merge (a stale count would
    leave the output unwritten) and the counters are zero afterwards."""
    args = make_case([40, 3, 129], [1, 2, 1], hq=4, hkv=2, seed=21)
    for num_splits in (3, 5, 2, 5):
        check(args, num_splits=num_splits)
    counters = attention_combine.split_counters(torch.device("cpu"), 1)
    assert counters.numel() >= 3 * 2 and not counters.any()


def test_default_num_splits(monkeypatch: pytest.MonkeyPatch) -> None:
    cpu, cuda = torch.device("cpu"), torch.device("cuda", 0)
    assert attention_combine.default_num_splits(cpu, 4, 1000) == 1
    monkeypatch.setattr(attention_combine, "_num_sms", lambda index: 132)
    assert attention_combine.default_num_splits(cuda, 8, 512) == 32  # batch 1, 8 kv heads
    assert attention_combine.default_num_splits(cuda, 8, 8) == 2  # short context: few splits
    assert attention_combine.default_num_splits(cuda, 2048, 512) == 1  # machine already full


def _bad(**over) -> tuple:
    q, k, v, tables, ctx, indptr, mask, scale = make_case([5, 9], [2, 3], mask="tree", seed=6)
    args = dict(q=q, k_cache=k, v_cache=v, block_tables=tables, context_lens=ctx,
                qo_indptr=indptr, tree_mask=mask, scale=scale)
    args.update(over)
    return args


BAD = [
    (lambda a: dict(q=a["q"][0]), ValueError, "q must be"),
    (lambda a: dict(k_cache=a["k_cache"][0]), ValueError, "k_cache must be"),
    (lambda a: dict(v_cache=a["v_cache"][:, :, :1]), ValueError, "differ in shape"),
    (lambda a: dict(q=a["q"].half()), TypeError, "share a dtype"),
    (lambda a: dict(q=a["q"].int(), k_cache=a["k_cache"].int(), v_cache=a["v_cache"].int()),
     TypeError, "float16, bfloat16 or float32"),
    (lambda a: dict(q=a["q"][:, :3]), ValueError, "multiple of Hkv"),
    (lambda a: dict(q=a["q"][..., :24], k_cache=a["k_cache"][..., :24].contiguous(),
                    v_cache=a["v_cache"][..., :24].contiguous()), ValueError, "power of two"),
    (lambda a: dict(k_cache=a["k_cache"].reshape(-1, 8, 2, 32),
                    v_cache=a["v_cache"].reshape(-1, 8, 2, 32)), ValueError, "block_size"),
    (lambda a: dict(q=a["q"].transpose(1, 2).contiguous().transpose(1, 2)), ValueError,
     "contiguous along head_dim"),
    (lambda a: dict(block_tables=a["block_tables"].long()), TypeError,
     "block_tables must be int32"),
    (lambda a: dict(context_lens=a["context_lens"][:1]), ValueError, "sequences"),
    (lambda a: dict(qo_indptr=a["qo_indptr"][:2]), ValueError, "B\\+1"),
    (lambda a: dict(qo_indptr=a["qo_indptr"].flip(0).contiguous()), ValueError,
     "non-decreasing"),
    (lambda a: dict(tree_mask=a["tree_mask"].long()), TypeError, "tree_mask must be int32"),
    (lambda a: dict(tree_mask=a["tree_mask"][1:]), ValueError, "tree_mask must be"),
    (lambda a: dict(tree_mask=a["tree_mask"][:, :0]), ValueError, "words per row"),
]


@pytest.mark.parametrize(("edit", "exc", "msg"), BAD)
def test_bad_inputs(edit, exc: type, msg: str) -> None:
    args = _bad()
    args = _bad(**edit(args))
    with pytest.raises(exc, match=msg):
        paged_attention(**args)


def test_bad_num_splits() -> None:
    with pytest.raises(ValueError, match="num_splits"):
        paged_attention(**_bad(), num_splits=0)


# --------------------------------------------------------------------------------------------
# GPU only: bf16, real model shapes, the heuristic split path and CUDA-graph capture.
# --------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mask", ["causal", "tree", "chain"])
def test_gpu_8b_shapes(dtype: torch.dtype, mask: str) -> None:
    ctx = [0, 1, 4095, 4096, 4097, 17, 2000, 300]
    q_lens = [300, 1, 8, 64, 5, 1, 33, 64] if mask == "causal" else [64, 1, 8, 64, 5, 1, 33, 64]
    args = make_case(ctx, q_lens, hq=32, hkv=8, d=128, bs=16, dtype=dtype, mask=mask,
                     device="cuda")
    for num_splits in (None, 1, 7):
        check(args, num_splits=num_splits, max_q_len=max(q_lens))


@pytest.mark.gpu
@pytest.mark.parametrize(("d", "bs"), [(64, 32), (256, 16)])
def test_gpu_head_dims_bf16(d: int, bs: int) -> None:
    check(make_case([1000, 3, 70], [1, 6, 40], hq=16, hkv=2, d=d, bs=bs, dtype=torch.bfloat16,
                    mask="tree", device="cuda"))


@pytest.mark.gpu
def test_gpu_cuda_graph_capture() -> None:
    # With max_q_len given the launcher never syncs, so it can be captured and replayed.
    args = make_case([3000, 100], [1, 1], hq=32, hkv=8, d=128, dtype=torch.bfloat16,
                     device="cuda")
    paged_attention(*args, max_q_len=1)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = paged_attention(*args, max_q_len=1)
    args[0].normal_()
    graph.replay()
    torch.cuda.synchronize()
    ref = reference.paged_attention(*args)
    torch.testing.assert_close(out.float(), ref.float(), atol=3e-2, rtol=3e-2)


@pytest.mark.gpu
def test_gpu_folded_combine_repeatable() -> None:
    """The folded combine under real concurrency: B=1 decode at 4k (the heuristic splits
    every (tile, kv head) 32 ways; the last split to arrive merges) and a 16-node tree at
    B=2 with 7 splits, 50 launches each: every one equals the first (the merge order is
    fixed: a stale or early read of another split's partial would show) and the reference."""
    for ctx, q_lens, mask, splits in (([4095], [1], "causal", None),
                                      ([4000, 1234], [16, 16], "tree", 7)):
        args = make_case(ctx, q_lens, hq=32, hkv=8, d=128, dtype=torch.bfloat16, mask=mask,
                         device="cuda", seed=len(q_lens))
        first = check(args, num_splits=splits, max_q_len=max(q_lens))
        for _ in range(50):
            out = paged_attention(*args, num_splits=splits, max_q_len=max(q_lens))
            assert torch.equal(out, first)
