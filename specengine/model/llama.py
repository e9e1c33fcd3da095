"""One decoder for Llama, Qwen2 (q/k/v biases) and Qwen3 (q/k RMSNorm) causal LMs, and their
mixture-of-experts variants (Qwen3-MoE, Qwen2-MoE, Mixtral: ``model/moe.py`` replaces the MLP of
the sparse layers).

A decoder layer is a handful of launches (docs/design.md §6): a fused residual-add + RMSNorm, one
merged QKV matmul, one q/k-norm + rope + KV-write kernel, attention, ``o_proj``, a second
add + RMSNorm, one merged gate-up matmul, SiLU·mul and ``down_proj``. The backend picks the
implementation of the fused ops (``AttentionBackend``: plain PyTorch or Triton).

Checkpoint names: every module is named as in the Hugging Face checkpoint, except the merged
projections ``qkv_proj`` (rows: q, k, v) and ``gate_up_proj`` (rows: gate, up), whose HF
tensors (``q_proj.weight`` ...) are row slices of the merged parameter.
:func:`specengine.model.loader.hf_named_tensors` lists every tensor under its HF name (views
sharing storage), ``state_dict()`` uses HF names and ``load_state_dict`` takes them.
All sequences of a step are packed into one ragged ``[T, ...]`` batch; the paged KV cache is
shared by all layers as ``kv_cache[2, num_layers, num_blocks, block_size, Hkv, D]``.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specengine.kernels import reference
from specengine.model import torch_layer
from specengine.model.attention import AttentionBackend, AttentionMetadata, with_pass_plan
from specengine.model.config import ModelConfig
from specengine.model.moe import MIXTRAL_EXPERT_NAMES, QWEN_EXPERT_NAMES, SparseMoeBlock
from specengine.model.rope import RotaryEmbedding
from specengine.model.tp_layers import embedding, lm_head, row_linear, shard_specs

if TYPE_CHECKING:
    from specengine.distributed.tp_group import TPGroup


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: Tensor, backend: AttentionBackend | None = None,
                out: Tensor | None = None) -> Tensor:
        """``x [N, H]`` normed (transformers' numerics); into ``out`` when given."""
        if backend is None:  # (the reference's values; fewer CPU operators: torch_layer)
            y = torch_layer.rms_norm(x, self.weight, self.eps)
            return y if out is None else out.copy_(y)
        return backend.rms_norm(x, self.weight, self.eps, out)

    def add_forward(self, x: Tensor, residual: Tensor,
                    backend: AttentionBackend | None = None) -> tuple[Tensor, Tensor]:
        """``(norm(x + residual), x + residual)`` in one fused op."""
        if backend is None:
            return reference.add_rms_norm(x, residual, self.weight, self.eps)
        return backend.add_rms_norm(x, residual, self.weight, self.eps)


class MergedLinear(nn.Module):
    """Several HF projections of one input as one matmul: the parts' weight rows (and biases)
    stacked in order. ``parts`` are ``(hf_name, out_features)``."""

    def __init__(self, in_features: int, parts: Sequence[tuple[str, int]], bias: bool) -> None:
        super().__init__()
        if not parts or any(n <= 0 for _, n in parts):
            raise ValueError(f"MergedLinear needs parts with positive sizes, got {parts}")
        self.parts = tuple(parts)
        out_features = sum(n for _, n in parts)
        self.in_features = in_features
        self.weight = nn.Parameter(torch.empty(out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features)) if bias else None
        # nn.Linear's initialisation, so an unloaded model behaves like the unmerged one did.
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))
        if self.bias is not None:
            bound = 1 / math.sqrt(in_features) if in_features > 0 else 0.0
            nn.init.uniform_(self.bias, -bound, bound)
        self.register_state_dict_post_hook(_state_dict_hf_names)

    def forward(self, x: Tensor) -> Tensor:
        return F.linear(x, self.weight, self.bias)

    def hf_tensors(self) -> dict[str, Tensor]:
        """``{"q_proj.weight": rows of weight, ...}`` (names relative to the parent module):
        views sharing this module's storage, so writing them writes the merged parameter."""
        out: dict[str, Tensor] = {}
        lo = 0
        for name, n in self.parts:  # per part weight then bias: nn.Linear's order
            out[f"{name}.weight"] = self.weight.detach()[lo: lo + n]
            if self.bias is not None:
                out[f"{name}.bias"] = self.bias.detach()[lo: lo + n]
            lo += n
        return out

    def merge_hf_entries(self, state_dict: dict[str, Any], parent_prefix: str,
                         attr: str) -> None:
        """Replace the parts' HF entries of a state dict by this module's merged ones (when
        all parts are there; otherwise load_state_dict reports them)."""
        for suffix, p in (("weight", self.weight), ("bias", self.bias)):
            keys = [f"{parent_prefix}{name}.{suffix}" for name, _ in self.parts]
            if p is not None and all(k in state_dict for k in keys):
                state_dict[f"{parent_prefix}{attr}.{suffix}"] = torch.cat(
                    [state_dict.pop(k) for k in keys])


