"""Small random Hugging Face checkpoints that tests write themselves (nothing is downloaded)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

ARCH_KWARGS: dict[str, dict[str, Any]] = {
    # Llama with llama3 rope scaling, GQA 4:2, untied embeddings.
    "llama": dict(
        num_attention_heads=4, num_key_value_heads=2,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 32},
        tie_word_embeddings=False,
    ),
    # Qwen2: q/k/v biases, tied embeddings, GQA 4:1.
    "qwen2": dict(num_attention_heads=4, num_key_value_heads=1, tie_word_embeddings=True),
    # Qwen3: q/k norms, head_dim != hidden/heads, untied.
    "qwen3": dict(num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  tie_word_embeddings=False),
    # Llama with yarn scaling and MHA.
    "llama_yarn": dict(
        num_attention_heads=4, num_key_value_heads=4,
        rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
        tie_word_embeddings=True,
    ),
}

# Mixture-of-experts archs: (config class, model class, kwargs); `num_layers` etc. as above.
MOE_ARCHS: dict[str, tuple[str, str, dict[str, Any]]] = {
    # Qwen3-MoE: 5 experts (not a power of two), top-3, renormalised, layer 0 dense.
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, head_dim=32, num_experts=5,
        num_experts_per_tok=3, moe_intermediate_size=48, norm_topk_prob=True,
        mlp_only_layers=[0], tie_word_embeddings=False)),
    # Qwen2-MoE: shared expert behind a sigmoid gate, q/k/v biases, top-2 not renormalised.
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, num_experts=6, num_experts_per_tok=2,
        moe_intermediate_size=40, shared_expert_intermediate_size=72, norm_topk_prob=False,
        tie_word_embeddings=False)),
    # Mixtral: top-2 of 3 experts, softmax over the chosen two.
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", dict(
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=3,
        num_experts_per_tok=2, tie_word_embeddings=True)),
}


def make_hf_model(arch: str, vocab_size: int = 128, hidden_size: int = 64, num_layers: int = 2,
                  seed: int = 0, init_std: float = 0.08, **overrides: Any) -> torch.nn.Module:
    """A random transformers model of ``arch`` (a key of ARCH_KWARGS), float32, eval mode.

    ``init_std`` is larger than the usual 0.02 so logits are well separated and greedy
    decoding does not hinge on float rounding.
    """
    transformers = pytest.importorskip("transformers")  # a test extra: absent on a bare GPU box

    if arch in MOE_ARCHS:
        return _make_moe_model(transformers, arch, vocab_size, hidden_size, num_layers, seed,
                               init_std, overrides)
    family = arch.split("_")[0]
    cfg_cls = {"llama": transformers.LlamaConfig, "qwen2": transformers.Qwen2Config,
               "qwen3": transformers.Qwen3Config}[family]
    model_cls = {"llama": transformers.LlamaForCausalLM, "qwen2": transformers.Qwen2ForCausalLM,
                 "qwen3": transformers.Qwen3ForCausalLM}[family]
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, max_position_embeddings=512, rms_norm_eps=1e-6,
        initializer_range=init_std, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    kwargs.update(ARCH_KWARGS[arch])
    kwargs.update(overrides)
    torch.manual_seed(seed)
    model = model_cls(cfg_cls(**kwargs)).float().eval()
    if family == "qwen2":
        # Random biases, so the bias path is exercised with non-zero values.
        with torch.no_grad():
            for name, p in model.named_parameters():
                if name.endswith("bias"):
                    p.normal_(0, init_std)
    return model


def _make_moe_model(transformers: Any, arch: str, vocab_size: int, hidden_size: int,
                    num_layers: int, seed: int, init_std: float,
                    overrides: dict[str, Any]) -> torch.nn.Module:
    cfg_name, model_name, arch_kwargs = MOE_ARCHS[arch]
    kwargs = dict(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers, max_position_embeddings=512, rms_norm_eps=1e-6,
        initializer_range=init_std, bos_token_id=None, eos_token_id=None, pad_token_id=None,
    )
    kwargs.update(arch_kwargs)
    kwargs.update(overrides)
    torch.manual_seed(seed)
    cfg = getattr(transformers, cfg_name)(**kwargs)
    model = getattr(transformers, model_name)(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, init_std)
            elif name.endswith("gate.weight"):
                # A wide router, so routing is decisive and tokens spread unevenly.
                p.normal_(0, 4 * init_std)
    return model


def save_checkpoint(model: torch.nn.Module, path: Path, shard_kb: int | None = None) -> Path:
    kwargs: dict[str, Any] = {"safe_serialization": True}
    if shard_kb is not None:
        kwargs["max_shard_size"] = f"{shard_kb}KB"
    model.save_pretrained(str(path), **kwargs)
    return path
