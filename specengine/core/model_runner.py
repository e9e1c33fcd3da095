"""Turns scheduled sequences into one ragged forward pass over the paged KV cache."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch
from torch import Tensor

import specengine._C as _C
from specengine.core.kv_cache import KVCache
from specengine.core.sequence import Sequence
from specengine.core.step_types import ForwardOutput
from specengine.core.transfer import to_device
from specengine.model.attention import AttentionBackend, AttentionMetadata
from specengine.model.llama import CausalLM


@dataclass(frozen=True)
class PrefillCounts:
    """One prefill pass: tokens whose KV it had to hold, of which reused (not computed), and
    block references taken instead of computing (``engine.stats``)."""

    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0
    num_shared_blocks: int = 0


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
        self.last_prefill = PrefillCounts()

    def metadata(self, seqs: tuple[Sequence, ...] | list[Sequence], context_lens: list[int],
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

    def prefill(self, seqs: tuple[Sequence, ...], drafted: bool = True
                ) -> tuple[Tensor, ForwardOutput]:
        """Run each sequence's tokens after its reused prefix (``seq.num_cached_tokens`` at
        admission, ``KVCache.pending``); returns last-token logits ``[B, V]`` (a sample that
        borrows a sibling's pass gets the sibling's row). ``drafted``: the drafter will catch
        up on this pass (``KVCache.finish_prefill``)."""
        plans = [self.kv_cache.pending.get(s.seq_id) for s in seqs]
        starts = [s.num_cached_tokens if p is not None else 0 for s, p in zip(seqs, plans)]
        fed = [b for b, p in enumerate(plans) if p is None or p.leader is None]
        fed_seqs = [seqs[b] for b in fed]
        q_lens = [len(seqs[b]) - starts[b] for b in fed]
        positions = [np.arange(starts[b], len(seqs[b]), dtype=np.int64) for b in fed]
        meta = self.metadata(fed_seqs, [starts[b] for b in fed], q_lens, positions, None)
        ids = [t for b in fed for t in seqs[b].token_slice(starts[b])]
        hidden, aux = self._run(ids, np.concatenate(positions), meta)
        begin = dict(zip(fed, np.concatenate([[0], np.cumsum(q_lens)[:-1]]).tolist()))
        rows_of = {b: list(range(q)) for b, q in zip(fed, q_lens)}
        index = {s.seq_id: b for b, s in enumerate(seqs)}
        src = [b if b in begin else index[p.leader.seq_id]  # type: ignore[union-attr]
               for b, p in enumerate(plans)]
        ends = np.asarray([begin[a] + len(rows_of[a]) for a in src], dtype=np.int64)
        logits = self.model.compute_logits(hidden[to_device(ends - 1, self.device)])
        self.last_prefill = PrefillCounts(
            sum(len(s) for s in seqs),
            sum(len(s) for s in seqs) - sum(q_lens),
            sum(len(p.shared) for p in plans if p is not None))
        self.kv_cache.finish_prefill(seqs, drafted)
        return logits, ForwardOutput(hidden, aux, [begin[a] for a in src] + [int(hidden.shape[0])],
                                     [rows_of[a] for a in src])
