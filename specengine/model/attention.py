"""Per-step attention metadata and the attention backends the decoder layers call."""

from __future__ import annotations

import dataclasses
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING

from torch import Tensor

if TYPE_CHECKING:
    from specengine.model.torch_attention import TorchPassPlan


@dataclass(frozen=True)
class AttentionMetadata:
    """What every attention layer of one forward pass needs; built once per step.

    The ``T`` new tokens of the step are ragged over ``B`` sequences: sequence ``b`` owns tokens
    ``qo_indptr[b]:qo_indptr[b+1]`` and has ``context_lens[b]`` tokens cached before them.
    """

    slot_mapping: Tensor  # [T] int64: cache slot of every new token
    block_tables: Tensor  # [B, max_blocks] int32
    context_lens: Tensor  # [B] int32
    qo_indptr: Tensor  # [B+1] int32
    max_q_len: int
    tree_mask: Tensor | None = None  # [T, num_words] int32 packed bits; None = causal
    # What the backend's layers share within one pass (``AttentionBackend.plan``, attached by
    # :func:`with_pass_plan` before the first layer); None: each layer reads the fields above.
    plan: TorchPassPlan | None = None

    def __post_init__(self) -> None:
        num_seqs = self.context_lens.shape[0]
        if self.block_tables.shape[0] != num_seqs or self.qo_indptr.shape[0] != num_seqs + 1:
            raise ValueError(
                f"metadata: block_tables {tuple(self.block_tables.shape)}, context_lens "
                f"{tuple(self.context_lens.shape)} and qo_indptr {tuple(self.qo_indptr.shape)} "
                "disagree on the number of sequences"
            )


