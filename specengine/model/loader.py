"""Reading Hugging Face safetensors checkpoints into existing parameters, in place.

Loading is two-phase so it is all-or-nothing: every name, shape and dtype is checked first
(and the tensors read), then each parameter is filled with ``param.data.copy_`` so storage
addresses never change (captured CUDA graphs stay valid). :func:`check_entries` holds the
rules for every update path (checkpoint, in-process ``load_weights``, the weight-sync
manifest); :func:`build_model` makes a model from a checkpoint dir.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from safetensors import SafetensorError, safe_open
from torch import Tensor, nn

from specengine.model.config import CheckpointError, ModelConfig
from specengine.model.llama import CausalLM
from specengine.model.weight_names import full_shape, hf_named_tensors

if TYPE_CHECKING:
    from specengine.distributed.tp_group import TPGroup

# Checkpoint keys that carry no parameter of ours.
IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint dir: a single file or the shards of an index."""
    root = Path(path)
    if not root.is_dir():
        raise CheckpointError(f"{path}: not a directory")
    index = root / "model.safetensors.index.json"
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
        except (json.JSONDecodeError, KeyError) as e:
            raise CheckpointError(f"{index}: not a valid safetensors index ({e})") from e
        files = sorted({root / name for name in weight_map.values()})
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{path}: shards named in the index are missing: {missing}")
        return files
    single = root / "model.safetensors"
    if single.is_file():
        return [single]
    others = sorted(root.glob("*.safetensors"))
    if others:
        return others
    raise CheckpointError(f"{path}: no model.safetensors, index, or *.safetensors file")


def iter_checkpoint(path: str | Path,
                    skip_prefixes: tuple[str, ...] = ()) -> Iterator[tuple[str, Tensor]]:
    """Yield ``(name, tensor)`` for every tensor in a checkpoint dir (CPU tensors), except
    those whose name starts with one of ``skip_prefixes`` (never read)."""
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    if skip_prefixes and name.startswith(skip_prefixes):
                        continue
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError, RuntimeError) as e:
            raise CheckpointError(f"{file}: cannot read safetensors file ({e})") from e


def copy_param(module: nn.Module, name: str, param: Tensor, src: Tensor) -> None:
    """``param.copy_(src)`` in place, or this rank's slice of ``src`` for a shard."""
    spec = getattr(module, "tp_shards", {}).get(name)
    if spec is None:
        param.copy_(src.to(param.device))
    else:
        spec.copy_into(param, src)


def _check_castable(name: str, src: torch.dtype, dst: torch.dtype) -> str | None:
    if src.is_floating_point != dst.is_floating_point or src.is_complex or src == torch.bool:
        return f"{name}: dtype {src} cannot be cast to the parameter's {dst}"
    return None


def check_entries(
    module: nn.Module,
    entries: Iterable[tuple[str, tuple[int, ...], torch.dtype]],
    *,
    strict: bool,
    tied: dict[str, str] | None = None,
) -> tuple[list[str], list[str]]:
    """The one set of rules for an update of ``module``'s parameters, on metadata only.

    ``entries`` are ``(checkpoint name, shape, dtype)``. Returns ``(accepted, errors)``: the
    names to write (in order) and, per bad entry, what is wrong (unknown name, given twice,
    shape differs, dtype not castable, and with ``strict`` every parameter not given). A name
    in ``tied`` (an alias of another parameter, e.g. a tied ``lm_head.weight``) is accepted
    and not written when its twin is given too, and an error otherwise; one ending in
    :data:`IGNORED_SUFFIXES` is accepted silently and not written.
    """
    tied = tied or {}
    params = hf_named_tensors(module, remove_duplicate=False)
    entries = list(entries)
    given = {name for name, _, _ in entries}
    accepted: list[str] = []
    seen: set[str] = set()
    errors: list[str] = []
    for name, shape, dtype in entries:
        if name in tied and tied[name] not in given:
            # Skipping it would drop the update silently (a learner with untied weights).
            errors.append(f"{name!r} is tied to {tied[name]!r} in this model (one tensor): "
                          f"send {tied[name]!r}")
            continue
        if name.endswith(IGNORED_SUFFIXES) or name in tied:
            # A tied weight is the same storage as its twin: load the twin, skip this copy.
            continue
        if name not in params:
            errors.append(f"unexpected weight {name!r} (no such parameter)")
            continue
        if name in seen:
            errors.append(f"weight {name!r} given twice")
            continue
        seen.add(name)
        param = params[name]
        want = full_shape(module, name, param)
        if tuple(shape) != want:
            errors.append(f"{name}: shape {tuple(shape)} does not match the parameter's "
                          f"{want}")
            continue
        bad_dtype = _check_castable(name, dtype, param.dtype)
        if bad_dtype:
            errors.append(bad_dtype)
            continue
        accepted.append(name)
    if strict:
        errors.extend(f"missing weight {n!r}" for n in params if n not in seen and n not in tied)
    return accepted, errors


