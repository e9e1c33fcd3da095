"""End-to-end rollout speed: tokens/s and target forwards per generated token.

Two modes:

* ``bundled`` (CPU or GPU): the bundled arithmetic pair (Qwen3 target + EAGLE-3 head) on
  held-out prompts of its task, k ∈ {0, 1, 3, 5, 7}, batch ∈ {1, 8, 64, 256}: real acceptance,
  real speedup over ``k=0`` on the same engine.
* ``--peer hf`` (bundled mode; on by default where transformers is installed, ``--peer none``
  to leave it out): transformers' own batched greedy ``generate`` (fp32, left-padded) on the
  same prompts at batch ``--peer-batch`` as a row next to specengine k=0, the n-gram drafter at
  k=3 and the EAGLE-3 head at k=3, interleaved rounds, medians, greedy outputs compared
  (``hf_peer.py``). ``--peer-only``: that table alone.
* ``step-cost`` (GPU): the per-step cost at 8B shapes with random weights
  (``load_format="dummy"``): the time of one target verify pass over k+1 tokens per sequence
  relative to a 1-token decode, batch × context × k. Together with a measured mean accepted
  length τ this bounds the speedup: τ / (verify cost ratio + draft cost).

Usage::

    python benchmarks/bench_generate.py --mode bundled [--batches 1 8] [--ks 0 3]
    OMP_NUM_THREADS=1 python benchmarks/bench_generate.py --peer-only --peer-rounds 5
    python benchmarks/bench_generate.py --mode step-cost --model-shape llama-8b
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import json
import logging
import tempfile
import time
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

SHAPES = {
    # Llama-3.1-8B: 32 layers, 32 q heads, 8 kv heads, head_dim 128, vocab 128256.
    "llama-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                     intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                     rope_theta=500000.0, max_position_embeddings=131072,
                     tie_word_embeddings=False),
    # Qwen3-8B: 36 layers, 32 q heads, 8 kv heads, head_dim 128, vocab 151936.
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936, rms_norm_eps=1e-6,
                     rope_theta=1000000.0, max_position_embeddings=40960,
                     tie_word_embeddings=False),
}


def bench_bundled(args: argparse.Namespace) -> list[dict]:
    from specengine import SamplingParams, SpecEngine
    from specengine.arith_task import heldout_prompts
    from specengine.cli import DEFAULT_DRAFT, DEFAULT_TARGET

    engine = SpecEngine(DEFAULT_TARGET, draft=str(DEFAULT_DRAFT), device=args.device,
                        max_batch_size=max(args.batches))
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens, seed=0)
    rows = []
    for batch in args.batches:
        prompts = heldout_prompts(batch, seed=7)
        engine.generate(prompts[:1], k=0, sampling=params)  # warm-up
        base_tps = None
        for k in tqdm(args.ks, desc=f"batch {batch}"):
            best = None
            for _ in range(args.repeats):
                engine.generate(prompts, k=k, sampling=params)
                st = engine.stats
                if best is None or st.wall_time_s < best.wall_time_s:
                    best = st
            assert best is not None
            tps = best.tokens_per_second
            base_tps = tps if k == 0 else base_tps
            rows.append(dict(
                mode="bundled", batch=batch, k=k, tokens=best.num_generated_tokens,
                wall_s=best.wall_time_s, tokens_per_s=tps,
                forwards_per_token=best.num_seq_steps / max(1, best.num_step_tokens),
                mean_accepted_length=best.mean_accepted_length,
                speedup=tps / base_tps if base_tps else None,
                draft_s=best.time_draft_s, verify_s=best.time_verify_s,
                bookkeeping_s=best.time_bookkeeping_s,
            ))
    return rows


def bench_peer(args: argparse.Namespace) -> list[dict]:
    """``--peer hf``: the interleaved table of ``hf_peer.py`` on the bundled pair."""
    from hf_peer import run_peer

    from specengine.arith_task import EOS, PAD, VOCAB, encode, heldout_prompts
    from specengine.cli import DEFAULT_DRAFT, DEFAULT_TARGET

    prompts = [encode(p) for p in heldout_prompts(args.peer_batch, seed=7)]
    return run_peer(device=args.device, batch=args.peer_batch, max_tokens=args.max_tokens,
                    rounds=args.peer_rounds, target=str(DEFAULT_TARGET), draft=str(DEFAULT_DRAFT),
                    prompts=prompts, eos_id=VOCAB.index(EOS), pad_id=VOCAB.index(PAD),
                    progress=lambda m: print(m, flush=True))


def _time_cuda(fn, repeats: int) -> float:
    torch.cuda.synchronize()
    fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(repeats):
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) / 1e3)
    times.sort()
    return times[len(times) // 2]


def bench_step_cost(args: argparse.Namespace) -> list[dict]:
    if not torch.cuda.is_available():
        raise SystemExit("step-cost mode needs a CUDA device (8B shapes)")
    from specengine import SamplingParams, SpecEngine
    from specengine.core.sequence import Sequence
    from specengine.core.step_types import VerifyShape

    ckpt = Path(tempfile.mkdtemp())
    (ckpt / "config.json").write_text(json.dumps(SHAPES[args.model_shape]))
    max_ctx = max(args.contexts) + 32
    max_batch = max(args.batches)
    engine = SpecEngine(ckpt, device="cuda", dtype="bfloat16", load_format="dummy",
                        max_model_len=max_ctx, max_batch_size=max_batch,
                        kv_cache_tokens=max_batch * max_ctx + 16 * max_batch)
    vocab = engine.model_config.vocab_size
    rows = []
    for batch in args.batches:
        for ctx in args.contexts:
            if batch * (ctx + 32) > engine.kv_cache.num_blocks * engine.config.block_size:
                continue
            seqs = []
            for i in range(batch):
                ids = torch.randint(0, vocab, (ctx,)).tolist()
                seq = Sequence(i, ids, SamplingParams(), 0, ())
                engine.kv_cache.ensure(seq, ctx + 16)
                seq.num_cached_tokens = ctx - 1
                seqs.append(seq)
            # The decode step's verify pass + rejection sampling on the engine's static
            # buffers (one CUDA graph replay per step when graphs are on), drafts random.
            state, graphs = engine.graphs.verifier.state, engine.graphs
            state.arrange(tuple(seqs))
            base = None
            for k in tqdm(args.ks, desc=f"batch {batch} ctx {ctx}"):
                shape = VerifyShape(graphs.padded_rows(batch), k + 1, None, False)
                state.stage(np.full(batch, k, dtype=np.int64))
                drafts = torch.randint(0, vocab, (batch, k), device="cuda")
                graphs.verifier.load_drafts(shape, drafts, None)
                t = _time_cuda(functools.partial(graphs.run, shape), 10)
                base = t if k == 0 else base
                rows.append(dict(mode="step-cost", shape=args.model_shape, batch=batch,
                                 context=ctx, k=k, verify_s=t,
                                 cost_vs_decode=t / base if base else None))
            state.clear()
            for seq in seqs:
                engine.kv_cache.free(seq)
    return rows


def print_table(rows: list[dict]) -> None:
    if not rows:
        return
    keys = [k for k in rows[0] if k != "mode"]
    print(" | ".join(f"{k:>14}" for k in keys))
    for r in rows:
        cells = []
        for k in keys:
            v = r.get(k)
            cells.append(f"{v:>14.4g}" if isinstance(v, float) else f"{v!s:>14}")
        print(" | ".join(cells))


def plot(rows: list[dict], path: Path) -> None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        logging.warning("matplotlib not installed: no plot")
        return
    if not rows:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    if rows[0]["mode"] == "bundled":
        for batch in sorted({r["batch"] for r in rows}):
            sel = [r for r in rows if r["batch"] == batch]
            ax.plot([r["k"] for r in sel], [r["tokens_per_s"] for r in sel], "o-",
                    label=f"batch {batch}")
        ax.set_ylabel("tokens / s")
    else:
        for batch, ctx in sorted({(r["batch"], r["context"]) for r in rows}):
            sel = [r for r in rows if r["batch"] == batch and r["context"] == ctx]
            ax.plot([r["k"] for r in sel], [r["cost_vs_decode"] for r in sel], "o-",
                    label=f"B={batch} ctx={ctx}")
        ax.set_ylabel("verify time / decode time")
    ax.set_xlabel("k")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--mode", choices=["bundled", "step-cost"], default="bundled")
    p.add_argument("--ks", type=int, nargs="+", default=[0, 1, 3, 5, 7])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64, 256])
    p.add_argument("--contexts", type=int, nargs="+", default=[512, 2048, 8192])
    p.add_argument("--model-shape", choices=sorted(SHAPES), default="llama-8b")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--device", default=None)
    p.add_argument("--peer", choices=["hf", "none"],
                   default="hf" if importlib.util.find_spec("transformers") else "none",
                   help="bundled mode: transformers' batched generate as a row (default where "
                        "transformers is installed)")
    p.add_argument("--peer-only", action="store_true", help="the peer table alone")
    p.add_argument("--peer-batch", type=int, default=16)
    p.add_argument("--peer-rounds", type=int, default=5)
    p.add_argument("--threads", type=int, default=1,
                   help="torch threads on CPU (the peer protocol: one)")
    p.add_argument("--out", type=Path, default=Path("benchmarks/out/generate.json"))
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    started = time.strftime("%Y-%m-%d %H:%M:%S")
    if not torch.cuda.is_available():
        torch.set_num_threads(args.threads)
    if args.peer_only and args.peer == "none":
        raise SystemExit("--peer-only needs --peer hf (and transformers installed)")
    rows: list[dict] = []
    if args.mode == "bundled" and args.peer == "hf":
        rows = bench_peer(args)
        print_table([{k: v for k, v in r.items() if k != "mismatches"} for r in rows])
    if args.mode == "step-cost":
        rows = bench_step_cost(args)
    elif not args.peer_only:
        sweep = bench_bundled(args)
        print_table(sweep)
        rows += sweep
    if args.mode == "step-cost":
        print_table(rows)
    device = torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(dict(started=started, device=device, mode=args.mode,
                                        rows=rows), indent=1))
    plot([r for r in rows if r["mode"] != "peer-hf"], args.out.with_suffix(".png"))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
