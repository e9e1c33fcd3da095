"""One graph-timed sweep of the engine's kernels against floors on the measured copy bandwidth.

Every case calls a public launcher (``kernels/*.py``: what the engine calls, so whatever the
kernels become is what is timed), captured in a CUDA graph and replayed with its inputs rotated
among copies whose working set is >= 4x L2 (``graph_timing.py`` says how); the eager time of
the same calls is beside it. The floor is the case's bytes, counted exactly (bf16 logits where
the engine passes bf16), over the device-to-device copy bandwidth measured at the start of the
run. Each row prints its issue-35 target with PASS / MISS.

Groups (``--only``):

* ``attention``: paged attention at 8B shapes (32 q / 8 kv heads, head_dim 128, pages of 16,
  bf16): decode, 4-token chain verify, 16-node tree verify, B 1..256, contexts 4k and 16k
  (B x ctx <= 1M tokens: 4 GiB of K/V), then forced split counts at small batches;
* ``sampling``: the fused rejection sampler, chains of k = 3 drafts (point-mass drafts, 4 rows
  per request), V = 151,936, temperature 1: top_p = 1, top_p = 0.9, top_k = 50, float32 and
  bfloat16 logits, B = 1 / 64 / 256; at B = 1, top_p = 0.9 also with every pass in one
  program per row (``parts=1``), and the kept-set cut alone (``keep_threshold``, 4 rows)
  split over the vocabulary and not;
* ``moe``: Qwen3-30B-A3B and Qwen3-235B-A22B sparse layers, T = 1 / 4 / 16 / 64 tokens:
  the whole ``moe_forward``, routing (``topk_softmax``), alignment (``moe_align_block_size``)
  and the experts (``fused_moe``: both grouped GEMMs and the combine) apart; the whole layer's
  replays also get a per-kernel profile, which times the two GEMMs apart (the launcher has no
  public entry per GEMM). Router logits differ per copy, so each copy touches other experts;
* ``kv``: ``rope_and_cache`` (the fused Q/K norm + rope + KV write the engine uses, Qwen3-8B
  heads), ``reshape_and_cache`` (one 8B layer's write of B x 4 tokens) and
  ``compact_kv_cache`` (3 accepted tree nodes per sequence moved in all 64 caches of 8B).

Cases run most valuable first (the ones with targets; within a priority the groups take
turns); ``--budget-s`` stops starting cases whose estimated time no longer fits, and
``--skip-from`` an earlier run's JSONL continues that run in a later command. Rows are
written to ``OUT/kernels_graph.jsonl`` as they finish (one ``meta`` line first), and a
markdown table to ``OUT/kernels_graph.md`` at the end.

``--dry``: tiny shapes on the CPU under the Triton interpreter, no graphs (the recorded call
list is replayed from Python); the same cases, builders, rotation, floors and targets. CI runs
it (tests/test_bench_kernels_graph.py).

Usage::

    python benchmarks/bench_kernels_graph.py --out OUT [--only attention,sampling] [--budget-s 240]
    python benchmarks/bench_kernels_graph.py --dry --out /tmp/sweep
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

HERE = Path(__file__).resolve().parent
if str(HERE.parent) not in sys.path:
    sys.path.insert(0, str(HERE.parent))  # the repo root: specengine

if not torch.cuda.is_available():  # the interpreter must be chosen before kernels are defined
    os.environ.setdefault("TRITON_INTERPRET", "1")

import graph_timing as gt  # noqa: E402

GROUPS = ("attention", "sampling", "moe", "kv")
VOCAB = 151936  # Qwen3
MOE_MODELS = {"qwen3-30b-a3b": (128, 8, 2048, 768), "qwen3-235b-a22b": (128, 8, 4096, 1536)}
DRY_MOE_MODELS = {"qwen3-30b-a3b": (12, 2, 64, 32), "qwen3-235b-a22b": (12, 2, 96, 48)}
# Errors after which the CUDA context is unusable: stop the sweep rather than fail every case.
FATAL = ("illegal memory access", "unspecified launch failure", "CUDA error: an illegal",
         "device-side assert")


@dataclass
class Env:
    """What every builder needs: the device, sizes and the run's measured bandwidth."""

    dry: bool
    device: str
    dtype: torch.dtype  # activations and caches: bf16 on a GPU, fp32 in dry runs
    l2: int
    gbps: float = 0.0  # measured copy bandwidth (read + write), GB/s
    max_copies: int = 64
    mem_cap: int = 3 << 30  # bytes of copies per case
    cache: dict[str, Any] = field(default_factory=dict)  # big shared tensors (MoE weights)


@dataclass
class Built:
    """A case ready to time: ``make(i)`` builds copy ``i``; ``call(copy)`` runs the launcher;
    ``nbytes(copy)`` is what a perfect kernel moves for that copy; ``copy_bytes`` is the
    memory one copy holds (what the per-case cap counts)."""

    make: Callable[[int], Any]
    call: Callable[[Any], object]
    nbytes: Callable[[Any], int]
    copy_bytes: int
    info: Callable[[list[Any]], dict[str, Any]] | None = None
    profile: bool = False


# A target: (text, verdict) from the row and the rows measured so far (by case name);
# verdict None when the row it compares with is missing.
Target = Callable[[dict, dict[str, dict]], tuple[str, bool | None]]


@dataclass(frozen=True)
class Case:
    group: str
    name: str
    priority: int  # lower runs first
    params: dict[str, Any]
    build: Callable[[Env], Built]
    target: Target | None = None


