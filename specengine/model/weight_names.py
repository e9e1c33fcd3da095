"""Parameters under their Hugging Face checkpoint names: the one naming every weight path
(checkpoint load, ``load_weights``, weight sync, tensor-parallel shards) goes through."""

from __future__ import annotations

from torch import Tensor, nn


def hf_named_tensors(module: nn.Module, remove_duplicate: bool = True) -> dict[str, Tensor]:
    """Every parameter of ``module`` under its Hugging Face checkpoint name, in module order.

    A merged projection (``qkv_proj``, ``gate_up_proj``) appears as its HF parts
    (``q_proj.weight`` ...), and a layer's merged experts (``model.moe.FusedExperts``) as
    ``experts.{e}.gate_proj.weight`` ...: any module with ``hf_tensors()`` is listed by it,
    slices sharing its storage, so copying into them writes the merged parameter in place.
    Every path that updates weights by name (checkpoint load, ``load_weights``, weight sync)
    goes through this. With ``remove_duplicate`` a tied
    parameter is listed once, under its first name (as ``named_parameters()``).
    """
    out: dict[str, Tensor] = {}
    seen: set[int] = set()
    for mod_name, mod in module.named_modules(remove_duplicate=False):
        prefix = f"{mod_name}." if mod_name else ""
        hf_tensors = getattr(mod, "hf_tensors", None)
        if hf_tensors is not None:  # merged weights (MergedLinear, FusedExperts): HF parts
            parent = prefix[: prefix.rstrip(".").rfind(".") + 1]
            out.update((parent + n, t) for n, t in hf_tensors().items())
            continue
        for name, p in mod.named_parameters(prefix=mod_name, recurse=False):
            if remove_duplicate and id(p) in seen:
                continue
            seen.add(id(p))
            out[name] = p
    return out


def full_shape(module: nn.Module, name: str, param: Tensor) -> tuple[int, ...]:
    """The shape an update of ``name`` carries: the parameter's, or for a tensor-parallel
    shard (``module.tp_shards``, ``distributed.tp_layers``) the whole tensor's."""
    spec = getattr(module, "tp_shards", {}).get(name)
    return tuple(param.shape) if spec is None else spec.full_shape(tuple(param.shape))


__all__ = ["full_shape", "hf_named_tensors"]
