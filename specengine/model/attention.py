"""Per-step attention metadata and the attention backends the decoder layers call."""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from torch import Tensor


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

    Contract (DESIGN §6): ``write_kv`` scatters ``k``/``v`` ``[T, Hkv, D]`` into the slots of
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


class TorchAttentionBackend(AttentionBackend):
    """Plain PyTorch (the CPU default): the reference KV write and a batched, padded form of
    the reference attention (``torch_attention.py``)."""

    def write_kv(self, k: Tensor, v: Tensor, k_cache: Tensor, v_cache: Tensor,
                 meta: AttentionMetadata) -> None:
        from specengine.kernels import reference

        reference.reshape_and_cache(k, v, k_cache, v_cache, meta.slot_mapping)

    def attend(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, meta: AttentionMetadata,
               scale: float) -> Tensor:
        from specengine.model.torch_attention import padded_paged_attention

        return padded_paged_attention(
            q, k_cache, v_cache, meta.block_tables, meta.context_lens, meta.qo_indptr,
            meta.tree_mask, scale,
        )


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


def make_attention_backend(kernel_backend: str) -> AttentionBackend:
    """``torch`` → references; ``triton`` / ``cuda`` → the kernels."""
    if kernel_backend == "torch":
        return TorchAttentionBackend()
    if kernel_backend in ("triton", "cuda"):
        return KernelAttentionBackend()
    raise ValueError(f"kernel_backend must be torch, triton or cuda, got {kernel_backend!r}")
