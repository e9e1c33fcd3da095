"""EAGLE-3 heads for training: a fresh one shaped for a target, one read from a head dir
(warm start), and writing one in the published layout (``drafters/eagle3.py``'s docstring:
``config.json`` + ``model.safetensors`` with ``fc``, ``midlayer.*``, ``norm``, ``lm_head``,
``d2t``, ``t2d``), which ``SpecEngine(draft=HEAD_DIR)`` loads like any published head.

A fresh head takes the target's layer shapes (hidden size, heads, head dim, MLP width, rope,
norm eps: one Llama decoder layer as SpecForge and the speculators library configure it), the
aux layers SpecForge reads (outputs of layers ``1, L/2 - 1, L - 4``; for a target of fewer
than 8 layers, evenly spread ``0, (L-1)/2, L-2``) and a draft vocabulary of the most
frequent generated tokens (EAGLE-3's ``d2t`` / ``t2d``; ties go to the smaller id, ids kept
in ascending order).
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import save_file
from torch import Tensor, nn

from specengine.drafters.eagle3 import Eagle3Head, read_head_checkpoint
from specengine.model.config import CheckpointError, ModelConfig
from specengine.model.loader import load_named_tensors
from specengine.model.weight_names import hf_named_tensors

logger = logging.getLogger(__name__)

# Target config fields a fresh head copies (its layer shape, rope and context length).
TARGET_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
               "intermediate_size", "rms_norm_eps", "rope_theta", "rope_parameters",
               "rope_scaling", "max_position_embeddings", "vocab_size")


def read_config(path: str | Path) -> dict[str, Any]:
    file = Path(path) / "config.json"
    try:
        cfg = json.loads(file.read_text())
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot read it ({e})") from e
    if not isinstance(cfg, dict):
        raise CheckpointError(f"{file}: expected a JSON object")
    return cfg


def aux_layer_ids(num_layers: int) -> list[int]:
    """The target layers whose outputs a fresh head reads (module docstring)."""
    if num_layers >= 8:
        return [1, num_layers // 2 - 1, num_layers - 4]
    return [0, max(0, (num_layers - 1) // 2), max(0, num_layers - 2)]


def fresh_config(target: dict[str, Any], draft_vocab_size: int, dtype: str) -> dict[str, Any]:
    """``config.json`` of a fresh head for the ``target`` config (module docstring)."""
    vocab = int(target["vocab_size"])
    if not 0 < draft_vocab_size <= vocab:
        raise ValueError(f"draft vocab size {draft_vocab_size} must be in [1, the target's "
                         f"vocab_size {vocab}]")
    text = target.get("text_config") or {}  # multimodal configs nest the language model's
    src = {**text, **{k: v for k, v in target.items() if k in TARGET_KEYS}}
    num_layers = int(target.get("num_hidden_layers") or text.get("num_hidden_layers") or 0)
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        **{k: src[k] for k in TARGET_KEYS if src.get(k) is not None},
        "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "draft_vocab_size": draft_vocab_size,
        "target_hidden_size": int(src["hidden_size"]),
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": aux_layer_ids(num_layers),
                         "use_aux_hidden_state": True},
        "torch_dtype": dtype,
    }


def most_frequent(counts: np.ndarray, size: int) -> Tensor:
    """Ascending ids of the ``size`` most frequent tokens (ties: the smaller id first)."""
    order = np.lexsort((np.arange(counts.size), -counts))[:size]
    return torch.from_numpy(np.sort(order).astype(np.int64))


def build_head(cfg: dict[str, Any], embed: nn.Embedding, device: torch.device,
               tensors: dict[str, Tensor] | None = None,
               draft_to_target: Tensor | None = None) -> Eagle3Head:
    """A float32 :class:`Eagle3Head` of ``cfg`` on ``device`` (the trainer's copy): the
    module's own initialisation, or ``tensors`` (checkpoint names, ``d2t`` / ``t2d`` /
    ``embed_tokens.weight`` already removed)."""
    mc = ModelConfig.from_dict({**cfg, "architectures": ["LlamaForCausalLM"],
                                "model_type": "llama"})
    vd = int(cfg.get("draft_vocab_size") or mc.vocab_size)
    with torch.device(device):
        head = Eagle3Head(mc, vd, embed, bool(cfg.get("norm_before_residual", False))).float()
    if tensors is not None:
        load_named_tensors(head, tensors.items(), strict=True)
    if draft_to_target is not None:
        head.draft_to_target.copy_(draft_to_target)
    return head


def read_head(path: str | Path, embed: nn.Embedding, device: torch.device
              ) -> tuple[dict[str, Any], Eagle3Head]:
    """The config and float32 head of a head dir (a warm start). Its shapes are checked
    against the target when the engine loads the same dir (``Eagle3Drafter``)."""
    cfg = read_config(path)
    tensors = read_head_checkpoint(path)
    tensors.pop("embed_tokens.weight", None)  # the target's (checked by Eagle3Drafter)
    d2t, _ = tensors.pop("d2t", None), tensors.pop("t2d", None)
    vd = int(cfg.get("draft_vocab_size") or cfg["vocab_size"])
    ids = None if d2t is None else torch.arange(vd) + d2t.long()
    return cfg, build_head(cfg, embed, device, {n: t.float() for n, t in tensors.items()}, ids)


def write_head(head: Eagle3Head, cfg: dict[str, Any], out: str | Path,
               dtype: torch.dtype) -> None:
    """``head`` in the published layout under ``out`` (``config.json``, ``model.safetensors``
    with ``d2t`` = target id - draft id and ``t2d`` = which target ids have a draft id)."""
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {n: p.detach().to(dtype).cpu().contiguous()
               for n, p in hf_named_tensors(head).items()}
    ids = head.draft_to_target.cpu()
    tensors["d2t"] = (ids - torch.arange(ids.numel())).to(torch.int64)
    t2d = torch.zeros(head.vocab_size, dtype=torch.bool)
    t2d[ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps({**cfg, "torch_dtype": str(dtype).split(".")[-1]},
                                                indent=2) + "\n")


def read_target_tensors(model: str | Path, names: tuple[str, ...]) -> dict[str, Tensor]:
    """The target checkpoint's tensors whose names end with one of ``names`` (the shortest
    such name each: ``model.norm.weight`` over nested copies), read alone from its files."""
    from safetensors import safe_open

    from specengine.model.loader import checkpoint_files

    found: dict[str, tuple[str, Tensor]] = {}
    for file in checkpoint_files(Path(model)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for key in f.keys():
                for want in names:
                    if key == want or key.endswith("." + want):
                        if "mtp" in key or "layers." in key:
                            continue
                        if want not in found or len(key) < len(found[want][0]):
                            found[want] = (key, f.get_tensor(key))
    return {want: t for want, (_, t) in found.items()}


@torch.no_grad()
def init_from_target(head: Eagle3Head, model: str | Path, embed: nn.Embedding) -> list[str]:
    """Start a fresh head's output side from the target's (as the speculators library does):
    ``lm_head`` rows of the draft vocabulary from the target's ``lm_head`` (its input
    embeddings when they are tied) and ``norm`` from the target's final norm, so the head's
    logits start in the target's own output space and training only has to learn what to
    put there. Returns the names initialised (a target without a final norm keeps the
    head's)."""
    got = read_target_tensors(model, ("lm_head.weight", "norm.weight"))
    lm = got.get("lm_head.weight")
    if lm is None:
        lm = embed.weight  # tied embeddings
    if lm.shape[1] != head.lm_head.weight.shape[1]:
        raise CheckpointError(f"{model}: lm_head width {lm.shape[1]} differs from the head's "
                              f"{head.lm_head.weight.shape[1]}")
    ids = head.draft_to_target.to(lm.device)
    head.lm_head.weight.copy_(lm[ids].to(head.lm_head.weight))
    done = ["lm_head.weight"]
    norm = got.get("norm.weight")
    if norm is not None and norm.shape == head.norm.weight.shape:
        head.norm.weight.copy_(norm.to(head.norm.weight))
        done.append("norm.weight")
    return done
