"""The target checkpoint's MTP layer for ``specengine train-draft --arch mtp``: checking the
target has one, reading it (from the target, or a warm start's dir), the float32 copy the
trainer updates, and writing the result.

The layer lives inside the target checkpoint (``drafters/mtp.py``: Qwen3-Next layout, config
``mtp_num_hidden_layers: 1`` and ``mtp.*`` weights) and the engine, like vLLM's and SGLang's
MTP speculation, loads it from there (``SpecEngine(model, draft="mtp")``). So the output is a
whole checkpoint dir: every file of the target copied as is, except the safetensors file(s)
holding ``mtp.*`` tensors, rewritten with the trained values under the same names, dtypes and
shards (the index, config and tokenizer unchanged). ``--model OUT --draft mtp`` serves it.
"""

from __future__ import annotations

import logging
import shutil
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import Tensor, nn

from specengine.drafters.mtp import MTP_PREFIX, MTPModule
from specengine.model.config import CheckpointError, ModelConfig
from specengine.model.loader import checkpoint_files, load_named_tensors
from specengine.model.rope import RotaryEmbedding
from specengine.model.weight_names import hf_named_tensors

logger = logging.getLogger(__name__)

# Config keys of other MTP layouts the engine's MTP drafter does not read.
OTHER_MTP_KEYS = ("num_nextn_predict_layers",)


def check_mtp_target(model: Path, cfg: dict[str, Any]) -> None:
    """The target declares exactly one MTP layer and holds its ``mtp.*`` weights."""
    text = cfg.get("text_config") or {}
    n = cfg.get("mtp_num_hidden_layers", text.get("mtp_num_hidden_layers"))
    if not n:
        other = [k for k in OTHER_MTP_KEYS if cfg.get(k, text.get(k))]
        if other:
            raise CheckpointError(
                f"--arch mtp: {model} declares {other[0]} (a DeepSeek-V3 / MiMo-style MTP "
                "layer), a layout the engine's MTP drafter does not read (it reads "
                "mtp_num_hidden_layers: 1 and mtp.* weights, Qwen3-Next style)")
        raise CheckpointError(
            f"--arch mtp: {model} has no MTP layer (its config.json declares no "
            "mtp_num_hidden_layers): train an EAGLE-3 head for it instead (--arch eagle3)")
    if n != 1:
        raise CheckpointError(f"--arch mtp: {model} declares mtp_num_hidden_layers: {n}; the "
                              "engine drafts with exactly one MTP layer")
    if not mtp_names(model):
        raise CheckpointError(f"--arch mtp: {model} declares mtp_num_hidden_layers: 1 but its "
                              "safetensors hold no mtp.* weights")


def mtp_names(path: Path) -> dict[str, Path]:
    """Each ``mtp.*`` tensor name of a checkpoint dir, with the file holding it."""
    out: dict[str, Path] = {}
    for file in checkpoint_files(path):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out.update((n, file) for n in f.keys() if n.startswith(MTP_PREFIX))
    return out


def read_mtp_tensors(path: Path, what: str = "--init") -> dict[str, Tensor]:
    """The ``mtp.*`` tensors of a checkpoint dir (only those are read)."""
    if not Path(path).is_dir():
        raise ValueError(f"{what} {path}: no such directory")
    names = mtp_names(path)
    if not names:
        raise CheckpointError(f"{what} {path}: its safetensors hold no mtp.* weights (give the "
                              "dir of a checkpoint with an MTP layer, e.g. an earlier "
                              "train-draft --arch mtp output)")
    out = {}
    for file in sorted(set(names.values())):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            out.update((n, f.get_tensor(n)) for n in f.keys() if n in names)
    return out


