"""A/B of fresh EAGLE-3 head shapes on one saved set of rollouts (issue 34 item 3: which
choices matter once data and steps are fixed).

``rollouts`` runs ``train-draft``'s generation once (``offline.generate_set``: the policy at
``--temperature`` with its top-20 distribution recorded per token, then greedy rollouts of the
held-out prompts) and saves both sets. ``train`` then trains one head variant on it with
``train-draft``'s loop (``DraftTrainer``, ``HeadOptimizer``, its step schedule and learning
rate) and reports at ``--points`` points:

- the greedy mean accepted length of the held-out greedy rollouts replayed with the head's
  unrolled maths (``offline.offline_acceptance``, k = 1..5), as train-draft's curve;
- a T=1 proxy on the last ``--proxy-rollouts`` sampled rollouts, never trained on: per depth,
  the mean of ``sum_x min(p(x), q(x))`` with ``p`` the policy's recorded top-20 distribution
  over draft ids (renormalised there) and ``q`` the head's (teacher forced). That is the
  probability that a draft drawn from ``q`` is accepted at that depth, given the earlier ones
  were (EAGLE-3 heads draw the drafts of sampled requests).

Variants: ``--mlp-width`` (the head's MLP, default the target's), ``--draft-vocab-size``,
``--feature-rms-norm`` (each aux layer's feature divided by its RMS per token before ``fc``),
``--layers 2`` (a second decoder layer after the EAGLE-3 layer, :class:`TwoLayerMath`), ``--lr``,
``--steps``, ``--batch-tokens``, ``--tv-weight`` (the loss's acceptance term, train-draft's
``--tv-weight``). The last two shapes are trials of the maths only: the engine
loads one-layer heads with raw features (the published EAGLE-3 layout).

Initialisations and precision: ``--head-init-target`` (train-draft's ``--head-init target``),
``--induction-init`` (head 0 starts as a 2-gram induction head over numbers, in the published
layout: :class:`InductionHead`) and ``--train-dtype bfloat16`` (train-draft's autocast).
``--points-at 1`` also measures the head right after its first step.

Data: ``--extra-data`` (a second set written by ``rollouts``, e.g. ``--temperature 0``: greedy
rollouts of the same training prompts) trains on the union of both sets' sequences (the
first set less its proxy rollouts), shuffled together; ``--extra-fraction F`` instead draws a
fixed share ``F`` of the steps' batches from the second set (1: that set alone). The draft
vocabulary is then the most frequent tokens of both sets. The proxy stays on the last
``--proxy-rollouts`` rollouts of the first set, the greedy replay on the first set's held-out
rollouts.

Usage::

    python benchmarks/ab_draft_head.py rollouts --model DIR --prompts train.jsonl \\
        --eval-prompts held.jsonl --out SET.safetensors [--rollout-tokens 200000] [--threads 2] \\
        [--temperature 0]
    python benchmarks/ab_draft_head.py train --model DIR --data SET.safetensors --name base \\
        [--mlp-width 3072] [--draft-vocab-size 8192] [--feature-rms-norm] [--json OUT.json] \\
        [--extra-data GREEDY.safetensors [--extra-fraction 0.5]]
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from specengine.drafters.adapt import BufferedSeq
from specengine.drafters.adapt_math import HeadMath, chain_attention, ttt_loss
from specengine.drafters.draft_trainer import DraftTrainer, HeadOptimizer
from specengine.kernels.reference import rms_norm
from specengine.model.config import ModelConfig
from specengine.model.llama import MLP, Attention, RMSNorm
from specengine.train.data import read_prompts, tokenize_prompts
from specengine.train.head_init import (
    build_head,
    fresh_config,
    init_from_target,
    most_frequent,
    read_config,
    write_head,
)
from specengine.train.offline import (
    GeneratedSet,
    TrainDraftConfig,
    generate_set,
    learning_rate,
    loss_autocast,
    offline_acceptance,
    read_embedding,
    training_schedule,
)

logger = logging.getLogger("ab_draft_head")
GROUP = 16  # sequences per padded forward of the proxy


def held_path(data: Path) -> Path:
    return data.with_name(data.stem + ".held.safetensors")


def save_rollouts(args: argparse.Namespace) -> dict[str, Any]:
    """Generate and save the training set (``--out``) and the held-out greedy set beside it."""
    cfg = TrainDraftConfig(
        model=args.model, prompts=args.prompts, eval_prompts=args.eval_prompts,
        out=args.out.parent, holdout=args.holdout, eval_max_tokens=args.eval_max_tokens,
        temperature=args.temperature, max_tokens=args.max_tokens,
        rollout_tokens=args.rollout_tokens, device=args.device, num_threads=args.threads,
        greedy_rollout_tokens=0,  # one temperature per set: a greedy set is --extra-data
        progress=False)
    target_cfg, embed = read_config(args.model), read_embedding(args.model)
    prompts = tokenize_prompts(args.model, read_prompts(args.prompts))
    held_prompts = tokenize_prompts(args.model, read_prompts(args.eval_prompts))[: args.holdout]
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:  # a random head only drives the capture
        torch.manual_seed(cfg.seed)
        gen_cfg = fresh_config(target_cfg, min(embed.num_embeddings, 4096), "float32")
        write_head(build_head(gen_cfg, embed, torch.device("cpu")), gen_cfg, tmp, torch.float32)
        data, held = generate_set(cfg, prompts, Path(tmp), embed.num_embeddings, None,
                                  held_prompts)
    assert held is not None
    data.holdout = held_prompts
    args.out.parent.mkdir(parents=True, exist_ok=True)
    data.save(args.out)
    held.save(held_path(args.out))
    return {"num_tokens": data.num_tokens, "num_seqs": len(data.seqs),
            "num_held": len(held.seqs), "seconds": time.perf_counter() - t0}


def rms_normalise_features(data: GeneratedSet, num_aux: int = 3, chunk: int = 65536) -> None:
    """Each aux layer's feature divided by its RMS, per token, in place (``--feature-rms-norm``)."""
    assert data.feats is not None
    h = data.feats.shape[1] // num_aux
    for i in range(0, data.feats.shape[0], chunk):
        f = data.feats[i: i + chunk].view(-1, num_aux, h)
        f.mul_(torch.rsqrt(f.pow(2).mean(-1, keepdim=True) + 1e-6))


