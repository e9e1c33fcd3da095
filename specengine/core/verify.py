"""The verify pass on static buffers: metadata built on the device from the persistent batch,
the target forward over ``N`` fed tokens per row, rejection sampling, one packed output.

Every row feeds exactly ``N`` tokens (a chain's ``k + 1`` or a tree's nodes): its newest token,
then its drafts. A row with fewer drafts (an n-gram without a match, a chain cut near
``max_tokens``) still feeds ``N`` tokens; the extra ones get slot ``-1`` (no KV write) and the
sampler never looks past ``num_draft``. So the logits are ``[rows, N, V]`` as they come out of
the LM head (no scatter), and the same shapes repeat step after step: a CUDA graph per shape
(:mod:`specengine.core.graphs`) replays the whole pass.

Padded queries (drafts a row does not have, rows past the batch) may read keys through block
table entries the row does not own: the table is zero-filled, so they read block 0, never out
of bounds, and their outputs are ignored. A real query only reads keys its own row wrote.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from specengine.config import MAX_K
from specengine.core.batch import (
    ACTIVE,
    CTX,
    LAST,
    LOG_MIN_P,
    NUM_DRAFT,
    OFFSET,
    SEED,
    TEMPERATURE,
    TOP_K,
    TOP_P,
    BatchState,
)
from specengine.core.block_rows import slots_of
from specengine.core.model_runner import ModelRunner
from specengine.core.sampler import Sampler, SamplerOutput, SamplingTensors
from specengine.core.step_types import VerifyOutput, VerifyShape
from specengine.core.transfer import to_device
from specengine.kernels.kv_cache import compact_kv_cache
from specengine.model.attention import AttentionMetadata
from specengine.sampling import MAX_TOP_LOGPROBS
from specengine.tree import DraftTree


def producer_key(key: tuple) -> tuple | None:
    """The ``run_graph`` key of the pass whose outputs a pass of ``key`` reads, or None (it
    reads static buffers only): a drafter's catch-up (``observe``) reads its verify pass's
    outputs, handed to it in its closure. A captured catch-up keeps reading the addresses of
    the outputs it was captured with, so it may be captured only over a captured verify pass
    (whose replays rewrite those very tensors), never over one that runs eagerly."""
    return ("verify", *key[1:]) if key[0] == "observe" else None


class StaticVerifier:
    """Runs the verify pass of a :class:`VerifyShape` reading only static buffers: the batch
    state, ``draft_ids`` and (per shape) ``draft_probs``. Drafts are copied into those
    buffers device-to-device (:meth:`load_drafts`); nothing in :meth:`run` touches the host."""

    def __init__(self, runner: ModelRunner, sampler: Sampler, state: BatchState,
                 block_size: int, vocab_size: int, max_tokens: int,
                 max_prob_drafts: int = MAX_K) -> None:
        self.runner, self.sampler, self.state = runner, sampler, state
        self.block_size, self.vocab_size = block_size, vocab_size
        dev = state.device
        # [R, max N - 1]: row b's drafts (chain) or its tree nodes 1..N-1.
        self.draft_ids = torch.zeros(state.capacity, max_tokens - 1, dtype=torch.int64,
                                     device=dev)
        # Draft distributions: one [capacity, max_prob_drafts, V] float32 allocation (made at
        # the first sampled step) that every (rows, N) shape reads as the view [:rows, :N-1],
        # so draft j of row r sits at the same address in every shape (a draft loop of k' < k
        # drafts writes where the verify pass of k reads). Shapes may share it because it is
        # an input of one step only: the step's drafter (or load_drafts) writes it, then that
        # step's verify pass reads it, and no later pass reads it. A shape past it (more rows
        # than the batch holds, more drafts) gets its own buffer. ``max_prob_drafts`` is the
        # largest k the engine verifies (``memory_plan.verify_k_max``), not MAX_K: each column
        # is capacity x V x 4 bytes the KV cache does not get.
        self.max_prob_drafts = max_prob_drafts
        # A drafter with a vocabulary of its own (an EAGLE-3 head's d2t) hands its
        # distributions over that: the buffer is [.., Vd] and the sampler reads q(t) through
        # ``draft_index`` [V] (-1: q = 0). ``set_draft_vocab`` (at the drafter's bind).
        self.probs_vocab = vocab_size
        self.draft_index: Tensor | None = None
        # Verify outputs (final hidden and the drafter's aux hidden states, [rows * N, H]
        # each) written into views of one [1 + aux, capacity * (max_prob_drafts + 1), H]
        # allocation (``share_outputs``: set for a runner that may capture), not each
        # captured graph's own tensors: every (bucket, k) graph would otherwise keep its own
        # (0.70 GiB at 8B over buckets 1-256 x k 0-8). They are read only by the same step's
        # catch-up pass or ``observe`` (copies), before the next verify pass rewrites them.
        # Larger shapes (trees, k past the buffer) keep their own outputs.
        self.share_outputs = False
        self._outputs_all: Tensor | None = None
        self._outputs: dict[tuple[int, int], Tensor] = {}
        self._probs_all: Tensor | None = None
        # wider than max_prob_drafts (a sampled tree's nodes): one buffer per width
        self._probs_wide: dict[int, Tensor] = {}
        self._probs: dict[tuple[int, int], Tensor] = {}
        # Tree passes move the accepted paths' K/V into place themselves (not under tensor
        # parallelism: every rank's shard must move, the step does it through the workers).
        self.compacts_trees = not hasattr(runner.kv_cache, "mirror_compact")
        self._consts: dict[tuple, tuple[Tensor, Tensor, Tensor | None, Tensor | None]] = {}

    def set_draft_vocab(self, draft_index: Tensor, size: int) -> None:
        """Draft distributions are over a drafter's vocabulary of ``size`` ids; target token
        ``t`` is its column ``draft_index[t]`` (``[V]`` int32, -1: none). Before the first
        sampled step (the shared buffer is made at that width)."""
        if self._probs:
            raise RuntimeError("set_draft_vocab after draft-probability buffers were made")
        if tuple(draft_index.shape) != (self.vocab_size,) or not 0 < size <= self.vocab_size:
            raise ValueError(f"a draft vocabulary maps the {self.vocab_size} target ids to at "
                             f"most that many columns, got {tuple(draft_index.shape)}, {size}")
        self.probs_vocab, self.draft_index = size, draft_index

    def load_drafts(self, shape: VerifyShape, token_ids: Tensor, probs: Tensor | None) -> None:
        """Copy the drafter's proposal (``[B, W]`` ids on the device, ``[B, W, V]`` probs, or
        ``[B, W, Vd]`` over a draft vocabulary) into the static buffers of ``shape``."""
        b, w = token_ids.shape
        if b > shape.num_rows:
            raise ValueError(f"{b} rows of drafts do not fit a pass of {shape.num_rows} rows")
        if shape.has_probs and (probs is None or tuple(probs.shape) != (b, w, self.probs_vocab)):
            raise ValueError(f"draft probs must be [{b}, {w}, {self.probs_vocab}]")
        # Columns past N - 1 are past every row's draft count (the caller sized N from them).
        w = min(w, shape.num_tokens - 1)
        if w and not _same_view(token_ids, self.draft_ids):  # a static drafter wrote in place
            self.draft_ids[:b, :w].copy_(token_ids[:, :w])
        if w and shape.has_probs:  # (a static drafter writes its probs in place too)
            buf = self.probs_buffer(shape)
            if not _same_view(probs, buf):  # type: ignore[arg-type]
                # Under inference mode: a buffer made inside a pass (the draft loop or the
                # verify pass made it first) is an inference tensor, which only inference mode
                # may write. A chain cut short (k' < k drafts) over a k past the shared
                # buffer's width lands here: its loop wrote the shared buffer, the pass of k
                # reads one of its own.
                with torch.inference_mode():
                    buf[:b, :w].copy_(probs[:, :w])  # type: ignore[index]

    def probs_buffer(self, shape: VerifyShape) -> Tensor:
        """``[rows, N-1, V]`` float32: :meth:`probs_view` of the shape."""
        return self.probs_view(shape.num_rows, shape.num_tokens - 1)

    def probs_view(self, rows: int, drafts: int) -> Tensor:
        """``[rows, drafts, V or Vd]`` float32, a view of the one shared buffer (``__init__``),
        the same tensor every call for the same arguments; a draft loop writes its
        distributions here and the verify pass of ``(rows, drafts + 1)`` reads them."""
        key = (rows, drafts)
        view = self._probs.get(key)
        if view is None:
            if rows > self.state.capacity:
                view = torch.zeros(rows, drafts, self.probs_vocab, dtype=torch.float32,
                                   device=self.state.device)
            elif drafts > self.max_prob_drafts:
                # A sampled tree's nodes: every row bucket of this width shares one buffer,
                # as the chains' do (one [capacity, drafts, V] allocation, not one per bucket:
                # 0.5 GiB each at 256 rows, 16 drafts and a 32k draft vocabulary).
                wide = self._probs_wide.get(drafts)
                if wide is None:
                    wide = self._probs_wide[drafts] = torch.zeros(
                        self.state.capacity, drafts, self.probs_vocab, dtype=torch.float32,
                        device=self.state.device)
                view = wide[:rows]
            else:
                if self._probs_all is None:
                    self._probs_all = torch.zeros(
                        self.state.capacity, self.max_prob_drafts, self.probs_vocab,
                        dtype=torch.float32, device=self.state.device)
                view = self._probs_all[:rows, :drafts]
            self._probs[key] = view
        return view

    def output_views(self, rows: int, num_tokens: int, like: Tensor, num_aux: int
                     ) -> Tensor | None:
        """``[1 + num_aux, rows * num_tokens, H]`` (dtype and H of ``like``), a view of the
        one shared output allocation (``__init__``), the same tensor every call; None when
        the shape is past it or outputs are not shared."""
        if not self.share_outputs or rows > self.state.capacity or \
                num_tokens > self.max_prob_drafts + 1:
            return None
        key = (rows, num_tokens)
        view = self._outputs.get(key)
        if view is None:
            if self._outputs_all is None:
                self._outputs_all = torch.zeros(
                    1 + num_aux, self.state.capacity * (self.max_prob_drafts + 1),
                    like.shape[-1], dtype=like.dtype, device=like.device)
            view = self._outputs[key] = self._outputs_all[:, : rows * num_tokens]
        return view

    def _constants(self, shape: VerifyShape) -> tuple[Tensor, Tensor, Tensor | None,
                                                       Tensor | None]:
        """(qo_indptr [rows+1] int32, depth [N] int64, tree mask [rows*N, words], parents)."""
        if shape.key not in self._consts:
            dev, rows, n, tree = self.state.device, shape.num_rows, shape.num_tokens, shape.tree
            indptr = to_device(np.arange(rows + 1, dtype=np.int32) * n, dev)
            if tree is None:
                depth = to_device(np.arange(n, dtype=np.int64), dev)
                mask = parents = None
            else:
                depth = to_device(tree.depths.astype(np.int64), dev)
                mask = to_device(tree.packed_mask_host, dev).repeat(rows, 1)
                parents = to_device(tree.parents.astype(np.int32), dev)
            self._consts[shape.key] = (indptr, depth, mask, parents)
        return self._consts[shape.key]

    @torch.inference_mode()
    def run(self, shape: VerifyShape) -> VerifyOutput:
        """The pass itself (captured whole into a CUDA graph by ``graphs.GraphRunner``)."""
        rows, n = shape.num_rows, shape.num_tokens
        indptr, depth, tree_mask, parents = self._constants(shape)
        st = self.state
        ints = st.ints[:, :rows]
        ctx, num_draft, active = ints[CTX], ints[NUM_DRAFT], ints[ACTIVE] > 0
        j = torch.arange(n, device=ctx.device)
        if shape.tree is None:
            fed = j[None, :] <= num_draft[:, None]  # [rows, N]: the newest token + own drafts
        else:
            fed = (j[None, :] == 0) | (num_draft[:, None] > 0)
        fed &= active[:, None]
        # Node j is stored in slot ctx + j and sits at position ctx + depth(j).
        slots = slots_of(st.block_tables[:rows], ctx[:, None] + j[None, :], fed, self.block_size)
        drafts = self.draft_ids[:rows, : n - 1]  # [rows, N-1]
        input_ids = torch.cat([ints[LAST][:, None], drafts], dim=1)  # [rows, N]
        positions = ctx[:, None] + depth[None, :]
        meta = AttentionMetadata(
            slot_mapping=slots.reshape(-1), block_tables=st.block_tables[:rows],
            context_lens=ctx.to(torch.int32), qo_indptr=indptr, max_q_len=n,
            tree_mask=tree_mask,
        )
        model = self.runner.model
        hidden, aux = model(input_ids.reshape(-1), positions.reshape(-1), self.runner.kv_cache.kv,
                            meta, self.runner.backend, self.runner.aux_layers)
        logits = model.compute_logits(hidden).view(rows, n, -1)  # [rows, N, V]
        raw = raw_top(logits) if shape.top_logprobs else None  # before any mask: raw logits
        if shape.masks_stops:
            mask_stop_ids(logits, ints[OFFSET][:, None] + depth[None, :], st.mask[:rows])
        shared = self.output_views(rows, n, hidden, len(aux))
        if shared is not None:  # the pass's own outputs become transient (pool memory)
            shared[0].copy_(hidden)
            for dst, src in zip(shared[1:], aux):
                dst.copy_(src)
            hidden, aux = shared[0], list(shared[1:])
        params = SamplingTensors(
            temperature=st.floats[TEMPERATURE, :rows], top_k=ints[TOP_K],
            top_p=st.floats[TOP_P, :rows], seeds=ints[SEED], offsets=ints[OFFSET],
            log_min_p=st.floats[LOG_MIN_P, :rows],
        )
        probs = self.probs_buffer(shape) if shape.has_probs else None
        out = self.sampler(logits, drafts, num_draft, probs, parents, params,
                           self.draft_index if probs is not None else None)
        if shape.tree is not None and self.compacts_trees:
            self._compact_accepted_paths(shape.tree, rows, ctx, active, out)
        top = None if raw is None else top_logprobs(logits, raw, out.output_ids, out.row_ids)
        return VerifyOutput(out.pack(), hidden, aux, out, top)

    def _compact_accepted_paths(self, tree: DraftTree, rows: int, ctx: Tensor, active: Tensor,
                                out: SamplerOutput) -> None:
        """Move each row's accepted tree path into place on the device, in the pass: the
        node accepted at depth ``d`` (``out.row_ids[:, d]``) has its K/V at position
        ``ctx + node`` and belongs at ``ctx + d``. Pairs of rows that accepted less, of nodes
        already in place and of padded rows get slot ``-1`` (skipped), so the pair count is
        fixed (``rows * max_depth``) and the launch can be captured. Within a path both
        positions increase with ``d`` and ``node >= d``, so no pair reads a slot an earlier
        one writes (the order ``compact_kv`` needs)."""
        key = ("depths", tree.max_depth)
        if key not in self._consts:
            self._consts[key] = (to_device(np.arange(1, tree.max_depth + 1, dtype=np.int64),
                                           self.state.device), None, None, None)
        depth = self._consts[key][0]  # [D]
        node = out.row_ids[:rows, 1: tree.max_depth + 1].long()  # [rows, D]
        moves = ((depth[None, :] <= out.num_accepted[:rows, None].long())
                 & (node != depth[None, :]) & active[:, None])
        table = self.state.block_tables[:rows]
        src = slots_of(table, ctx[:, None] + node.clamp_min(0), moves, self.block_size)
        dst = slots_of(table, ctx[:, None] + depth[None, :], moves, self.block_size)
        compact_kv_cache(self.runner.kv_cache.kv, torch.stack([src.reshape(-1),
                                                               dst.reshape(-1)]))


def raw_top(logits: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """(top ids, top logprobs ``[..., TOP]``, log-sum-exp ``[..., 1]``) of raw logits
    ``[..., V]`` in float32: the policy's unprocessed log-softmax (vLLM's default logprobs),
    TOP = min(MAX_TOP_LOGPROBS, V) (every request's N is at most that; the host keeps N)."""
    z = logits.float()
    lse = torch.logsumexp(z, -1, keepdim=True)
    vals, ids = z.topk(min(MAX_TOP_LOGPROBS, z.shape[-1]), dim=-1)
    return ids, vals - lse, lse


def top_logprobs(logits: Tensor, raw: tuple[Tensor, Tensor, Tensor], output_ids: Tensor,
                 row_ids: Tensor) -> Tensor:
    """``[B, N, 2 * TOP + 1]`` float64 (ids exact): for output position ``i`` of row ``b``,
    judged at logits row ``row_ids[b, i]``, that row's top ids, their raw logprobs, and the
    raw logprob of the emitted token ``output_ids[b, i]`` (garbage past the emitted ones).
    ``logits`` may have been masked since ``raw`` was taken: a masked id is never emitted, so
    the emitted token's logit is still the raw one."""
    ids, lps, lse = raw
    bsz, n, vocab = logits.shape
    r = row_ids.long().clamp_min(0)  # [B, N]
    at = r[..., None].expand(-1, -1, ids.shape[-1])
    ids, lps = ids.gather(1, at), lps.gather(1, at)
    flat = r * vocab + output_ids.clamp_min(0)  # the emitted token in its row's logits
    own = logits.reshape(bsz, n * vocab).gather(1, flat).float() - lse[..., 0].gather(1, r)
    return torch.cat([ids.double(), lps.double(), own[..., None].double()], dim=-1)


def mask_stop_ids(logits: Tensor, positions: Tensor, mask: Tensor) -> None:
    """``min_tokens``, in place: row ``b``'s logits at node ``j`` (``[rows, N, V]``) get -inf
    at its stop ids (``mask[b, 1:]``) where the token emitted there, at ``positions[b, j]``,
    comes before ``mask[b, 0]`` (prompt + min_tokens). The mask depends on each node's
    position, so every verify position is judged under its own processed law (the rejection
    sampler then rejects a drafted stop id there and never samples one). One gather and one
    scatter of ``rows x N x ids`` elements; repeated pad ids write the same value twice."""
    rows, n, _ = logits.shape
    ids = mask[:, None, 1:].expand(rows, n, -1)
    on = (positions < mask[:, :1])[..., None]  # [rows, N, 1]
    logits.scatter_(2, ids, torch.where(on, float("-inf"), logits.gather(2, ids)))


def _same_view(a: Tensor, b: Tensor) -> bool:
    """``a`` is a leading block of ``b`` (same start, same strides)."""
    return a.data_ptr() == b.data_ptr() and a.stride() == b.stride()
