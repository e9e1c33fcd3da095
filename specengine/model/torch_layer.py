"""The CPU engine's fused decoder-layer ops (``kernel_backend="torch"``) in few operators.

``kernels/reference_layer.py`` is the specification (the Triton kernels' too); on the CPU every
operator is a Python → C++ dispatch, so these compute the same values with fewer of them, bit
for bit (``tests/test_torch_layer.py``):

* q and k are normed (Qwen3) and rotated together, as one ``[T, Hq + Hkv, D]`` block of the
  merged QKV output: the per-head RMSNorm reduces each head's ``D`` values alone either way,
  and the two weights become one ``[Hq + Hkv, D]`` row set;
* rope is ``x · cat(c, c) + swap_halves(x) · cat(-s, s)`` with the tables built once per pass
  (``TorchPassPlan``): ``x1·c + x2·(-s)`` is ``x1·c - x2·s`` exactly (IEEE negation is exact),
  so this equals ``reference_layer.rotate``;
* K/V are written through the plan's rows and slots (``torch_attention.plan_write_kv``).
"""

from __future__ import annotations

import torch
from torch import Tensor

from specengine.kernels import reference
from specengine.model.torch_attention import TorchPassPlan, plan_write_kv


def rms_norm(x: Tensor, weight: Tensor, eps: float) -> Tensor:
    """``reference.rms_norm`` (``weight`` ``[..., H]`` broadcast over ``x``'s rows). Float32 as
    ``x · rsqrt(sum(x·x) / H + eps)`` and the weight product: ``x·x`` is ``x.pow(2)`` and
    ``sum / H`` is what ``mean`` computes, bit for bit (``tests/test_torch_layer.py``), at a
    third of the cost (``mean`` and the fused ``rms_norm`` take several times a ``sum`` on the
    CPU). Other dtypes and devices: the reference (its casts and two roundings; a GPU's
    reductions were not checked bit for bit)."""
    if x.dtype != torch.float32 or weight.dtype != torch.float32 or x.device.type != "cpu":
        return reference.rms_norm(x, weight, eps)
    var = (x * x).sum(-1, keepdim=True).div_(x.shape[-1]).add_(eps)
    return weight * (x * var.rsqrt_())


def rope_and_write_kv(qkv: Tensor, plan: TorchPassPlan, k_cache: Tensor, v_cache: Tensor,
                      num_heads: int, num_kv_heads: int, q_norm_weight: Tensor | None,
                      k_norm_weight: Tensor | None, eps: float) -> Tensor:
    """``reference.rope_and_cache`` of a merged QKV output ``[T, (Hq + 2·Hkv)·D]`` with the
    rope tables and KV-write rows of ``plan`` (built with ``cos`` / ``sin``); returns q
    ``[T, Hq, D]``."""
    num_tokens = qkv.shape[0]
    rotated = num_heads + num_kv_heads
    d = qkv.shape[1] // (rotated + num_kv_heads)
    x = qkv.view(num_tokens, rotated + num_kv_heads, d)
    qk = x[:, :rotated]
    if q_norm_weight is not None and k_norm_weight is not None:
        weight = torch.cat([q_norm_weight.expand(num_heads, d),
                            k_norm_weight.expand(num_kv_heads, d)])
        qk = rms_norm(qk, weight, eps)
    half = d // 2
    swapped = torch.cat([qk[..., half:], qk[..., :half]], dim=-1)  # (a cat: flip costs 3x)
    qk = qk * plan.cos + swapped * plan.sin
    plan_write_kv(qk[:, num_heads:], x[:, rotated:], k_cache, v_cache, plan)
    return qk[:, :num_heads]
