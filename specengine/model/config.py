"""The decoder's hyper-parameters, read from a Hugging Face ``config.json``."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

# architecture name in config.json → model_type
SUPPORTED_ARCHITECTURES: dict[str, str] = {
    "LlamaForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "MixtralForCausalLM": "mixtral",
}
# model_type → the dense family whose attention it shares (q/k/v biases, q/k norms)
ATTENTION_FAMILY: dict[str, str] = {"qwen3_moe": "qwen3", "qwen2_moe": "qwen2",
                                    "mixtral": "llama"}
SUPPORTED_MODEL_TYPES = frozenset(SUPPORTED_ARCHITECTURES.values())


class CheckpointError(ValueError):
    """A checkpoint directory is missing, malformed, or does not fit the model it describes."""


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder needs to know about a Llama / Qwen2 / Qwen3 checkpoint, or a
    mixture-of-experts one (Qwen3-MoE, Qwen2-MoE, Mixtral: ``num_experts > 0``)."""

    model_type: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    rope_scaling: dict[str, Any] | None = field(default=None, hash=False)
    max_position_embeddings: int = 4096
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    mlp_bias: bool = False
    qk_norm: bool = False
    eos_token_ids: tuple[int, ...] = ()
    #: multi-token-prediction layers under ``mtp.*`` (config ``mtp_num_hidden_layers``)
    num_mtp_layers: int = 0
    #: routed experts per MoE layer (0: a dense model)
    num_experts: int = 0
    #: experts each token is routed to (top-k of the router's softmax)
    num_experts_per_tok: int = 0
    #: intermediate size of one routed expert
    moe_intermediate_size: int = 0
    #: renormalise the k routing weights to sum to 1 (Mixtral always does)
    norm_topk_prob: bool = False
    #: indices of the layers whose MLP is a sparse MoE block (the rest stay dense)
    moe_layers: tuple[int, ...] = ()
    #: Qwen2-MoE's shared expert (a dense MLP behind a sigmoid gate; 0: none)
    shared_expert_intermediate_size: int = 0

    def __post_init__(self) -> None:
        if self.model_type not in SUPPORTED_MODEL_TYPES:
            raise CheckpointError(
                f"unsupported model_type {self.model_type!r}; supported: "
                f"{sorted(SUPPORTED_MODEL_TYPES)}"
            )
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim"):
            if getattr(self, name) <= 0:
                raise CheckpointError(f"config: {name} must be positive, got {getattr(self, name)}")
        if self.num_heads % self.num_kv_heads != 0:
            raise CheckpointError(
                f"config: num_attention_heads ({self.num_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_kv_heads})"
            )
        if self.rope_scaling is not None:
            rope_type = self.rope_scaling.get("rope_type")
            if rope_type not in ("llama3", "yarn", "linear"):
                raise CheckpointError(
                    f"config: rope scaling type {rope_type!r} is not supported "
                    "(supported: default, linear, llama3, yarn)"
                )
        if self.num_experts:
            if not 1 <= self.num_experts_per_tok <= self.num_experts:
                raise CheckpointError(
                    f"config: num_experts_per_tok ({self.num_experts_per_tok}) must be in "
                    f"[1, num_experts={self.num_experts}]")
            if self.moe_intermediate_size <= 0:
                raise CheckpointError("config: moe_intermediate_size must be positive, got "
                                      f"{self.moe_intermediate_size}")
            if any(not 0 <= i < self.num_layers for i in self.moe_layers):
                raise CheckpointError(f"config: MoE layers {self.moe_layers} out of range for "
                                      f"{self.num_layers} layers")
        elif self.moe_layers:
            raise CheckpointError("config: MoE layers given but num_experts is 0")

    @property
    def is_moe(self) -> bool:
        """Whether any layer routes its tokens to experts."""
        return bool(self.moe_layers)

    @classmethod
    def from_dict(cls, cfg: dict[str, Any]) -> ModelConfig:
        model_type = _model_type(cfg)
        hidden_act = cfg.get("hidden_act", "silu")
        if hidden_act != "silu":
            raise CheckpointError(f"config: hidden_act {hidden_act!r} is not supported (silu only)")
        if cfg.get("use_sliding_window"):
            raise CheckpointError("config: sliding-window attention is not supported")
        window = cfg.get("sliding_window") if model_type == "mixtral" else None
        if window is not None and int(window) < int(cfg.get("max_position_embeddings", 4096)):
            # Mixtral has no `use_sliding_window` switch: a window shorter than the context
            # would change attention (a window at least as long never binds).
            raise CheckpointError(f"config: sliding-window attention (sliding_window={window}) "
                                  "is not supported")
        num_heads = int(cfg["num_attention_heads"])
        hidden = int(cfg["hidden_size"])
        rope_theta, rope_scaling = _rope(cfg)
        attention_bias = bool(cfg.get("attention_bias", False))
        # Qwen2 always has q/k/v biases and no o_proj bias; Llama and Qwen3 put
        # `attention_bias` on all four projections.
        family = ATTENTION_FAMILY.get(model_type, model_type)
        # (Qwen2-MoE's config may turn them off with `qkv_bias`.)
        qkv_bias = bool(cfg.get("qkv_bias", True)) if model_type == "qwen2_moe" else (
            True if family == "qwen2" else attention_bias)
        o_bias = False if family == "qwen2" else attention_bias
        eos = cfg.get("eos_token_id")
        eos_ids = () if eos is None else (tuple(eos) if isinstance(eos, list) else (int(eos),))
        return cls(
            model_type=model_type,
            vocab_size=int(cfg["vocab_size"]),
            hidden_size=hidden,
            intermediate_size=int(cfg["intermediate_size"]),
            num_layers=int(cfg["num_hidden_layers"]),
            num_heads=num_heads,
            num_kv_heads=int(cfg.get("num_key_value_heads") or num_heads),
            head_dim=int(cfg.get("head_dim") or hidden // num_heads),
            rms_norm_eps=float(cfg.get("rms_norm_eps", 1e-6)),
            rope_theta=rope_theta,
            rope_scaling=rope_scaling,
            max_position_embeddings=int(cfg.get("max_position_embeddings", 4096)),
            tie_word_embeddings=bool(cfg.get("tie_word_embeddings", False)),
            qkv_bias=qkv_bias,
            o_bias=o_bias,
            mlp_bias=bool(cfg.get("mlp_bias", False)),
            qk_norm=family == "qwen3",
            eos_token_ids=eos_ids,
            num_mtp_layers=int(cfg.get("mtp_num_hidden_layers") or 0),
            **_moe_fields(model_type, cfg),
        )

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        cfg_path = Path(path) / "config.json"
        if not cfg_path.is_file():
            raise CheckpointError(
                f"{path}: no config.json (expected a Hugging Face checkpoint dir)"
            )
        try:
            cfg = json.loads(cfg_path.read_text())
        except json.JSONDecodeError as e:
            raise CheckpointError(f"{cfg_path}: not valid JSON ({e})") from e
        try:
            return cls.from_dict(cfg)
        except KeyError as e:
            raise CheckpointError(f"{cfg_path}: missing required field {e}") from e


def _model_type(cfg: dict[str, Any]) -> str:
    archs = cfg.get("architectures") or []
    for arch in archs:
        if arch in SUPPORTED_ARCHITECTURES:
            return SUPPORTED_ARCHITECTURES[arch]
    if archs:
        raise CheckpointError(
            f"unsupported architecture {archs}; supported: {sorted(SUPPORTED_ARCHITECTURES)}"
        )
    model_type = cfg.get("model_type")
    if model_type not in SUPPORTED_MODEL_TYPES:
        raise CheckpointError(
            f"unsupported model_type {model_type!r}; supported: {sorted(SUPPORTED_MODEL_TYPES)}"
        )
    return model_type


def _moe_fields(model_type: str, cfg: dict[str, Any]) -> dict[str, Any]:
    """The MoE fields of :class:`ModelConfig`, with transformers' layer rule: layer ``i`` is
    sparse unless ``i in mlp_only_layers`` or ``(i + 1) % decoder_sparse_step != 0``."""
    if model_type not in ("qwen3_moe", "qwen2_moe", "mixtral"):
        return {}
    # The Qwen configs write `num_experts` (transformers >= 5 saves `num_local_experts`);
    # Mixtral's is `num_local_experts`.
    keys = ("num_local_experts", "num_experts") if model_type == "mixtral" else (
        "num_experts", "num_local_experts")
    num_experts = int(cfg.get(keys[0]) or cfg.get(keys[1]) or 0)
    num_layers = int(cfg["num_hidden_layers"])
    if model_type == "mixtral":
        # Every layer sparse; experts as wide as `intermediate_size`; top-k always renormalised.
        moe_layers = tuple(range(num_layers)) if num_experts else ()
        return dict(num_experts=num_experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                    moe_intermediate_size=int(cfg["intermediate_size"]), norm_topk_prob=True,
                    moe_layers=moe_layers)
    step = cfg.get("decoder_sparse_step")
    step = 1 if step is None else int(step)
    if step <= 0:
        raise CheckpointError(f"config: decoder_sparse_step must be positive, got {step}")
    dense = set(cfg.get("mlp_only_layers") or ())
    moe_layers = tuple(i for i in range(num_layers)
                       if num_experts > 0 and i not in dense and (i + 1) % step == 0)
    shared = int(cfg.get("shared_expert_intermediate_size") or 0) \
        if model_type == "qwen2_moe" else 0
    return dict(num_experts=num_experts, num_experts_per_tok=int(cfg["num_experts_per_tok"]),
                moe_intermediate_size=int(cfg["moe_intermediate_size"]),
                norm_topk_prob=bool(cfg.get("norm_topk_prob", False)), moe_layers=moe_layers,
                shared_expert_intermediate_size=shared)


def _rope(cfg: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """Rope base and scaling from either the old (`rope_theta` + `rope_scaling`) or the new
    (`rope_parameters`, transformers ≥ 5) config layout."""
    params = dict(cfg.get("rope_parameters") or cfg.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", cfg.get("rope_theta", 10000.0)))
    rope_type = params.get("rope_type", params.get("type", "default"))
    if rope_type == "default":
        return theta, None
    params["rope_type"] = rope_type
    params.pop("type", None)
    params.pop("rope_theta", None)
    # As transformers does: a top-level `original_max_position_embeddings` wins.
    if "original_max_position_embeddings" in cfg:
        params["original_max_position_embeddings"] = cfg["original_max_position_embeddings"]
    params.setdefault("original_max_position_embeddings", cfg.get("max_position_embeddings", 4096))
    if params.get("factor") is None and rope_type == "yarn":
        params["factor"] = cfg.get("max_position_embeddings", 4096) / params[
            "original_max_position_embeddings"
        ]
    return theta, params
