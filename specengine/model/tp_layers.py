"""Megatron-style tensor-parallel layers and the map from full HF tensors to each rank's shard.

A rank of ``N`` owns (docs/design.md §19): its ``num_heads / N`` query heads and their K/V
heads (``num_kv_heads / N``, or one replicated head when there are fewer KV heads than ranks)
in the merged QKV projection, its ``1/N`` of the gate and up rows (column-parallel: no
communication), the matching input columns of ``o_proj`` and ``down_proj`` (row-parallel: the
partial products are summed by an all-reduce, the bias added once after it), and ``ceil(V /
N)`` rows of the embedding and LM head (vocab-parallel; padding rows are zero and cut from the
logits). Norms and rope are replicated. Modules that rank 0 may call on their own (the
embedding and LM head, which the EAGLE-3 and MTP drafters share) enter lockstep themselves:
:meth:`TPGroup.entry` tells the other ranks to run the same call.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import Tensor, nn

if TYPE_CHECKING:
    from specengine.distributed.tp_group import TPGroup
    from specengine.model.config import ModelConfig


def check_tensor_parallel(cfg: ModelConfig, n: int) -> None:
    """Raise ``ValueError`` saying what does not divide when ``cfg`` cannot be split over ``n``
    ranks."""
    if n == 1:
        return
    # MoE: every rank keeps every expert, a slice of its inner dimension (as a dense MLP).
    for what, size in (("moe_intermediate_size", cfg.moe_intermediate_size if cfg.is_moe
                        else 0),
                       ("shared_expert_intermediate_size", cfg.shared_expert_intermediate_size)):
        if size % n:
            raise ValueError(f"tensor_parallel_size {n} must divide {what} ({size}): each "
                             "rank owns a slice of every expert's gate/up")
    if cfg.num_heads % n:
        raise ValueError(f"tensor_parallel_size {n} must divide the number of attention heads "
                         f"({cfg.num_heads}): each rank owns num_heads / tensor_parallel_size "
                         "query heads")
    kv = cfg.num_kv_heads
    if kv % n and n % kv:
        raise ValueError(f"tensor_parallel_size {n} and the number of KV heads ({kv}) must "
                         "divide one another: each rank owns num_kv_heads / N KV heads, or "
                         "one replicated head when there are fewer KV heads than ranks")
    if cfg.intermediate_size % n:
        raise ValueError(f"tensor_parallel_size {n} must divide intermediate_size "
                         f"({cfg.intermediate_size}): each rank owns a slice of gate/up")
    if cfg.vocab_size < n:
        raise ValueError(f"tensor_parallel_size {n} exceeds the vocabulary ({cfg.vocab_size}): "
                         "every rank owns ceil(vocab / N) rows of the embedding")


@dataclass(frozen=True)
class ShardSpec:
    """A rank's slice of a full tensor: ``full.narrow(dim, start, size)`` (cut at ``full_size``
    for the padded last vocab shard; the rest of the parameter stays zero)."""

    dim: int
    start: int
    size: int
    full_size: int

    def __post_init__(self) -> None:
        if self.dim not in (0, 1) or self.start < 0 or self.size < 1 or self.full_size < 1:
            raise ValueError(f"bad shard spec {self}")

    @property
    def valid(self) -> int:
        return max(0, min(self.size, self.full_size - self.start))

    def full_shape(self, shape: tuple[int, ...]) -> tuple[int, ...]:
        out = list(shape)
        out[self.dim] = self.full_size
        return tuple(out)

    def copy_into(self, param: Tensor, full: Tensor) -> None:
        """Write this rank's part of ``full`` into ``param`` in place."""
        n = self.valid
        if n:
            param.narrow(self.dim, 0, n).copy_(
                full.narrow(self.dim, self.start, n).to(param.device))