# ---------------------------------------------------------------------------------------------
# targets


def at_most_us(limit: float) -> Target:
    return lambda r, rows: (f"<= {limit:g} us", r["time_us"] <= limit)


def at_most_floor(mult: float) -> Target:
    return lambda r, rows: (f"<= {mult:g}x floor ({mult * r['floor_us']:.1f} us)",
                            r["time_us"] <= mult * r["floor_us"])


def at_least_bw(frac: float) -> Target:
    return lambda r, rows: (f">= {frac:.0%} of copy bw", r["bw_frac"] >= frac)


def at_most_times(ref: str, mult: float, label: str) -> Target:
    def judge(r: dict, rows: dict[str, dict]) -> tuple[str, bool | None]:
        other = rows.get(ref)
        if other is None or other.get("time_us") is None:
            return f"<= {mult:g}x {label} (not measured)", None
        return (f"<= {mult:g}x {label} ({mult * other['time_us']:.1f} us)",
                r["time_us"] <= mult * other["time_us"])
    return judge


def all_of(*targets: Target) -> Target:
    def judge(r: dict, rows: dict[str, dict]) -> tuple[str, bool | None]:
        parts = [t(r, rows) for t in targets]
        verdicts = [v for _, v in parts]
        ok = None if any(v is None for v in verdicts) else all(verdicts)
        if any(v is False for v in verdicts):
            ok = False
        return "; ".join(text for text, _ in parts), ok
    return judge


# ---------------------------------------------------------------------------------------------
# attention


def attention_cases(dry: bool) -> list[Case]:
    batches = [1, 2] if dry else [1, 8, 32, 64, 128, 256]
    contexts = [40, 72] if dry else [4096, 16384]
    max_tokens = 1 << 20  # B x ctx: 4 GiB of bf16 K/V at 8B shapes
    chain_q, tree_q = (3, 8) if dry else (4, 16)
    cases = []
    for ctx_i, ctx in enumerate(contexts):
        for batch in batches:
            if batch * ctx > max_tokens:
                continue
            decode = f"attention decode B={batch} ctx={ctx}"
            big = batch * ctx >= (256 if dry else 128 * 1024)
            targets: list[Target] = []
            if batch == 1:
                targets.append(at_most_us((8.0, 22.0)[ctx_i]))
            if big:
                targets.append(at_least_bw(0.85))
            prio = 0 if targets or (ctx_i == 0 and batch >= 32) else 2
            cases.append(Case("attention", decode, prio,
                              dict(mode="decode", batch=batch, context=ctx, q_len=1),
                              _attention_builder(batch, ctx, 1, "decode", None),
                              all_of(*targets) if targets else None))
            cases.append(Case("attention", f"attention chain{chain_q} B={batch} ctx={ctx}", 2,
                              dict(mode="chain", batch=batch, context=ctx, q_len=chain_q),
                              _attention_builder(batch, ctx, chain_q, "chain", None)))
            tree_target = (at_most_times(decode, 1.3, "decode")
                           if ctx_i == 0 and batch >= (2 if dry else 32) else None)
            cases.append(Case("attention", f"attention tree{tree_q} B={batch} ctx={ctx}",
                              prio if tree_target else 2,
                              dict(mode="tree", batch=batch, context=ctx, q_len=tree_q),
                              _attention_builder(batch, ctx, tree_q, "tree", None),
                              tree_target))
    # Split-KV counts forced at small batches (the launcher's default is the decode rows).
    splits = [1, 2] if dry else [1, 2, 4, 8, 16, 32]
    for batch, ctx in ([(1, contexts[0])] if dry else [(1, 4096), (1, 16384), (8, 16384)]):
        for s in splits if batch == 1 else splits[::2]:
            cases.append(Case("attention", f"attention decode B={batch} ctx={ctx} splits={s}", 3,
                              dict(mode="decode", batch=batch, context=ctx, q_len=1, splits=s),
                              _attention_builder(batch, ctx, 1, "decode", s)))
    return cases


