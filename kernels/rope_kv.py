"""Q/K norm + rope + KV-cache write over a merged QKV output: one launch per layer.

One program per (token, head) of ``Hq + Hkv`` heads reads its head's row of the ``qkv``
projection output, applies Qwen3's per-head RMSNorm when given the weights, rotates it with
the token's ``cos`` / ``sin`` rows, and stores it: a q head into the returned ``q``, a k head
(with the matching v head, copied as is) into its cache slot, skipped when the slot is
negative (padding).

Rope tables: ``cos`` / ``sin`` ``[T, D/2]`` are computed once per forward pass from the
positions (``RotaryEmbedding.cos_sin``, shared by every layer) rather than in this kernel:
the values are then bit-identical to transformers' (float32 ``cos`` of ``pos · inv_freq``,
times the yarn attention factor, rounded to the activation dtype), whereas ``tl.cos`` lowers
to an approximate instruction on NVIDIA GPUs that loses accuracy at the large arguments of
long contexts (``pos · inv_freq`` reaches 1e5 rad), and a position-indexed cache would need a
bound on positions and tens of MB per model. The cost is a few small launches per forward,
not per layer. Specification: ``reference_layer.rope_and_cache``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

from .debug import check_values_now

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_SLOT_DTYPES = (torch.int32, torch.int64)


@triton.jit
def _rope_kv_kernel(
    qkv_ptr, cos_ptr, sin_ptr, qn_ptr, kn_ptr, slot_ptr, q_ptr, k_cache_ptr, v_cache_ptr,
    stride_qkv, stride_cos, stride_sin, stride_qt, stride_qh, eps,
    NUM_HEADS: tl.constexpr, NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr,
    HALF_BLOCK: tl.constexpr, QK_NORM: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)  # q heads 0..Hq-1, then k heads: the column order of qkv
    HALF: tl.constexpr = HEAD_DIM // 2
    offs = tl.arange(0, HALF_BLOCK)
    mask = offs < HALF
    dtype = q_ptr.dtype.element_ty
    row = qkv_ptr + tok * stride_qkv + head * HEAD_DIM
    x1 = tl.load(row + offs, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(row + HALF + offs, mask=mask, other=0.0).to(tl.float32)
    if QK_NORM:
        is_q = head < NUM_HEADS
        w1 = tl.where(is_q, tl.load(qn_ptr + offs, mask=mask, other=0.0),
                      tl.load(kn_ptr + offs, mask=mask, other=0.0)).to(tl.float32)
        w2 = tl.where(is_q, tl.load(qn_ptr + HALF + offs, mask=mask, other=0.0),
                      tl.load(kn_ptr + HALF + offs, mask=mask, other=0.0)).to(tl.float32)
        rstd = tl.rsqrt((tl.sum(x1 * x1, axis=0) + tl.sum(x2 * x2, axis=0)) / HEAD_DIM + eps)
        # transformers' RMSNorm: normalised value rounded to the dtype, then scaled and rounded.
        x1 = (w1 * (x1 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
        x2 = (w2 * (x2 * rstd).to(dtype).to(tl.float32)).to(dtype).to(tl.float32)
    c = tl.load(cos_ptr + tok * stride_cos + offs, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(sin_ptr + tok * stride_sin + offs, mask=mask, other=0.0).to(tl.float32)
    o1 = (x1 * c - x2 * s).to(dtype)
    o2 = (x2 * c + x1 * s).to(dtype)
    if head < NUM_HEADS:
        dst = q_ptr + tok * stride_qt + head * stride_qh
        tl.store(dst + offs, o1, mask=mask)
        tl.store(dst + HALF + offs, o2, mask=mask)
    else:
        slot = tl.load(slot_ptr + tok).to(tl.int64)
        if slot >= 0:
            kv = head - NUM_HEADS
            at = slot * (NUM_KV_HEADS * HEAD_DIM) + kv * HEAD_DIM
            tl.store(k_cache_ptr + at + offs, o1, mask=mask)
            tl.store(k_cache_ptr + at + HALF + offs, o2, mask=mask)
            v_row = row + NUM_KV_HEADS * HEAD_DIM  # v head kv sits Hkv heads after k head kv
            tl.store(v_cache_ptr + at + offs, tl.load(v_row + offs, mask=mask), mask=mask)
            tl.store(v_cache_ptr + at + HALF + offs, tl.load(v_row + HALF + offs, mask=mask),
                     mask=mask)


def _check(qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
           slot_mapping: Tensor, num_heads: int, num_kv_heads: int,
           norms: tuple[Tensor | None, Tensor | None], eps: float) -> int:
    """Raise naming the argument unless the layout is what the kernel indexes; returns D."""
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k_cache / v_cache must both be [num_blocks, block_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    if not (k_cache.is_contiguous() and v_cache.is_contiguous()):
        raise ValueError("k_cache and v_cache must be contiguous (indexed as flat slots)")
    hkv, d = k_cache.shape[2], k_cache.shape[3]
    if num_kv_heads != hkv or num_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} / num_kv_heads {num_kv_heads} do not fit the "
                         f"cache's {hkv} kv heads (GQA needs Hq a multiple of Hkv)")
    if d % 2:
        raise ValueError(f"head_dim must be even for rope, got {d}")
    width = (num_heads + 2 * num_kv_heads) * d
    if qkv.dim() != 2 or qkv.shape[1] != width:
        raise ValueError(f"qkv must be [T, (Hq + 2*Hkv) * D] = [T, {width}], got "
                         f"{tuple(qkv.shape)}")
    if qkv.dtype not in _DTYPES:
        raise TypeError(f"qkv must be float16, bfloat16 or float32, got {qkv.dtype}")
    if qkv.stride(1) != 1:
        raise ValueError("qkv must be contiguous along its last dim (stride(1) == 1)")
    num_tokens = qkv.shape[0]
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.dtype != qkv.dtype or t.device != qkv.device:
            raise TypeError(f"{name} must be {qkv.dtype} on {qkv.device}, got {t.dtype} on "
                            f"{t.device}")
    for name, t in (("cos", cos), ("sin", sin)):
        if tuple(t.shape) != (num_tokens, d // 2) or not t.is_floating_point():
            raise ValueError(f"{name} must be float [T, D/2] = [{num_tokens}, {d // 2}], got "
                             f"{t.dtype} {tuple(t.shape)}")
        if t.device != qkv.device or (d > 2 and t.stride(1) != 1):
            raise ValueError(f"{name} must be on {qkv.device}, contiguous along its last dim")
    if slot_mapping.dtype not in _SLOT_DTYPES or tuple(slot_mapping.shape) != (num_tokens,):
        raise TypeError(f"slot_mapping must be int32/int64 [{num_tokens}], got "
                        f"{slot_mapping.dtype} {tuple(slot_mapping.shape)}")
    if slot_mapping.device != qkv.device:
        raise ValueError(f"slot_mapping is on {slot_mapping.device} but qkv on {qkv.device}")
    q_norm, k_norm = norms
    if (q_norm is None) != (k_norm is None):
        raise ValueError("give both q_norm_weight and k_norm_weight, or neither")
    for name, w in (("q_norm_weight", q_norm), ("k_norm_weight", k_norm)):
        if w is not None and (tuple(w.shape) != (d,) or w.dtype != qkv.dtype
                              or w.device != qkv.device or not w.is_contiguous()):
            raise ValueError(f"{name} must be a contiguous [{d}] {qkv.dtype} tensor on "
                             f"{qkv.device}, got {w.dtype} {tuple(w.shape)}")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")
    return d


def rope_and_cache(
    qkv: Tensor,  # [T, (Hq + 2*Hkv) * D]
    cos: Tensor,  # [T, D/2]
    sin: Tensor,  # [T, D/2]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: Tensor,  # [T] int32/int64; negative = skip
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: Tensor | None = None,  # [D]
    k_norm_weight: Tensor | None = None,  # [D]
    eps: float = 1e-6,
) -> Tensor:  # q [T, Hq, D]
    """``reference_layer.rope_and_cache`` in one launch. Reads no device value (capturable in
    a CUDA graph) unless ``debug.value_checks`` are on, which then check every slot is below
    the cache's size (skipped under graph capture)."""
    d = _check(qkv, cos, sin, k_cache, v_cache, slot_mapping, num_heads, num_kv_heads,
               (q_norm_weight, k_norm_weight), eps)
    num_tokens = qkv.shape[0]
    q = torch.empty(num_tokens, num_heads, d, dtype=qkv.dtype, device=qkv.device)
    if num_tokens == 0:
        return q
    num_slots = k_cache.shape[0] * k_cache.shape[1]
    if check_values_now() and int(slot_mapping.max()) >= num_slots:
        raise IndexError(f"rope_and_cache: slot {int(slot_mapping.max())} is out of range for a "
                         f"cache of {num_slots} slots")
    qk_norm = q_norm_weight is not None
    qn = q_norm_weight if qk_norm else qkv  # dummy pointers when QK_NORM is off
    kn = k_norm_weight if qk_norm else qkv
    _rope_kv_kernel[(num_tokens, num_heads + num_kv_heads)](
        qkv, cos, sin, qn, kn, slot_mapping, q, k_cache, v_cache,
        qkv.stride(0), cos.stride(0), sin.stride(0), q.stride(0), q.stride(1), float(eps),
        NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, HEAD_DIM=d,
        HALF_BLOCK=triton.next_power_of_2(d // 2), QK_NORM=qk_norm,
        num_warps=1 if d <= 128 else 2,
    )
    return q
