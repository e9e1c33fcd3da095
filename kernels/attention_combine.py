"""Split-KV (flash-decoding) helpers for ``kernels/attention.py``.

When a batch has few sequences and few query tiles, one program per (sequence, tile, kv head)
leaves most SMs idle while each program walks a long context. Splitting the KV range across
``num_splits`` programs fills the machine; every split writes its normalised partial output and
its log-sum-exp (base 2), and ``combine_splits`` merges them exactly:
``o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M = max_s lse_s``.
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl
from torch import Tensor


@triton.jit
def _combine_kernel(
    part_ptr,  # [S, T, Hq, D] float32: each split's normalised output
    lse_ptr,  # [S, T, Hq] float32: each split's log2-sum-exp2 (-inf when it saw no key)
    out_ptr,  # [T, Hq, D] in the output dtype
    num_splits,
    stride_ps, stride_pt, stride_ph,
    stride_ls, stride_lt,
    stride_ot, stride_oh,
    SPLITS_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
):
    tok = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_ok = offs_s < num_splits
    lse = tl.load(lse_ptr + offs_s * stride_ls + tok * stride_lt + head, mask=s_ok,
                  other=float("-inf"))  # [SPLITS_PAD]
    m = tl.max(lse, 0)
    # A row no split saw (fully masked) has m = -inf: give it weight 0 everywhere, output 0.
    m_safe = tl.where(m == float("-inf"), 0.0, m)
    w = tl.math.exp2(lse - m_safe)  # [SPLITS_PAD]; 0 for empty splits
    denom = tl.sum(w, 0)
    denom = tl.where(denom == 0.0, 1.0, denom)
    part = tl.load(
        part_ptr + offs_s[:, None] * stride_ps + tok * stride_pt + head * stride_ph
        + offs_d[None, :],
        mask=s_ok[:, None], other=0.0,
    )  # [SPLITS_PAD, D]
    # Empty splits stored zeros (never NaN), so 0-weight rows cannot poison the sum.
    out = tl.sum(part * w[:, None], 0) / denom  # [D]
    tl.store(out_ptr + tok * stride_ot + head * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty))


def combine_splits(part: Tensor, lse: Tensor, out: Tensor) -> None:
    """Merge split partials ``part [S, T, Hq, D]`` / ``lse [S, T, Hq]`` into ``out [T, Hq, D]``."""
    num_splits, num_tokens, num_heads, head_dim = part.shape
    _combine_kernel[(num_tokens, num_heads)](
        part, lse, out, num_splits,
        part.stride(0), part.stride(1), part.stride(2),
        lse.stride(0), lse.stride(1),
        out.stride(0), out.stride(1),
        SPLITS_PAD=triton.next_power_of_2(num_splits), HEAD_DIM=head_dim,
    )


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(device: torch.device, num_programs: int, max_kv_tiles: int) -> int:
    """How many KV splits to use, from shapes only (no device->host sync, CUDA-graph stable).

    ``num_programs`` = sequences x query tiles x kv heads; ``max_kv_tiles`` is an upper bound on
    the KV tiles of any sequence (from the block table width). Off CUDA the interpreter gains
    nothing from splitting, so 1.
    """
    if device.type != "cuda" or num_programs == 0:
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= sms:
        return 1  # one wave is already full: splitting only adds the combine pass
    # Aim for about two waves, but keep >= 4 KV tiles per split so the partial write and the
    # combine stay small next to the KV read; 32 splits is plenty for 32k contexts.
    want = triton.cdiv(2 * sms, num_programs)
    return max(1, min(want, max_kv_tiles // 4, 32))