class SecondLayer(nn.Module):
    """A Llama decoder layer of the head's shape (input H wide), parameter names as the
    EAGLE-3 layer's: what ``--layers 2`` stacks after it (``head.layer2``)."""

    def __init__(self, cfg: ModelConfig, rope: nn.Module) -> None:
        super().__init__()
        h = cfg.hidden_size
        self.input_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.self_attn = Attention(cfg, rope, in_features=h)
        self.post_attention_layernorm = RMSNorm(h, cfg.rms_norm_eps)
        self.mlp = MLP(cfg)


class TwoLayerMath(HeadMath):
    """``HeadMath.unroll`` with a second decoder layer (``layer2.*``) after the EAGLE-3 layer:
    at every depth the layer-1 output of an entry goes through layer 2, whose attention reads
    layer 2's own keys and values of the context entries and of the anchor's chain (as a
    paged cache would hold them); the next depth reads layer 2's output. With layer 2's
    ``o_proj`` and ``down_proj`` zero it is the identity and this is ``HeadMath.unroll``."""

    def _layer(self, p: dict[str, Tensor], name: str, x: Tensor, positions: Tensor
               ) -> tuple[Tensor, Tensor, Tensor]:
        normed = rms_norm(x, p[name + "input_layernorm.weight"], self.eps)
        return self.attn_qkv(p, name + "self_attn.", normed, positions, self.head.rotary_emb)

    def unroll(self, p: dict[str, Tensor], feats: Tensor, ids: Tensor, valid: Tensor,
               depth: int, start: int = 0) -> list[Tensor]:
        b, t = valid.shape
        group = self.num_heads // self.num_kv_heads
        rep = lambda x: x.repeat_interleave(group, dim=2)  # noqa: E731
        pos = torch.arange(t, device=feats.device)
        full = (pos[:, None] >= pos[None, :])[None, None] & valid[:, None, None, :]
        causal = full[:, :, start:]
        # layer 1 over every entry: layer 2 reads the context's layer-1 outputs
        q, k1, v1, res = self.qkv(p, ids[:, :t], feats, pos)
        k1, v1 = rep(k1), rep(v1)
        h1 = self.finish(p, chain_attention(q, k1, v1, full, [], [], self.scale), res)
        q2, k2, v2 = self._layer(p, "layer2.", h1, pos)
        k2, v2 = rep(k2), rep(v2)
        g = self.layer_out(p, "layer2.", "layer2.mlp.",
                           chain_attention(q2[:, start:], k2, v2, causal, [], [], self.scale),
                           h1[:, start:])
        out = [self.logits(p, g)]
        own1_k: list[Tensor] = []
        own1_v: list[Tensor] = []
        own2_k: list[Tensor] = []
        own2_v: list[Tensor] = []
        for d in range(1, depth):
            q, k, v, res = self.qkv(p, ids[:, start + d: d + t], g, pos[start:] + d)
            own1_k.append(rep(k))
            own1_v.append(rep(v))
            h1 = self.finish(p, chain_attention(q, k1, v1, causal, own1_k, own1_v, self.scale), res)
            q2, k, v = self._layer(p, "layer2.", h1, pos[start:] + d)
            own2_k.append(rep(k))
            own2_v.append(rep(v))
            g = self.layer_out(p, "layer2.", "layer2.mlp.",
                               chain_attention(q2, k2, v2, causal, own2_k, own2_v, self.scale), h1)
            out.append(self.logits(p, g))
        return out