def format_errors(errors: list[str]) -> str:
    """``"weights do not match the model: <first five>"`` for an error message."""
    shown = "; ".join(errors[:5])
    more = f" (and {len(errors) - 5} more)" if len(errors) > 5 else ""
    return f"weights do not match the model: {shown}{more}"


def load_named_tensors(
    module: nn.Module,
    named_tensors: Iterable[tuple[str, Tensor]],
    *,
    strict: bool = True,
    tied: dict[str, str] | None = None,
    before_write: Callable[[list[str]], None] | None = None,
) -> list[str]:
    """Copy tensors into ``module``'s parameters by checkpoint name, all or nothing.

    ``tied`` maps a checkpoint name that may be absent (or is redundant) to the parameter it
    shares storage with, e.g. ``{"lm_head.weight": "model.embed_tokens.weight"}``. With
    ``strict`` every parameter must be given (a full load); otherwise a subset may be. Raises
    :class:`CheckpointError` naming the first bad entries (:func:`check_entries`) before
    anything is written. ``before_write`` is called with the names about to be written once
    the check passed (a copy may still fail midway: the caller can mark them torn). Returns
    the names of the parameters written.
    """
    items = list(named_tensors)
    accepted, errors = check_entries(
        module, ((n, tuple(t.shape), t.dtype) for n, t in items), strict=strict, tied=tied)
    if errors:
        raise CheckpointError(format_errors(errors))
    if before_write is not None:
        before_write(accepted)
    params = hf_named_tensors(module, remove_duplicate=False)
    tensors = dict(items)
    with torch.no_grad():
        for name in accepted:
            copy_param(module, name, params[name], tensors[name])
    return accepted


def tied_names(module: nn.Module) -> dict[str, str]:
    """HF names that alias another parameter (e.g. a tied ``lm_head.weight``)."""
    seen: dict[int, str] = {}
    tied: dict[str, str] = {}
    for name, p in hf_named_tensors(module, remove_duplicate=False).items():
        if id(p) in seen:
            tied[name] = seen[id(p)]
        else:
            seen[id(p)] = name
    return tied


def build_model(path: str | Path, dtype: torch.dtype, device: torch.device,
                load_format: str = "auto", tp: TPGroup | None = None) -> CausalLM:
    """A :class:`CausalLM` on ``device`` filled from the checkpoint dir (strict: every weight
    present, none unexpected, shapes equal). ``load_format="dummy"`` reads only config.json
    and fills the weights with seeded random values (vLLM's option, for benchmarks at real
    shapes without the checkpoint). With ``tp``: this rank's shard (each full tensor read,
    its slice kept)."""
    cfg = ModelConfig.from_dir(path)
    prev = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = CausalLM(cfg, tp)
    finally:
        torch.set_default_dtype(prev)
    if load_format == "dummy":
        gen = torch.Generator(device=device).manual_seed(0)
        with torch.no_grad():
            # By HF tensor, so the values are those an unmerged model drew.
            for name, param in hf_named_tensors(model).items():
                full = torch.empty(full_shape(model, name, param), dtype=param.dtype,
                                   device=device)  # a shard: the whole tensor drawn, sliced
                if name.endswith("norm.weight"):
                    full.fill_(1.0)
                else:
                    full.normal_(0.0, 0.02, generator=gen)
                copy_param(model, name, param, full)
    elif load_format == "auto":
        # A checkpoint's MTP layers are the "mtp" drafter's business, not the target's.
        skip = ("mtp.",) if cfg.num_mtp_layers else ()
        load_named_tensors(model, iter_checkpoint(path, skip), strict=True,
                           tied=tied_names(model))
    else:
        raise ValueError(f"load_format must be 'auto' or 'dummy', got {load_format!r}")
    return model.eval().requires_grad_(False)
