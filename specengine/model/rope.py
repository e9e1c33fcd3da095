"""Rotary position embeddings: default, linear, ``llama3`` and ``yarn`` frequency scaling.

The frequencies follow the published recipes (and transformers' numerics: float32 throughout,
cos/sin cast to the activation dtype last) so logits match Hugging Face to float rounding.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import Tensor, nn


def _inv_freq(dim: int, base: float) -> Tensor:
    return 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.int64).float() / dim))


def _llama3(inv_freq: Tensor, s: dict[str, Any]) -> Tensor:
    # Long wavelengths (low frequencies) are divided by `factor`, short ones kept, and the band
    # in between interpolated linearly in 1/wavelength.
    factor, low, high = s["factor"], s["low_freq_factor"], s["high_freq_factor"]
    old_len = s["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_len / low, old_len / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_len / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_wavelen) * ~(wavelen > low_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(dim: int, base: float, s: dict[str, Any]) -> tuple[Tensor, float]:
    factor = s["factor"]
    orig = s["original_max_position_embeddings"]

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    attn_factor = s.get("attention_factor")
    if attn_factor is None:
        if s.get("mscale") and s.get("mscale_all_dim"):
            attn_factor = mscale(factor, s["mscale"]) / mscale(factor, s["mscale_all_dim"])
        else:
            attn_factor = mscale(factor)
    beta_fast = s.get("beta_fast") or 32
    beta_slow = s.get("beta_slow") or 1

    def correction_dim(num_rotations: float) -> float:
        # The dimension whose wavelength completes `num_rotations` turns over the original context.
        return dim * math.log(orig / (num_rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if s.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation = 1 - ramp  # 1: keep the original frequency, 0: interpolate (divide by factor)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    inv = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv, float(attn_factor)


class RotaryEmbedding(nn.Module):
    """RoPE tables (rotate-half layout) at arbitrary positions; the rotation itself is fused
    into the rope + KV-write op (``kernels/reference_layer.rotate`` is its specification)."""

    def __init__(self, head_dim: int, base: float, scaling: dict[str, Any] | None) -> None:
        super().__init__()
        self.attention_factor = 1.0
        if scaling is None:
            inv_freq = _inv_freq(head_dim, base)
        elif scaling["rope_type"] == "linear":
            inv_freq = _inv_freq(head_dim, base) / scaling["factor"]
        elif scaling["rope_type"] == "llama3":
            inv_freq = _llama3(_inv_freq(head_dim, base), scaling)
        else:
            inv_freq, self.attention_factor = _yarn(head_dim, base, scaling)
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def cos_sin(self, positions: Tensor, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
        """``cos`` / ``sin`` ``[T, D/2]`` at ``positions``, in float32 then cast to ``dtype``
        (HF's ``cat([freqs, freqs])`` repeats these halves). Computed once per forward pass
        and read by every layer's rope kernel (see ``kernels/rope_kv.py`` for why here)."""
        freqs = positions.float()[:, None] * self.inv_freq[None, :]  # [T, D/2]
        cos, sin = freqs.cos(), freqs.sin()
        if self.attention_factor != 1.0:
            cos, sin = cos * self.attention_factor, sin * self.attention_factor
        if dtype == torch.float32:  # no cast to dispatch (each is an operator on the CPU)
            return cos, sin
        return cos.to(dtype), sin.to(dtype)
