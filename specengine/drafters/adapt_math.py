"""The EAGLE-3 training loss of a head on buffered rollouts (``drafters/adapt.py``).

The loss unrolls the head exactly as drafting runs it (``Eagle3Head.forward``,
``FeatureDrafter`` / ``StaticFeatureChain``), "training-time test" in EAGLE-3's words:

* depth 0: entry ``i`` (rope position ``i``) reads the target's features ``f_i`` (through
  ``fc``) and ``x_{i+1}``, attends causally to entries ``0 .. i``; ``g0_i`` predicts
  ``x_{i+2}``. These are the entries the catch-up pass writes from the target's features.
* depth ``d >= 1``: the entry of anchor ``i`` sits at position ``i + d``, reads ``g{d-1}_i``
  (the head's own output, ``fc`` skipped) and ``x_{i+d+1}``, and attends to the target-feature
  entries ``0 .. i`` plus the anchor's own entries of depths ``1 .. d``: the keys the draft
  chain rooted at ``i`` sees in the paged cache. ``g{d}_i`` predicts ``x_{i+d+2}``.

Fed tokens are the policy's (teacher forcing): a draft at depth ``d`` only counts when drafts
``0 .. d-1`` were accepted, i.e. equal to the tokens the policy then produced. Only anchors a
draft chain can start from (``i >= prompt_len - 1``) and targets with a draft id count; the
loss is ``sum_d 0.8^d * mean CE_d`` (EAGLE-3's depth weights). The parameters come as a
dict (the trainer's float32 masters); the target's embeddings are read, never trained.

**Soft targets.** The token ``x_{i+d+2}`` is one sample of the policy's distribution at
position ``i + d + 1``; when that distribution is known (offline training records the
policy's top-N log-probabilities of every generated position, ``train/offline.py``), the
entry's cross-entropy is taken against it instead, restricted to the draft vocabulary and
renormalised there (SpecForge trains on the target's distribution the same way). Its
expectation over the sampled token is the hard loss's, with far less variance: at T=1 one
sampled token says little about which token is the policy's most likely one, which is what
greedy drafting must guess. An entry whose recorded tokens have no draft id keeps the hard
target (or none).

**Acceptance term.** A draft drawn from the head's ``q`` is kept with probability
``sum_x min(p(x), q(x)) = 1 - TV(p, q)`` (rejection sampling), so sampled drafting's
acceptance is exactly one minus the total-variation distance, not the cross-entropy: the
cross-entropy (forward KL) spreads ``q`` over every token ``p`` might take, which costs
acceptance wherever the head cannot tell which of them the policy favours here.
``tv_weight`` adds ``w * (1 - sum_x min(p, q))`` to each entry's loss (``p`` the recorded
distribution over draft ids, or the hard target's point mass, where ``min`` reads
``q(target)``). The cross-entropy stays: TV's gradient is ``q``-weighted and vanishes on
tokens ``q`` gives nothing (DistillSpec, Zhou et al. 2023, compares such divergences).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specengine.kernels.reference import add_rms_norm, rms_norm, silu_mul
from specengine.kernels.reference_layer import split_qkv_rope

DEPTH_WEIGHT = 0.8


def chain_attention(q: Tensor, k: Tensor, v: Tensor, causal: Tensor, own_k: list[Tensor],
                    own_v: list[Tensor], scale: float) -> Tensor:
    """Attention of the anchors' queries ``q [B, T', Hq, D]`` over the target-feature entries
    ``k / v [B, T, Hq, D]`` (``causal [B, 1, T', T]``) and over each anchor's own entries of
    the earlier depths (``own_k / own_v``, one ``[B, T', Hq, D]`` per depth: the diagonal
    keys its draft chain wrote)."""
    t = k.shape[1]
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~causal, float("-inf"))
    if own_k:
        diag = torch.stack([(q * kk).sum(-1) for kk in own_k], -1) * scale
        scores = torch.cat([scores, diag.permute(0, 2, 1, 3)], -1)  # [B, Hq, T', T+d]
    probs = torch.softmax(scores, dim=-1)
    out = torch.einsum("bhqk,bkhd->bqhd", probs[..., :t], v)
    for e, vv in enumerate(own_v):
        out = out + probs[..., t + e].permute(0, 2, 1)[..., None] * vv
    return out


class HeadMath:
    """The head's forward as differentiable tensor maths over a dict of parameters."""

    def __init__(self, head: nn.Module, embed: nn.Embedding) -> None:
        self.head, self.embed = head, embed
        attn = head.midlayer.self_attn
        self.num_heads, self.num_kv_heads = attn.num_heads, attn.num_kv_heads
        self.scale = attn.scale
        self.eps = head.norm.eps
        self.qk_eps = attn.q_norm.eps if attn.qk_norm else 1e-6
        self.norm_before_residual = head.midlayer.norm_before_residual

    def _w(self, p: dict[str, Tensor], name: str) -> Tensor | None:
        return p.get(name)

    def to_draft(self, device: torch.device) -> Tensor | None:
        """Target id -> draft id (``-100``: no draft id, no loss) for the loss's targets;
        None where the head's logits are over the target vocabulary (MTP)."""
        d2t = self.head.draft_to_target
        out = torch.full((self.head.vocab_size,), -100, dtype=torch.int64, device=device)
        out[d2t] = torch.arange(d2t.numel(), device=device)
        return out

    def qkv(self, p: dict[str, Tensor], ids: Tensor, hidden: Tensor, positions: Tensor
            ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """``ids [B, T]``, ``hidden [B, T, 3H or H]``, ``positions [T]`` → q ``[B, T, Hq, D]``,
        k / v ``[B, T, Hkv, D]`` and the residual ``[B, T, H]``."""
        embeds = F.embedding(ids, self.embed.weight.detach()).float()
        if hidden.shape[-1] != embeds.shape[-1]:
            hidden = F.linear(hidden, p["fc.weight"])
        m = "midlayer."
        normed = rms_norm(hidden, p[m + "hidden_norm.weight"], self.eps)
        x = torch.cat([rms_norm(embeds, p[m + "input_layernorm.weight"], self.eps), normed], -1)
        residual = normed if self.norm_before_residual else hidden
        q, k, v = self.attn_qkv(p, m + "self_attn.", x, positions, self.head.rotary_emb)
        return q, k, v, residual

    def attn_qkv(self, p: dict[str, Tensor], a: str, x: Tensor, positions: Tensor,
                 rope: nn.Module) -> tuple[Tensor, Tensor, Tensor]:
        """The attention's ``qkv_proj`` (prefix ``a``) of ``x [B, T, *]``, its q/k norms and
        the rotary embedding at ``positions [T]``: q ``[B, T, Hq, D]``, k / v
        ``[B, T, Hkv, D]`` (the EAGLE-3 and MTP layers alike)."""
        b, t = x.shape[:2]
        qkv = F.linear(x, p[a + "qkv_proj.weight"], self._w(p, a + "qkv_proj.bias"))
        cos, sin = rope.cos_sin(positions, torch.float32)
        q, k, v = split_qkv_rope(qkv.reshape(b * t, -1), cos.repeat(b, 1), sin.repeat(b, 1),
                                 self.num_heads, self.num_kv_heads,
                                 self._w(p, a + "q_norm.weight"), self._w(p, a + "k_norm.weight"),
                                 self.qk_eps)
        return (q.view(b, t, self.num_heads, -1), k.view(b, t, self.num_kv_heads, -1),
                v.view(b, t, self.num_kv_heads, -1))

    def layer_out(self, p: dict[str, Tensor], m: str, mlp: str, attn: Tensor,
                  residual: Tensor) -> Tensor:
        """A decoder layer after its attention (layer prefix ``m``, MLP prefix ``mlp``):
        ``o_proj``, the post-attention add + norm and the MLP."""
        o = F.linear(attn.flatten(-2), p[m + "self_attn.o_proj.weight"],
                     self._w(p, m + "self_attn.o_proj.bias"))
        x, residual = add_rms_norm(o, residual, p[m + "post_attention_layernorm.weight"],
                                   self.eps)
        up = F.linear(x, p[mlp + "gate_up_proj.weight"], self._w(p, mlp + "gate_up_proj.bias"))
        return residual + F.linear(silu_mul(up), p[mlp + "down_proj.weight"],
                                   self._w(p, mlp + "down_proj.bias"))

    def finish(self, p: dict[str, Tensor], attn: Tensor, residual: Tensor) -> Tensor:
        """``o_proj``, the post-attention add + norm and the MLP: the entries' ``g``."""
        return self.layer_out(p, "midlayer.", "midlayer.mlp.", attn, residual)

    def logits(self, p: dict[str, Tensor], g: Tensor) -> Tensor:
        return F.linear(rms_norm(g, p["norm.weight"], self.eps), p["lm_head.weight"])

    def unroll(self, p: dict[str, Tensor], feats: Tensor, ids: Tensor, valid: Tensor,
               depth: int, start: int = 0) -> list[Tensor]:
        """Draft logits ``[B, T - start, Vd]`` per depth ``0 .. depth-1`` (module docstring)
        of the anchors ``start .. T-1``. ``feats [B, T, 3H]`` float32, ``ids [B, T + depth]``
        (``ids[:, j] = x_{j+1}``, padded), ``valid [B, T]`` marks real entries. Entries
        before ``start`` are only keys and values (a prompt's: no anchor there), so their
        queries, MLP and logits are not computed."""
        b, t = valid.shape
        group = self.num_heads // self.num_kv_heads
        pos = torch.arange(t, device=feats.device)
        causal = (pos[start:, None] >= pos[None, :])[None, None] & valid[:, None, None, :]
        q, k0, v0, res = self.qkv(p, ids[:, :t], feats, pos)
        q, res = q[:, start:], res[:, start:]
        k0 = k0.repeat_interleave(group, dim=2)  # [B, T, Hq, D]
        v0 = v0.repeat_interleave(group, dim=2)
        own_k: list[Tensor] = []  # the anchor's entries of depths 1 .. d (diagonal keys)
        own_v: list[Tensor] = []
        out = []
        g = feats  # replaced by each depth's output before depth d + 1 reads it
        for d in range(depth):
            if d > 0:
                q, k, v, res = self.qkv(p, ids[:, start + d: d + t], g, pos[start:] + d)
                own_k.append(k.repeat_interleave(group, dim=2))
                own_v.append(v.repeat_interleave(group, dim=2))
            attn = chain_attention(q, k0, v0, causal, own_k, own_v, self.scale)
            g = self.finish(p, attn, res)
            out.append(self.logits(p, g))
        return out


def ttt_sums(math: HeadMath, p: dict[str, Tensor], feats: Tensor, ids: Tensor,
             valid: Tensor, targets: list[Tensor],
             soft: list[tuple[Tensor, Tensor]] | None = None,
             tv_weight: float = 0.0) -> tuple[Tensor, Tensor]:
    """Per depth ``d``: the summed cross-entropy of the depth-d logits against ``targets[d]``
    (``-100``: no loss at that entry) and the number of entries it sums over. ``soft[d]``:
    ``(idx [B, T, K], probs [B, T, K])``, the policy's distribution over draft ids at each
    entry (``probs`` 0 on padding, rows summing to 1 or all 0): an entry with one is scored
    against it (module docstring) and counts whether or not its hard target has a draft id.
    ``tv_weight > 0`` adds that multiple of each entry's rejection probability (module
    docstring, "Acceptance term")."""
    # the first entry with a loss at any depth (anchors start at a prompt's last token):
    # the entries before it only serve as keys and values
    masks = [tg >= 0 for tg in targets]
    if soft is not None:
        masks = [m | (pr.sum(-1) > 0) for m, (_, pr) in zip(masks, soft)]
    has = torch.stack([m.any(0) for m in masks]).any(0)
    start = int(has.int().argmax()) if bool(has.any()) else 0
    logits = math.unroll(p, feats, ids, valid, len(targets), start)
    if soft is None and tv_weight == 0.0:
        sums = torch.stack([F.cross_entropy(lg.flatten(0, 1), tg[:, start:].flatten(),
                                            ignore_index=-100, reduction="sum")
                            for lg, tg in zip(logits, targets)])
        return sums, torch.stack([m.sum() for m in masks])
    out = []
    for d, (lg, tg, m) in enumerate(zip(logits, targets, masks)):
        logp = torch.log_softmax(lg, dim=-1)  # [B, T', Vd]
        tg, m = tg[:, start:], m[:, start:]
        hard_logp = logp.gather(-1, tg.clamp_min(0)[..., None])[..., 0]  # [B, T']
        nll = -hard_logp
        if tv_weight:
            # a point mass on the hard target: sum_x min(p, q) = q(target)
            nll = nll + tv_weight * (1.0 - hard_logp.float().exp())
        if soft is not None:
            idx, pr = soft[d][0][:, start:], soft[d][1][:, start:]  # [B, T', K]
            has = pr.sum(-1) > 0
            logq = logp.gather(-1, idx.clamp_min(0))
            # padding has probability 0 and a clamped index: 0 * a finite log-probability
            dist = -(pr * logq).sum(-1)
            if tv_weight:
                # padding: min(0, q) = 0, whatever its clamped index reads
                kept = torch.minimum(pr.float(), logq.float().exp()).sum(-1)
                dist = dist + tv_weight * (1.0 - kept)
            nll = torch.where(has, dist, nll)
        out.append(torch.where(m, nll, torch.zeros_like(nll)).sum())
    return torch.stack(out), torch.stack([m.sum() for m in masks])


def ttt_loss(sums: Tensor, counts: Tensor) -> Tensor:
    """``sum_d 0.8^d * mean CE_d`` from :func:`ttt_sums` totals."""
    w = DEPTH_WEIGHT ** torch.arange(len(sums), device=sums.device, dtype=sums.dtype)
    return (w * sums / counts.clamp_min(1)).sum()