def t1_proxy(trainer: DraftTrainer, params: dict[str, torch.Tensor], data: GeneratedSet,
             seqs: list[Any], depth: int) -> list[float]:
    """Per depth, the mean over anchors of ``sum_x min(p(x), q(x))`` (module docstring)."""
    num, den = torch.zeros(depth), torch.zeros(depth)
    with torch.no_grad():
        for i in range(0, len(seqs), GROUP):
            group = sorted(seqs[i: i + GROUP], key=lambda s: len(s.rows))
            feats, ids, valid, _ = trainer.batch(data, group)
            soft = trainer.soft_targets(data, group)
            assert soft is not None, "the set records no distributions (soft labels)"
            logits = trainer.math.unroll(params, feats, ids, valid, depth)
            for d in range(depth):
                sid, sp = soft[d]  # [B, T, K] draft ids (-1: none), probabilities
                q = torch.softmax(logits[d].float(), -1)
                qx = q.gather(-1, sid.clamp_min(0)) * (sid >= 0)
                kept = torch.minimum(sp, qx).sum(-1)
                has = sp.sum(-1) > 0
                num[d] += kept[has].sum()
                den[d] += has.sum()
    return (num / den.clamp_min(1)).tolist()


def mixed_schedule(first: list[BufferedSeq], extra: list[BufferedSeq], cfg: TrainDraftConfig,
                   fraction: float | None) -> list[list[tuple[int, int]]]:
    """Each step's batch as ``(set, sequence index)`` pairs (set 0: ``first``, 1: ``extra``).
    ``fraction`` None: ``training_schedule`` over the union of both lists (batches may mix the
    sets). Else step ``s`` takes the next batch of ``extra``'s own schedule when
    ``floor((s + 1) F) > floor(s F)`` (a share ``F`` of the steps, spread evenly), of
    ``first``'s otherwise."""
    if fraction is None:
        n = len(first)
        return [[(int(i >= n), i - n if i >= n else i) for i in b]
                for b in training_schedule(first + extra, cfg)]
    if not 0.0 <= fraction <= 1.0:
        raise ValueError(f"--extra-fraction must be in [0, 1], got {fraction}")
    scheds = (training_schedule(first, cfg), training_schedule(extra, cfg))
    used = [0, 0]
    out = []
    for step in range(cfg.steps):
        which = int(math.floor((step + 1) * fraction) > math.floor(step * fraction))
        out.append([(which, i) for i in scheds[which][used[which]]])
        used[which] += 1
    return out


