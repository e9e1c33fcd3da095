"""The CPU backend's fused layer ops equal their references bit for bit (``model/torch_layer.py``:
q and k normed and rotated as one block, rope through the per-pass tables, K/V written through
the plan's rows)."""

from __future__ import annotations

import pytest
import torch

from specengine.kernels import reference
from specengine.model.rope import RotaryEmbedding
from specengine.model.torch_attention import build_pass_plan
from specengine.model.torch_layer import rms_norm, rope_and_write_kv


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize(("hq", "hkv"), [(4, 2), (2, 2)])
def test_rope_and_write_kv_equals_reference(dtype: torch.dtype, qk_norm: bool, hq: int,
                                            hkv: int) -> None:
    g = torch.Generator().manual_seed(hq + 2 * qk_norm)
    d, t, bs = 32, 6, 4
    qkv = (torch.randn(t, (hq + 2 * hkv) * d, generator=g) * 3).to(dtype)
    positions = torch.tensor([0, 1, 2, 7, 8, 40])
    cos, sin = RotaryEmbedding(d, 10000.0, None).cos_sin(positions, dtype)
    q_w, k_w = ((torch.rand(2, d, generator=g) + 0.5).to(dtype) if qk_norm else (None, None))
    slots = torch.tensor([0, 1, -1, 9, 10, 30])  # one padded token: no write
    caches = [torch.randn(8, bs, hkv, d, generator=g).to(dtype) for _ in range(2)]
    want = [c.clone() for c in caches]
    plan = build_pass_plan(torch.zeros(2, 8, dtype=torch.int32), torch.tensor([0, 7]),
                           torch.tensor([0, 3, 6], dtype=torch.int32), None, slots, 3, bs,
                           cos, sin)
    assert plan is not None
    with torch.inference_mode():  # (the engine's passes run under it)
        q = rope_and_write_kv(qkv, plan, *caches, hq, hkv, q_w, k_w, 1e-6)
    q_ref = reference.rope_and_cache(qkv, cos, sin, *want, slots, hq, hkv, q_w, k_w, 1e-6)
    assert torch.equal(q, q_ref)
    assert torch.equal(caches[0], want[0]) and torch.equal(caches[1], want[1])


@pytest.mark.parametrize("inference", [False, True])  # the engine's passes: one fused op
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_equals_reference(dtype: torch.dtype, inference: bool) -> None:
    g = torch.Generator().manual_seed(0)
    with torch.inference_mode(inference):
        for _ in range(30):
            h = (128, 96, 32)[_ % 3]  # mean divides by H: powers of two and not
            x = (torch.randn(7, 4, h, generator=g) * 4).to(dtype)
            for w in ((torch.rand(h, generator=g) + 0.5).to(dtype),
                      (torch.rand(4, h, generator=g) + 0.5).to(dtype)):
                assert torch.equal(rms_norm(x, w, 1e-6), reference.rms_norm(x, w, 1e-6))
                # a column slice, as q/k of a merged QKV output
                assert torch.equal(rms_norm(x[:, :2], w[..., :2, :] if w.dim() == 2 else w,
                                            1e-6),
                                   reference.rms_norm(x[:, :2], w[..., :2, :] if w.dim() == 2
                                                      else w, 1e-6))