class AttentionBackend(ABC):
    """Writes a step's new K/V into the paged cache and attends over it.

    Contract (docs/design.md §6): ``write_kv`` scatters ``k``/``v`` ``[T, Hkv, D]`` to the slots of
    ``meta.slot_mapping``; ``attend`` then returns ``o [T, Hq, D]`` where query ``i`` of a
    sequence sees its whole cached context plus the new tokens its mask row allows. Both run
    without a host sync on CUDA so a step can be captured in a CUDA graph.
    """

    @abstractmethod
    def write_kv(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 meta: AttentionMetadata) -> None: ...

    @abstractmethod
    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
               scale: float) -> Tensor: ...

    def plan(self, meta: AttentionMetadata, kv_cache: Tensor, cos: Tensor | None = None,
             sin: Tensor | None = None) -> TorchPassPlan | None:
        """Per-pass data every layer of a forward pass over ``meta`` shares (``kv_cache`` the
        pass's ``[2, L, num_blocks, block_size, Hkv, D]`` cache, ``cos`` / ``sin`` its rope
        tables), built once before the first layer; None (the kernels': they read the
        metadata on the device, one launch each)."""
        return None

    # The fused layer ops below default to the plain-PyTorch references (the ``torch``
    # backend, and test / training backends that only define write_kv and attend);
    # KernelAttentionBackend runs them as Triton kernels, one launch each.

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float,
                 out: Tensor | None = None) -> Tensor:
        """RMSNorm of ``x [N, H]``; written into ``out`` (e.g. half of a wider buffer) when
        given."""
        from specengine.kernels import reference

        y = reference.rms_norm(x, weight, eps)
        return y if out is None else out.copy_(y)

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
        """``(rms_norm(x + residual), x + residual)``, both new tensors."""
        from specengine.kernels import reference

        return reference.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, x: Tensor) -> Tensor:
        """``silu(gate) * up`` of a merged gate-up output ``[N, 2I]``."""
        from specengine.kernels import reference

        return reference.silu_mul(x)

    def fused_moe(self, x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor,
                  top_k: int, renormalize: bool) -> Tensor:
        """A sparse MoE block after its router matmul: softmax top-k routing of
        ``router_logits [T, E]`` and the weighted sum of the chosen experts' SwiGLU MLPs
        (``w13 [E, 2I, H]``, ``w2 [E, H, I]``) of ``x [T, H]`` (``reference_moe``)."""
        from specengine.kernels import reference

        return reference.moe_forward(x, router_logits, w13, w2, top_k, renormalize)

    def rope_and_write_kv(self, qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                          v_cache: Tensor, meta: AttentionMetadata, num_heads: int,
                          num_kv_heads: int, q_norm_weight: Tensor | None = None,
                          k_norm_weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
        """From a merged QKV output ``[T, (Hq+2Hkv)·D]``: q/k per-head norm (Qwen3, when
        given), rope with ``cos`` / ``sin`` ``[T, D/2]``, k and v written by ``write_kv``;
        returns q ``[T, Hq, D]``."""
        from specengine.kernels import reference

        q, k, v = reference.split_qkv_rope(qkv, cos, sin, num_heads, num_kv_heads,
                                           q_norm_weight, k_norm_weight, eps)
        self.write_kv(k, v, k_cache, v_cache, meta)
        return q


class TorchAttentionBackend(AttentionBackend):
    """Plain PyTorch (the CPU default): a batched, padded form of the reference attention and
    the reference layer ops in fewer operators, over a plan built once per pass
    (``torch_attention.py``, ``torch_layer.py``; each equal to its reference)."""

    def plan(self, meta: AttentionMetadata, kv_cache: Tensor, cos: Tensor | None = None,
             sin: Tensor | None = None) -> TorchPassPlan | None:
        from specengine.model.torch_attention import build_pass_plan

        return build_pass_plan(meta.block_tables, meta.context_lens, meta.qo_indptr,
                               meta.tree_mask, meta.slot_mapping, meta.max_q_len,
                               kv_cache.shape[3], cos, sin)

    def write_kv(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 meta: AttentionMetadata) -> None:
        if meta.plan is not None:
            from specengine.model.torch_attention import plan_write_kv

            plan_write_kv(k, v, k_cache, v_cache, meta.plan)
            return
        from specengine.kernels import reference

        reference.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
               scale: float) -> Tensor:
        from specengine.model import torch_attention

        if meta.plan is not None:
            return torch_attention.plan_attention(q, k_cache, v_cache, meta.plan, scale)
        return torch_attention.padded_paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.qo_indptr,
            meta.tree_mask, scale, meta.max_q_len,
        )

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float,
                 out: Tensor | None = None) -> Tensor:
        from specengine.model.torch_layer import rms_norm

        y = rms_norm(x, weight, eps)
        return y if out is None else out.copy_(y)

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
        from specengine.model.torch_layer import rms_norm

        residual = x + residual
        return rms_norm(residual, weight, eps), residual

    def rope_and_write_kv(self, qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                          v_cache: Tensor, meta: AttentionMetadata, num_heads: int,
                          num_kv_heads: int, q_norm_weight: Tensor | None = None,
                          k_norm_weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
        if meta.plan is None or meta.plan.cos is None:
            return super().rope_and_write_kv(qkv, cos, sin, k_cache, v_cache, meta, num_heads,
                                             num_kv_heads, q_norm_weight, k_norm_weight, eps)
        from specengine.model.torch_layer import rope_and_write_kv

        return rope_and_write_kv(qkv, meta.plan, k_cache, v_cache, num_heads, num_kv_heads,
                                 q_norm_weight, k_norm_weight, eps)


class KernelAttentionBackend(AttentionBackend):
    """The hand-written kernels: ``_C`` KV writes and the Triton paged attention."""

    def write_kv(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 meta: AttentionMetadata) -> None:
        from specengine.kernels import kv_cache

        kv_cache.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
               scale: float) -> Tensor:
        from specengine.kernels import attention

        return attention.paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.qo_indptr,
            meta.tree_mask, scale, max_q_len=meta.max_q_len,
        )

    def rms_norm(self, x: Tensor, weight: Tensor, eps: float,
                 out: Tensor | None = None) -> Tensor:
        from specengine.kernels import rms_norm

        return rms_norm.rms_norm(x, weight, eps, out)

    def add_rms_norm(self, x: Tensor, residual: Tensor, weight: Tensor,
                     eps: float) -> tuple[Tensor, Tensor]:
        from specengine.kernels import rms_norm

        return rms_norm.add_rms_norm(x, residual, weight, eps)

    def silu_mul(self, x: Tensor) -> Tensor:
        from specengine.kernels import activation

        return activation.silu_mul(x)

    def fused_moe(self, x: Tensor, router_logits: Tensor, w13: Tensor, w2: Tensor,
                  top_k: int, renormalize: bool) -> Tensor:
        from specengine.kernels import fused_moe

        return fused_moe.moe_forward(x, router_logits, w13, w2, top_k, renormalize)

    def rope_and_write_kv(self, qkv: Tensor, cos: Tensor, sin: Tensor, k_cache: Tensor,
                          v_cache: Tensor, meta: AttentionMetadata, num_heads: int,
                          num_kv_heads: int, q_norm_weight: Tensor | None = None,
                          k_norm_weight: Tensor | None = None, eps: float = 1e-6) -> Tensor:
        from specengine.kernels import rope_kv

        return rope_kv.rope_and_cache(qkv, cos, sin, k_cache, v_cache, meta.slot_mapping,
                                      num_heads, num_kv_heads, q_norm_weight, k_norm_weight,
                                      eps)


def with_pass_plan(meta: AttentionMetadata, backend: AttentionBackend, kv_cache: Tensor,
                   cos: Tensor | None = None, sin: Tensor | None = None) -> AttentionMetadata:
    """``meta`` carrying ``backend``'s per-pass plan (``AttentionBackend.plan``), if it has one:
    called once per forward pass, before the first layer. (A plan is data of this pass only,
    passed down explicitly: nothing is kept between passes.)"""
    plan = backend.plan(meta, kv_cache, cos, sin)
    return meta if plan is None else dataclasses.replace(meta, plan=plan)


def make_attention_backend(kernel_backend: str) -> AttentionBackend:
    """``torch`` → references; ``triton`` / ``cuda`` → the kernels."""
    if kernel_backend == "torch":
        return TorchAttentionBackend()
    if kernel_backend in ("triton", "cuda"):
        return KernelAttentionBackend()
    raise ValueError(f"kernel_backend must be torch, triton or cuda, got {kernel_backend!r}")
