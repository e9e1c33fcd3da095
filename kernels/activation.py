"""SiLU·mul over a merged gate-up projection output: one launch instead of three ops.

The input row is ``[gate | up]`` (``[N, 2I]``, as the merged ``gate_up_proj`` writes it); the
output is ``silu(gate) * up`` ``[N, I]``. ``silu`` is computed in float32 and rounded to the
activation dtype before the product, as torch's ``F.silu(gate) * up`` does.
Specification: ``reference_layer.silu_mul``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl
from torch import Tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_BLOCK = 1024


@triton.jit
def _silu_mul_kernel(x_ptr, out_ptr, stride_x, stride_o, n_cols, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + row * stride_x + n_cols + cols, mask=mask, other=0.0).to(tl.float32)
    act = (gate / (1.0 + tl.exp(-gate))).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, (act.to(tl.float32) * up).to(dtype), mask=mask)


def silu_mul(x: Tensor) -> Tensor:  # [N, 2I] -> [N, I]
    """``silu(x[:, :I]) * x[:, I:]`` (``reference_layer.silu_mul``) in one launch."""
    if x.dim() != 2 or x.shape[1] % 2:
        raise ValueError(f"x must be [N, 2*I] (gate then up), got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    if x.shape[1] > 1 and x.stride(1) != 1:
        raise ValueError("x must be contiguous along its last dim (stride(1) == 1)")
    n_rows, n_cols = x.shape[0], x.shape[1] // 2
    out = torch.empty(n_rows, n_cols, dtype=x.dtype, device=x.device)
    if n_rows == 0 or n_cols == 0:
        return out
    block = min(_BLOCK, triton.next_power_of_2(n_cols))
    grid = (n_rows, triton.cdiv(n_cols, block))
    _silu_mul_kernel[grid](x, out, x.stride(0), out.stride(0), n_cols, BLOCK=block,
                           num_warps=4 if block >= 512 else 1)
    return out
