"""The paged KV cache: one tensor for all layers plus the C++ block allocator that hands out
its blocks to sequences, which may share them (reference counts): a GRPO group's prompt
blocks, and full blocks found in the prefix cache (``specengine.core.prefix_cache``)."""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from specengine.config import MAX_K, EngineConfig
from specengine.core.prefix_cache import PrefixCache, block_hashes
from specengine.core.sequence import Sequence
from specengine.model.config import ModelConfig

if TYPE_CHECKING:
    from specengine.core.seq_arena import SeqArena

logger = logging.getLogger(__name__)

CPU_KV_BUDGET_BYTES = 1 << 30


class KVCacheFullError(RuntimeError):
    """A request can never fit in the KV cache (it would need more blocks than exist)."""


@dataclass
class PrefillPlan:
    """How an admitted sequence's prefill reuses KV (made by :meth:`KVCache.plan` /
    :meth:`KVCache.plan_borrow`, applied by :meth:`KVCache.admit`, read by the prefill pass).

    ``shared`` are blocks its table starts with by reference, holding the KV of its first
    ``num_cached`` tokens (only ``len(seq) - num_cached`` tokens are computed). A group sample
    that *borrows* computes nothing: ``leader`` (a sibling in the same prefill batch) computes
    the prompt, whose full blocks are shared, whose last-token logits it samples from, and
    whose partial last block ``copy_src`` is copied into its own last block after the pass
    (copy on write: the sample's next step writes its first token there)."""

    seq: Sequence
    shared: list[int] = field(default_factory=list)
    num_cached: int = 0
    hashes: list[bytes] = field(default_factory=list)  # full blocks after the prefill
    leader: Sequence | None = None
    copy_src: int | None = None
    epoch: int = 0

    @property
    def num_computed(self) -> int:
        return 0 if self.leader is not None else len(self.seq) - self.num_cached