def shard_specs(names: list[str], cfg: ModelConfig, rank: int, n: int) -> dict[str, ShardSpec]:
    """The shard of every HF-named tensor of a decoder LM that is split (the rest are whole)."""
    d, kv = cfg.head_dim, cfg.num_kv_heads
    q_l, kv_l, i_l = cfg.num_heads // n, max(1, kv // n), cfg.intermediate_size // n
    v_l = math.ceil(cfg.vocab_size / n)
    kv0 = rank * kv // n  # the first KV head (the replicated one when kv < n)
    rows = {
        "q_proj": ShardSpec(0, rank * q_l * d, q_l * d, cfg.num_heads * d),
        "k_proj": ShardSpec(0, kv0 * d, kv_l * d, kv * d),
        "v_proj": ShardSpec(0, kv0 * d, kv_l * d, kv * d),
        "gate_proj": ShardSpec(0, rank * i_l, i_l, cfg.intermediate_size),
        "up_proj": ShardSpec(0, rank * i_l, i_l, cfg.intermediate_size),
    }
    cols = {
        "o_proj": ShardSpec(1, rank * q_l * d, q_l * d, cfg.num_heads * d),
        "down_proj": ShardSpec(1, rank * i_l, i_l, cfg.intermediate_size),
    }
    vocab = ShardSpec(0, rank * v_l, v_l, cfg.vocab_size)
    # MoE experts (Qwen names, and Mixtral's w1 / w3 / w2) and Qwen2-MoE's shared expert: the
    # same split of their own inner dimension.
    inner = {".experts.": cfg.moe_intermediate_size,
             ".shared_expert.": cfg.shared_expert_intermediate_size}
    out: dict[str, ShardSpec] = {}
    for name in names:
        parts = name.split(".")
        proj, kind = parts[-2] if len(parts) > 1 else "", parts[-1]
        size = next((v for k, v in inner.items() if k in name), 0)
        if size:
            i_e = size // n
            if proj in ("gate_proj", "up_proj", "w1", "w3"):
                out[name] = ShardSpec(0, rank * i_e, i_e, size)
            elif proj in ("down_proj", "w2") and kind == "weight":
                out[name] = ShardSpec(1, rank * i_e, i_e, size)
        elif proj in rows:
            out[name] = rows[proj]
        elif proj in cols and kind == "weight":  # the bias is added once, after the reduce
            out[name] = cols[proj]
        elif name in ("model.embed_tokens.weight", "lm_head.weight"):
            out[name] = vocab
    return out


class RowParallelLinear(nn.Module):
    """``y = all_reduce(x_local @ W_local^T) + b``: the input is split by columns (each rank's
    heads or gate/up slice), the bias replicated and added once."""

    def __init__(self, in_local: int, out_features: int, bias: bool, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        ref = nn.Linear(in_local, out_features, bias=bias)  # its initialisation, then shared
        self.weight = ref.weight
        self.bias = ref.bias

    def forward(self, x: Tensor) -> Tensor:
        y = F.linear(x, self.weight)
        self.tp.all_reduce(y)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Rows ``[rank * V_l, (rank + 1) * V_l)`` of the embedding; a lookup zeroes ids owned by
    other ranks and sums over ranks (exact: one non-zero term per row)."""

    def __init__(self, num_embeddings: int, dim: int, tp: TPGroup) -> None:
        super().__init__()
        self.tp = tp
        self.num_embeddings = num_embeddings  # the full vocabulary, as nn.Embedding's
        self.rows = math.ceil(num_embeddings / tp.world_size)
        self.start = tp.rank * self.rows
        self.weight = nn.Parameter(torch.zeros(self.rows, dim))

    def forward(self, ids: Tensor) -> Tensor:
        with self.tp.entry("embed", ids):
            local = ids - self.start
            outside = (local < 0) | (local >= self.rows)
            out = F.embedding(local.masked_fill(outside, 0), self.weight)
            out.masked_fill_(outside.unsqueeze(-1), 0.0)
            self.tp.all_reduce(out)
            return out


class ParallelLMHead(nn.Module):
    """Rows of the LM head (the embedding's own when tied); every rank's logits are gathered
    and the padding cut, so each rank returns ``[N, V]``."""

    def __init__(self, dim: int, vocab_size: int, tp: TPGroup,
                 tied: VocabParallelEmbedding | None = None) -> None:
        super().__init__()
        self.tp = tp
        self.vocab_size = vocab_size
        rows = math.ceil(vocab_size / tp.world_size)
        self.weight = tied.weight if tied is not None else nn.Parameter(torch.zeros(rows, dim))

    def forward(self, hidden: Tensor) -> Tensor:
        with self.tp.entry("lm_head", hidden):
            local = F.linear(hidden, self.weight)
            return self.tp.all_gather_last(local)[..., : self.vocab_size]


def row_linear(in_features: int, out_features: int, bias: bool, tp: TPGroup | None
               ) -> nn.Module:
    """``nn.Linear``, or its row-parallel shard (``in_features`` this rank's) under ``tp``."""
    if tp is None:
        return nn.Linear(in_features, out_features, bias=bias)
    return RowParallelLinear(in_features, out_features, bias, tp)


def embedding(vocab_size: int, dim: int, tp: TPGroup | None) -> nn.Module:
    """``nn.Embedding``, or this rank's vocab-parallel rows under ``tp``."""
    return nn.Embedding(vocab_size, dim) if tp is None else \
        VocabParallelEmbedding(vocab_size, dim, tp)


def lm_head(dim: int, vocab_size: int, tp: TPGroup | None, tied: nn.Module | None
            ) -> nn.Module:
    """The LM head (sharing ``tied``'s weight when given), vocab-parallel under ``tp``."""
    if tp is not None:
        return ParallelLMHead(dim, vocab_size, tp, tied)  # type: ignore[arg-type]
    head = nn.Linear(dim, vocab_size, bias=False)
    if tied is not None:
        head.weight = tied.weight  # type: ignore[assignment]
    return head


__all__ = ["ParallelLMHead", "RowParallelLinear", "ShardSpec", "VocabParallelEmbedding",
           "check_tensor_parallel", "embedding", "lm_head", "row_linear", "shard_specs"]
