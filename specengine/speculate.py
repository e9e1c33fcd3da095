"""One speculative step: draft → verify → rejection-sample → keep the accepted path.

With k = 0 (or no drafter) the same function is a plain decode step: one fed token per
sequence, one sampled token, so the k = 0 baseline runs through exactly this code.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from specengine.drafters.base import Drafter
from specengine.kv_cache import KVCache
from specengine.model_runner import ModelRunner
from specengine.sampler import Sampler
from specengine.sequence import Sequence
from specengine.tree import DraftTree


@dataclass
class StepTimes:
    """Mutable accumulators of one ``generate`` call (turned into frozen EngineStats after)."""

    draft: float = 0.0
    verify: float = 0.0
    sample: float = 0.0
    bookkeeping: float = 0.0
    num_steps: int = 0
    num_seq_steps: int = 0  # (sequence, step) pairs
    num_step_tokens: int = 0  # tokens those steps kept (after stop / max_tokens cuts)
    accepted_per_position: list[int] = field(default_factory=list)
    proposed_per_position: list[int] = field(default_factory=list)

    def count(self, position: int, proposed: int, accepted: int) -> None:
        while len(self.proposed_per_position) <= position:
            self.proposed_per_position.append(0)
            self.accepted_per_position.append(0)
        self.proposed_per_position[position] += proposed
        self.accepted_per_position[position] += accepted


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
    runner: ModelRunner,
    sampler: Sampler,
    kv_cache: KVCache,
    max_model_len: int,
    times: StepTimes,
) -> None:
    """Advance every sequence of ``seqs`` by one verified step (1 .. k+1 new tokens each)."""
    dev = runner.device
    t0 = time.perf_counter()

    # 1. Draft. A tree is verified whole: its nodes need slots up to len + N - 1 <= max_model_len
    #    (tokens past max_tokens are cut by seq.append). Near the context limit the batch falls
    #    back to plain decoding for this step.
    if drafter is None or k == 0:
        num_drafts = [0] * len(seqs)
        tree = None
    elif tree is not None:
        fits = all(len(s) + tree.num_nodes - 1 <= max_model_len for s in seqs)
        num_drafts = [tree.num_nodes - 1] * len(seqs) if fits else [0] * len(seqs)
        tree = tree if fits else None
    else:
        num_drafts = [num_drafts_for(s, k, max_model_len) for s in seqs]
    if any(num_drafts):
        proposal = drafter.propose(seqs, num_drafts, tree)  # type: ignore[union-attr]
        draft_ids = proposal.token_ids.to(dev)
        # A chain drafter may propose fewer tokens than asked (an n-gram without a match).
        num_drafts = proposal.num_draft_tokens.tolist()
        draft_probs = proposal.probs
    else:
        draft_ids = torch.zeros(len(seqs), 0, dtype=torch.int64, device=dev)
        draft_probs = None
    num_draft_tokens = torch.tensor(num_drafts, dtype=torch.int32, device=dev)
    # The drafts reach the host in one copy (the drafters never sync), so this is where the
    # draft's device time ends.
    all_drafts = draft_ids.tolist()
    drafts = [all_drafts[b][:n] for b, n in enumerate(num_drafts)]
    t1 = time.perf_counter()

    # 2. Verify: one target pass over [newest token, drafts...] of every sequence.
    logits, target_out = runner.verify(seqs, drafts, tree)  # [B, N, V]
    t2 = time.perf_counter()

    # 3. Rejection sampling keeps exactly the policy's distribution (DESIGN §6).
    n_rows = logits.shape[1]
    draft_ids = draft_ids[:, : n_rows - 1]
    if draft_probs is not None:
        draft_probs = draft_probs[:, : n_rows - 1]
    parents = None if tree is None else torch.from_numpy(tree.parents).to(dev)
    out = sampler(seqs, logits, draft_ids, num_draft_tokens, draft_probs, parents)
    output_ids = out.output_ids.tolist()  # the step's one host sync
    num_accepted = out.num_accepted.tolist()
    logprobs = out.logprobs.tolist()
    row_ids = out.row_ids.tolist()
    t3 = time.perf_counter()

    # 4. Keep the accepted path: tree nodes move to contiguous slots (chains are already
    #    contiguous); rejected slots are simply reused by the next step.
    if tree is not None:
        _compact_tree_path(seqs, num_accepted, row_ids, kv_cache, runner)
    accepted_rows: list[list[int]] = []
    for b, seq in enumerate(seqs):
        n = num_accepted[b]
        accepted_rows.append(row_ids[b][: n + 1])
        seq.num_steps += 1
        seq.num_draft_tokens += num_drafts[b]
        seq.num_accepted_tokens += n
        depth = num_drafts[b] if tree is None else tree.max_depth
        for j in range(depth if num_drafts[b] else 0):
            times.count(j, 1, int(n > j))
        seq.num_cached_tokens = len(seq) + n  # root + accepted drafts are cached
        before = len(seq)
        seq.append(output_ids[b][: n + 1], logprobs[b][: n + 1], max_model_len)
        times.num_seq_steps += 1
        times.num_step_tokens += len(seq) - before
    if drafter is not None and k > 0:
        drafter.observe(seqs, target_out, accepted_rows)
    times.num_steps += 1
    times.draft += t1 - t0
    times.verify += t2 - t1
    times.sample += t3 - t2
    times.bookkeeping += time.perf_counter() - t3


def _compact_tree_path(seqs: tuple[Sequence, ...], num_accepted: list[int],
                       row_ids: list[list[int]], kv_cache: KVCache, runner: ModelRunner) -> None:
    """Move the accepted nodes' K/V (root excluded: it is already in place) from slot
    ``ctx + node`` to ``ctx + depth``, in every layer, with one kernel launch."""
    from specengine.kernels.kv_cache import compact_kv

    bs = kv_cache.block_size
    src: list[int] = []
    dst: list[int] = []
    for b, seq in enumerate(seqs):
        ctx = len(seq) - 1
        for depth in range(1, num_accepted[b] + 1):
            node = row_ids[b][depth]
            if node == depth:
                continue
            for pos, out in ((ctx + node, src), (ctx + depth, dst)):
                out.append(seq.block_table[pos // bs] * bs + pos % bs)
    if not src:
        return
    dev = runner.device
    layers = kv_cache.kv.shape[1]
    compact_kv(
        [kv_cache.kv[0, i] for i in range(layers)],
        [kv_cache.kv[1, i] for i in range(layers)],
        torch.tensor(src, dtype=torch.int64, device=dev),
        torch.tensor(dst, dtype=torch.int64, device=dev),
    )
