"""The launches ``compile_kernels.py`` compiles: the real launchers on meta tensors, 8B shapes.

Qwen3-8B: 32 query / 8 KV heads, head_dim 128, block_size 16, vocabulary 151,936. Attention:
decode, chain verification (k+1 = 2, 4, 8), trees of 1-16 nodes, prefill tiles, each with and
without split-KV (which adds the combine kernel). Rejection sampling: chains of k+1 = 1, 2, 4, 8
with point-mass drafts, with probability drafts and with probability drafts over an EAGLE-3
head's 32,000-id draft vocabulary, trees of 1-16 nodes, and at B = 1 (pass 1 and the first
pass of the top-k / top-p search split over the vocabulary: ``_part_kernel``,
``_search_pivot_kernel``, ``_search_snap_kernel``); greedy and sampled rows share
one compiled kernel (the temperature is a runtime value). The fused layer kernels (RMSNorm,
SiLU·mul, rope + KV write) at 64 and 512 tokens. bf16 and fp32 throughout.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

HQ, HKV, HEAD_DIM, BLOCK_SIZE, VOCAB = 32, 8, 128, 16, 151_936
DRAFT_VOCAB = 32_000
MAX_BLOCKS = 2048  # block-table width: 32k-token contexts
NUM_BLOCKS = 8192
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}
Config = tuple[str, Callable[[], object]]


def _meta(*shape: int, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(*shape, dtype=dtype, device="meta")


def attention_call(dtype: torch.dtype, q_lens: list[int], tree: bool,
                   num_splits: int) -> Callable[[], object]:
    """``paged_attention`` on meta tensors: ``q_lens`` queries per sequence."""

    def call() -> object:
        from specengine.kernels.attention import paged_attention

        num_tokens, num_seqs, longest = sum(q_lens), len(q_lens), max(q_lens)
        q = _meta(num_tokens, HQ, HEAD_DIM, dtype=dtype)
        k = _meta(NUM_BLOCKS, BLOCK_SIZE, HKV, HEAD_DIM, dtype=dtype)
        v = _meta(NUM_BLOCKS, BLOCK_SIZE, HKV, HEAD_DIM, dtype=dtype)
        tables = _meta(num_seqs, MAX_BLOCKS, dtype=torch.int32)
        ctx = _meta(num_seqs, dtype=torch.int32)
        indptr = _meta(num_seqs + 1, dtype=torch.int32)
        mask = _meta(num_tokens, (longest + 31) // 32, dtype=torch.int32) if tree else None
        return paged_attention(q, k, v, tables, ctx, indptr, mask, HEAD_DIM**-0.5,
                               max_q_len=longest, num_splits=num_splits)

    return call


def sampling_call(dtype: torch.dtype, n_rows: int, mode: str,
                  batch: int = 64) -> Callable[[], object]:
    """``rejection_sample`` on meta tensors; ``mode`` is chain, probs (draft_probs), vocab
    (draft_probs over a 32,000-id draft vocabulary, read through ``draft_index``), tree
    (point-mass children) or sampled-tree (children drawn from the draft vocabulary's q)."""

    def call() -> object:
        from specengine.kernels.rejection_sampling import rejection_sample

        logits = _meta(batch, n_rows, VOCAB, dtype=dtype)
        drafts = _meta(batch, n_rows - 1, dtype=torch.int64)
        width = DRAFT_VOCAB if mode in ("vocab", "sampled-tree") else VOCAB
        probs = _meta(batch, n_rows - 1, width, dtype=torch.float32) \
            if mode in ("probs", "vocab", "sampled-tree") else None
        index = _meta(VOCAB, dtype=torch.int32) if mode in ("vocab", "sampled-tree") else None
        parents = _meta(n_rows, dtype=torch.int32) if "tree" in mode else None
        vec = [_meta(batch, dtype=t) for t in (torch.int32, torch.float32, torch.int64,
                                               torch.float32, torch.int64, torch.int64)]
        num_draft, temperature, top_k, top_p, seeds, offsets = vec
        return rejection_sample(logits, drafts, num_draft, probs, temperature, top_k, top_p,
                                seeds, offsets, parents, draft_index=index)

    return call


def attention_configs() -> list[Config]:
    out: list[Config] = []
    for name, dtype in DTYPES.items():
        shapes = [("decode", [1], False), *((f"chain k+1={n}", [n], False) for n in (2, 4, 8)),
                  *((f"tree {n} nodes", [n], True) for n in (1, 2, 4, 8, 16))]
        for what, q_lens, tree in shapes:
            out.append((f"{name} {what} B=64", attention_call(dtype, q_lens * 64, tree, 1)))
            out.append((f"{name} {what} B=1 split=16", attention_call(dtype, q_lens, tree, 16)))
        out.append((f"{name} prefill 2x2048", attention_call(dtype, [2048, 2048], False, 1)))
        out.append((f"{name} prefill 1x300 split=4", attention_call(dtype, [300], False, 4)))
    return out


def sampling_configs() -> list[Config]:
    out: list[Config] = []
    for name, dtype in DTYPES.items():
        for n in (1, 2, 4, 8):
            out.append((f"{name} chain k+1={n}", sampling_call(dtype, n, "chain")))
            if n > 1:
                out.append((f"{name} chain+probs k+1={n}", sampling_call(dtype, n, "probs")))
                out.append((f"{name} chain+draft-vocab probs k+1={n}",
                            sampling_call(dtype, n, "vocab")))
        for n in (1, 2, 5, 8, 16):
            out.append((f"{name} tree {n} nodes", sampling_call(dtype, n, "tree")))
        for n in (5, 16):  # children drawn from the head's q over its draft vocabulary
            out.append((f"{name} sampled tree {n} nodes",
                        sampling_call(dtype, n, "sampled-tree")))
        # B = 1: pass 1 and the search's first pass split over the vocabulary (_part_kernel,
        # _search_pivot_kernel, _search_snap_kernel, the row kernel's merges)
        out.append((f"{name} chain k+1=4 B=1 split-vocab",
                    sampling_call(dtype, 4, "chain", batch=1)))
    for n, mode in ((4, "probs"), (5, "tree"), (5, "sampled-tree")):
        what = {"probs": "chain+probs k+1=4", "tree": "tree 5 nodes",
                "sampled-tree": "sampled tree 5 nodes"}[mode]
        out.append((f"bf16 {what} B=1 split-vocab",
                    sampling_call(torch.bfloat16, n, mode, batch=1)))
    return out


def builtin_configs() -> list[Config]:
    """Every configuration of the launchers in ``kernels/``."""
    return attention_configs() + sampling_configs() + layer_configs()


HIDDEN, INTERMEDIATE = 4096, 12_288


def layer_configs() -> list[Config]:
    """The fused layer kernels (RMSNorm, SiLU·mul, rope + KV write) at decode and prefill sizes."""

    def norm(dtype: torch.dtype, rows: int, residual: bool) -> Callable[[], object]:
        def call() -> object:
            from specengine.kernels.rms_norm import add_rms_norm, rms_norm

            x, w = _meta(rows, HIDDEN, dtype=dtype), _meta(HIDDEN, dtype=dtype)
            if residual:
                return add_rms_norm(x, _meta(rows, HIDDEN, dtype=dtype), w, 1e-6)
            return rms_norm(x, w, 1e-6)

        return call

    def silu(dtype: torch.dtype, rows: int) -> Callable[[], object]:
        def call() -> object:
            from specengine.kernels.activation import silu_mul

            return silu_mul(_meta(rows, 2 * INTERMEDIATE, dtype=dtype))

        return call

    def rope(dtype: torch.dtype, rows: int, qk_norm: bool) -> Callable[[], object]:
        def call() -> object:
            from specengine.kernels.rope_kv import rope_and_cache

            qkv = _meta(rows, (HQ + 2 * HKV) * HEAD_DIM, dtype=dtype)
            cos, sin = (_meta(rows, HEAD_DIM // 2, dtype=torch.float32) for _ in range(2))
            cache = [_meta(NUM_BLOCKS, BLOCK_SIZE, HKV, HEAD_DIM, dtype=dtype) for _ in "kv"]
            norms = [_meta(HEAD_DIM, dtype=dtype) for _ in "qk"] if qk_norm else [None, None]
            return rope_and_cache(qkv, cos, sin, *cache, _meta(rows, dtype=torch.int64), HQ, HKV,
                                  *norms)

        return call

    out: list[Config] = []
    for name, dtype in DTYPES.items():
        for rows in (64, 512):
            out += [(f"{name} rms_norm T={rows}", norm(dtype, rows, False)),
                    (f"{name} add_rms_norm T={rows}", norm(dtype, rows, True)),
                    (f"{name} silu_mul T={rows}", silu(dtype, rows)),
                    (f"{name} rope+kv qk-norm T={rows}", rope(dtype, rows, True)),
                    (f"{name} rope+kv T={rows}", rope(dtype, rows, False))]
    return out
