"""One speculative step: draft → verify → rejection-sample → keep the accepted path.

With k = 0 (or no drafter) the same function is a plain decode step: one fed token per
sequence, one sampled token, so the k = 0 baseline runs through exactly this code.

The step talks to the device through the persistent batch state (``core.batch``: what changed
since the last step goes over in non-blocking copies) and reads back exactly one packed tensor
after rejection sampling (``core.transfer.to_host``): drafts stay on the device from the
drafter to the verify pass, and the verify pass + sampler run on static buffers
(``core.verify``), as one CUDA graph replay per step on CUDA (``core.graphs``).
"""

from __future__ import annotations

import functools

import numpy as np

import specengine._C as _C
from specengine.core.graphs import GraphRunner
from specengine.core.kv_cache import KVCache
from specengine.core.run_stats import StepTimes
from specengine.core.sampler import StepResult
from specengine.core.seq_arena import SeqArena
from specengine.core.sequence import Sequence
from specengine.core.step_types import VerifyShape, forward_output
from specengine.core.stop_strings import cut_at_stop_strings
from specengine.core.token_logprobs import record_top_logprobs
from specengine.core.transfer import to_host
from specengine.drafters.base import Drafter
from specengine.kernels.kv_cache import compact_kv_cache
from specengine.tree import DraftTree


def num_drafts_for(seq: Sequence, k: int, max_model_len: int) -> int:
    """Draft length for ``seq``: ``k``, cut so the step can neither emit past ``max_tokens``
    (it emits at most drafts + 1) nor feed a position past ``max_model_len - 1``."""
    remaining = seq.params.max_tokens - seq.num_generated
    return max(0, min(k, remaining - 1, max_model_len - len(seq)))


def speculative_step(
    seqs: tuple[Sequence, ...],
    k: int,
    tree: DraftTree | None,
    drafter: Drafter | None,
    graphs: GraphRunner,
    kv_cache: KVCache,
    max_model_len: int,
    times: StepTimes,
    arena: SeqArena,
    version: int,
) -> None:
    """Advance every sequence of ``seqs`` by one verified step (1 .. k+1 new tokens each)."""
    clock = graphs.clock
    clock.start()
    state = graphs.verifier.state
    seqs = state.arrange(seqs)  # row order: every buffer of the step uses it
    batch = len(seqs)

    # 1. Draft. A tree is verified whole: its nodes need slots up to len + N - 1 <= max_model_len
    #    (tokens past max_tokens are cut by the arena). Near the context limit the batch falls
    #    back to plain decoding for this step. The plan and the step fields are staged in one
    #    pass (a static draft loop reads positions from the state).
    drafting = drafter is not None and k > 0
    rows = graphs.padded_rows(batch)
    num_drafts, max_drafts = state.stage_step(
        k if drafting else 0, tree.num_nodes - 1 if drafting and tree is not None else -1,
        max_model_len)
    proposal = None
    if max_drafts:
        proposal = drafter.propose(seqs, num_drafts.tolist(), tree)  # type: ignore[union-attr]
        # A chain drafter may propose fewer tokens than asked (an n-gram without a match).
        if not proposal.as_asked:
            proposed = np.asarray(proposal.num_draft_tokens, dtype=np.int64)
            if (proposed != num_drafts).any():
                num_drafts = proposed
                state.restage_num_drafts(num_drafts)
                if not num_drafts.any():
                    proposal = None
    if proposal is None:
        tree = None
    if tree is not None:
        num_tokens = tree.num_nodes
    elif proposal is None:
        num_tokens = 1
    else:  # graphs keep one shape per k; eagerly, feed no more than the longest chain needs
        num_tokens = k + 1 if graphs.static else int(num_drafts.max()) + 1
    shape = _shape(rows, num_tokens, tree, proposal is not None and proposal.probs is not None,
                   state.masks_stops(), state.num_logprobs_rows > 0)
    if proposal is not None and not proposal.in_place:
        graphs.verifier.load_drafts(shape, proposal.token_ids, proposal.probs)
    clock.drafted()

    # 2-3. Verify every fed token in one target pass, then rejection sampling keeps exactly the
    #      policy's distribution (docs/design.md §6). The packed result is the one host sync.
    out = graphs.run(shape)
    clock.verified()
    packed = to_host(out.packed)
    clock.synced(times)
    top = None
    if out.top is not None:  # some row asks for top-N logprobs: their copy, and lengths
        top, old_lens = to_host(out.top), arena.lens[state.row_slots[:batch]].copy()

    # 4. Keep the accepted path: tree nodes move to contiguous slots (the verify pass does it
    #    on the device; under tensor parallelism the step does it on every rank; chains are
    #    already contiguous); rejected slots are simply reused by the next step. Every row's
    #    tokens are appended at once (the arena cuts at stop tokens / max_tokens / context).
    result = None
    if tree is not None and not graphs.verifier.compacts_trees:  # (tensor parallel)
        _compact_tree_path(arena, state.row_slots, packed, batch, kv_cache)
    # Draft positions each row proposed (for the acceptance counts): a tree's depth, all rows
    # (a tree is drafted by every row or by none: then tree is None here).
    depths = num_drafts if tree is None else _filled(batch, tree.max_depth)
    times.num_step_tokens += append_step(arena, seqs, packed, batch, state.row_slots,
                                         num_drafts, depths, times, version)
    if top is not None:
        record_top_logprobs(arena, seqs, state.row_slots, batch, old_lens, top)
    times.num_seq_steps += batch
    # Also after a fallback step; k < 0 (core.auto_k.SYNC): no drafts, the drafter catches up.
    if drafter is not None and k != 0:
        num_accepted = packed[:batch, -1].astype(np.int64)
        if not drafter.observe_step(seqs, out, shape, num_accepted):
            result = result or StepResult.unpack(packed, batch)
            accepted_rows = [rows_b[: n + 1] for rows_b, n in
                             zip(result.row_ids.tolist(), num_accepted.tolist())]
            drafter.observe(seqs, forward_output(out, batch, num_tokens), accepted_rows)
    times.num_steps += 1
    clock.end(times)