def _attention_builder(batch: int, ctx: int, q_len: int, mode: str,
                       splits: int | None) -> Callable[[Env], Built]:
    def build(env: Env) -> Built:
        from bench_attention import Case as AttnCase
        from bench_attention import run_triton

        hq, hkv, d = (4, 2, 32) if env.dry else (32, 8, 128)  # 8B attention; tiny in dry runs

        def make(i: int) -> tuple[Any, Callable[[], object]]:
            c = AttnCase(batch, ctx, q_len, mode, 16, env.dtype, env.device, seed=i,
                         heads=(hq, hkv, d))
            return c, run_triton(c, splits)

        def nbytes(copy: tuple) -> int:
            c = copy[0]
            extra = c.block_tables.numel() * 4 + c.context_lens.numel() * 4 \
                + c.qo_indptr.numel() * 4
            if c.tree_mask is not None:
                extra += c.tree_mask.numel() * 4
            return c.bytes_moved() + extra

        el = torch.tensor([], dtype=env.dtype).element_size()
        per_seq = -(-(ctx + q_len) // 16)
        copy_bytes = 2 * batch * per_seq * 16 * hkv * d * el + 2 * batch * q_len * hq * d * el

        def info(copies: list[Any]) -> dict[str, Any]:
            return _attention_launch(copies[0][0], splits)

        return Built(make, lambda copy: copy[1](), nbytes, copy_bytes, info=info)
    return build


def _attention_launch(c: Any, splits: int | None) -> dict[str, Any]:
    """The tile shape and split count the launcher uses for case ``c`` (from its public
    ``tiles`` and ``default_num_splits``, as the launcher computes them), so each row says
    which variant it timed; {"launch_error": ...} if those functions changed."""
    try:
        import triton

        from specengine.kernels.attention import tiles
        from specengine.kernels.attention_combine import default_num_splits

        group = c.hq // c.hkv
        t = tiles(c.q_len, group, c.head_dim, c.q.dtype == torch.float32,
                  c.tree_mask is not None)
        n_q_tiles = triton.cdiv(c.q_len, t.qt)
        max_kv_tiles = triton.cdiv(c.block_tables.shape[1] * c.k_cache.shape[1], t.block_n)
        auto = default_num_splits(c.q.device, c.batch * n_q_tiles * c.hkv, max_kv_tiles)
        return dict(splits_used=splits if splits is not None else auto, block_m=t.block_m,
                    block_n=t.block_n, num_warps=t.num_warps, num_stages=t.num_stages)
    except Exception as e:  # noqa: BLE001 - a description of the launch, never fatal
        return dict(launch_error=f"{type(e).__name__}: {e}"[:200])


# ---------------------------------------------------------------------------------------------
# sampling


def sampling_cases(dry: bool) -> list[Case]:
    vocab = 1000 if dry else VOCAB
    batches = [1, 2] if dry else [1, 64, 256]
    big = batches[-1]
    k = 3
    cases = []
    for dtype in ("bf16", "fp32"):
        for batch in batches:
            plain = f"sampling top_p=1 {dtype} B={batch}"
            t_plain: list[Target] = []
            if batch == 1:
                t_plain.append(at_most_us(15.0))
            if batch == big:
                t_plain.append(at_most_us(500.0))
                if dtype == "bf16":
                    t_plain.append(at_least_bw(0.60))
            t_p: list[Target] = [at_most_us(50.0)] if batch == 1 else []
            if batch == big:
                t_p.append(at_most_times(plain, 2.0, "top_p=1"))
            prio = 0 if dtype == "bf16" and batch in (1, big) else 1
            for name, top_p, top_k, targets in (
                    (plain, 1.0, -1, t_plain),
                    (f"sampling top_p=0.9 {dtype} B={batch}", 0.9, -1, t_p),
                    (f"sampling top_k=50 {dtype} B={batch}", 1.0, 50, [])):
                cases.append(Case("sampling", name, prio if targets else 1,
                                  dict(batch=batch, k=k, vocab=vocab, top_p=top_p, top_k=top_k,
                                       dtype=dtype),
                                  _sampling_builder(batch, k, vocab, top_p, top_k, dtype),
                                  all_of(*targets) if targets else None))
    # B = 1, top_p = 0.9 beside the split default above: the sampler with every pass in one
    # program per row (vocab_parts=1), and the kept-set cut alone (keep_threshold on 4 rows,
    # as B = 1, k = 3) split (pass 1 and the search's row passes over 38 parts) and in one
    # program per row: what the split search saves. Dry runs cut 4,097 tokens (3 parts: the
    # split path; the dry sampler's 1,000 never split).
    cut_vocab = 4097 if dry else vocab
    for dtype in ("bf16", "fp32"):
        prio = 1 if dtype == "bf16" else 2
        cases.append(Case("sampling", f"sampling top_p=0.9 {dtype} B=1 parts=1", prio,
                          dict(batch=1, k=k, vocab=vocab, top_p=0.9, top_k=-1, dtype=dtype,
                               vocab_parts=1),
                          _sampling_builder(1, k, vocab, 0.9, -1, dtype, vocab_parts=1)))
        for parts in (None, 1):
            name = f"keep_threshold top_p=0.9 {dtype} rows={k + 1}" + \
                (f" parts={parts}" if parts else "")
            cases.append(Case("sampling", name, prio,
                              dict(rows=k + 1, vocab=cut_vocab, top_p=0.9, dtype=dtype,
                                   vocab_parts=parts),
                              _cut_builder(k + 1, cut_vocab, 0.9, dtype, parts)))
    # A tree of 16 drafts (the SmolLM2 head's best for sampled requests: six children at the
    # root), T=1: children as point masses, and drawn from a 32,000-id draft vocabulary's q
    # (recursive rejection sampling: one more pass over the row per rejected child).
    draft_vocab = 200 if dry else 32_000
    for batch in batches:
        for sampled in (False, True):
            what = "sampled" if sampled else "point-mass"
            cases.append(Case("sampling", f"sampling tree16 {what} bf16 B={batch}", 1,
                              dict(batch=batch, nodes=17, vocab=vocab, dtype="bf16",
                                   draft_vocab=draft_vocab if sampled else None),
                              _tree_sampling_builder(batch, vocab, draft_vocab, sampled)))
    return cases


TREE16 = [(0,), (1,), (2,), (3,), (4,), (5,), (0, 0), (0, 1), (0, 2), (0, 3), (1, 0), (2, 0),
          (0, 0, 0), (0, 0, 1), (0, 1, 0), (1, 0, 0)]


def _tree_sampling_builder(batch: int, vocab: int, draft_vocab: int,
                           sampled: bool) -> Callable[[Env], Built]:
    def build(env: Env) -> Built:
        from specengine.kernels.rejection_sampling import rejection_sample

        dev = env.device
        paths = [()] + TREE16
        parents = torch.tensor([-1] + [paths.index(p[:-1]) for p in TREE16],
                               dtype=torch.int32, device=dev)
        n = len(paths)
        index = torch.full((vocab,), -1, dtype=torch.int32, device=dev)
        index[:draft_vocab] = torch.arange(draft_vocab, dtype=torch.int32, device=dev)

        def make(i: int) -> tuple:
            g = torch.Generator(device=dev).manual_seed(i)
            logits32 = torch.randn(batch, n, vocab, device=dev, generator=g) * 3
            par = parents[1:].long()
            q_node = torch.softmax(logits32[:, :, :draft_vocab] + 0.5, -1)  # [B, N, Vd]
            e = torch.empty_like(q_node).exponential_(generator=g)
            ranks = (q_node / e).argsort(-1, descending=True)[:, :, :8]  # without replacement
            rank = torch.tensor([p[-1] for p in TREE16], device=dev)
            drafts = ranks[:, par, rank]  # [B, 16]: child c takes rank(c) of its parent's draw
            probs = q_node[:, par].contiguous() if sampled else None
            return (logits32.to(torch.bfloat16), drafts,
                    torch.full((batch,), n - 1, dtype=torch.int32, device=dev), probs,
                    torch.ones(batch, device=dev),
                    torch.full((batch,), -1, dtype=torch.int32, device=dev),
                    torch.ones(batch, device=dev),
                    torch.arange(batch, dtype=torch.int64, device=dev),
                    torch.zeros(batch, dtype=torch.int64, device=dev), parents)

        def nbytes(x: tuple) -> int:
            # logits and (sampled) q read once each at least; the outputs are small
            q = x[3]
            return x[0].numel() * 2 + (q.numel() * 4 if q is not None else 0) + batch * n * 24

        return Built(make, lambda x: rejection_sample(
            *x, draft_index=index if sampled else None, check_values=False), nbytes,
            batch * n * (vocab * 2 + (draft_vocab * 4 if sampled else 0)))
    return build


def _cut_builder(rows: int, vocab: int, top_p: float, dtype: str,
                 parts: int | None) -> Callable[[Env], Built]:
    def build(env: Env) -> Built:
        from specengine.kernels.keep_threshold import keep_threshold

        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]

        def make(i: int) -> tuple:
            g = torch.Generator(device=env.device).manual_seed(i)
            logits = (torch.randn(rows, vocab, device=env.device, generator=g) * 3).to(dt)
            return (logits, torch.ones(rows, device=env.device),
                    torch.full((rows,), -1, dtype=torch.int32, device=env.device),
                    torch.full((rows,), top_p, device=env.device))

        def nbytes(x: tuple) -> int:
            # the logits, temperature / top_k / top_p in, tau / mass / max out (per row)
            return x[0].numel() * x[0].element_size() + rows * (3 * 4 + 3 * 4)

        return Built(make, lambda x: keep_threshold(*x, vocab_parts=parts), nbytes,
                     rows * vocab * dt.itemsize)
    return build