def _state_dict_hf_names(module: MergedLinear, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
    """``state_dict()`` lists a merged projection under its HF names (checkpoint keys)."""
    parent = prefix[: prefix.rstrip(".").rfind(".") + 1]  # drop this module's own name
    for suffix in ("weight", "bias"):
        state_dict.pop(prefix + suffix, None)
    for name, t in module.hf_tensors().items():
        state_dict[parent + name] = t


def _load_hf_names(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                   *args: Any) -> None:
    """``load_state_dict`` takes HF names: merge the parts of every merged child."""
    for attr, child in module.named_children():
        if isinstance(child, MergedLinear):
            child.merge_hf_entries(state_dict, prefix, attr)


class Attention(nn.Module):
    """Self-attention over the paged cache. ``in_features`` is the width q/k/v read (default
    ``hidden_size``; an EAGLE-3 layer reads ``2 * hidden_size``). With ``tp`` this rank's
    heads only (``specengine.model.tp_layers``): QKV column-, ``o_proj`` row-parallel."""

    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding,
                 in_features: int | None = None, tp: TPGroup | None = None) -> None:
        super().__init__()
        n = tp.world_size if tp is not None else 1
        # Fewer KV heads than ranks: each rank keeps the one its query heads read (replicated).
        self.num_heads, self.num_kv_heads = cfg.num_heads // n, max(1, cfg.num_kv_heads // n)
        self.head_dim = cfg.head_dim
        h, d = cfg.hidden_size, cfg.head_dim
        self.qkv_proj = MergedLinear(
            in_features or h, (("q_proj", self.num_heads * d), ("k_proj", self.num_kv_heads * d),
                               ("v_proj", self.num_kv_heads * d)), bias=cfg.qkv_bias)
        self.o_proj = row_linear(self.num_heads * d, h, cfg.o_bias, tp)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.rope = rope
        self.scale = d**-0.5
        self.register_load_state_dict_pre_hook(_load_hf_names)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor, v_cache: Tensor,
                meta: AttentionMetadata, backend: AttentionBackend) -> Tensor:
        """``x [T, in]`` → ``o_proj(attention) [T, H]``; ``cos`` / ``sin`` ``[T, D/2]``
        (``RotaryEmbedding.cos_sin``). Writes this step's K/V into the cache."""
        num_tokens = x.shape[0]
        norms = (self.q_norm.weight, self.k_norm.weight, self.q_norm.eps) if self.qk_norm \
            else (None, None, 1e-6)
        q = backend.rope_and_write_kv(self.qkv_proj(x), cos, sin, k_cache, v_cache, meta,
                                      self.num_heads, self.num_kv_heads, *norms)
        o = backend.attend(q, k_cache, v_cache, meta, self.scale)  # [T, Hq, D]
        return self.o_proj(o.reshape(num_tokens, -1))


class MLP(nn.Module):
    """Gate-up (column-parallel with ``tp``: this rank's slice of each) and down (row-parallel)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None,
                 intermediate_size: int | None = None) -> None:
        super().__init__()
        h = cfg.hidden_size
        n = tp.world_size if tp is not None else 1
        i = (intermediate_size or cfg.intermediate_size) // n
        self.gate_up_proj = MergedLinear(h, (("gate_proj", i), ("up_proj", i)),
                                         bias=cfg.mlp_bias)
        self.down_proj = row_linear(i, h, cfg.mlp_bias, tp)
        self.register_load_state_dict_pre_hook(_load_hf_names)

    def forward(self, x: Tensor, backend: AttentionBackend | None = None) -> Tensor:
        gate_up = self.gate_up_proj(x)  # [T, 2I]
        act = reference.silu_mul(gate_up) if backend is None else backend.silu_mul(gate_up)
        return self.down_proj(act)


def sparse_moe_block(cfg: ModelConfig, tp: TPGroup | None = None) -> SparseMoeBlock:
    """The sparse MLP of an MoE layer (Qwen2-MoE's with its shared expert); with ``tp`` this
    rank's slice of every expert's inner dimension (and of the shared expert's)."""
    shared = (MLP(cfg, tp, intermediate_size=cfg.shared_expert_intermediate_size)
              if cfg.shared_expert_intermediate_size else None)
    names = MIXTRAL_EXPERT_NAMES if cfg.model_type == "mixtral" else QWEN_EXPERT_NAMES
    inner = cfg.moe_intermediate_size // (tp.world_size if tp is not None else 1)
    return SparseMoeBlock(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok, inner,
                          cfg.norm_topk_prob, names, shared, tp)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, rope: RotaryEmbedding,
                 tp: TPGroup | None = None, layer_idx: int | None = None) -> None:
        super().__init__()
        self.self_attn = Attention(cfg, rope, tp=tp)
        # The MLP under its checkpoint name: Mixtral calls its sparse block `block_sparse_moe`.
        self.mlp_name = "block_sparse_moe" if cfg.model_type == "mixtral" else "mlp"
        if layer_idx is not None and layer_idx in cfg.moe_layers:
            setattr(self, self.mlp_name, sparse_moe_block(cfg, tp))
        else:
            setattr(self, self.mlp_name, MLP(cfg, tp))
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x: Tensor, residual: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                v_cache: Tensor, meta: AttentionMetadata, backend: AttentionBackend
                ) -> tuple[Tensor, Tensor]:
        """``x`` is ``input_layernorm(residual)`` (the caller fuses it with the previous
        layer's add, see :func:`run_layers`). Returns ``(mlp output, residual)``: the layer's
        output is their sum, left to the next fused add + norm."""
        attn = self.self_attn(x, cos, sin, k_cache, v_cache, meta, backend)
        x, residual = self.post_attention_layernorm.add_forward(attn, residual, backend)
        return getattr(self, self.mlp_name)(x, backend), residual


