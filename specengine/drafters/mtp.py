"""Multi-token-prediction drafter: the checkpoint's own MTP layer, reused autoregressively.

Layout (Qwen3-Next style, on the Llama / Qwen decoder): the target's ``config.json`` declares
``mtp_num_hidden_layers: 1`` and its safetensors hold, next to the target's weights,

    mtp.fc.weight                  [H, 2H]   (no bias)
    mtp.pre_fc_norm_embedding.weight [H]
    mtp.pre_fc_norm_hidden.weight  [H]
    mtp.layers.0.*                 one decoder layer, the target's own layer type
    mtp.norm.weight                [H]

Embeddings and LM head are the target's. The MTP entry at position ``i`` reads the target's
final-norm hidden state ``h_i`` and the next token ``x_{i+1}``:
``g_i = norm(layer(fc(concat(norm_e(embed(x_{i+1})), norm_h(h_i)))))`` (rope position ``i``)
and ``lm_head(g_i)`` predicts ``x_{i+2}``. Drafting feeds ``g_i`` back in place of
``h_{i+1}``. The layer keeps its own one-layer paged KV cache; entries written with a drafted
hidden state are overwritten with the target's once the target has verified the position.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch
from torch import Tensor, nn

from specengine.drafters.base import Drafter, DraftProposal
from specengine.drafters.draft_model import choose_tokens, draft_kv_blocks, tree_level_mask
from specengine.kv_cache import KVCache
from specengine.model.attention import AttentionMetadata, make_attention_backend
from specengine.model.config import ModelConfig
from specengine.model.llama import DecoderLayer, RMSNorm
from specengine.model_runner import ForwardOutput, ModelRunner
from specengine.sequence import SeqStatus, Sequence
from specengine.tree import DraftTree

if TYPE_CHECKING:
    from specengine.engine import SpecEngine

logger = logging.getLogger(__name__)

MTP_PREFIX = "mtp."


class MTPLayers(nn.Module):
    """``fc``, the two pre-fc norms, the decoder layer(s) and the final norm."""

    def __init__(self, cfg: ModelConfig, rope: nn.Module, num_layers: int) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.pre_fc_norm_embedding = RMSNorm(h, cfg.rms_norm_eps)
        self.pre_fc_norm_hidden = RMSNorm(h, cfg.rms_norm_eps)
        self.layers = nn.ModuleList(DecoderLayer(cfg, rope) for _ in range(num_layers))
        self.norm = RMSNorm(h, cfg.rms_norm_eps)


class MTPModule(nn.Module):
    """Parameter names are the checkpoint's (``mtp.fc.weight`` ...); ``embed`` / ``lm_head`` /
    ``rope`` are the target's modules, held outside the parameter tree."""

    def __init__(self, cfg: ModelConfig, target: nn.Module, num_layers: int) -> None:
        super().__init__()
        self.mtp = MTPLayers(cfg, target.model.rotary_emb, num_layers)
        self._shared = (target.model.embed_tokens, target.lm_head, target.model.rotary_emb)

    def forward(self, input_ids: Tensor, hidden: Tensor, positions: Tensor, kv_cache: Tensor,
                meta: AttentionMetadata, backend: object,
                aux_layers: tuple[int, ...] = ()) -> tuple[Tensor, list[Tensor]]:
        embed, _, rope = self._shared
        m = self.mtp
        x = torch.cat([m.pre_fc_norm_embedding(embed(input_ids)),
                       m.pre_fc_norm_hidden(hidden.to(m.fc.weight.dtype))], dim=-1)
        h = m.fc(x)
        cos, sin = rope.cos_sin(positions, h.dtype)
        for i, layer in enumerate(m.layers):
            h = layer(h, cos, sin, kv_cache[0, i], kv_cache[1, i], meta, backend)
        return m.norm(h), []

    def compute_logits(self, hidden: Tensor) -> Tensor:
        return self._shared[1](hidden).float()


@dataclass
class _State:
    block_table: list[int] = field(default_factory=list)
    num_cached: int = 0  # entries 0..num_cached-1 were written with the target's hidden states
    hidden: Tensor | None = None  # g at position num_cached - 1