def check_mtp_init(model: Path, tensors: dict[str, Tensor], init: Path) -> None:
    """A warm start's ``mtp.*`` tensors have the target layer's names and shapes (read from
    the file headers, before any work)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in sorted(set(mtp_names(model).values())):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            shapes.update((n, tuple(f.get_slice(n).get_shape())) for n in f.keys()
                          if n.startswith(MTP_PREFIX))
    bad = [f"missing {n}" for n in sorted(set(shapes) - set(tensors))]
    bad += [f"unexpected {n}" for n in sorted(set(tensors) - set(shapes))]
    bad += [f"{n} {tuple(t.shape)} (the target's: {shapes[n]})" for n, t in sorted(
        tensors.items()) if n in shapes and tuple(t.shape) != shapes[n]]
    if bad:
        raise CheckpointError(f"--init {init}: its MTP layer does not fit this target: "
                              f"{', '.join(bad[:4])}" + (" ..." if len(bad) > 4 else ""))


def read_lm_head(model: Path, embed: nn.Embedding, tied: bool) -> nn.Linear:
    """The target's LM head (frozen): ``lm_head.weight``, or the embeddings when tied."""
    weight = None
    if not tied:
        for file in checkpoint_files(model):
            with safe_open(str(file), framework="pt", device="cpu") as f:
                if "lm_head.weight" in f.keys():
                    weight = f.get_tensor("lm_head.weight").float()
                    break
    if weight is None:
        weight = embed.weight.detach()
    head = nn.Linear(weight.shape[1], weight.shape[0], bias=False, device="meta")
    head.weight = nn.Parameter(weight.to(embed.weight.device), requires_grad=False)
    return head


class SharedModules(nn.Module):
    """What an :class:`MTPModule` reads of its target (``model.embed_tokens``,
    ``model.rotary_emb``, ``lm_head``), without the target's layers."""

    def __init__(self, embed: nn.Embedding, lm_head: nn.Linear, rope: RotaryEmbedding) -> None:
        super().__init__()
        self.model = nn.Module()
        self.model.embed_tokens = embed
        self.model.rotary_emb = rope
        self.lm_head = lm_head


def build_mtp(model: Path, embed: nn.Embedding, device: torch.device,
              tensors: dict[str, Tensor]) -> MTPModule:
    """A float32 :class:`MTPModule` of the target ``model`` on ``device`` holding
    ``tensors`` (checkpoint names, all of the layer's)."""
    mc = ModelConfig.from_dir(model)
    lm_head = read_lm_head(model, embed, mc.tie_word_embeddings)
    with torch.device(device):
        rope = RotaryEmbedding(mc.head_dim, mc.rope_theta, mc.rope_scaling)
        module = MTPModule(mc, SharedModules(embed, lm_head, rope), 1).float()
    load_named_tensors(module, ((n, t.float()) for n, t in tensors.items()), strict=True)
    return module


def write_mtp_checkpoint(model: Path, module: MTPModule, out: Path) -> list[Path]:
    """The target ``model`` copied into ``out`` with ``module``'s weights in place of its
    ``mtp.*`` tensors (module docstring). Returns the rewritten files."""
    trained = {n: t.detach().cpu() for n, t in hf_named_tensors(module).items()}
    files = checkpoint_files(model)
    out.mkdir(parents=True, exist_ok=True)
    for f in sorted(model.iterdir()):  # config, tokenizer, index, ...: as they are
        if f.is_file() and f not in files:
            shutil.copy2(f, out / f.name)
    rewritten, written = [], set()
    for file in files:
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = list(f.keys())
            if not any(n in trained for n in names):
                shutil.copy2(file, out / file.name)
                continue
            meta = f.metadata()
            tensors = {}
            for n in names:
                t = f.get_tensor(n)
                if n in trained:
                    t = trained[n].to(t.dtype).contiguous()
                    written.add(n)
                tensors[n] = t
        save_file(tensors, str(out / file.name), metadata=meta)
        rewritten.append(out / file.name)
    missing = sorted(set(trained) - written)
    if missing:  # the module was read from this checkpoint: its names are there
        raise CheckpointError(f"{model}: no tensor named {missing[:3]} to write the trained "
                              "MTP layer into")
    return rewritten