def mixed_objective(trainer: DraftTrainer, sources: tuple[GeneratedSet, ...],
                    batch: list[tuple[BufferedSeq, int]], params: dict[str, Tensor]) -> Tensor:
    """``trainer.objective`` of a batch whose sequences (each with its source index) may come
    from several sets: the per-depth sums of every set's groups added, then one loss (the
    same value, up to rounding, as one set holding all the sequences). One set: ``objective``
    itself."""
    which = {w for _, w in batch}
    if len(which) == 1:
        return trainer.objective(sources[which.pop()], [s for s, _ in batch], params)
    parts = [trainer.sums(sources[w], [s for s, v in batch if v == w], params)
             for w in sorted(which)]
    return ttt_loss(sum(p[0] for p in parts), sum(p[1] for p in parts))  # type: ignore[arg-type]


def train_seqs_of(data: GeneratedSet, args: argparse.Namespace) -> list[BufferedSeq]:
    """The sequences trained on: all but the last ``--proxy-rollouts`` (the T=1 proxy's)."""
    return data.seqs[: -args.proxy_rollouts]


def ridge(a: Tensor, y: Tensor, lam: float) -> Tensor:
    """``W [out, in]`` minimising ``|a W^T - y|^2 + lam mean(diag(a^T a)) |W|^2``."""
    ata = a.T @ a
    ata += lam * ata.diagonal().mean() * torch.eye(ata.shape[0], dtype=a.dtype)
    return torch.linalg.solve(ata, a.T @ y).T


def code_map(ne: Tensor, coded: Tensor, others: Tensor, weight: float = 3.0) -> Tensor:
    """``P [len(coded), H]`` with ``P ne[coded[j]] ~ e_j`` (one-hot codes) and ``P ne[others]
    ~ 0`` (the others weigh ``weight`` in all against one per coded token)."""
    a = torch.cat([ne[coded], ne[others]])
    y = torch.zeros(len(a), len(coded), dtype=ne.dtype)
    y[torch.arange(len(coded)), torch.arange(len(coded))] = 1.0
    w = torch.ones(len(a), dtype=ne.dtype)
    w[len(coded):] = weight * len(coded) / max(1, len(others))
    return ridge(a * w[:, None].sqrt(), y * w[:, None].sqrt(), 1e-3)