class MTPDrafter(Drafter):
    """Drafts with the target checkpoint's MTP layer (``draft="mtp"``). Greedy point masses by
    default; ``sample=True`` samples chain drafts like :class:`DraftModelDrafter`."""

    def __init__(self, engine: SpecEngine, *, sample: bool = False) -> None:
        from specengine.model.loader import iter_checkpoint, load_named_tensors

        cfg, mc = engine.config, engine.model_config
        num_layers = mc.num_mtp_layers
        if num_layers != 1:
            raise ValueError(f"draft='mtp' needs a checkpoint with mtp_num_hidden_layers: 1 in "
                             f"config.json (and mtp.* weights); {cfg.model} declares "
                             f"{num_layers}")
        self.sample = bool(sample)
        self.point_mass = not self.sample
        self.device = engine.device
        prev = torch.get_default_dtype()
        torch.set_default_dtype(cfg.torch_dtype)
        try:
            with torch.device(self.device):
                self.module = MTPModule(mc, engine.model, num_layers)
        finally:
            torch.set_default_dtype(prev)
        tensors = ((n, t) for n, t in iter_checkpoint(cfg.model) if n.startswith(MTP_PREFIX))
        load_named_tensors(self.module, tensors, strict=True)
        self.module.eval().requires_grad_(False)
        bpt = 2 * num_layers * mc.num_kv_heads * mc.head_dim * \
            torch.empty(0, dtype=cfg.torch_dtype).element_size()
        self.kv_cache = KVCache(draft_kv_blocks(engine, bpt), cfg.block_size, num_layers,
                                mc.num_kv_heads, mc.head_dim, cfg.torch_dtype, self.device)
        self.runner = ModelRunner(self.module, self.kv_cache,  # type: ignore[arg-type]
                                  make_attention_backend(cfg.kernel_backend), self.device)
        self._states: dict[int, _State] = {}

    def load_weights(self, named_tensors: object) -> list[str]:
        """In-place update of (a subset of) the ``mtp.*`` weights, by checkpoint name."""
        from specengine.model.loader import load_named_tensors

        return load_named_tensors(self.module, named_tensors, strict=False)  # type: ignore

    def release(self, seq: Sequence) -> None:
        st = self._states.pop(seq.seq_id, None)
        if st is not None:
            self.kv_cache.free(st)  # type: ignore[arg-type]

    @torch.inference_mode()
    def _forward(self, states: list[_State], ctx: list[int], tokens: list[list[int]],
                 hidden: Tensor, positions: list[np.ndarray],
                 tree_mask: Tensor | None = None) -> Tensor:
        """One MTP pass: entry j of sequence b (slot ``ctx[b] + j``) reads ``tokens[b][j]`` and
        its row of ``hidden``; returns the output hidden states ``g [T, H]``."""
        q_lens = [len(t) for t in tokens]
        slots = [c + np.arange(n, dtype=np.int64) for c, n in zip(ctx, q_lens)]
        meta = self.runner._metadata(states, ctx, q_lens, slots, tree_mask)  # type: ignore
        ids = torch.tensor([t for ts in tokens for t in ts], dtype=torch.int64,
                           device=self.device)
        pos = torch.from_numpy(np.concatenate(positions)).to(self.device)
        out, _ = self.module(ids, hidden, pos, self.kv_cache.kv, meta, self.runner.backend)
        return out

    def observe(self, seqs: tuple[Sequence, ...], target: ForwardOutput,
                accepted_rows: list[list[int]]) -> None:
        """Write the entries of the positions the target just verified (its hidden states of
        the accepted rows, each with the token that followed)."""
        live = [b for b, s in enumerate(seqs) if s.status is not SeqStatus.FINISHED]
        if not live:
            return
        states, ctx, tokens, positions, rows = [], [], [], [], []
        for b in live:
            seq, acc = seqs[b], accepted_rows[b]
            st = self._states.setdefault(seq.seq_id, _State())
            start = len(seq) - len(acc) - 1  # position of the first accepted row
            if st.num_cached < start:
                logger.debug("mtp: seq %d misses entries %d..%d", seq.seq_id, st.num_cached,
                             start)
            self.kv_cache.ensure(st, len(seq) - 1)  # type: ignore[arg-type]
            states.append(st)
            ctx.append(start)
            tokens.append(seq.token_ids[start + 1: len(seq)])
            positions.append(np.arange(start, len(seq) - 1, dtype=np.int64))
            rows.extend(target.qo_indptr[b] + r for r in acc)
        hidden = target.hidden[torch.tensor(rows, device=target.hidden.device)]
        out = self._forward(states, ctx, tokens, hidden.to(self.device), positions)
        ends = torch.tensor(np.cumsum([len(t) for t in tokens]) - 1, device=self.device)
        last = out[ends]  # a copy: the states must not keep the whole pass alive
        for i, (st, b) in enumerate(zip(states, live)):
            st.num_cached = len(seqs[b]) - 1
            st.hidden = last[i]

    def propose(self, seqs: tuple[Sequence, ...], num_drafts: list[int],
                tree: DraftTree | None) -> DraftProposal:
        width = max(num_drafts)
        ids = torch.zeros(len(seqs), width, dtype=torch.int64, device=self.device)
        counts = torch.tensor(num_drafts, dtype=torch.int32)
        rows = [b for b, n in enumerate(num_drafts) if n > 0]
        for b in rows:  # the last proposals' entries sit after num_cached; room for k - 1 more
            st = self._states[seqs[b].seq_id]
            self.kv_cache.ensure(st, st.num_cached + num_drafts[b])  # type: ignore[arg-type]
        hidden = torch.stack([self._states[seqs[b].seq_id].hidden for b in rows])  # type: ignore
        if tree is not None:
            ids[:, : tree.num_nodes - 1] = self._propose_tree(seqs, tree, hidden)
            return DraftProposal(ids, counts, None)
        probs = None
        fed: dict[int, int] = {}  # the token row b feeds next
        for j in range(width):
            if j > 0:  # entry at position len - 2 + j: (g of the previous entry, draft j - 1)
                keep = [i for i, b in enumerate(rows) if num_drafts[b] > j]
                rows, hidden = [rows[i] for i in keep], hidden[keep]
                pos = [len(seqs[b]) - 2 + j for b in rows]
                hidden = self._forward([self._states[seqs[b].seq_id] for b in rows], pos,
                                       [[fed[b]] for b in rows], hidden,
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
        return DraftProposal(ids, counts, probs)

    def _propose_tree(self, seqs: tuple[Sequence, ...], tree: DraftTree,
                      root_hidden: Tensor) -> Tensor:
        """Level by level: each pass feeds the entries of the nodes down to depth d (ancestor
        mask; entry of node i reads its parent's g and its own token)."""
        states = [self._states[s.seq_id] for s in seqs]
        n_nodes, batch = tree.num_nodes, len(seqs)
        ctx = [len(s) - 1 for s in seqs]
        g = {0: root_hidden}
        top = {0: self.module.compute_logits(root_hidden).topk(tree.max_rank + 1, -1).indices}
        node_ids = torch.zeros(batch, n_nodes, dtype=torch.int64, device=self.device)
        for d in range(1, tree.max_depth + 1):
            for i in np.flatnonzero(tree.depths == d):
                node_ids[:, i] = top[int(tree.parents[i])][:, int(tree.ranks[i])]
            if d == tree.max_depth:
                break
            n = int((tree.depths <= d).sum())
            parent_g = torch.stack([g[int(tree.parents[i])] for i in range(1, n)], dim=1)
            positions = [c - 1 + tree.depths[1:n].astype(np.int64) for c in ctx]
            out = self._forward(states, ctx, node_ids[:, 1:n].tolist(),
                                parent_g.reshape(batch * (n - 1), -1), positions,
                                tree_level_mask(tree, n, batch, self.device))
            out = out.view(batch, n - 1, -1)
            for i in np.flatnonzero(tree.depths == d):
                g[int(i)] = out[:, i - 1]
                if (tree.parents == i).any():
                    logits = self.module.compute_logits(out[:, i - 1])
                    top[int(i)] = logits.topk(tree.max_rank + 1, dim=-1).indices
        return node_ids[:, 1:]
