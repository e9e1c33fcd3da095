"""Turns scheduled sequences into one ragged forward pass over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

from specengine import _C
from specengine.kv_cache import KVCache
from specengine.model.attention import AttentionBackend, AttentionMetadata
from specengine.model.llama import CausalLM
from specengine.sequence import Sequence
from specengine.tree import DraftTree


@dataclass(frozen=True)
class ForwardOutput:
    hidden: Tensor  # [T, H] final-norm hidden states of every fed token
    aux_hidden: list[Tensor]  # inputs of the requested layers, each [T, H]
    qo_indptr: list[int]  # token range of each sequence in the ragged batch


class ModelRunner:
    """Owns a model and its KV cache; ``prefill`` and ``verify`` are the two kinds of pass."""

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
            slot_mapping=torch.from_numpy(slots).to(dev),
            block_tables=torch.from_numpy(block_tables).to(dev),
            context_lens=torch.tensor(context_lens, dtype=torch.int32, device=dev),
            qo_indptr=torch.from_numpy(indptr).to(dev),
            max_q_len=max(q_lens),
            tree_mask=tree_mask,
        )

    @torch.inference_mode()
    def _run(self, input_ids: list[int], positions: np.ndarray,
             meta: AttentionMetadata) -> tuple[Tensor, list[Tensor]]:
        ids = torch.tensor(input_ids, dtype=torch.int64, device=self.device)
        pos = torch.from_numpy(positions.astype(np.int64)).to(self.device)
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
        last = torch.tensor(np.cumsum(q_lens) - 1, device=self.device)
        logits = self.model.compute_logits(hidden[last])
        return logits, ForwardOutput(hidden, aux, meta.qo_indptr.tolist())

    def verify(self, seqs: tuple[Sequence, ...], drafts: list[list[int]],
               tree: DraftTree | None) -> tuple[Tensor, ForwardOutput]:
        """Feed each sequence's newest token followed by its drafts (a chain, or the nodes of
        ``tree``); returns logits ``[B, N, V]`` with row ``j`` = next-token logits after node
        ``j`` (rows past a shorter chain are zero padding)."""
        q_lens = [len(d) + 1 for d in drafts]
        context_lens = [len(s) - 1 for s in seqs]
        if tree is None:
            depth = [np.arange(n, dtype=np.int64) for n in q_lens]
            tree_mask = None
        else:
            depth = [tree.depths.astype(np.int64)] * len(seqs)
            tree_mask = tree.packed_mask.to(self.device).repeat(len(seqs), 1)
        # Node j is stored in slot context_len + j; it *sits* at position context_len + depth(j).
        slot_positions = [c + np.arange(n, dtype=np.int64) for c, n in zip(context_lens, q_lens)]
        positions = np.concatenate([c + d for c, d in zip(context_lens, depth)])
        meta = self._metadata(seqs, context_lens, q_lens, slot_positions, tree_mask)
        input_ids = [t for s, d in zip(seqs, drafts) for t in (s.last_token, *d)]
        hidden, aux = self._run(input_ids, positions, meta)
        flat = self.model.compute_logits(hidden)  # [T, V]
        n_max = max(q_lens)
        logits = flat.new_zeros(len(seqs), n_max, flat.shape[-1])
        rows = torch.tensor([j for n in q_lens for j in range(n)], device=self.device)
        seq_idx = torch.tensor(np.repeat(np.arange(len(seqs)), q_lens), device=self.device)
        logits[seq_idx, rows] = flat
        return logits, ForwardOutput(hidden, aux, meta.qo_indptr.tolist())