class KVCache:
    """``kv[2, num_layers, num_blocks, block_size, Hkv, D]`` and the ownership of its blocks.

    Blocks are owned by sequences through ``seq.block_table``; :meth:`ensure` grows a table to
    cover a number of tokens (all or nothing) and :meth:`free` drops a table's references.
    With ``prefix_caching``, full blocks computed by a prefill stay named by their tokens'
    hash (``self.prefix``) until evicted (least recently released first, when an allocation
    needs them) or the weights change (:meth:`invalidate_prefix_cache`).
    """

    def __init__(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 prefix_caching: bool = False) -> None:
        import specengine._C as _C

        if num_blocks <= 0:
            raise ValueError(f"the KV cache needs at least one block, got {num_blocks}")
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.kv = torch.zeros(2, num_layers, num_blocks, block_size, num_kv_heads, head_dim,
                              dtype=dtype, device=device)
        self.allocator = _C.BlockAllocator(num_blocks)
        self.prefix = PrefixCache(self.allocator, block_size) if prefix_caching else None
        self.pending: dict[int, PrefillPlan] = {}  # seq_id -> plan of this step's prefill
        # seq_id -> the prefix cache's epoch when the sequence's KV started (its admission):
        # a finished sequence's blocks are named only if no weight update came since.
        self.epoch_of: dict[int, int] = {}
        # How the drafter's KV follows the named blocks (:meth:`follow_drafter`).
        self.name_next_token = False
        self.names_need_draft = False
        self.draft_hits: Callable[[list[bytes]], int] | None = None

    def follow_drafter(self, *, name_next_token: bool, names_need_draft: bool,
                       draft_hits: Callable[[list[bytes]], int] | None) -> None:
        """Make the named blocks serve the drafter too (``drafters.draft_prefix``): blocks are
        named with their next token (``name_next_token``: a feature drafter's entry of
        position p reads token p + 1), named only after a prefill the drafter caught up on
        (``names_need_draft``: its entries live in these very blocks), and a hit is cut to
        the leading blocks ``draft_hits(names)`` says the drafter's own cache also holds."""
        self.name_next_token = name_next_token
        self.names_need_draft = names_need_draft
        self.draft_hits = draft_hits

    @property
    def num_free_blocks(self) -> int:
        """Blocks an allocation may take: free ones and cached ones nobody holds."""
        evictable = len(self.prefix.evictable) if self.prefix is not None else 0
        return int(self.allocator.num_free) + evictable

    def blocks_for(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def num_missing_blocks(self, seq: Sequence, num_tokens: int) -> int:
        return max(0, self.blocks_for(num_tokens) - _num_blocks(seq))

    def can_ensure(self, seq: Sequence, num_tokens: int) -> bool:
        return self.num_missing_blocks(seq, num_tokens) <= self.num_free_blocks

    def ensure(self, seq: Sequence, num_tokens: int) -> None:
        """Grow ``seq.block_table`` to hold ``num_tokens`` tokens (raises if blocks run out)."""
        if num_tokens <= _num_blocks(seq) * self.block_size:  # the common case: no work
            return
        missing = self.num_missing_blocks(seq, num_tokens)
        if not missing:
            return
        ids = self._allocate(missing)
        if isinstance(seq, Sequence):
            seq.add_blocks(ids)
        else:  # a drafter's own per-sequence state: a plain list
            seq.block_table.extend(ids.tolist())

    def ensure_running(self, arena: SeqArena, slots: np.ndarray) -> bool:
        """:meth:`ensure` for every running sequence (arena ``slots``) before a verify step:
        each table covers ``len + min(lookahead, max_model_len - len)`` tokens, from one
        allocation written straight into the arena's rows (one C++ pass, ``_C.grow_tables``),
        all or nothing: False, with nothing allocated, when the free blocks (cached ones
        nobody holds included) do not cover them all."""
        import specengine._C as _C

        while True:
            status, value = _C.grow_tables(self.allocator, slots, len(slots), arena.lens,
                                           arena.lookahead, arena.num_blocks, arena.block_ids,
                                           arena.max_model_len, self.block_size)
            if status == 0:
                return True
            if status == 2:  # a table outgrew the arena's columns: widen, then grow
                arena.grow_block_columns(value)
                continue
            short = value - int(self.allocator.num_free)
            if self.prefix is None or short > len(self.prefix.evictable):
                return False
            self.prefix.evict(short)  # cached blocks nobody holds make up the rest

    def _allocate(self, num: int) -> np.ndarray:
        """``num`` fresh blocks (int32), evicting cached ones nobody holds when needed."""
        short = num - int(self.allocator.num_free)
        if short > 0 and self.prefix is not None and short <= len(self.prefix.evictable):
            self.prefix.evict(short)
        return self.allocator.allocate(num)

    def free(self, seq: Sequence) -> None:
        """Drop ``seq``'s references (shared blocks stay with their other holders)."""
        table = seq.block_table
        if table:
            self.allocator.free(np.asarray(table, dtype=np.int32))
            if self.prefix is not None:
                self.prefix.released(table)
        seq.block_table = []
        seq.num_cached_tokens = 0
        if self.epoch_of:
            self.epoch_of.pop(getattr(seq, "seq_id", None), None)
        if self.pending:  # (drafters free their own states here too: no seq_id)
            self.pending.pop(getattr(seq, "seq_id", None), None)

    # ---- sharing at admission ----------------------------------------------------------------
    def plan(self, seq: Sequence) -> PrefillPlan:
        """Reuse the longest cached prefix of ``seq``'s tokens, in full blocks, leaving at
        least its last token to compute (its logits sample the next token)."""
        if self.prefix is None:
            return PrefillPlan(seq)
        n = len(seq)
        reusable = (n - 1) // self.block_size
        if self.name_next_token:  # a block is named once the token after it is known
            hashes = block_hashes(seq.token_ids, self.block_size, reusable, next_token=True)
        else:
            hashes = block_hashes(seq.token_ids, self.block_size, n // self.block_size)
        hits = self.prefix.match(hashes[:reusable])
        if hits and self.draft_hits is not None:
            hits = hits[: self.draft_hits(hashes[: len(hits)])]
        return PrefillPlan(seq, hits, len(hits) * self.block_size, hashes,
                           epoch=self.prefix.epoch)

    def plan_borrow(self, seq: Sequence, leader: Sequence) -> PrefillPlan:
        """``seq`` (a fresh group sample) borrows the prefill of ``leader`` (a fresh sibling
        admitted in the same batch, whose table covers the prompt)."""
        n, bs = len(seq), self.block_size
        full = n // bs
        src = leader.block_table[full] if n % bs else None
        return PrefillPlan(seq, leader.block_table[:full], n, leader=leader, copy_src=src,
                           epoch=self.prefix.epoch if self.prefix is not None else 0)

    def can_admit(self, plan: PrefillPlan) -> bool:
        taken = self.prefix.num_evictable_in(plan.shared) if self.prefix is not None else 0
        need = self.blocks_for(len(plan.seq)) - len(plan.shared)
        return need <= self.num_free_blocks - taken

    def admit(self, plan: PrefillPlan) -> None:
        """Give the waiting ``plan.seq`` its table: the shared blocks by reference, the rest
        fresh (check :meth:`can_admit` first)."""
        seq = plan.seq
        assert not seq.block_table, "a waiting sequence holds no blocks"
        if plan.shared:
            if self.prefix is not None:
                self.prefix.acquire(plan.shared)
            else:
                self.allocator.incref(np.asarray(plan.shared, dtype=np.int64))
            seq.block_table = list(plan.shared)
        self.ensure(seq, len(seq))
        seq.num_cached_tokens = plan.num_cached
        if seq.num_generated == 0:  # its first prefill: what the prefix cache served
            seq.num_prefix_cached_tokens = plan.num_cached if plan.leader is None else 0
        if self.prefix is not None:
            self.epoch_of[seq.seq_id] = plan.epoch
        self.pending[seq.seq_id] = plan

    def finish_prefill(self, seqs: tuple[Sequence, ...] | list[Sequence],
                       drafted: bool = True) -> None:
        """After the prefill pass of ``seqs``: borrowers get their copy of the leader's
        partial block, computed full blocks are named in the prefix cache (unless the
        drafter's entries live in them and it did not catch up on this prefill:
        ``drafted``), and every sequence's KV covers its tokens."""
        register = drafted or not self.names_need_draft
        src, dst = [], []
        for seq in seqs:
            plan = self.pending.pop(seq.seq_id, None)
            if plan is not None and plan.copy_src is not None:
                src.append(plan.copy_src)
                dst.append(seq.block_table[len(seq) // self.block_size])
            elif plan is not None and plan.hashes and self.prefix is not None and register:
                full = len(plan.hashes)
                self.prefix.register(seq.block_table[:full], plan.hashes, plan.epoch)
            seq.num_cached_tokens = len(seq)
        if src:
            self.copy_blocks(src, dst)

    def cache_finished(self, seq: Sequence, num_tokens: int) -> int:
        """Name the full blocks of a finishing (or aborted) running ``seq`` whose KV is
        valid, generated tokens included (as vLLM caches every full block), so that a
        prompt extending its tokens (a conversation's next turn) reuses them. Call before
        :meth:`free`. ``num_tokens``: how many leading tokens have valid KV in every cache
        that lives in these blocks (at most ``len(seq) - 1``: a verify step writes the KV of
        its fed tokens, and after it only the accepted path's is valid, up to the position
        before the newest token; rejected drafts sit past it). Nothing is named when a
        weight update came after the sequence's admission (its KV would mix weight
        versions). Names are the prefill's (``block_hashes``), the next token included when
        a feature drafter follows. Returns how many blocks were newly named."""
        if self.prefix is None or self.epoch_of.get(seq.seq_id) != self.prefix.epoch:
            return 0
        num_blocks = min(min(num_tokens, len(seq) - 1) // self.block_size, seq.num_blocks)
        if num_blocks <= 0:
            return 0
        # (num_blocks * block_size <= len - 1: the next token of the last block exists)
        hashes = block_hashes(seq.token_array(), self.block_size, num_blocks,
                              next_token=self.name_next_token)
        return self.prefix.register(seq.block_table[:num_blocks], hashes, self.prefix.epoch)

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        """``kv[:, :, dst[i]] = kv[:, :, src[i]]`` (every layer, K and V)."""
        s = torch.as_tensor(src, dtype=torch.int64, device=self.kv.device)
        d = torch.as_tensor(dst, dtype=torch.int64, device=self.kv.device)
        self.kv.index_copy_(2, d, self.kv.index_select(2, s))

    def invalidate_prefix_cache(self) -> None:
        """Forget every cached block (after a weight update: their KV is of older weights)."""
        if self.prefix is not None:
            self.prefix.clear()

    def check_fits(self, num_tokens: int) -> None:
        """Raise if one sequence of ``num_tokens`` tokens could never fit, even alone."""
        need = self.blocks_for(num_tokens)
        if need > self.num_blocks:
            raise KVCacheFullError(
                f"a sequence of up to {num_tokens} tokens needs {need} KV blocks but the cache "
                f"has only {self.num_blocks} (block_size {self.block_size}); raise "
                "kv_cache_tokens or lower max_tokens / max_model_len"
            )


def _num_blocks(holder: Sequence) -> int:
    """Blocks a sequence (or a drafter's per-sequence state, which has a plain list) owns."""
    return holder.num_blocks if isinstance(holder, Sequence) else len(holder.block_table)


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int,
                       dtype: torch.dtype) -> int:
    """K and V of one token in every layer."""
    return 2 * num_layers * num_kv_heads * head_dim * torch.empty(0, dtype=dtype).element_size()


def num_kv_blocks(cfg: EngineConfig, target: ModelConfig, device: torch.device,
                  extra_bytes_per_token: int = 0, measured_peak: int | None = None) -> int:
    """Blocks of a paged cache that holds as many tokens as the target's will.

    ``kv_cache_tokens`` when given; otherwise enough for ``max_batch_size`` full sequences,
    capped on CPU by a 1 GiB target cache and on CUDA by the memory plan
    (``core.memory_plan``): of ``cfg.gpu_memory_utilization`` of the card, what is in use now
    (the weights are loaded by then, the CUDA context, a drafter's cache built first), the
    planned activations and the graphs' static buffers are taken first; the rest is split
    between the target's cache and ``extra_bytes_per_token`` (a drafter's own cache). Every
    cache of an engine gets the same token count, so a drafter never runs out of room before
    the target does: the drafter's cache, sized first, takes its share of the rest, and the
    target's call then finds it in use and gets the same tokens. ``measured_peak``: the
    engine's largest-shape dry run (``memory_plan.dry_run_largest_shape``) on CUDA."""
    target_bpt = kv_bytes_per_token(target.num_layers, target.num_kv_heads, target.head_dim,
                                    cfg.torch_dtype)
    wanted = cfg.max_batch_size * (cfg.max_model_len + MAX_K + 1)
    if cfg.kv_cache_tokens is not None:
        tokens = cfg.kv_cache_tokens
    elif device.type == "cuda":
        tokens = _cuda_kv_tokens(cfg, target, device, target_bpt + extra_bytes_per_token,
                                 measured_peak)
    else:
        tokens = min(wanted, CPU_KV_BUDGET_BYTES // target_bpt)
    return max(1, tokens // cfg.block_size)


def _cuda_kv_tokens(cfg: EngineConfig, target: ModelConfig, device: torch.device,
                    bytes_per_token: int, measured_peak: int | None = None) -> int:
    from specengine.core.memory_plan import (
        DrafterFacts,
        activation_bytes_with,
        kv_budget_bytes,
        kv_tokens_for,
        plan_memory,
    )

    free, total = torch.cuda.mem_get_info(device)
    e = torch.empty(0, dtype=cfg.torch_dtype).element_size()
    drafter = DrafterFacts.from_draft(cfg.draft, target, e)
    plan = plan_memory(target, cfg, total, drafter)
    # Measured, not planned: the weights are on the card already (and whatever else is).
    in_use = total - free
    budget = kv_budget_bytes(total, cfg.gpu_memory_utilization, in_use,
                             activation_bytes_with(plan, measured_peak), plan.static_bytes)
    tokens = kv_tokens_for(cfg, budget, bytes_per_token)
    logger.info("memory plan (%.2f GiB in use before the KV cache, planned weights "
                "%.2f GiB):\n%s", in_use / (1 << 30), plan.weight_bytes / (1 << 30),
                plan.format())
    if tokens < cfg.max_model_len:
        logger.warning("the KV cache gets %d tokens (%.2f GiB left of %.2f under "
                       "gpu_memory_utilization %g): fewer than one max_model_len sequence",
                       tokens, budget / (1 << 30), cfg.gpu_memory_utilization * total / (1 << 30),
                       cfg.gpu_memory_utilization)
    return tokens