def _sampling_builder(batch: int, k: int, vocab: int, top_p: float, top_k: int,
                      dtype: str, vocab_parts: int | None = None) -> Callable[[Env], Built]:
    def build(env: Env) -> Built:
        from bench_rejection_sampling import inputs

        from specengine.kernels.rejection_sampling import rejection_sample

        dt = {"bf16": torch.bfloat16, "fp32": torch.float32}[dtype]

        def make(i: int) -> tuple:
            return inputs(batch, k, vocab, False, top_p, env.device, dtype=dt, top_k=top_k,
                          seed=i)

        def nbytes(x: tuple) -> int:
            logits, drafts = x[0], x[1]
            n = batch * (k + 1)
            # inputs: logits, drafts, num drafts, temperature, top_k, top_p, seeds, offsets;
            # outputs: ids (int64), num accepted, logprobs (float32), row ids (int32)
            return (logits.numel() * logits.element_size() + drafts.numel() * 8
                    + batch * (4 + 4 + 4 + 4 + 8 + 8) + n * (8 + 4 + 4) + batch * 4)

        copy_bytes = batch * (k + 1) * vocab * dt.itemsize
        return Built(make, lambda x: rejection_sample(*x, check_values=False,
                                                      vocab_parts=vocab_parts), nbytes,
                     copy_bytes)
    return build


# ---------------------------------------------------------------------------------------------
# MoE


def moe_cases(dry: bool) -> list[Case]:
    models = DRY_MOE_MODELS if dry else MOE_MODELS
    tokens = [1, 4] if dry else [1, 4, 16, 64]
    cases = []
    for model in models:
        for t in tokens:
            target = None
            if t == 1:
                target = at_most_floor(2.0 if model == "qwen3-30b-a3b" else 1.5)
            elif t == 4 and model == "qwen3-235b-a22b":
                target = at_most_floor(2.0)
            for part in ("forward", "routing", "align", "experts"):
                prio = 0 if part == "forward" and target else (1 if part == "forward" else 2)
                cases.append(Case("moe", f"moe {model} T={t} {part}", prio,
                                  dict(model=model, tokens=t, part=part,
                                       **dict(zip(("experts", "top_k", "hidden", "inter"),
                                                  models[model]))),
                                  _moe_builder(model, models[model], t, part),
                                  target if part == "forward" else None))
    return cases