class InductionHead:
    """Head 0 (kv group 0) as a 2-gram induction head over numbers, in the published layout:
    its query ``[code(x_{i+1}), code(x_i)]`` meets the key ``[code(x_p), code(x_{p-1})]`` of
    every earlier entry ``p``, whose value ``vcode(x_{p+1})`` is the token that followed
    there, and ``o_proj`` writes that token's ``lm_head`` row (``gain`` times the median
    ``|fc(features)|``; 0: zero rows that training grows). Prompt-lookup of the last two
    tokens predicts 80% of the copied digits of SmolLM2's answers, where the trained head gets
    5-14% (``draft_misses.py``).

    Codes: one-hot over the single-digit tokens and the space for the match, on the rope's
    slowest pairs (SmolLM2's turn by under 0.3 rad over 350 positions), and over the
    ``head_dim`` most frequent generated tokens for the value. The query's ``code(x_{i+1})``
    and the value are exact (the embedding half); the keys' codes and the query's
    ``code(x_i)`` are ridge fits from the entry's normalised ``fc(features)`` (the hidden
    half) over ``num_rows`` rows.
    :meth:`fit` recomputes them from the current ``fc`` and norms (``--induction-refit``:
    with those rows frozen between fits, training cannot detune them)."""

    KEY_GAIN = 10.0  # the keys' weights an order above Adam's step noise; the query less

    def __init__(self, head: nn.Module, embed: nn.Embedding, data: GeneratedSet,
                 seqs: list[BufferedSeq], counts: Any, model: Path, scale: float,
                 num_rows: int = 60_000) -> None:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(model)
        texts = tok.convert_ids_to_tokens(list(range(embed.num_embeddings)))
        match = [i for i, t in enumerate(texts) if t is not None and len(t) == 1
                 and t in "0123456789"]
        lead = tok.convert_tokens_to_ids(tok.tokenize(" 1"))[0]  # the space before a number
        self.match_ids = torch.tensor(sorted(set(match) | {lead}))
        attn = head.midlayer.self_attn
        self.hq, self.hkv = attn.num_heads, attn.num_kv_heads
        self.h = head.fc.weight.shape[0]
        self.d = self.h // self.hq
        self.eps = head.norm.eps
        self.embed, self.scale = embed, scale
        rows = np.concatenate([s.rows[2:] for s in seqs if len(s.rows) > 2])
        rows = np.random.default_rng(0).choice(rows, min(num_rows, len(rows)), replace=False)
        rows = torch.from_numpy(rows)
        self.feats = data.feats[rows].float()
        self.cur, self.prev = data.tokens[rows - 1], data.tokens[rows - 2]  # x_p, x_{p-1}
        order = torch.from_numpy(np.argsort(-np.asarray(counts), kind="stable").copy())
        self.value_ids = order[: self.d]
        top = order[:600]
        self.others_m = top[~torch.isin(top, self.match_ids)]
        self.others_v = top[~torch.isin(top, self.value_ids)]
        # the rope's slowest pairs (dims k and k + d/2, rotate-half layout) that turn by under
        # 0.3 rad over the longest sequence carry the match, nearly position-blind
        cos, sin = head.rotary_emb.cos_sin(torch.ones(1, dtype=torch.long), torch.float32)
        omega = torch.atan2(sin[0], cos[0])  # [d/2] radians per position, slowest last
        longest = max(len(s.rows) for s in seqs)
        n = len(self.match_ids)
        if n > self.d // 2 or float(omega[self.d // 2 - n]) * longest > 0.3:
            raise ValueError(f"{n} match codes need {n} rope pairs turning under 0.3 rad over "
                             f"{longest} positions; head_dim {self.d} has "
                             f"{int((omega * longest < 0.3).sum())}")

    @torch.no_grad()
    def fit(self, p: dict[str, Tensor]) -> tuple[float, float]:
        """Write head 0's query, group 0's key and value rows of ``qkv_proj`` from the
        current ``fc`` and norms in ``p``; returns the key fits' R^2 (x_p, x_{p-1})."""
        m = "midlayer."
        ne = rms_norm(self.embed.weight.float(), p[m + "input_layernorm.weight"].float(),
                      self.eps)
        fused = F.linear(self.feats, p["fc.weight"].float())
        nh = rms_norm(fused, p[m + "hidden_norm.weight"].float(), self.eps)
        p_m = code_map(ne, self.match_ids, self.others_m)  # [n_m, H]
        t_cur, t_prev = ne[self.cur] @ p_m.T, ne[self.prev] @ p_m.T
        a_cur, a_prev = ridge(nh, t_cur, 1e-2), ridge(nh, t_prev, 1e-2)
        p_v = code_map(ne, self.value_ids, self.others_v)
        d, h, half, g = self.d, self.h, self.d // 2, self.KEY_GAIN
        slow = torch.arange(half - len(self.match_ids), half)  # dims slow, slow + half
        q0, k0, v0 = (torch.zeros(d, 2 * h) for _ in range(3))
        q0[slow, :h] = self.scale / g * p_m
        q0[slow + half, h:] = self.scale / g * a_cur
        k0[slow, h:] = g * a_cur
        k0[slow + half, h:] = g * a_prev
        v0[: len(self.value_ids), :h] = p_v
        w = p[m + "self_attn.qkv_proj.weight"]  # [(hq + 2 hkv) d, 2H]: [embedding | hidden]
        for row, block in zip(self.rows(), (q0, k0, v0)):
            w[row].copy_(block)
        return r_squared(nh, a_cur, t_cur), r_squared(nh, a_prev, t_prev)

    def rows(self) -> tuple[slice, slice, slice]:
        """``qkv_proj`` rows of head 0's query, group 0's key and value."""
        d, hq, hkv = self.d, self.hq, self.hkv
        return slice(0, d), slice(hq * d, (hq + 1) * d), slice((hq + hkv) * d,
                                                               (hq + hkv + 1) * d)

    @torch.no_grad()
    def init_output(self, head: nn.Module, gain: float) -> None:
        """Head 0's ``o_proj`` columns: the value code's token's ``lm_head`` row at ``gain``
        times the median ``|fc(features)|``, or 0."""
        o = head.midlayer.self_attn.o_proj.weight  # [H, hq d]
        o[:, : self.d] = 0
        if gain <= 0:
            return
        scale = gain * float(F.linear(self.feats, head.fc.weight.float()).norm(dim=-1).median())
        t2d = HeadMath(head, self.embed).to_draft(o.device)  # -100: no draft id
        for j, t in enumerate(self.value_ids.tolist()):
            if t2d[t] >= 0:
                r = head.lm_head.weight[t2d[t]].float()
                o[:, j] = scale * r / r.norm()

    def freeze(self, p: dict[str, Tensor]) -> None:
        """No gradient reaches the rows :meth:`fit` writes (Adam then leaves them as set)."""
        mask = torch.ones_like(p["midlayer.self_attn.qkv_proj.weight"])
        for row in self.rows():
            mask[row] = 0
        p["midlayer.self_attn.qkv_proj.weight"].register_hook(lambda grad: grad * mask)


