"""Input checks of the Triton paged attention launcher (``attention.paged_attention``).

``check_inputs`` reads only metadata (shapes, dtypes, strides, devices): no device→host sync, so
a checked call can still be captured in a CUDA graph. ``query_run_bounds`` reads ``qo_indptr``
values (one sync); the launcher calls it only when it must know ``max_q_len`` or when value
checks are on (``debug.value_checks``).
"""

from __future__ import annotations

import operator

import torch
from torch import Tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def _is_pow2(x: int) -> bool:
    return x > 0 and x & (x - 1) == 0


def as_count(name: str, value: object, minimum: int) -> int | None:
    """None, or ``value`` as a Python int >= minimum (numpy integers accepted)."""
    if value is None:
        return None
    try:
        value = operator.index(value)
    except TypeError:
        raise TypeError(f"{name} must be an int, got {type(value).__name__}") from None
    if value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_inputs(q: Tensor, k_cache: Tensor, v_cache: Tensor, block_tables: Tensor,
                 context_lens: Tensor, qo_indptr: Tensor, tree_mask: Tensor | None) -> None:
    """Raise TypeError / ValueError, naming the argument, unless shapes, dtypes, strides and
    devices are what ``_paged_attention_kernel`` assumes (it reads raw pointers with them)."""
    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got shape {tuple(q.shape)}")
    for name, c in (("k_cache", k_cache), ("v_cache", v_cache)):
        if c.dim() != 4:
            raise ValueError(f"{name} must be [num_blocks, block_size, Hkv, D], got "
                             f"{tuple(c.shape)}")
        if c.stride(3) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim (stride(3) == 1)")
    if k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} and v_cache {tuple(v_cache.shape)} "
                         "differ in shape")
    if q.dtype not in _DTYPES:
        raise TypeError(f"q must be float16, bfloat16 or float32, got {q.dtype}")
    if k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise TypeError(f"q, k_cache, v_cache must share a dtype, got {q.dtype}, "
                        f"{k_cache.dtype}, {v_cache.dtype}")
    if q.stride(2) != 1:
        raise ValueError("q must be contiguous along head_dim (stride(2) == 1)")
    _, hq, d = q.shape
    _, block_size, hkv, dk = k_cache.shape
    if dk != d:
        raise ValueError(f"q head_dim {d} differs from the cache's {dk}")
    if not _is_pow2(d) or d < 16:
        raise ValueError(f"head_dim must be a power of two >= 16, got {d}")
    if not _is_pow2(block_size) or block_size < 16:
        raise ValueError(f"block_size must be a power of two >= 16, got {block_size}")
    if hkv == 0 or hq % hkv != 0:
        raise ValueError(f"Hq ({hq}) must be a multiple of Hkv ({hkv})")
    for name, t, nd in (("block_tables", block_tables, 2), ("context_lens", context_lens, 1),
                        ("qo_indptr", qo_indptr, 1)):
        if t.dtype != torch.int32:
            raise TypeError(f"{name} must be int32, got {t.dtype}")
        if t.dim() != nd:
            raise ValueError(f"{name} must have {nd} dims, got shape {tuple(t.shape)}")
    num_seqs = context_lens.shape[0]
    if block_tables.shape[0] != num_seqs:
        raise ValueError(f"block_tables has {block_tables.shape[0]} rows but context_lens has "
                         f"{num_seqs} sequences")
    if block_tables.stride(1) != 1:
        raise ValueError("block_tables must be contiguous along its last dim")
    if qo_indptr.shape[0] != num_seqs + 1:
        raise ValueError(f"qo_indptr must have B+1 = {num_seqs + 1} entries, got "
                         f"{qo_indptr.shape[0]}")
    if not context_lens.is_contiguous() or not qo_indptr.is_contiguous():
        raise ValueError("context_lens and qo_indptr must be contiguous")
    if tree_mask is not None:
        if tree_mask.dtype != torch.int32:
            raise TypeError(f"tree_mask must be int32 packed bits, got {tree_mask.dtype}")
        if tree_mask.dim() != 2 or tree_mask.shape[0] != q.shape[0]:
            raise ValueError(f"tree_mask must be [T={q.shape[0]}, num_words], got "
                             f"{tuple(tree_mask.shape)}")
    tensors = (k_cache, v_cache, block_tables, context_lens, qo_indptr, tree_mask)
    for name, t in zip(("k_cache", "v_cache", "block_tables", "context_lens", "qo_indptr",
                        "tree_mask"), tensors):
        if t is not None and t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def query_run_bounds(qo_indptr: Tensor, num_tokens: int, max_q_len: int | None) -> int:
    """The longest query run of ``qo_indptr`` [B+1], read with one device→host copy.

    Raises ValueError unless ``qo_indptr`` is non-decreasing from >= 0 to <= ``num_tokens``
    and, when given, ``max_q_len`` bounds every run.
    """
    if qo_indptr.shape[0] < 2:
        return 0
    q_lens = qo_indptr[1:] - qo_indptr[:-1]  # [B]
    # One copy for all four numbers: the first/last entry, the shortest and longest run.
    first, last, shortest, longest = torch.stack(
        [qo_indptr[0], qo_indptr[-1], q_lens.min(), q_lens.max()]).tolist()
    if shortest < 0 or first < 0 or last > num_tokens:
        raise ValueError(f"qo_indptr must be non-decreasing from >= 0 to <= T={num_tokens}")
    if max_q_len is not None and max_q_len < longest:
        raise ValueError(f"max_q_len={max_q_len} is below the longest query run {longest}")
    return longest
