"""Turns scheduled sequences into one ragged forward pass over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specengine import _C
from specengine.core.transfer import to_device
from specengine.kv_cache import KVCache
from specengine.model.attention import AttentionBackend, AttentionMetadata
from specengine.model.llama import CausalLM
from specengine.sequence import Sequence


@dataclass(frozen=True)
class ForwardOutput:
    hidden: Tensor  # [T, H] final-norm hidden states of every fed token
    aux_hidden: list[Tensor]  # inputs of the requested layers, each [T, H]
    qo_indptr: list[int]  # token range of each sequence in the ragged batch


class ModelRunner:
    """Owns a model and its KV cache and runs ragged passes built from host lists: the prefill
    and the drafters' passes. (The decode step's verify pass runs on static buffers instead:
    ``core.verify``.)"""

    def __init__(self, model: CausalLM, kv_cache: KVCache, backend: AttentionBackend,
                 device: torch.device, aux_layers: tuple[int, ...] = ()) -> None:
        self.model = model
        self.kv_cache = kv_cache
        self.backend = backend
        self.device = device
        self.aux_layers = aux_layers

    def _metadata(self, seqs: tuple[Sequence, ...] | list[Sequence], context_lens: list[int],
                  q_lens: list[int], slot_positions: list[np.ndarray],
                  tree_mask: Tensor | None) -> AttentionMetadata:
        block_tables = _C.build_block_tables(
            [np.asarray(s.block_table, dtype=np.int32) for s in seqs],
            max(len(s.block_table) for s in seqs),
        )
        seq_ids = np.repeat(np.arange(len(seqs), dtype=np.int32), q_lens)
        slots = _C.compute_slot_mapping(block_tables, seq_ids, np.concatenate(slot_positions),
                                        self.kv_cache.block_size)
        indptr = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
        dev = self.device
        return AttentionMetadata(
            slot_mapping=to_device(slots, dev),
            block_tables=to_device(block_tables, dev),
            context_lens=to_device(np.asarray(context_lens, dtype=np.int32), dev),
            qo_indptr=to_device(indptr, dev),
            max_q_len=max(q_lens),
            tree_mask=tree_mask,
        )

    @torch.inference_mode()
    def _run(self, input_ids: list[int], positions: np.ndarray,
             meta: AttentionMetadata) -> tuple[Tensor, list[Tensor]]:
        ids = to_device(np.asarray(input_ids, dtype=np.int64), self.device)
        pos = to_device(positions.astype(np.int64), self.device)
        return self.model(ids, pos, self.kv_cache.kv, meta, self.backend, self.aux_layers)

    def prefill(self, seqs: tuple[Sequence, ...]) -> tuple[Tensor, ForwardOutput]:
        """Run every token of each sequence; returns last-token logits ``[B, V]``."""
        q_lens = [len(s) for s in seqs]
        positions = [np.arange(n, dtype=np.int64) for n in q_lens]
        meta = self._metadata(seqs, [0] * len(seqs), q_lens, positions, None)
        hidden, aux = self._run([t for s in seqs for t in s.token_ids], np.concatenate(positions),
                                meta)
        for s in seqs:
            s.num_cached_tokens = len(s)
        ends = np.cumsum(q_lens)
        logits = self.model.compute_logits(hidden[to_device(ends - 1, self.device)])
        return logits, ForwardOutput(hidden, aux, [0, *ends.tolist()])