def r_squared(x: Tensor, w: Tensor, y: Tensor) -> float:
    return float(1 - ((x @ w.T - y) ** 2).sum() / ((y - y.mean(0)) ** 2).sum())


def train_variant(args: argparse.Namespace) -> dict[str, Any]:
    torch.manual_seed(0)
    data = GeneratedSet.load(args.data)
    held = GeneratedSet.load(held_path(args.data))
    extra = GeneratedSet.load(args.extra_data) if args.extra_data else None
    if args.extra_fraction is not None and extra is None:
        raise ValueError("--extra-fraction needs --extra-data")
    if args.feature_rms_norm:
        for s in (data, held, extra):
            if s is not None:
                rms_normalise_features(s)
    target_cfg, embed = read_config(args.model), read_embedding(args.model)
    vocab = min(embed.num_embeddings, args.draft_vocab_size)
    head_cfg = fresh_config(target_cfg, vocab, "bfloat16")
    if args.mlp_width:
        head_cfg["intermediate_size"] = args.mlp_width
    if not 0 < args.proxy_rollouts < len(data.seqs):
        raise ValueError(f"--proxy-rollouts must be in [1, {len(data.seqs) - 1}]")
    counts = data.counts if extra is None else data.counts + extra.counts
    head = build_head(head_cfg, embed, torch.device("cpu"),
                      draft_to_target=most_frequent(counts, vocab))
    if args.head_init_target:
        init_from_target(head, args.model, embed)
    head_math = None
    if args.layers == 2:
        mc = ModelConfig.from_dict({**head_cfg, "architectures": ["LlamaForCausalLM"],
                                    "model_type": "llama"})
        head.layer2 = SecondLayer(mc, head.rotary_emb).float()
        head_math = TwoLayerMath(head, embed)
    elif args.layers != 1:
        raise ValueError(f"--layers must be 1 or 2, got {args.layers}")
    induction = None
    if args.induction_init:
        induction = InductionHead(head, embed, data, train_seqs_of(data, args), counts,
                                  args.model, args.induction_scale)
        fits = induction.fit(dict(head.named_parameters()))
        induction.init_output(head, args.induction_gain)
        logger.info("induction head: %d match tokens, key fits R^2 %.3f (x_p) / %.3f "
                    "(x_{p-1})", len(induction.match_ids), *fits)
    opt = HeadOptimizer(head)
    if induction is not None and args.induction_refit:
        induction.freeze(opt.masters)
    trainer = DraftTrainer(head, embed, torch.device("cpu"), depth=args.ttt_steps,
                           batch_tokens=args.batch_tokens, seed=0, math=head_math,
                           tv_weight=args.tv_weight)
    train_seqs = train_seqs_of(data, args)
    proxy_seqs = data.seqs[-args.proxy_rollouts:]
    cfg = TrainDraftConfig(model=args.model, prompts=args.data, out=args.data.parent,
                           steps=args.steps, batch_tokens=args.batch_tokens, lr=args.lr)
    sources = (data,) if extra is None else (data, extra)
    pools = (train_seqs,) if extra is None else (train_seqs, extra.seqs)
    schedule = mixed_schedule(train_seqs, [] if extra is None else extra.seqs, cfg,
                              args.extra_fraction)
    points = {max(1, round(len(schedule) * (i + 1) / args.points)) for i in range(args.points)}
    if args.points_at:
        points |= {int(x) for x in args.points_at.split(",")}
    out: dict[str, Any] = {"name": args.name, "tv_weight": args.tv_weight,
                           "params": sum(p.numel() for p in head.parameters()),
                           "head_config": head_cfg, "curve": [],
                           "extra_data": str(args.extra_data) if extra else None,
                           "extra_fraction": args.extra_fraction,
                           "proxy_tokens": sum(len(s.rows) - s.num_prompt_tokens
                                               for s in proxy_seqs),
                           "trained_rows_by_set": [0] * len(sources)}
    t0 = time.perf_counter()
    for step, batch_ids in enumerate(schedule):
        batch = [(pools[w][i], w) for w, i in batch_ids]
        for s, w in batch:
            out["trained_rows_by_set"][w] += len(s.rows)
        with torch.enable_grad(), loss_autocast(trainer.device, getattr(torch,
                                                                       args.train_dtype)):
            loss = mixed_objective(trainer, sources, batch, opt.masters)
        opt.step(loss, learning_rate(step, len(schedule), args.lr))
        if induction is not None and args.induction_refit and (step + 1) % args.induction_refit \
                == 0:
            induction.fit(opt.masters)
        if step + 1 in points:
            acc = offline_acceptance(trainer, opt.masters, held)
            row = {"step": step + 1, "loss": float(loss.detach()),
                   "seconds": time.perf_counter() - t0,
                   "greedy_mean_accepted_length": {
                       k: v["mean_accepted_length"] for k, v in acc.items()},
                   "greedy_acceptance_per_position_k3": acc["3"]["acceptance_per_position"],
                   "t1_proxy_per_depth": t1_proxy(trainer, opt.masters, data, proxy_seqs,
                                                  args.ttt_steps)}
            out["curve"].append(row)
            logger.info("%s", row)
    return out