def _moe_weights(env: Env, model: str, shape: tuple[int, int, int, int]) -> tuple:
    """The model's expert weights, one model's at a time (235B-A22B's are 4.8 GB)."""
    key = f"moe:{model}"
    if key not in env.cache:
        for other in [k for k in env.cache if k.startswith("moe:")]:
            del env.cache[other]
        gc.collect()
        if env.device == "cuda":
            torch.cuda.empty_cache()
        num_experts, _, hidden, inter = shape
        g = torch.Generator(device=env.device).manual_seed(0)
        # drawn in the activation dtype and scaled in place: no float32 copy of 4.8 GB
        w13 = torch.randn(num_experts, 2 * inter, hidden, generator=g, device=env.device,
                          dtype=env.dtype).mul_(hidden**-0.5)
        w2 = torch.randn(num_experts, hidden, inter, generator=g, device=env.device,
                         dtype=env.dtype).mul_(inter**-0.5)
        env.cache[key] = (w13, w2)
    return env.cache[key]


def _moe_builder(model: str, shape: tuple[int, int, int, int], tokens: int,
                 part: str) -> Callable[[Env], Built]:
    num_experts, top_k, hidden, inter = shape

    def build(env: Env) -> Built:
        from specengine.kernels import fused_moe

        w13, w2 = _moe_weights(env, model, shape)
        el = w13.element_size()

        def make(i: int) -> dict[str, Any]:
            g = torch.Generator(device=env.device).manual_seed(1000 + i)
            x = torch.randn(tokens, hidden, generator=g, device=env.device).to(env.dtype)
            logits = torch.randn(tokens, num_experts, generator=g,
                                 device=env.device).to(env.dtype)
            weights, ids = fused_moe.topk_softmax(logits, top_k, True)
            touched = int(torch.bincount(ids.flatten().long(), minlength=num_experts)
                          .gt(0).sum())
            return dict(x=x, logits=logits, weights=weights, ids=ids, touched=touched)

        pairs = tokens * top_k
        block_m = fused_moe.block_m_for(pairs)
        padded = -(-max(fused_moe.max_padded_pairs(pairs, num_experts, block_m), 1)
                   // block_m) * block_m

        def nbytes(c: dict[str, Any]) -> int:
            route_out = pairs * (4 + 4)  # float32 weights, int32 ids
            if part == "routing":
                return tokens * num_experts * el + route_out
            if part == "align":
                return pairs * 4 + padded * 4 + padded // block_m * 4 + 4
            experts = c["touched"] * 3 * hidden * inter * el + 2 * tokens * hidden * el
            if part == "experts":
                return experts + route_out
            return experts + tokens * num_experts * el  # forward: router logits in

        calls: dict[str, Callable[[dict[str, Any]], object]] = {
            "forward": lambda c: fused_moe.moe_forward(c["x"], c["logits"], w13, w2, top_k,
                                                       True),
            "routing": lambda c: fused_moe.topk_softmax(c["logits"], top_k, True),
            "align": lambda c: fused_moe.moe_align_block_size(c["ids"], num_experts, block_m),
            "experts": lambda c: fused_moe.fused_moe(c["x"], w13, w2, c["weights"], c["ids"]),
        }

        def info(copies: list[dict[str, Any]]) -> dict[str, Any]:
            return dict(distinct_experts=statistics.mean(c["touched"] for c in copies),
                        block_m=block_m)

        return Built(make, calls[part], nbytes, copy_bytes=tokens * (hidden + num_experts) * el,
                     info=info, profile=part == "forward" and tokens <= 4)
    return build


# ---------------------------------------------------------------------------------------------
# KV writes


def kv_cases(dry: bool) -> list[Case]:
    cases = []
    for t in ([4, 16] if dry else [1, 16, 64, 256, 1024, 4096]):
        cases.append(Case("kv", f"rope_kv T={t}", 0 if t == (16 if dry else 1024) else 2,
                          dict(op="rope_kv", tokens=t), _rope_kv_builder(t),
                          at_most_floor(2.0) if t == (16 if dry else 1024) else None))
    for b in ([1, 2] if dry else [1, 64, 256]):
        cases.append(Case("kv", f"reshape_and_cache B={b} x4", 2,
                          dict(op="reshape_and_cache", batch=b, tokens_per_seq=4),
                          _reshape_builder(b, 4)))
        cases.append(Case("kv", f"compact_kv B={b} accepted=3", 2,
                          dict(op="compact_kv", batch=b, accepted=3, tree_size=16),
                          _compact_builder(b, 3, 16)))
    return cases


def _qwen3_heads(env: Env) -> tuple[int, int, int]:
    return (4, 2, 64) if env.dry else (32, 8, 128)  # Hq, Hkv, D (Qwen3-8B)


def _rope_kv_builder(tokens: int) -> Callable[[Env], Built]:
    def build(env: Env) -> Built:
        from specengine.kernels.rope_kv import rope_and_cache

        hq, hkv, d = _qwen3_heads(env)
        el = torch.tensor([], dtype=env.dtype).element_size()
        num_blocks = -(-4 * tokens // 16) + 1
        k_cache = torch.zeros(num_blocks, 16, hkv, d, dtype=env.dtype, device=env.device)
        v_cache = torch.zeros_like(k_cache)
        q_norm = torch.rand(d, device=env.device).to(env.dtype) + 0.5
        k_norm = torch.rand(d, device=env.device).to(env.dtype) + 0.5

        def make(i: int) -> tuple:
            g = torch.Generator(device=env.device).manual_seed(i)
            qkv = torch.randn(tokens, (hq + 2 * hkv) * d, generator=g,
                              device=env.device).to(env.dtype)
            angle = torch.rand(tokens, d // 2, generator=g, device=env.device) * 100
            slots = torch.randperm(num_blocks * 16, generator=g, device=env.device)[:tokens]
            return qkv, angle.cos().to(env.dtype), angle.sin().to(env.dtype), slots

        def nbytes(c: tuple) -> int:
            qkv_in = tokens * (hq + 2 * hkv) * d * el
            rope = 2 * tokens * (d // 2) * el + 2 * d * el  # cos, sin, both norm weights
            out = tokens * hq * d * el + 2 * tokens * hkv * d * el  # q out, k and v into cache
            return qkv_in + rope + out + tokens * 8

        def call(c: tuple) -> object:
            qkv, cos, sin, slots = c
            return rope_and_cache(qkv, cos, sin, k_cache, v_cache, slots, hq, hkv, q_norm,
                                  k_norm, 1e-6)

        return Built(make, call, nbytes, tokens * (hq + 2 * hkv + d) * d * el)
    return build


def _reshape_builder(batch: int, per_seq: int) -> Callable[[Env], Built]:
    def build(env: Env) -> Built:
        import numpy as np
        from kv_cache_cases import Layout, blocks_per_seq, new_token_slots

        from specengine.kernels import kv_cache

        hq, hkv, d = (4, 2, 64) if env.dry else (32, 8, 128)  # Llama-3.1-8B
        ctx = 64 if env.dry else 512
        num_blocks = batch * blocks_per_seq(ctx, 16)
        k_cache = torch.zeros(num_blocks, 16, hkv, d, dtype=env.dtype, device=env.device)
        v_cache = torch.zeros_like(k_cache)
        t = batch * per_seq
        el = k_cache.element_size()

        def make(i: int) -> tuple:
            layout = Layout(np.random.default_rng(i), batch, ctx, 16, num_blocks)
            slots = torch.from_numpy(new_token_slots(layout, per_seq)).to(env.device)
            qkv = torch.randn(t, (hq + 2 * hkv) * d, device=env.device).to(env.dtype)
            key = qkv[:, hq * d:(hq + hkv) * d].view(t, hkv, d)  # strided, as the model has
            value = qkv[:, (hq + hkv) * d:].view(t, hkv, d)
            return key, value, slots

        def nbytes(c: tuple) -> int:
            return 4 * t * hkv * d * el + t * c[2].element_size()

        return Built(make, lambda c: kv_cache.reshape_and_cache(c[0], c[1], k_cache, v_cache,
                                                                 c[2]),
                     nbytes, t * (hq + 2 * hkv) * d * el)
    return build


def _compact_builder(batch: int, accepted: int, tree_size: int) -> Callable[[Env], Built]:
    def build(env: Env) -> Built:
        import numpy as np
        from kv_cache_cases import Layout, accepted_path_moves, blocks_per_seq

        from specengine.kernels import kv_cache

        layers, hkv, d = (2, 2, 64) if env.dry else (32, 8, 128)  # Llama-3.1-8B
        ctx = 32
        num_blocks = batch * blocks_per_seq(ctx, 16)
        kv = torch.zeros(2, layers, num_blocks, 16, hkv, d, dtype=env.dtype, device=env.device)
        row_bytes = hkv * d * kv.element_size()

        def make(i: int) -> torch.Tensor:
            rng = np.random.default_rng(i)
            layout = Layout(rng, batch, ctx, 16, num_blocks)
            src, dst = accepted_path_moves(layout, rng, accepted, tree_size)
            return torch.from_numpy(np.stack([src, dst]).astype(np.int64)).to(env.device)

        def nbytes(slots: torch.Tensor) -> int:
            pairs = slots.shape[1]
            return 2 * (2 * layers) * pairs * row_bytes + 2 * pairs * 8

        return Built(make, lambda slots: kv_cache.compact_kv_cache(kv, slots), nbytes,
                     batch * accepted * 16)
    return build


# ---------------------------------------------------------------------------------------------
# the run


def all_cases(dry: bool, groups: list[str]) -> list[Case]:
    makers = {"attention": attention_cases, "sampling": sampling_cases, "moe": moe_cases,
              "kv": kv_cases}
    cases = [c for g in groups for c in makers[g](dry)]
    names = [c.name for c in cases]
    if len(set(names)) != len(names):
        raise AssertionError("case names must be unique")
    # Most valuable first; within a priority the groups take turns (a slow group cannot
    # starve the others of the budget) and each group keeps its listed order (a row that a
    # target compares with comes before that target's row).
    rank: dict[str, int] = {}
    seen: dict[tuple[int, str], int] = {}
    for c in cases:
        key = (c.priority, c.group)
        rank[c.name] = seen.get(key, 0)
        seen[key] = rank[c.name] + 1
    return sorted(cases, key=lambda c: (c.priority, rank[c.name], groups.index(c.group)))


def run_case(case: Case, env: Env, args: argparse.Namespace, rows: dict[str, dict]) -> dict:
    built = case.build(env)
    c0 = built.make(0)
    n = gt.num_copies(built.nbytes(c0), built.copy_bytes, l2=env.l2,
                      max_copies=env.max_copies, mem_cap_bytes=env.mem_cap)
    copies = [c0] + [built.make(i) for i in range(1, n)]
    nbytes = statistics.mean(built.nbytes(c) for c in copies)
    timing = gt.time_rotated(built.call, copies, replays=args.replays,
                             eager_runs=args.eager_runs, graphs=env.device == "cuda",
                             calls=n if env.dry else None, profile=built.profile)
    row: dict[str, Any] = dict(kind="row", group=case.group, case=case.name, **case.params)
    if built.info is not None:
        row.update(built.info(copies))
    floor = gt.floor_us(nbytes, env.gbps)
    row.update(bytes=int(nbytes), copies=timing.copies, calls=timing.calls,
               replays=timing.replays, working_set_mb=round(n * nbytes / 1e6, 1),
               graph_us=timing.graph_us, eager_us=timing.eager_us, time_us=timing.best_us,
               floor_us=floor, x_floor=timing.best_us / floor,
               gbps=nbytes / (timing.best_us * 1e-6) / 1e9)
    row["bw_frac"] = row["gbps"] / env.gbps
    if timing.graph_error:
        row["graph_error"] = timing.graph_error
    if timing.kernels is not None:
        row["kernels_us"] = timing.kernels
    if case.target is not None:
        text, ok = case.target(row, rows)
        row["target"] = text
        row["verdict"] = "-" if ok is None else ("PASS" if ok else "MISS")
    return row


def fmt(x: float | None, spec: str) -> str:
    return "-" if x is None else format(x, spec)


def markdown(meta: dict, rows: list[dict], skipped: list[str]) -> str:
    lines = [f"Device {meta['device']}, torch {meta['torch']}, triton {meta['triton']}; copy "
             f"bandwidth {meta['copy_gbps']:.0f} GB/s (read + write, measured), L2 "
             f"{meta['l2_bytes'] / 2**20:.0f} MiB; {meta['timing']}.", "",
             "| case | graph us | eager us | floor us | x floor | % bw | copies x calls | "
             "target | verdict |", "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['case']} | error | | | | | | {r['error'][:80]} | ERROR |")
            continue
        graph = fmt(r["graph_us"], ".1f") + ("*" if r.get("graph_error") else "")
        name = r["case"]
        if "splits_used" in r:  # the attention variant the launcher ran
            name += f" [S={r['splits_used']} {r['block_m']}x{r['block_n']}]"
        lines.append(f"| {name} | {graph} | {r['eager_us']:.1f} | {r['floor_us']:.1f} | "
                     f"{r['x_floor']:.2f} | {100 * r['bw_frac']:.0f} | "
                     f"{r['copies']} x {r['calls']} | {r.get('target', '')} | "
                     f"{r.get('verdict', '')} |")
    if any(r.get("graph_error") for r in rows):
        lines.append("")
        lines.append("\\* no graph time: " + sorted({r["graph_error"] for r in rows
                                                     if r.get("graph_error")})[0])
    if skipped:
        lines += ["", f"Not run (budget): {', '.join(skipped)}"]
    return "\n".join(lines) + "\n"


def summary(jsonl: Path) -> str:
    """The rows with a target (and errors) of a sweep's JSONL, also of one stopped mid-way."""
    lines = [ln for ln in jsonl.read_text().splitlines() if ln.strip()]
    meta, rows, skipped = {}, [], []
    for ln in lines:
        try:
            rec = json.loads(ln)
        except json.JSONDecodeError:
            continue  # a line cut by a kill
        if rec.get("kind") == "meta":
            meta = rec
        elif rec.get("kind") == "row":
            rows.append(rec)
        elif rec.get("kind") == "skipped":
            skipped = rec["cases"]
    out = [f"sweep: {len(rows)} cases on {meta.get('device', '?')}, copy "
           f"{meta.get('copy_gbps', 0):.0f} GB/s" + (f", {len(skipped)} not run (budget)"
                                                     if skipped else "")]
    for r in rows:
        if "error" in r:
            out.append(f"  ERROR {r['case']}: {r['error'][:90]}")
        elif r.get("verdict"):
            how = "" if r.get("graph_us") is not None else " EAGER (no graph)"
            out.append(f"  {r['verdict']:4} {r['case']:40} {r['time_us']:9.1f} us{how} "
                       f"(eager {r['eager_us']:.1f}, x{r['x_floor']:.2f} floor, "
                       f"{100 * r['bw_frac']:.0f}% bw)  {r['target']}")
    verdicts = [r.get("verdict") for r in rows]
    out.append(f"  targets: {verdicts.count('PASS')} PASS, {verdicts.count('MISS')} MISS")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--only", default=",".join(GROUPS),
                   help=f"comma-separated groups among {', '.join(GROUPS)}")
    p.add_argument("--budget-s", type=float, default=280.0,
                   help="stop starting cases whose estimated time does not fit")
    p.add_argument("--out", type=Path, help="folder for the JSONL and table (required)")
    p.add_argument("--summary-of", type=Path, default=None,
                   help="print the target rows of OUT/kernels_graph.jsonl of an earlier run")
    p.add_argument("--dry", action="store_true",
                   help="tiny shapes on the CPU (Triton interpreter, no graphs)")
    p.add_argument("--replays", type=int, default=30, help="timed graph replays per case")
    p.add_argument("--eager-runs", type=int, default=5, help="timed eager runs per case")
    p.add_argument("--mem-gib", type=float, default=3.0, help="memory for copies per case")
    p.add_argument("--skip-from", type=Path, default=None,
                   help="a JSONL of an earlier run: its cases measured without error are not "
                        "run again (a second command continues the sweep)")
    p.add_argument("--match", default="",
                   help="comma-separated: only cases whose name contains one of these")
    args = p.parse_args(argv)
    if args.summary_of is not None:
        print(summary(args.summary_of / "kernels_graph.jsonl"))
        return 0
    if args.out is None:
        p.error("--out is required")
    groups = [g for g in args.only.split(",") if g]
    bad = [g for g in groups if g not in GROUPS]
    if bad or not groups:
        p.error(f"--only takes groups among {GROUPS}, got {args.only!r}")
    cuda = torch.cuda.is_available()
    if not cuda and not args.dry:
        print("bench_kernels_graph: no CUDA device; --dry runs tiny shapes on the CPU",
              file=sys.stderr)
        return 2
    if args.dry:
        args.replays, args.eager_runs = min(args.replays, 2), 1
    t_start = time.monotonic()
    # --dry on a GPU: the tiny shapes, graph-timed (a quick check of the device path).
    env = Env(dry=args.dry, device="cuda" if cuda else "cpu",
              dtype=torch.bfloat16 if cuda else torch.float32, l2=gt.l2_bytes(),
              max_copies=2 if args.dry else 64, mem_cap=int(args.mem_gib * 2**30))
    env.gbps, bw = gt.copy_bandwidth(1 << 30 if cuda and not args.dry else 1 << 22)
    import triton

    meta = dict(kind="meta", device=torch.cuda.get_device_name() if cuda else "cpu (dry)",
                torch=torch.__version__, triton=triton.__version__, copy_gbps=env.gbps,
                copy_graph_us=bw.graph_us, l2_bytes=env.l2, dtype=str(env.dtype),
                timing=("median of graph replays (inputs rotated over >= 4x L2) per call"
                        if cuda else "dry run: wall clock, no graphs, meaningless as speed"),
                budget_s=args.budget_s, groups=groups)
    args.out.mkdir(parents=True, exist_ok=True)
    jsonl = args.out / "kernels_graph.jsonl"
    wanted = [m for m in args.match.split(",") if m]
    before: dict[str, dict] = {}  # rows of an earlier run: not run again, still compared with
    if args.skip_from is not None and args.skip_from.is_file():
        for ln in args.skip_from.read_text().splitlines():
            try:
                rec = json.loads(ln)
            except json.JSONDecodeError:
                continue
            if rec.get("kind") == "row" and "error" not in rec:
                before[rec["case"]] = rec
    done = set(before)
    cases = [c for c in all_cases(env.dry, groups)
             if (not wanted or any(m in c.name for m in wanted)) and c.name not in done]
    if done:
        meta["skipped_measured_before"] = sorted(done)
    print(f"{meta['device']}: copy {env.gbps:.0f} GB/s, L2 {env.l2 / 2**20:.0f} MiB, "
          f"{len(cases)} cases, budget {args.budget_s:.0f} s", flush=True)
    rows: dict[str, dict] = dict(before)
    ordered: list[dict] = []
    skipped: list[str] = []
    spent: dict[str, list[float]] = {}
    with jsonl.open("w") as f:
        f.write(json.dumps(meta) + "\n")
        f.flush()
        fatal = None
        for case in cases:
            elapsed = time.monotonic() - t_start
            past = spent.get(case.group, [])
            estimate = 1.5 * statistics.mean(past) if past else 5.0
            if fatal or elapsed + estimate > args.budget_s:
                skipped.append(case.name)
                continue
            t0 = time.monotonic()
            try:
                row = run_case(case, env, args, rows)
            except Exception as e:  # noqa: BLE001 - one failing case is a row, not the end
                row = dict(kind="row", group=case.group, case=case.name, **case.params,
                           error=f"{type(e).__name__}: {e}"[:400])
                if any(s in str(e) for s in FATAL):
                    fatal = row["error"]
            row["seconds"] = round(time.monotonic() - t0, 2)
            spent.setdefault(case.group, []).append(row["seconds"])
            rows[case.name] = row
            ordered.append(row)
            f.write(json.dumps(row) + "\n")
            f.flush()
            verdict = row.get("verdict", "")
            print(f"{case.name:48} " + (f"error: {row['error'][:100]}" if "error" in row else
                  f"graph {fmt(row['graph_us'], '9.1f')} us  eager {row['eager_us']:9.1f} us  "
                  f"floor {row['floor_us']:8.1f}  x{row['x_floor']:.2f}  "
                  f"{100 * row['bw_frac']:3.0f}% bw  {verdict}"), flush=True)
            if cuda:
                gc.collect()
                torch.cuda.empty_cache()
        if skipped:
            f.write(json.dumps(dict(kind="skipped", cases=skipped)) + "\n")
    env.cache.clear()
    table = markdown(meta, ordered, skipped)
    (args.out / "kernels_graph.md").write_text(table)
    print(table)
    verdicts = [r.get("verdict") for r in ordered]
    print(f"{len(ordered)} cases in {time.monotonic() - t_start:.0f} s; targets: "
          f"{verdicts.count('PASS')} PASS, {verdicts.count('MISS')} MISS; "
          f"{sum('error' in r for r in ordered)} errors; {len(skipped)} not run")
    return 0


if __name__ == "__main__":
    sys.exit(main())
