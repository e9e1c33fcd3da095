"""Sparse mixture-of-experts MLP blocks (Qwen3-MoE, Qwen2-MoE, Mixtral).

The experts of a layer are two merged parameters, ``w13 [E, 2I, H]`` (per expert the gate rows
then the up rows) and ``w2 [E, H, I]``, which the fused kernel (``kernels/fused_moe.py``) reads
as one grouped GEMM each. They are still addressed by their Hugging Face names
(``experts.{e}.gate_proj.weight`` ..., Mixtral's ``experts.{e}.w1/w3/w2.weight``) through
:meth:`FusedExperts.hf_tensors`: views of the merged storage, so ``load_weights``, weight sync
and ``state_dict`` work per expert while every ``data_ptr`` stays fixed (captured CUDA graphs
keep reading the updated weights).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specengine.kernels import reference

if TYPE_CHECKING:
    from specengine.distributed.tp_group import TPGroup
    from specengine.model.attention import AttentionBackend

# HF expert part names: (gate, up, down)
QWEN_EXPERT_NAMES = ("gate_proj", "up_proj", "down_proj")
MIXTRAL_EXPERT_NAMES = ("w1", "w3", "w2")


class FusedExperts(nn.Module):
    """``E`` SwiGLU experts as ``w13 [E, 2I, H]`` and ``w2 [E, H, I]``."""

    def __init__(self, num_experts: int, hidden_size: int, intermediate_size: int,
                 names: tuple[str, str, str] = QWEN_EXPERT_NAMES) -> None:
        super().__init__()
        if num_experts <= 0 or hidden_size <= 0 or intermediate_size <= 0:
            raise ValueError(f"FusedExperts needs positive sizes, got E={num_experts}, "
                             f"H={hidden_size}, I={intermediate_size}")
        self.num_experts = num_experts
        self.intermediate_size = intermediate_size
        self.names = names
        self.w13 = nn.Parameter(torch.empty(num_experts, 2 * intermediate_size, hidden_size))
        self.w2 = nn.Parameter(torch.empty(num_experts, hidden_size, intermediate_size))
        # transformers' initialisation, so an unloaded model is a plausible random one.
        nn.init.normal_(self.w13, std=0.02)
        nn.init.normal_(self.w2, std=0.02)
        self.register_state_dict_post_hook(_state_dict_hf_names)

    def hf_tensors(self) -> dict[str, Tensor]:
        """``{"experts.0.gate_proj.weight": w13[0, :I], ...}`` (names relative to the parent
        block, as :meth:`MergedLinear.hf_tensors`): views sharing this module's storage."""
        gate, up, down = self.names
        i = self.intermediate_size
        w13, w2 = self.w13.detach(), self.w2.detach()
        out: dict[str, Tensor] = {}
        for e in range(self.num_experts):  # per expert, in the checkpoint's part order
            out[f"experts.{e}.{gate}.weight"] = w13[e, :i]
            out[f"experts.{e}.{up}.weight"] = w13[e, i:]
            out[f"experts.{e}.{down}.weight"] = w2[e]
        return out

    def merge_hf_entries(self, state_dict: dict[str, Any], parent_prefix: str,
                         attr: str) -> None:
        """Replace the experts' HF entries of a state dict by ``w13`` / ``w2`` (when all are
        there; otherwise ``load_state_dict`` reports the merged names missing)."""
        gate, up, down = self.names
        keys = {part: [f"{parent_prefix}experts.{e}.{part}.weight"
                       for e in range(self.num_experts)] for part in self.names}
        if not all(k in state_dict for ks in keys.values() for k in ks):
            return
        g = [state_dict.pop(k) for k in keys[gate]]
        u = [state_dict.pop(k) for k in keys[up]]
        d = [state_dict.pop(k) for k in keys[down]]
        state_dict[f"{parent_prefix}{attr}.w13"] = torch.stack(
            [torch.cat([a, b]) for a, b in zip(g, u)])
        state_dict[f"{parent_prefix}{attr}.w2"] = torch.stack(d)


def _state_dict_hf_names(module: FusedExperts, state_dict: dict[str, Any], prefix: str,
                         local_metadata: Any) -> None:
    """``state_dict()`` lists the experts under their HF names (checkpoint keys)."""
    parent = prefix[: prefix.rstrip(".").rfind(".") + 1]
    state_dict.pop(prefix + "w13", None)
    state_dict.pop(prefix + "w2", None)
    for name, t in module.hf_tensors().items():
        state_dict[parent + name] = t


def _load_hf_names(module: nn.Module, state_dict: dict[str, Any], prefix: str,
                   *args: Any) -> None:
    for attr, child in module.named_children():
        if isinstance(child, FusedExperts):
            child.merge_hf_entries(state_dict, prefix, attr)


class SparseMoeBlock(nn.Module):
    """Router ``gate`` (``[E, H]``, no bias), the routed experts and, for Qwen2-MoE, a shared
    expert (any module called as ``shared_expert(x, backend)``) scaled by
    ``sigmoid(shared_expert_gate(x))`` and added to the routed sum.

    With ``tp`` every rank keeps every expert but ``intermediate_size`` (already this rank's
    slice) of its inner dimension, as a dense MLP is split: the router is replicated, so
    every rank routes alike, and the ranks' partial expert sums are added by one all-reduce
    (SiLU·mul stays local: each rank holds the gate and up rows of the same slice)."""

    def __init__(self, hidden_size: int, num_experts: int, top_k: int, intermediate_size: int,
                 renormalize: bool, expert_names: tuple[str, str, str] = QWEN_EXPERT_NAMES,
                 shared_expert: nn.Module | None = None, tp: TPGroup | None = None) -> None:
        super().__init__()
        self.tp = tp
        if not 1 <= top_k <= num_experts:
            raise ValueError(f"top_k must be in [1, {num_experts}], got {top_k}")
        self.top_k = top_k
        self.renormalize = renormalize
        self.gate = nn.Linear(hidden_size, num_experts, bias=False)
        self.experts = FusedExperts(num_experts, hidden_size, intermediate_size, expert_names)
        self.shared_expert = shared_expert
        self.shared_expert_gate = (nn.Linear(hidden_size, 1, bias=False)
                                   if shared_expert is not None else None)
        self.register_load_state_dict_pre_hook(_load_hf_names)
        #: expert-load counters (``model.expert_load``), set by the engine; None: not counted
        self.expert_load: Any = None

    def forward(self, x: Tensor, backend: AttentionBackend | None = None) -> Tensor:
        """``x [T, H]`` → ``[T, H]``. Every shape is fixed by ``T``: no host sync, so a decode
        or verify pass stays CUDA-graph capturable."""
        router_logits = F.linear(x, self.gate.weight)  # [T, E], activation dtype as HF
        if self.expert_load is not None:
            self.expert_load.count(router_logits, self.top_k)
        w13, w2 = self.experts.w13, self.experts.w2
        if backend is None:
            out = reference.moe_forward(x, router_logits, w13, w2, self.top_k, self.renormalize)
        else:
            out = backend.fused_moe(x, router_logits, w13, w2, self.top_k, self.renormalize)
        if self.tp is not None:
            self.tp.all_reduce(out)
        if self.shared_expert is not None and self.shared_expert_gate is not None:
            shared = self.shared_expert(x, backend)
            out = out + torch.sigmoid(F.linear(x, self.shared_expert_gate.weight)) * shared
        return out
