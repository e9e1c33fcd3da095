"""RMSNorm, optionally fused with the residual add before it: one launch per norm.

``add_rms_norm`` is the decoder's ``residual = x + residual; out = rmsnorm(residual)`` (the
second norm of a layer and the first norm of the next one); ``rms_norm`` is the plain norm
(first layer, EAGLE-3 / MTP input norms). One program per row holds the whole row, so the
sum of squares needs no second pass. Numerics follow transformers: the add in the activation
dtype, the normalisation in float32, rounded to the activation dtype before the weight scales
it. Specification: ``reference_layer.rms_norm`` / ``add_rms_norm``.
"""

from __future__ import annotations

import math

import torch
import triton
import triton.language as tl
from torch import Tensor

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
# One program holds a row in registers; wider rows than any decoder's hidden size are refused.
MAX_COLS = 65536


@triton.jit
def _rms_norm_kernel(
    x_ptr, res_ptr, out_ptr, res_out_ptr, w_ptr,
    stride_x, stride_r, stride_o, stride_ro,
    n_cols, eps,
    HAS_RESIDUAL: tl.constexpr, BLOCK: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dtype = out_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_r + cols, mask=mask, other=0.0)
        # Rounded to the activation dtype, as torch's ``x + residual`` is.
        x = (x.to(tl.float32) + r.to(tl.float32)).to(dtype)
        tl.store(res_out_ptr + row * stride_ro + cols, x, mask=mask)
    xf = x.to(tl.float32)
    var = tl.sum(xf * xf, axis=0) / n_cols
    y = (xf * tl.rsqrt(var + eps)).to(dtype)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    out = (w.to(tl.float32) * y.to(tl.float32)).to(dtype)
    tl.store(out_ptr + row * stride_o + cols, out, mask=mask)


def _check_rows(name: str, t: Tensor, shape: tuple[int, int], like: Tensor) -> None:
    if t.dim() != 2 or tuple(t.shape) != shape:
        raise ValueError(f"{name} must be [{shape[0]}, {shape[1]}], got {tuple(t.shape)}")
    if t.dtype != like.dtype:
        raise TypeError(f"{name} dtype {t.dtype} differs from x's {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but x is on {like.device}")
    if t.shape[1] > 1 and t.stride(1) != 1:
        raise ValueError(f"{name} must be contiguous along the hidden dim (stride(1) == 1)")


def _check(x: Tensor, weight: Tensor, eps: float) -> None:
    if x.dim() != 2:
        raise ValueError(f"x must be [N, H], got shape {tuple(x.shape)}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x must be float16, bfloat16 or float32, got {x.dtype}")
    n_cols = x.shape[1]
    if not 0 < n_cols <= MAX_COLS:
        raise ValueError(f"hidden size must be in [1, {MAX_COLS}], got {n_cols}")
    _check_rows("x", x, tuple(x.shape), x)
    if weight.shape != (n_cols,) or weight.dtype != x.dtype or weight.device != x.device:
        raise ValueError(f"weight must be [{n_cols}] {x.dtype} on {x.device}, got "
                         f"{tuple(weight.shape)} {weight.dtype} on {weight.device}")
    if not weight.is_contiguous():
        raise ValueError("weight must be contiguous")
    if not (math.isfinite(eps) and eps >= 0):
        raise ValueError(f"eps must be finite and >= 0, got {eps}")


def _launch(x: Tensor, residual: Tensor | None, weight: Tensor, eps: float, out: Tensor,
            res_out: Tensor | None) -> None:
    n_rows, n_cols = x.shape
    if n_rows == 0:
        return
    block = triton.next_power_of_2(n_cols)
    res = residual if residual is not None else x  # dummy pointer when HAS_RESIDUAL is off
    ro = res_out if res_out is not None else out
    _rms_norm_kernel[(n_rows,)](
        x, res, out, ro, weight,
        x.stride(0), res.stride(0), out.stride(0), ro.stride(0),
        n_cols, float(eps),
        HAS_RESIDUAL=residual is not None, BLOCK=block,
        num_warps=min(max(block // 512, 1), 8),
    )


def rms_norm(
    x: Tensor,  # [N, H]
    weight: Tensor,  # [H]
    eps: float,
    out: Tensor | None = None,  # [N, H], may be a column slice of a wider buffer
) -> Tensor:  # [N, H]
    """``reference_layer.rms_norm`` in one launch. ``out`` lets two norms fill the halves of
    one buffer (EAGLE-3's ``cat([norm(e), norm(h)])`` without the cat)."""
    _check(x, weight, eps)
    if out is None:
        out = torch.empty_like(x, memory_format=torch.contiguous_format)
    else:
        _check_rows("out", out, tuple(x.shape), x)
    _launch(x, None, weight, eps, out, None)
    return out


def add_rms_norm(
    x: Tensor,  # [N, H] the sub-layer's output
    residual: Tensor,  # [N, H] the residual stream
    weight: Tensor,  # [H]
    eps: float,
) -> tuple[Tensor, Tensor]:  # normed [N, H], new residual [N, H]
    """``reference_layer.add_rms_norm`` in one launch; both outputs are new tensors (the old
    residual may still be read, e.g. as an aux hidden state)."""
    _check(x, weight, eps)
    _check_rows("residual", residual, tuple(x.shape), x)
    out = torch.empty_like(x, memory_format=torch.contiguous_format)
    res_out = torch.empty_like(x, memory_format=torch.contiguous_format)
    _launch(x, residual, weight, eps, out, res_out)
    return out, res_out
