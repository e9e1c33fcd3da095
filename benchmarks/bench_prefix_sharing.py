"""GRPO batch with and without shared prompt KV (issue 16; docs/design.md §17).

Two parts:

- ``bundled``: the real engine on the bundled pair (CPU): 64 prompts, n = 8, once as groups
  (``SamplingParams(n=8)``, prefix caching on) and once as 8 lone requests per prompt with the
  derived seeds on an engine that shares nothing. Reports prompt tokens computed, the peak of
  KV blocks held, wall time, and checks that both give the same tokens. The bundled target has
  256 positions, so its prompts are 32–224 tokens.
- ``shapes``: 8B shapes (Qwen3-8B / Llama-3.1-8B KV layout, bf16, block 16) on an 80 GB H100
  budget (0.85 of the memory less the bf16 weights). Prompt tokens computed and KV blocks
  held do not depend on the weights' values, so they are measured by driving the engine's own
  scheduler and block allocator (``Scheduler``, ``KVCache``) through the whole GRPO batch
  (64 prompts of 1–4k tokens, n = 8, ``--max-tokens`` each), with a prefill simulated by
  ``KVCache.finish_prefill`` and a decode step by appending a token; no forward pass runs
  (no timings at 8B here). The largest batch that fits is the most groups whose whole
  rollouts (prompt + max_tokens) the budget holds at once, counted block by block as the
  allocator hands them out.

Usage:
  python benchmarks/bench_prefix_sharing.py bundled
  python benchmarks/bench_prefix_sharing.py shapes [--max-tokens 1024]
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from specengine import SamplingParams
from specengine.core.kv_cache import KVCache
from specengine.core.prefix_cache import SeqGroup, sample_seed
from specengine.core.scheduler import Scheduler
from specengine.core.sequence import SeqStatus, Sequence

BS = 16
N = 8
GIB = 1 << 30
# (layers, kv heads, head_dim, parameters) of the 8B shapes in bench_generate.SHAPES
SHAPES = {"qwen3-8b": (36, 8, 128, 8.19e9), "llama-8b": (32, 8, 128, 8.03e9)}


def prompts_of(num: int, lo: int, hi: int, vocab: int, seed: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(2, vocab) for _ in range(rng.randint(lo, hi))] for _ in range(num)]


# ---- the scheduler and allocator without a model ----------------------------------------------
def simulate(prompts: list[list[int]], n: int, max_tokens: int, num_blocks: int,
             share: bool) -> dict:
    """Run the whole batch through the scheduler; count computed prompt tokens, peak blocks
    held and preemptions."""
    cache = KVCache(num_blocks, BS, 1, 1, 1, torch.float32, "cpu", prefix_caching=share)
    sched = Scheduler(cache, max_batch_size=len(prompts) * n, max_num_batched_tokens=1 << 20)
    sid = 0
    for i, prompt in enumerate(prompts):
        group = SeqGroup(i, n) if share else None
        for _ in range(n):
            sched.add(Sequence(sid, prompt, SamplingParams(max_tokens=max_tokens), 0, ()),
                      group)
            sid += 1
    computed = held = peak = peak_running = 0
    while sched.has_unfinished():
        batch = sched.schedule(lambda s: 0)
        if batch.is_prefill:
            for s in batch.seqs:
                plan = cache.pending[s.seq_id]
                computed += plan.num_computed
                held += len(s)
            cache.finish_prefill(batch.seqs)
        for s in batch.seqs:
            s.append([1], [0.0], 1 << 30)
            if s.status is SeqStatus.FINISHED:
                sched.finish(s)
            else:
                s.num_cached_tokens = len(s) - 1
        peak = max(peak, num_blocks - cache.num_free_blocks)
        peak_running = max(peak_running, len(sched.running))
    return dict(prompt_tokens=held, computed_prompt_tokens=computed, peak_blocks=peak,
                peak_running=peak_running, preemptions=sched.num_preemptions)


def group_blocks(p: int, n: int, max_tokens: int, share: bool) -> int:
    """Blocks a group holds at its longest: the prompt's full blocks once when shared (each
    sample's partial block is its own copy), every sample's own blocks after that."""
    total = -(-(p + max_tokens) // BS)
    return p // BS + n * (total - p // BS) if share else n * total


def largest_batch(prompts: list[list[int]], n: int, max_tokens: int, budget: int,
                  share: bool) -> int:
    used = groups = 0
    for p in prompts:
        used += group_blocks(len(p), n, max_tokens, share)
        if used > budget:
            break
        groups += 1
    return groups


def run_shapes(args: argparse.Namespace) -> list[dict]:
    prompts = prompts_of(64, 1024, 4096, 150_000)
    many = prompts_of(4096, 1024, 4096, 150_000, seed=1)
    rows = []
    for name, (layers, kv_heads, head_dim, params) in SHAPES.items():
        bytes_per_block = 2 * layers * kv_heads * head_dim * 2 * BS
        budget = int((0.85 * 80e9 - 2 * params) // bytes_per_block)
        for share in (True, False):
            t0 = time.perf_counter()
            whole = simulate(prompts, N, args.max_tokens, 1 << 18, share)  # all at once
            fit = simulate(prompts, N, args.max_tokens, budget, share)  # on the H100 budget
            formula = sum(group_blocks(len(p), N, args.max_tokens, share) for p in prompts)
            rows.append(dict(
                shape=name, sharing=share, max_tokens=args.max_tokens, h100_blocks=budget,
                prompt_tokens=whole["prompt_tokens"],
                computed_prompt_tokens=whole["computed_prompt_tokens"],
                blocks_all_at_once=whole["peak_blocks"], blocks_formula=formula,
                gib_all_at_once=round(whole["peak_blocks"] * bytes_per_block / GIB, 1),
                h100_computed_prompt_tokens=fit["computed_prompt_tokens"],
                h100_peak_running=fit["peak_running"], h100_preemptions=fit["preemptions"],
                largest_groups=largest_batch(many, N, args.max_tokens, budget, share),
                sim_s=round(time.perf_counter() - t0, 1)))
            print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- the real engine on the bundled pair ------------------------------------------------------
def run_engine(engine: object, prompts: list[list[int]], params: list[SamplingParams]) -> dict:
    t0 = time.perf_counter()
    ids = [rid for p, sp in zip(prompts, params)
           for rid in _as_list(engine.add_request(p, sp))]  # type: ignore[attr-defined]
    done, peak, kv = {}, 0, engine.kv_cache  # type: ignore[attr-defined]
    while engine.has_unfinished():  # type: ignore[attr-defined]
        for out in engine.step():  # type: ignore[attr-defined]
            if out.finished:
                done[out.request_id] = out.output.token_ids
        peak = max(peak, kv.num_blocks - kv.num_free_blocks)
    stats = engine.stats  # type: ignore[attr-defined]
    return dict(prompt_tokens=stats.num_prompt_tokens,
                computed_prompt_tokens=stats.num_computed_prompt_tokens,
                shared_blocks=stats.num_shared_blocks, peak_blocks=peak,
                wall_s=round(time.perf_counter() - t0, 2), tokens=[done[i] for i in ids])


def _as_list(x: str | list[str]) -> list[str]:
    return x if isinstance(x, list) else [x]


def run_bundled(args: argparse.Namespace) -> list[dict]:
    from specengine import SpecEngine
    from specengine.assets import DEFAULT_TARGET

    kw = dict(device="cpu", max_batch_size=64 * N, kv_cache_tokens=64 * N * 256,
              max_num_batched_tokens=8192)
    prompts = prompts_of(64, 32, 224, 20)
    base = SamplingParams(temperature=1.0, max_tokens=args.bundled_max_tokens, seed=0,
                          ignore_eos=True)
    shared = SpecEngine(DEFAULT_TARGET, **kw)
    grouped = run_engine(shared, prompts, [SamplingParams(**{**_fields(base), "n": N})] * 64)
    plain = SpecEngine(DEFAULT_TARGET, enable_prefix_caching=False, **kw)
    lone = [SamplingParams(**{**_fields(base), "seed": sample_seed(0, i)})
            for _ in prompts for i in range(N)]
    alone = run_engine(plain, [p for p in prompts for _ in range(N)], lone)
    same = grouped.pop("tokens") == alone.pop("tokens")
    many = prompts_of(4096, 32, 224, 20, seed=1)
    fits = {s: largest_batch(many, N, args.bundled_max_tokens, args.bundled_budget, s)
            for s in (True, False)}  # groups whose rollouts the budget holds at once
    rows = [dict(model="bundled", sharing=s, **r, same_tokens=same,
                 budget_blocks=args.bundled_budget, largest_groups=fits[s])
            for s, r in ((True, grouped), (False, alone))]
    for r in rows:
        print(json.dumps(r), flush=True)
    return rows


def _fields(p: SamplingParams) -> dict:
    return {f: getattr(p, f) for f in p.__dataclass_fields__}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("part", choices=["bundled", "shapes"])
    ap.add_argument("--max-tokens", type=int, default=1024, help="8B shapes: tokens per sample")
    ap.add_argument("--bundled-max-tokens", type=int, default=16)
    ap.add_argument("--bundled-budget", type=int, default=1024,
                    help="bundled pair: KV blocks for the largest-batch count")
    args = ap.parse_args()
    run_bundled(args) if args.part == "bundled" else run_shapes(args)


if __name__ == "__main__":
    main()