def append_step(arena: SeqArena, seqs: tuple[Sequence, ...], packed: np.ndarray,
                num_rows: int, slots: np.ndarray, num_drafts: np.ndarray, depths: np.ndarray,
                times: StepTimes | None, version: int) -> int:
    """Row ``b`` (``seqs[b]``, arena slot ``slots[b]``) emitted ``ids[b, :num_accepted[b] +
    1]`` of the packed sampler output: append them all at once to the arena, count the step
    (its ``num_drafts``, and in ``times`` its acceptance per draft position up to
    ``depths``), and finish the sequences that reached a stop token or their length limit.
    Returns the number of tokens kept (fewer than emitted where a sequence ended)."""
    stats = _NO_STATS if times is None else times.position_counts
    kept, ended = arena.append_packed(packed, num_rows, slots, num_drafts, depths, stats,
                                      version)
    for b, code in ended:  # only the rows that finished this step
        seqs[b].finish("stop" if code == 1 else "length")
    if arena.has_stop_strings.any():  # some running request has stop strings: check its text
        kept -= cut_at_stop_strings(arena, seqs, slots, num_rows)
    return kept


_NO_STATS = np.zeros((2, 0), dtype=np.int64)


@functools.lru_cache(maxsize=256)
def _filled(num_rows: int, value: int) -> np.ndarray:
    """A read-only ``[num_rows]`` int64 array of ``value`` (made once per shape)."""
    a = np.full(num_rows, value, dtype=np.int64)
    a.flags.writeable = False
    return a


@functools.lru_cache(maxsize=1024)
def _shape(num_rows: int, num_tokens: int, tree: DraftTree | None, has_probs: bool,
           masks_stops: bool, top_logprobs: bool) -> VerifyShape:
    """One ``VerifyShape`` object per shape (its checks run once; trees key by identity)."""
    return VerifyShape(num_rows, num_tokens, tree, has_probs, masks_stops, top_logprobs)


def _compact_tree_path(arena: SeqArena, slots: np.ndarray, packed: np.ndarray, num_rows: int,
                       kv_cache: KVCache) -> None:
    """Move the accepted nodes' K/V (root excluded: it is already in place) from slot
    ``ctx + node`` to ``ctx + depth``, in every layer, with one kernel launch. Row ``b`` is
    the sequence in arena slot ``slots[b]`` (before this step's tokens are appended); the
    moves come from one C++ pass over the packed output (``tests/tree_path_reference.py``)."""
    moves = _C.tree_path_moves(packed, num_rows, slots, arena.lens, arena.num_blocks,
                               arena.block_ids, kv_cache.block_size)  # [2, M]
    if not moves.shape[1]:
        return
    if hasattr(kv_cache, "mirror_compact"):  # tensor parallel: every rank's heads move
        kv_cache.mirror_compact(moves[0].tolist(), moves[1].tolist())
    compact_kv_cache(kv_cache.kv, moves)