def format_rows(result: dict[str, Any]) -> str:
    lines = [f"{result['name']} ({result['params'] / 1e6:.1f} M parameters)"]
    for r in result["curve"]:
        g = r["greedy_mean_accepted_length"]
        lines.append(f"  step {r['step']}: greedy k=1..5 " + " / ".join(
            f"{g[k]:.2f}" for k in sorted(g, key=int)) + "; T=1 proxy per depth " + " / ".join(
            f"{x:.3f}" for x in r["t1_proxy_per_depth"]) + f"; {r['seconds']:.0f} s")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                 formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("rollouts", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    r.add_argument("--model", type=Path, required=True)
    r.add_argument("--prompts", type=Path, required=True)
    r.add_argument("--eval-prompts", type=Path, required=True)
    r.add_argument("--out", type=Path, required=True, help="the set's .safetensors file")
    r.add_argument("--holdout", type=int, default=16)
    r.add_argument("--rollout-tokens", type=int, default=200_000)
    r.add_argument("--temperature", type=float, default=1.0)
    r.add_argument("--max-tokens", type=int, default=96)
    r.add_argument("--eval-max-tokens", type=int, default=80)
    r.add_argument("--device", default="cpu")
    r.add_argument("--threads", type=int, default=None)
    t = sub.add_parser("train", formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    t.add_argument("--model", type=Path, required=True)
    t.add_argument("--data", type=Path, required=True, help="a set written by 'rollouts'")
    t.add_argument("--name", default="variant")
    t.add_argument("--mlp-width", type=int, default=0, help="0: the target's")
    t.add_argument("--draft-vocab-size", type=int, default=4096)
    t.add_argument("--feature-rms-norm", action="store_true")
    t.add_argument("--layers", type=int, default=1, help="2: a second decoder layer (offline)")
    t.add_argument("--lr", type=float, default=3e-3)
    t.add_argument("--steps", type=int, default=250)
    t.add_argument("--batch-tokens", type=int, default=4096)
    t.add_argument("--ttt-steps", type=int, default=3)
    t.add_argument("--tv-weight", type=float, default=0.0,
                   help="weight of the loss's acceptance term, 1 - sum min(p, q)")
    t.add_argument("--points", type=int, default=2)
    t.add_argument("--proxy-rollouts", type=int, default=64)
    t.add_argument("--train-dtype", choices=("float32", "bfloat16"), default="float32",
                   help="the loss's compute dtype (train-draft's --train-dtype: autocast, "
                        "float32 masters and evaluation)")
    t.add_argument("--head-init-target", action="store_true",
                   help="lm_head and the final norm from the target's (train-draft's "
                        "--head-init target)")
    t.add_argument("--induction-init", action="store_true",
                   help="head 0 and kv group 0 start as an induction head (InductionHead)")
    t.add_argument("--induction-scale", type=float, default=48.0,
                   help="the induction query's scale (attention logit ~ scale/8 per match)")
    t.add_argument("--induction-gain", type=float, default=3.0,
                   help="head 0's output rows: this times the median |fc(features)|; 0 "
                        "starts them at zero (training grows them)")
    t.add_argument("--induction-refit", type=int, default=0,
                   help="N > 0: the induction rows get no gradient and are refitted to the "
                        "current fc and norms every N steps")
    t.add_argument("--points-at", default="",
                   help="extra comma-separated steps measured (e.g. 1: right after the init)")
    t.add_argument("--threads", type=int, default=None)
    t.add_argument("--json", type=Path, default=None)
    t.add_argument("--extra-data", type=Path, default=None,
                   help="a second set from 'rollouts' (e.g. greedy) trained on with the first")
    t.add_argument("--extra-fraction", type=float, default=None,
                   help="share of the steps whose batch comes from --extra-data (1: it alone); "
                        "default: the union of both sets' sequences, shuffled together")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    if args.threads:
        torch.set_num_threads(args.threads)
    if args.cmd == "rollouts":
        print(json.dumps(save_rollouts(args)))
        return 0
    result = train_variant(args)
    print(format_rows(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
