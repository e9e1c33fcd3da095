"""One decoder for Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm) causal LMs.

Module names equal the Hugging Face checkpoint names (``model.layers.3.self_attn.q_proj``), so
``state_dict()`` keys are the checkpoint's keys and loading is a validated ``param.copy_``.
All sequences of a step are packed into one ragged ``[T, ...]`` batch; the paged KV cache is
shared by all layers as ``kv_cache[2, num_layers, num_blocks, block_size, Hkv, D]``.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specengine.model.attention import AttentionBackend, AttentionMetadata
from specengine.model.config import ModelConfig
from specengine.model.rope import RotaryEmbedding


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor) -> Tensor:
        # Normalise in float32, scale in the activation dtype (transformers' numerics).
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


class Attention(nn.Module):
    """Self-attention over the paged cache. ``in_features`` is the width q/k/v read (default
    ``hidden_size``; an EAGLE-3 layer reads ``2 * hidden_size``)."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding,
                 in_features: int | None = None) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = cfg.num_heads, cfg.num_kv_heads
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        x = in_features or h
        self.q_proj = nn.Linear(x, cfg.num_heads * d, bias=cfg.qkv_bias)
        self.k_proj = nn.Linear(x, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.v_proj = nn.Linear(x, cfg.num_kv_heads * d, bias=cfg.qkv_bias)
        self.o_proj = nn.Linear(cfg.num_heads * d, h, bias=cfg.o_bias)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rope = rope
        self.scale = d**-0.5

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> Tensor:
        num_tokens = x.shape[0]
        q = self.q_proj(x).view(num_tokens, self.num_heads, self.head_dim)
        k = self.k_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        v = self.v_proj(x).view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = RotaryEmbedding.apply(q, cos, sin), RotaryEmbedding.apply(k, cos, sin)
        backend.write_kv(k, v, k_cache, v_cache, meta)
        o = backend.attend(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(num_tokens, -1))


class MLP(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        h, i = cfg.hidden_size, cfg.intermediate_size
        self.gate_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.up_proj = nn.Linear(h, i, bias=cfg.mlp_bias)
        self.down_proj = nn.Linear(i, h, bias=cfg.mlp_bias)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rope)
        self.mlp = MLP(cfg)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, h: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> Tensor:
        h = h + self.self_attn(self.input_layernorm(h), cos, sin, k_cache, v_cache, meta, backend)
        return h + self.mlp(self.post_attention_layernorm(h))


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = nn.Embedding(cfg.vocab_size, cfg.hidden_size)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary_emb) for _ in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The policy (or a small draft LM): ``forward`` → final hidden states, ``compute_logits``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.config = cfg
        self.model = DecoderModel(cfg)
        self.lm_head = nn.Linear(cfg.hidden_size, cfg.vocab_size, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    def forward(
        self,
        input_ids: Tensor,  # [T] int64
        positions: Tensor,  # [T] int64
        kv_cache: Tensor,  # [2, L, num_blocks, block_size, Hkv, D]
        meta: AttentionMetadata,
        backend: AttentionBackend,
        aux_layers: tuple[int, ...] = (),
    ) -> tuple[Tensor, list[Tensor]]:
        """Final-norm hidden states ``[T, H]`` and the inputs of the layers in ``aux_layers``
        (the residual stream entering each, as EAGLE-3 reads it), in layer order; index
        ``num_layers`` is the last layer's output before the final norm."""
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb.cos_sin(positions, h.dtype)
        aux: list[Tensor] = []
        for i, layer in enumerate(self.model.layers):
            if i in aux_layers:
                aux.append(h)
            h = layer(h, cos, sin, kv_cache[0, i], kv_cache[1, i], meta, backend)
        if len(self.model.layers) in aux_layers:
            aux.append(h)
        return self.model.norm(h), aux

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``[N, H]`` → float32 logits ``[N, V]`` (the sampler works in float32)."""
        return self.lm_head(hidden).float()
