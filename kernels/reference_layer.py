"""Plain-PyTorch specifications of the fused decoder-layer kernels.

Each function is the contract its Triton twin (``rms_norm.py``, ``activation.py``,
``rope_kv.py``) is tested against, and the CPU engine (``kernel_backend="torch"``) runs these
directly. The numerics are transformers' own, so logits match Hugging Face to float rounding:
residual adds in the activation dtype, RMSNorm in float32 with ``weight * x.to(dtype)``,
``silu(gate) * up`` and rope ``x·cos + rotate_half(x)·sin`` in the activation dtype.

Layouts: a merged QKV projection output is ``[T, (Hq + 2·Hkv)·D]`` with the q heads, then the
k heads, then the v heads; a merged gate-up output is ``[T, 2·I]``, gate first. Rope tables are
``[T, D/2]`` per token (the two halves of HF's ``cat([freqs, freqs])`` are equal).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference_kv import reshape_and_cache


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``x [..., H]`` normalised over its last dim in float32, scaled in ``x``'s dtype."""
    # fp32 activations skip the two no-op casts: each is still an operator dispatched from
    # Python on the CPU backend (34 per step of the bundled target), same values either way.
    fp32 = x.dtype == torch.float32
    xf = x if fp32 else x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * (xf if fp32 else xf.to(x.dtype))


def add_rms_norm(x: Tensor, residual: Tensor, weight: Tensor,
                 eps: float) -> tuple[Tensor, Tensor]:
    """``residual = x + residual`` (activation dtype), then ``(rms_norm(residual), residual)``.
    Nothing is written in place: the old residual may be held elsewhere (aux hidden states)."""
    residual = x + residual
    return rms_norm(residual, weight, eps), residual


def silu_mul(x: Tensor) -> Tensor:
    """``x [..., 2I]`` (gate then up) → ``silu(gate) * up`` ``[..., I]``."""
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up


def rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rope in the rotate-half layout: ``x [T, H, D]`` with ``cos`` / ``sin`` ``[T, D/2]``.
    Bit-identical to HF's ``x * cat(c, c) + cat(-x2, x1) * cat(s, s)``."""
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    c, s = cos[:, None, :], sin[:, None, :]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


def split_qkv_rope(
    qkv: Tensor,  # [T, (Hq + 2*Hkv) * D]
    cos: Tensor,  # [T, D/2]
    sin: Tensor,  # [T, D/2]
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: Tensor | None = None,  # [D] Qwen3's per-head q RMSNorm
    k_norm_weight: Tensor | None = None,  # [D]
    eps: float = 1e-6,
) -> tuple[Tensor, Tensor, Tensor]:
    """``(q [T, Hq, D], k [T, Hkv, D], v [T, Hkv, D])``: q and k per-head normed (when the
    weights are given) and rotated, v as projected."""
    num_tokens = qkv.shape[0]
    d = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
    q, k, v = qkv.split([num_heads * d, num_kv_heads * d, num_kv_heads * d], dim=-1)
    q = q.reshape(num_tokens, num_heads, d)
    k = k.reshape(num_tokens, num_kv_heads, d)
    v = v.reshape(num_tokens, num_kv_heads, d)
    if q_norm_weight is not None and k_norm_weight is not None:
        q, k = rms_norm(q, q_norm_weight, eps), rms_norm(k, k_norm_weight, eps)
    return rotate(q, cos, sin), rotate(k, cos, sin), v


def rope_and_cache(
    qkv: Tensor,  # [T, (Hq + 2*Hkv) * D]
    cos: Tensor,  # [T, D/2]
    sin: Tensor,  # [T, D/2]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: Tensor,  # [T] int; a negative slot skips the token
    num_heads: int,
    num_kv_heads: int,
    q_norm_weight: Tensor | None = None,
    k_norm_weight: Tensor | None = None,
    eps: float = 1e-6,
) -> Tensor:
    """:func:`split_qkv_rope`, then k and v written to their cache slots; returns q
    ``[T, Hq, D]``."""
    q, k, v = split_qkv_rope(qkv, cos, sin, num_heads, num_kv_heads, q_norm_weight,
                             k_norm_weight, eps)
    reshape_and_cache(k, v, k_cache, v_cache, slot_mapping)
    return q
