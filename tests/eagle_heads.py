"""EAGLE-3 heads for the tests, written in the published layout: random ones (optionally
spoilt on purpose) and one fitted to a target by construction."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import torch
from lossless import DenseCausal
from safetensors.torch import save_file
from torch import nn

from specengine.drafters.eagle3 import Eagle3Head
from specengine.model.config import ModelConfig
from specengine.model.weight_names import hf_named_tensors

DROPPED = (0, 7, 100)  # target ids without a draft id
Edit = Callable[[dict, dict], None]


def head_tensors(target: Path, *, seed: int = 0, aux_ids: tuple[int, ...] = (0, 1, 0),
                 dropped: tuple[int, ...] = DROPPED) -> tuple[dict, dict[str, torch.Tensor]]:
    """Config and random weights of an EAGLE-3 head for ``target``, in the published layout.
    ``aux_ids`` (0, 1, 0) on a 2-layer target reads the inputs of layers 1, 2 (the last
    output, pre-norm) and 1 again: unsorted and repeated, as a config may say."""
    tcfg = json.loads((target / "config.json").read_text())
    vocab, h = tcfg["vocab_size"], tcfg["hidden_size"]
    cfg = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
           "hidden_size": h, "intermediate_size": 2 * h, "num_attention_heads": 4,
           "num_key_value_heads": 2, "head_dim": 16, "num_hidden_layers": 1,
           "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "max_position_embeddings": 512,
           "vocab_size": vocab, "draft_vocab_size": vocab - len(dropped),
           "eagle_config": {"eagle_aux_hidden_state_layer_ids": list(aux_ids)}}
    torch.manual_seed(seed)
    head = Eagle3Head(head_model_config(cfg), cfg["draft_vocab_size"], nn.Embedding(vocab, h))
    tensors = {}
    for name, p in hf_named_tensors(head).items():  # checkpoint (HF) names
        noise = torch.randn(p.shape)
        tensors[name] = 1 + 0.1 * noise if name.endswith("norm.weight") else 0.08 * noise
    kept = torch.tensor([t for t in range(vocab) if t not in dropped])
    tensors["d2t"] = kept - torch.arange(kept.numel())
    tensors["t2d"] = torch.ones(vocab, dtype=torch.bool)
    tensors["t2d"][list(dropped)] = False
    return cfg, tensors


def head_model_config(cfg: dict) -> ModelConfig:
    return ModelConfig.from_dict({**cfg, "architectures": ["LlamaForCausalLM"]})


def save_head(path: Path, cfg: dict, tensors: dict[str, torch.Tensor],
              fmt: str = "safetensors") -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    if fmt == "bin":
        torch.save(tensors, path / "pytorch_model.bin")
    else:
        save_file(tensors, str(path / "model.safetensors"))
    return path


def write_head(path: Path, target: Path, *, fmt: str = "safetensors", edit: Edit | None = None,
               **kwargs: object) -> Path:
    """A random head (see :func:`head_tensors`); ``edit(cfg, tensors)`` spoils it on
    purpose."""
    cfg, tensors = head_tensors(target, **kwargs)  # type: ignore[arg-type]
    if edit is not None:
        edit(cfg, tensors)
    return save_head(path, cfg, tensors, fmt)


def fit_head(hf: nn.Module, target: Path, path: Path, contexts: list[list[int]],
             dropped: tuple[int, ...] = (), seed: int = 0) -> Path:
    """A head close to the target by construction: random layer reading the output of target
    layer 0 (three times), then the LM head is the least-squares fit of the target's logits
    after each context prefix from the head's normed output (its first draft step)."""
    cfg, tensors = head_tensors(target, seed=seed, aux_ids=(0, 0, 0), dropped=dropped)
    head = Eagle3Head(head_model_config(cfg), cfg["draft_vocab_size"], hf.model.embed_tokens)
    head.load_state_dict({k: v for k, v in tensors.items() if k not in ("d2t", "t2d")})
    kept = torch.arange(cfg["draft_vocab_size"]) + tensors["d2t"]
    xs, ys = [], []
    with torch.no_grad():
        for ctx in (c for c in contexts if len(c) > 1):
            out = hf(torch.tensor([ctx]), output_hidden_states=True)
            feats = out.hidden_states[1][0, :-1].repeat(1, 3)
            g = head(torch.tensor(ctx[1:]), feats, torch.arange(len(ctx) - 1),
                     torch.zeros(2, 1, 1), None, DenseCausal())[0]
            xs.append(head.norm(g))
            ys.append(out.logits[0, 1:, kept])  # entry i predicts the token after ctx[:i+2]
        x, y = torch.cat(xs), torch.cat(ys)
        fit = torch.linalg.lstsq(x, y - y.mean(1, keepdim=True)).solution
        tensors["lm_head.weight"] = fit.T.contiguous()
    return save_head(path, cfg, tensors)
