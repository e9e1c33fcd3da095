"""The fused decoder-layer kernels against their plain-PyTorch specifications
(``kernels/reference_layer.py``) over awkward sizes; fp32 and fp16 (the interpreter's bf16
arithmetic is not the GPU's)."""

from __future__ import annotations

import pytest
import torch

from specengine.kernels import activation, reference, rms_norm, rope_kv

DTYPES = [torch.float32, torch.float16]


def tol(dtype: torch.dtype) -> dict[str, float]:
    # fp16: one rounding step of difference (sum order, rsqrt) is allowed, no more.
    return dict(atol=1e-5, rtol=1e-5) if dtype == torch.float32 else dict(atol=2e-3, rtol=2e-3)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 96), (7, 111), (3, 4096), (0, 64)])
def test_rms_norm_matches_reference(rows: int, hidden: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(rows * hidden)
    x = (3 * torch.randn(rows, hidden, generator=g)).to(dtype)
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    ref = reference.rms_norm(x, w, 1e-6)
    assert torch.allclose(rms_norm.rms_norm(x, w, 1e-6), ref, **tol(dtype))
    # Into a column slice of a wider buffer (EAGLE-3's two input norms), the rest untouched.
    buf = torch.full((rows, 2 * hidden), 7.0, dtype=dtype)
    rms_norm.rms_norm(x, w, 1e-6, out=buf[:, hidden:])
    assert torch.allclose(buf[:, hidden:], ref, **tol(dtype))
    assert bool((buf[:, :hidden] == 7.0).all())


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 96), (5, 111), (2, 4096)])
def test_add_rms_norm_matches_reference(rows: int, hidden: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(hidden)
    x = torch.randn(rows, hidden, generator=g).to(dtype)
    wide = (5 * torch.randn(rows, hidden + 3, generator=g)).to(dtype)
    residual = wide[:, 3:]  # strided rows: the launcher must honour the row stride
    w = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    old = residual.clone()
    out, new_res = rms_norm.add_rms_norm(x, residual, w, 1e-5)
    ref_out, ref_res = reference.add_rms_norm(x, residual, w, 1e-5)
    assert torch.equal(new_res, ref_res)  # one correctly rounded add: exact
    assert torch.allclose(out, ref_out, **tol(dtype))
    assert torch.equal(residual, old)  # out of place: an aux copy of the old stream survives


def test_rms_norm_bad_input_is_named() -> None:
    x, w = torch.randn(3, 8), torch.ones(8)
    with pytest.raises(ValueError, match="weight must be"):
        rms_norm.rms_norm(x, torch.ones(9), 1e-6)
    with pytest.raises(TypeError, match="residual dtype"):
        rms_norm.add_rms_norm(x, x.half(), w, 1e-6)
    with pytest.raises(ValueError, match="out must be"):
        rms_norm.rms_norm(x, w, 1e-6, out=torch.empty(3, 9))
    with pytest.raises(ValueError, match="contiguous along the hidden dim"):
        rms_norm.rms_norm(torch.randn(8, 3).t(), w, 1e-6)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,inter", [(1, 96), (9, 111), (2, 3000), (0, 8)])
def test_silu_mul_matches_reference(rows: int, inter: int, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(inter)
    x = (4 * torch.randn(rows, 2 * inter, generator=g)).to(dtype)
    assert torch.allclose(activation.silu_mul(x), reference.silu_mul(x), **tol(dtype))


def test_silu_mul_bad_input_is_named() -> None:
    with pytest.raises(ValueError, match=r"\[N, 2\*I\]"):
        activation.silu_mul(torch.randn(3, 7))
    with pytest.raises(TypeError, match="float16, bfloat16 or float32"):
        activation.silu_mul(torch.ones(3, 8, dtype=torch.int32))


def rope_case(num_tokens: int, hq: int, hkv: int, d: int, dtype: torch.dtype, seed: int = 0
              ) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    qkv = (2 * torch.randn(num_tokens, (hq + 2 * hkv) * d, generator=g)).to(dtype)
    freqs = torch.randint(0, 3000, (num_tokens,), generator=g).float()[:, None] * \
        (1.0 / 10000 ** (torch.arange(0, d, 2).float() / d))[None, :]
    cos, sin = freqs.cos().to(dtype), freqs.sin().to(dtype)
    num_blocks, block_size = 5, 4
    k_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks, block_size, hkv, d, generator=g).to(dtype)
    slots = torch.randperm(num_blocks * block_size, generator=g)[:num_tokens]
    slots[::3] = -1  # padding tokens: their K/V must not be written anywhere
    return qkv, cos, sin, k_cache, v_cache, slots


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("num_tokens,hq,hkv,d", [(7, 4, 2, 64), (1, 8, 8, 128),
                                                 (13, 6, 1, 64), (3, 2, 1, 80)])
@pytest.mark.parametrize("qk_norm", [False, True])
def test_rope_and_cache_matches_reference(num_tokens: int, hq: int, hkv: int, d: int,
                                          qk_norm: bool, dtype: torch.dtype) -> None:
    qkv, cos, sin, k_cache, v_cache, slots = rope_case(num_tokens, hq, hkv, d, dtype, d + hq)
    norms = (None, None)
    if qk_norm:
        g = torch.Generator().manual_seed(1)
        norms = tuple((1 + 0.3 * torch.randn(d, generator=g)).to(dtype) for _ in range(2))
    kc, vc = k_cache.clone(), v_cache.clone()
    q = rope_kv.rope_and_cache(qkv, cos, sin, kc, vc, slots.to(torch.int32), hq, hkv,
                               *norms, eps=1e-6)
    ref_q = reference.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, hq, hkv, *norms,
                                     eps=1e-6)
    assert q.shape == (num_tokens, hq, d)
    assert torch.allclose(q, ref_q, **tol(dtype))
    assert torch.allclose(kc, k_cache, **tol(dtype))
    assert torch.equal(vc, v_cache)  # v is copied as is; untouched slots stay as they were


def test_rope_and_cache_bad_input_is_named() -> None:
    qkv, cos, sin, k_cache, v_cache, slots = rope_case(4, 4, 2, 64, torch.float32)
    with pytest.raises(ValueError, match=r"qkv must be \[T, \(Hq \+ 2\*Hkv\) \* D\]"):
        rope_kv.rope_and_cache(qkv[:, 1:], cos, sin, k_cache, v_cache, slots, 4, 2)
    with pytest.raises(ValueError, match="cos must be"):
        rope_kv.rope_and_cache(qkv, cos[:3], sin, k_cache, v_cache, slots, 4, 2)
    with pytest.raises(ValueError, match="num_kv_heads"):
        rope_kv.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, 4, 1)
    with pytest.raises(ValueError, match="both q_norm_weight and k_norm_weight"):
        rope_kv.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, 4, 2, torch.ones(64))
    with pytest.raises(IndexError, match="out of range"):
        rope_kv.rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots.abs() + 20, 4, 2)