def run_layers(layers: nn.ModuleList, final_norm: RMSNorm, h: Tensor, cos: Tensor,
               sin: Tensor, kv_cache: Tensor, meta: AttentionMetadata,
               backend: AttentionBackend, aux_layers: tuple[int, ...] = ()
               ) -> tuple[Tensor, list[Tensor]]:
    """``final_norm(layers(h))`` with every residual add fused into the next norm, and the
    residual stream entering each layer of ``aux_layers`` (index ``len(layers)``: the last
    layer's output before the final norm), in layer order."""
    aux: list[Tensor] = []
    delta: Tensor | None = None
    residual = h
    for i, layer in enumerate(layers):
        if delta is None:
            x = layer.input_layernorm(residual, backend)
        else:
            x, residual = layer.input_layernorm.add_forward(delta, residual, backend)
        if i in aux_layers:
            aux.append(residual)
        delta, residual = layer(x, residual, cos, sin, kv_cache[0, i], kv_cache[1, i], meta,
                                backend)
    if delta is None:
        out = final_norm(residual, backend)
    else:
        out, residual = final_norm.add_forward(delta, residual, backend)
    if len(layers) in aux_layers:
        aux.append(residual)
    return out, aux


class DecoderModel(nn.Module):
    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope_theta, cfg.rope_scaling)
        self.embed_tokens = embedding(cfg.vocab_size, cfg.hidden_size, tp)
        self.layers = nn.ModuleList(
            DecoderLayer(cfg, self.rotary_emb, tp, i) for i in range(cfg.num_layers)
        )
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)


class CausalLM(nn.Module):
    """The policy (or a small draft LM): ``forward`` → final hidden states, ``compute_logits``.

    With ``tp`` (a :class:`~specengine.distributed.tp_group.TPGroup`) this rank's shard of a
    tensor-parallel model: ``tp_shards`` maps each split HF tensor to this rank's slice of it
    (every weight-loading path copies that slice), and on rank 0 ``forward`` / the embedding /
    the LM head first tell the other ranks to run the same call (``distributed.tp_group``)."""

    def __init__(self, cfg: ModelConfig, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.config = cfg
        self.tp = tp
        self.model = DecoderModel(cfg, tp)
        self.lm_head = lm_head(cfg.hidden_size, cfg.vocab_size, tp,
                               self.model.embed_tokens if cfg.tie_word_embeddings else None)
        #: HF name -> this rank's slice of that tensor, for the tensors that are split
        self.tp_shards: dict[str, Any] = {}
        #: MoE expert-load counters (``model.expert_load.enable_expert_load``); None: off
        self.expert_load: Any = None
        if tp is not None:
            from specengine.model.weight_names import hf_named_tensors

            names = list(hf_named_tensors(self, remove_duplicate=False))
            self.tp_shards = shard_specs(names, cfg, tp.rank, tp.world_size)

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
        if self.tp is not None:
            # Rank 0 broadcasts the step's inputs; the workers run it on their own caches.
            with self.tp.entry("forward", input_ids, positions, meta, aux_layers):
                return self._forward(input_ids, positions, kv_cache, meta, backend, aux_layers)
        return self._forward(input_ids, positions, kv_cache, meta, backend, aux_layers)

    def _forward(self, input_ids: Tensor, positions: Tensor, kv_cache: Tensor,
                 meta: AttentionMetadata, backend: AttentionBackend,
                 aux_layers: tuple[int, ...]) -> tuple[Tensor, list[Tensor]]:
        if self.expert_load is not None:  # which rows are real, which kind of pass
            self.expert_load.begin_pass(meta.slot_mapping, meta.max_q_len)
        h = self.model.embed_tokens(input_ids)
        cos, sin = self.model.rotary_emb.cos_sin(positions, h.dtype)
        meta = with_pass_plan(meta, backend, kv_cache, cos, sin)
        return run_layers(self.model.layers, self.model.norm, h, cos, sin, kv_cache, meta,
                          backend, aux_layers)

    def compute_logits(self, hidden: Tensor) -> Tensor:
        """``[N, H]`` → logits ``[N, V]`` in the model's dtype. Not upcast here: the rejection
        sampler and the draft choice read them in float32 row by row (an exact upcast), which
        spares a ``[N, V]`` float32 copy per pass (0.6 GB at 1,024 rows x 151,936 ids)."""
        return self.lm_head(hidden)
