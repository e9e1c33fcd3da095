"""Small-LM drafter: a second model with the target's vocabulary, run autoregressively on its
own paged KV cache (DESIGN §7).

KV bookkeeping per sequence: positions ``0 .. num_cached-1`` of the draft cache hold the K/V
of ``seq.token_ids[:num_cached]``; ``pending`` are the draft tokens fed speculatively right
after them. ``observe`` keeps the pending tokens the target accepted (the K/V the draft wrote
for them is exactly what it would write now) and drops the rest; ``propose`` first feeds the
tokens the draft has not seen (the newest token, and at most one accepted draft more), so the
cache is rewritten from the first divergence on.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor

from specengine.drafters.base import Drafter, DraftProposal
from specengine.kv_cache import KVCache
from specengine.model.attention import make_attention_backend
from specengine.model.config import ModelConfig
from specengine.model_runner import ForwardOutput, ModelRunner
from specengine.sequence import SeqStatus, Sequence
from specengine.tree import DraftTree

if TYPE_CHECKING:
    from specengine.engine import SpecEngine

logger = logging.getLogger(__name__)

def _signed(c: int) -> int:
    c %= 1 << 64
    return c - (1 << 64) if c >= 1 << 63 else c


_K = tuple(_signed(c) for c in (0x9E3779B97F4A7C15, 0xBF58476D1CE4E5B9, 0x94D049BB133111EB,
                                 0xD6E8FEB86659FD93))


def draft_uniforms(seeds: Tensor, positions: Tensor, vocab: int) -> Tensor:
    """``[B, V]`` uniforms in (0, 1): a counter-based hash (splitmix64 finaliser, int64
    arithmetic wrapping) of (request seed, draft position, token id). This is the drafter's
    own stream, independent of the target sampler's Philox draws; the same (seed, position)
    always gives the same numbers, and no host sync is needed."""
    ids = torch.arange(vocab, device=seeds.device, dtype=torch.int64)
    x = seeds[:, None] * _K[0] + positions[:, None] * _K[1] + ids[None, :] * _K[3] + _K[2]
    for shift, mul in ((30, _K[1]), (27, _K[2]), (31, 1)):
        x = (x ^ ((x >> shift) & ((1 << (64 - shift)) - 1))) * mul
    return (((x >> 40) & 0xFFFFFF).float() + 0.5) / float(1 << 24)


def processed_probs(logits: Tensor, temperature: Tensor, top_k: Tensor, top_p: Tensor) -> Tensor:
    """The policy's sampling distribution per row, computed as the rejection sampler computes
    its ``p`` (``kernels.reference``: ``z = logits · (1/T)``, keep ``z >= keep_threshold``, i.e.
    top-k then top-p with ties kept, softmax over the kept set). ``temperature`` > 0."""
    from specengine.kernels.reference import keep_threshold

    z = logits.float() * temperature.reciprocal()[:, None]
    kept = z >= keep_threshold(z, top_k, top_p)[:, None]
    w = torch.where(kept, torch.exp(z - z.max(1, keepdim=True).values), 0.0)
    return w / w.sum(1, keepdim=True)


def choose_tokens(logits: Tensor, seqs: list[Sequence], positions: list[int],
                  sample: bool) -> tuple[Tensor, Tensor | None]:
    """Draft tokens from ``logits [B, V]``: the argmax (``sample`` False, or greedy requests),
    else a draw from :func:`processed_probs` with the request's temperature / top-k / top-p,
    made with :func:`draft_uniforms` of (request seed, ``positions[b]``) by an exponential race
    (``argmax q / Exp(1)`` is distributed as ``q``). Returns the tokens ``[B]`` and, when
    sampling, the distributions they were drawn from ``[B, V]`` float32 (one-hot for greedy
    requests)."""
    logits = logits.float()
    tokens = logits.argmax(-1)
    if not sample:
        return tokens, None
    dev = logits.device
    params = [s.params for s in seqs]
    temperature = torch.tensor([p.temperature for p in params], device=dev)
    greedy = temperature == 0
    q = processed_probs(logits, torch.where(greedy, 1.0, temperature),
                        torch.tensor([p.top_k for p in params], device=dev),
                        torch.tensor([p.top_p for p in params], device=dev))
    one_hot = torch.zeros_like(logits).scatter_(-1, tokens[:, None], 1.0)
    q = torch.where(greedy[:, None], one_hot, q)
    seeds = torch.tensor([_signed(s.seed) for s in seqs], dtype=torch.int64, device=dev)
    pos = torch.tensor(positions, dtype=torch.int64, device=dev)
    drawn = (q / -torch.log(draft_uniforms(seeds, pos, logits.shape[-1]))).argmax(-1)
    return torch.where(greedy, tokens, drawn), q


def draft_kv_blocks(engine: SpecEngine, bytes_per_token: int) -> int:
    """Blocks for a drafter's cache: as many tokens as the target's cache will hold (so the
    draft never runs out first). On CUDA the free memory is split between both caches."""
    from specengine.engine import CPU_KV_BUDGET_BYTES, GPU_MEMORY_UTILIZATION, MAX_K

    cfg, mc = engine.config, engine.model_config
    target_bpt = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * \
        torch.empty(0, dtype=cfg.torch_dtype).element_size()
    wanted = cfg.max_batch_size * (cfg.max_model_len + MAX_K + 1)
    if cfg.kv_cache_tokens is not None:
        tokens = cfg.kv_cache_tokens
    elif engine.device.type == "cuda":
        free, total = torch.cuda.mem_get_info(engine.device)
        budget = max(free - (1 - GPU_MEMORY_UTILIZATION) * total, 0)
        tokens = min(wanted, int(budget // (target_bpt + bytes_per_token)))
    else:
        tokens = min(wanted, CPU_KV_BUDGET_BYTES // target_bpt)
    return max(1, tokens // cfg.block_size)


@dataclass
class _State:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0
    pending: list[int] = field(default_factory=list)


def tree_level_mask(tree: DraftTree, n: int, batch: int, device: torch.device) -> Tensor:
    """Packed mask of tree nodes ``1 .. n-1`` (the root sits in the context), per sequence."""
    from specengine.kernels.reference import pack_tree_mask

    return pack_tree_mask(tree.dense_mask[1:n, 1:n]).to(device).repeat(batch, 1)


class DraftModelDrafter(Drafter):
    """A small causal LM with the target's vocabulary proposes drafts autoregressively.

    ``sample=False`` (default): greedy point-mass drafts (``probs`` None). ``sample=True``:
    chain drafts are drawn from the request's temperature / top-k / top-p distribution on the
    drafter's own seeded stream and ``probs`` holds those distributions. Trees always take each
    node's rank-r most likely child (point masses). ``module`` is the draft ``CausalLM``
    (checkpoint names); :meth:`load_weights` updates it in place.
    """

    def __init__(self, path: str | Path, engine: SpecEngine, *, sample: bool = False) -> None:
        from specengine.engine import build_model

        cfg, target = engine.config, engine.model_config
        dcfg = ModelConfig.from_dir(path)
        if dcfg.vocab_size != target.vocab_size:
            raise ValueError(f"draft model {path} has vocab_size {dcfg.vocab_size} but the target "
                             f"has {target.vocab_size}: a draft LM needs the target's vocabulary")
        _check_tokenizers(Path(path), Path(cfg.model))
        if dcfg.max_position_embeddings < cfg.max_model_len:
            logger.warning("draft max_position_embeddings %d < max_model_len %d",
                           dcfg.max_position_embeddings, cfg.max_model_len)
        self.sample = bool(sample)
        self.point_mass = not self.sample
        self.device = engine.device
        self.module = build_model(path, cfg.torch_dtype, self.device)
        bpt = 2 * dcfg.num_layers * dcfg.num_kv_heads * dcfg.head_dim * \
            torch.empty(0, dtype=cfg.torch_dtype).element_size()
        self.kv_cache = KVCache(draft_kv_blocks(engine, bpt), cfg.block_size, dcfg.num_layers,
                                dcfg.num_kv_heads, dcfg.head_dim, cfg.torch_dtype, self.device)
        self.runner = ModelRunner(self.module, self.kv_cache,
                                  make_attention_backend(cfg.kernel_backend), self.device)
        self._states: dict[int, _State] = {}

    # ---------------------------------------------------------------------------------------
    def load_weights(self, named_tensors: object) -> list[str]:
        """In-place update of (a subset of) the draft's weights, by checkpoint name; the draft
        KV of live sequences is recomputed from scratch at their next proposal."""
        from specengine.model.loader import load_named_tensors, tied_names

        names = load_named_tensors(self.module, named_tensors,  # type: ignore[arg-type]
                                   strict=False, tied=tied_names(self.module))
        for st in self._states.values():
            st.num_cached, st.pending = 0, []
        return names

    def release(self, seq: Sequence) -> None:
        st = self._states.pop(seq.seq_id, None)
        if st is not None:
            self.kv_cache.free(st)  # type: ignore[arg-type]

    def observe(self, seqs: tuple[Sequence, ...], target: ForwardOutput,
                accepted_rows: list[list[int]]) -> None:
        """Keep the accepted speculative K/V; prefill the draft on new sequences' prompts."""
        new = []
        for seq in seqs:
            st = self._states.get(seq.seq_id)
            if st is None:
                if seq.status is not SeqStatus.FINISHED:
                    new.append(seq)
                continue
            m = 0
            tail = seq.token_ids[st.num_cached:]
            while m < min(len(st.pending), len(tail)) and st.pending[m] == tail[m]:
                m += 1
            st.num_cached += m
            st.pending = []
        if new:
            self._catch_up(new, [self._state(s) for s in new], upto_last=False)

    # ---------------------------------------------------------------------------------------
    def _state(self, seq: Sequence) -> _State:
        return self._states.setdefault(seq.seq_id, _State())

    def _forward(self, states: list[_State], ctx: list[int], tokens: list[list[int]],
                 positions: list[np.ndarray], tree_mask: Tensor | None = None) -> Tensor:
        """One draft pass; sequence b feeds ``tokens[b]`` into slots ``ctx[b]..`` at
        ``positions[b]``. Returns the final hidden states ``[T, H]``."""
        q_lens = [len(t) for t in tokens]
        slots = [c + np.arange(n, dtype=np.int64) for c, n in zip(ctx, q_lens)]
        meta = self.runner._metadata(states, ctx, q_lens, slots, tree_mask)  # type: ignore
        hidden, _ = self.runner._run([t for ts in tokens for t in ts], np.concatenate(positions),
                                     meta)
        return hidden

    def _catch_up(self, seqs: list[Sequence], states: list[_State], upto_last: bool,
                  extra: list[int] | None = None) -> Tensor:
        """Feed every token the draft has not cached (all but the newest unless ``upto_last``),
        reserving ``extra[b]`` more slots; returns the logits after each last fed token."""
        ctx, tokens, positions = [], [], []
        for b, (seq, st) in enumerate(zip(seqs, states)):
            end = len(seq) if upto_last else len(seq) - 1
            start = min(st.num_cached, end - 1)
            self.kv_cache.ensure(st, end + (extra[b] if extra else 0))  # type: ignore[arg-type]
            ctx.append(start)
            tokens.append(seq.token_ids[start:end])
            positions.append(np.arange(start, end, dtype=np.int64))
            st.num_cached, st.pending = end, []
        hidden = self._forward(states, ctx, tokens, positions)
        last = torch.tensor(np.cumsum([len(t) for t in tokens]) - 1, device=self.device)
        return self.module.compute_logits(hidden[last])

    # ---------------------------------------------------------------------------------------
    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int],
                tree: DraftTree | None) -> DraftProposal:
        width = max(num_drafts)
        ids = torch.zeros(len(seqs), width, dtype=torch.int64, device=self.device)
        counts = torch.tensor(num_drafts, dtype=torch.int32)
        if tree is not None:
            ids[:, : tree.num_nodes - 1] = self._propose_tree(seqs, tree)
            return DraftProposal(ids, counts, None)
        probs = None
        active = [b for b, n in enumerate(num_drafts) if n > 0]
        act_seqs = [seqs[b] for b in active]
        states = [self._state(s) for s in act_seqs]
        logits = self._catch_up(act_seqs, states, upto_last=True,
                                extra=[num_drafts[b] - 1 for b in active])
        rows = active
        fed: dict[int, int] = {}  # the token row b feeds next
        for j in range(width):
            if j > 0:  # feed draft j-1 of the sequences that want a draft j
                keep = [i for i, b in enumerate(rows) if num_drafts[b] > j]
                rows = [rows[i] for i in keep]
                pos = [len(seqs[b]) - 1 + j for b in rows]
                hidden = self._forward([self._states[seqs[b].seq_id] for b in rows], pos,
                                       [[fed[b]] for b in rows],
                                       [np.array([p], dtype=np.int64) for p in pos])
                logits = self.module.compute_logits(hidden)
            tokens, q = choose_tokens(logits, [seqs[b] for b in rows],
                                      [len(seqs[b]) + j for b in rows], self.sample)
            if j + 1 < width:  # one host sync per draft step
                fed = dict(zip(rows, tokens.tolist()))
            sel = torch.tensor(rows, device=self.device)
            ids[sel, j] = tokens
            if q is not None:
                if probs is None:
                    probs = torch.zeros(len(seqs), width, q.shape[-1], device=self.device)
                probs[sel, j] = q
        for b in active:
            self._states[seqs[b].seq_id].pending = ids[b, : num_drafts[b] - 1].tolist()
        return DraftProposal(ids, counts, probs)

    def _propose_tree(self, seqs: tuple[Sequence, ...], tree: DraftTree) -> Tensor:
        """Level by level: each pass feeds the tree's nodes down to depth d (root in the
        context, ancestor mask) and ranks the children of the depth-d nodes."""
        states = [self._state(s) for s in seqs]
        n_nodes = tree.num_nodes
        root_logits = self._catch_up(list(seqs), states, upto_last=True,
                                     extra=[n_nodes - 1] * len(seqs))
        top = {0: root_logits.topk(tree.max_rank + 1, dim=-1).indices}
        node_ids = torch.zeros(len(seqs), n_nodes, dtype=torch.int64, device=self.device)
        ctx = [len(s) for s in seqs]
        for d in range(1, tree.max_depth + 1):
            for i in np.flatnonzero(tree.depths == d):
                node_ids[:, i] = top[int(tree.parents[i])][:, int(tree.ranks[i])]
            if d == tree.max_depth:
                break
            n = int((tree.depths <= d).sum())
            positions = [c - 1 + tree.depths[1:n].astype(np.int64) for c in ctx]
            hidden = self._forward(states, ctx, node_ids[:, 1:n].tolist(), positions,
                                   tree_level_mask(tree, n, len(seqs), self.device))
            hidden = hidden.view(len(seqs), n - 1, -1)
            for i in np.flatnonzero(tree.depths == d):
                if (tree.parents == i).any():
                    logits = self.module.compute_logits(hidden[:, i - 1])
                    top[int(i)] = logits.topk(tree.max_rank + 1, dim=-1).indices
        for st, c in zip(states, ctx):
            st.num_cached, st.pending = c, []  # tree slots are not linear positions
        return node_ids[:, 1:]


def _check_tokenizers(draft: Path, target: Path) -> None:
    """Both dirs have a tokenizer.json → their vocabularies must agree."""
    files = [p / "tokenizer.json" for p in (draft, target)]
    if not all(f.is_file() for f in files):
        return
    try:
        from tokenizers import Tokenizer
    except ImportError:
        return
    vocabs = [Tokenizer.from_file(str(f)).get_vocab(with_added_tokens=True) for f in files]
    if vocabs[0] != vocabs[1]:
        diff = sorted(set(vocabs[0].items()) ^ set(vocabs[1].items()))[:3]
        raise ValueError(f"draft tokenizer {files[0]} differs from the target's ({diff} ...): "
                         "a draft LM needs the target's vocabulary")
