"""Online adaptation of the EAGLE-3 head (issue 14 item 3): a spoilt head's acceptance before
and after ``engine.adapt_draft`` on the rollouts of 64 prompts, and the time it takes.

Setting: the bundled pair, k = 3, temperature 1 (the GRPO rollout setting), at most 64 new
tokens. The bundled head is spoilt in place through ``load_weights(which="draft")`` (the
public path): ``--spoil noise`` adds Gaussian noise of ``--sigma`` times each weight
matrix's own standard deviation to every matrix; ``--spoil reinit`` re-initialises ``fc``
and ``lm_head`` as at construction (small random weights). Then:

1. roll out ``--prompts`` held-out prompts (the adaptation rollouts; the engine keeps their
   features and tokens in its buffer): acceptance *before*;
2. ``adapt_draft(steps, lr)``, timed;
3. roll out ``--prompts`` *other* held-out prompts: acceptance *after* (on prompts the head
   did not train on, so it measures the policy's behaviour, not memorised rollouts).

"Acceptance per draft" is ``num_accepted_tokens / num_draft_tokens`` of the rollout. The
untouched head's acceptance on the step-3 prompts is printed as the reference.

Usage::

    python benchmarks/bench_adapt.py [--spoil noise --sigma 1.5] [--steps 40 --lr 3e-3] [--static]
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path

import torch
from benchlib import DEFAULT_OUT, write_json


def spoilt_tensors(engine, how: str, sigma: float, seed: int) -> dict[str, torch.Tensor]:
    """HF-named head tensors after spoiling (see the module docstring)."""
    from specengine.model.weight_names import hf_named_tensors

    g = torch.Generator().manual_seed(seed)
    out = {}
    for name, t in hf_named_tensors(engine.drafter.module).items():
        t = t.detach().float().cpu()
        if how == "noise" and t.dim() == 2:
            t = t + sigma * t.std() * torch.randn(t.shape, generator=g)
        elif how == "reinit" and name.split(".")[0] in ("fc", "lm_head"):
            t = torch.randn(t.shape, generator=g) / t.shape[1] ** 0.5
        out[name] = t
    return out


def acceptance(engine, prompts: list[list[int]], params) -> tuple[float, list[float], float]:
    t0 = time.perf_counter()
    engine.generate(prompts, k=3, sampling=params)
    st = engine.stats
    return (st.num_accepted_tokens / max(st.num_draft_tokens, 1),
            list(st.acceptance_rate_per_position), time.perf_counter() - t0)


def run(args: argparse.Namespace) -> dict:
    from specengine import SamplingParams, SpecEngine
    from specengine.arith_task import encode, heldout_prompts
    from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

    prompts = [encode(p) for p in heldout_prompts(2 * args.prompts)]
    train, test = prompts[: args.prompts], prompts[args.prompts:]
    params = SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                            seed=args.seed)
    engine = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, device=args.device,
                        cuda_graphs=True if args.static else None,
                        draft_options={"adapt_buffer_tokens": args.buffer_tokens})
    reference, _, _ = acceptance(engine, test, params)
    engine.drafter.adapter.buffer.clear()  # the buffer keeps only the spoilt head's rollouts
    engine.load_weights(spoilt_tensors(engine, args.spoil, args.sigma, args.seed),
                        which="draft")
    before, before_pos, gen_s = acceptance(engine, train, params)
    res = engine.adapt_draft(steps=args.steps, lr=args.lr)
    after, after_pos, gen2_s = acceptance(engine, test, params)
    return dict(static=args.static, spoil=args.spoil, sigma=args.sigma, steps=args.steps,
                lr=args.lr,
                prompts=args.prompts, reference=reference, before=before,
                before_per_position=before_pos, after=after, after_per_position=after_pos,
                loss_before=res.loss_before, loss_after=res.loss_after,
                num_seqs=res.num_seqs, num_tokens=res.num_tokens, adapt_s=res.seconds,
                rollout_s=gen_s, eval_rollout_s=gen2_s,
                total_s=gen_s + res.seconds)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--spoil", choices=("noise", "reinit"), default="noise")
    ap.add_argument("--sigma", type=float, default=1.5, help="noise / weight std (noise)")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--buffer-tokens", type=int, default=16384)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--static", action="store_true",
                    help="the static decode step (cuda_graphs=True; padded buffers on a CPU)")
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()
    r = run(args)
    print(f"spoil {r['spoil']} (sigma {r['sigma']}), {r['prompts']} prompts, k=3, "
          f"T={args.temperature}: untouched head {r['reference']:.3f}")
    print(f"acceptance per draft: spoilt {r['before']:.3f} -> adapted {r['after']:.3f} "
          f"(per position {' '.join(f'{x:.2f}' for x in r['after_per_position'])})")
    print(f"adapt_draft({r['steps']} steps, lr {r['lr']}): loss {r['loss_before']:.3f} -> "
          f"{r['loss_after']:.3f} on {r['num_seqs']} rollouts ({r['num_tokens']} tokens) in "
          f"{r['adapt_s']:.1f} s; rollouts {r['rollout_s']:.1f} s; rollouts + adaptation "
          f"{r['total_s']:.1f} s")
    write_json(r, args.out, "bench_adapt")


if __name__ == "__main__":
    main()
