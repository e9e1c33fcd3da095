"""``k="auto"`` against every fixed k (issue 14 item 1, docs/design.md §15).

On the bundled pair (``specengine.assets``), held-out arithmetic prompts, temperature 1,
seeded requests (every round replays the same completions):

* **trained head** (``DEFAULT_DRAFT``) at batch 1 (``--b1-prompts`` prompts, one
  ``generate`` call each) and batch 64 (one call of 64 prompts): tokens per second of
  k = 0..8 and ``k="auto"`` (``k_max`` 8). Verdict: auto within 10 % of the best fixed k.
* **useless head**: the trained head's tensors replaced by seeded Gaussian noise of the same
  scale (``d2t`` / ``t2d`` kept): k = 0 and auto, at both batch sizes. Verdict: auto drafts on
  at most a few per cent of steps and runs within 10 % of k = 0.

Each round runs every (head, batch, k) unit once, in a shuffled order, so a shared machine's
load drifts over all of them alike; the figure of a unit is its median over ``--rounds``
rounds, and each verdict's ratio is also given as the median of the per-round ratios (paired:
both runs of a round saw about the same load). An A/A control (the useless head's k = 0 run
twice per round, ``0'``) shows the noise floor: identical work, different figures. Figures:
tokens / wall seconds of ``engine.stats``, prefill included; next to it tokens per
CPU second of this thread, ``time.thread_time``: with one torch thread every op runs on it,
so on a shared machine it leaves out the time slices other jobs took). Each engine runs one
untimed ``k="auto"`` call first: the warm-up that fits the cost model (timed, printed) happens
there, once per engine, as in a long RL run; the controller's state carries across calls.

Usage::

    OMP_NUM_THREADS=1 python benchmarks/bench_auto_k.py [--rounds 7]
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch
from benchlib import DEFAULT_OUT, write_json
from safetensors.torch import load_file, save_file

TOLERANCE = 0.10
KS: list[int | str] = [*range(9), "auto"]


def useless_head(out: Path, seed: int = 0) -> Path:
    """The bundled head with every weight replaced by noise of its own scale."""
    import shutil

    from specengine.assets import DEFAULT_DRAFT

    src = Path(DEFAULT_DRAFT)
    shutil.copy(src / "config.json", out / "config.json")
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, t in load_file(str(src / "model.safetensors")).items():
        if t.is_floating_point() and t.numel() > 1:
            noise = torch.randn(t.shape, generator=gen) * t.float().std() + t.float().mean()
            t = noise.to(t.dtype)
        tensors[name] = t
    save_file(tensors, str(out / "model.safetensors"))
    return out


def run_unit(engine, prompts: list, params: list, k: int | str, batch: int) -> dict:
    """One (batch, k) unit: ``batch`` prompts per ``generate`` call."""
    tokens = steps = 0
    wall = cpu = 0.0
    hist: list[int] = []
    for i in range(0, len(prompts), batch):
        c0 = time.thread_time()
        engine.generate(prompts[i:i + batch], k=k, sampling=params[i:i + batch])
        cpu += time.thread_time() - c0
        st = engine.stats
        tokens += st.num_generated_tokens
        wall += st.wall_time_s
        steps += st.num_steps
        for j, n in enumerate(st.auto_k_steps):
            hist += [0] * (j + 1 - len(hist))
            hist[j] += n
    return dict(tokens=tokens, wall_s=wall, tok_s=tokens / wall, cpu_tok_s=tokens / cpu,
                steps=steps, k_hist=hist)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--b1-prompts", type=int, default=8)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    from specengine import SamplingParams, SpecEngine
    from specengine.arith_task import encode, heldout_prompts
    from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

    tmp = Path(tempfile.mkdtemp(prefix="useless-head-"))
    heads = {"trained": DEFAULT_DRAFT, "useless": str(useless_head(tmp))}
    engines, calib = {}, {}
    prompts = [encode(p) for p in heldout_prompts(64, seed=5)]
    params = [SamplingParams(temperature=1.0, max_tokens=args.max_tokens, seed=i)
              for i in range(64)]
    for name, head in heads.items():
        eng = SpecEngine(DEFAULT_TARGET, draft=head, device="cpu", seed=0)
        t0 = time.perf_counter()
        eng.generate(prompts[:4], k="auto", sampling=params[:4])  # calibration + warm-up
        calib[name] = time.perf_counter() - t0
        eng.generate(prompts[:4], k=3, sampling=params[:4])
        engines[name] = eng
    units = [("trained", b, k) for b in (1, 64) for k in KS] + \
        [("useless", b, k) for b in (1, 64) for k in (0, "0'", "auto")]
    data = {b: (prompts[:args.b1_prompts], params[:args.b1_prompts]) if b == 1
            else (prompts, params) for b in (1, 64)}
    results: dict[tuple, list[dict]] = {u: [] for u in units}
    rng = random.Random(0)
    for r in range(args.rounds):
        rng.shuffle(units)
        t0 = time.perf_counter()
        for head, b, k in units:
            kk = 0 if k == "0'" else k  # the A/A control runs k = 0 again
            results[(head, b, k)].append(run_unit(engines[head], *data[b], kk, b))
        print(f"round {r + 1}/{args.rounds}: {time.perf_counter() - t0:.1f} s", flush=True)

    rows = []
    for (head, b, k), reps in sorted(results.items(), key=lambda x: (x[0][0], x[0][1],
                                                                       str(x[0][2]))):
        width = max(len(r["k_hist"]) for r in reps)
        hist = [sum(r["k_hist"][j] for r in reps if j < len(r["k_hist"])) for j in range(width)]
        rows.append(dict(head=head, batch=b, k=k,
                         tok_s=statistics.median(r["tok_s"] for r in reps),
                         cpu_tok_s=statistics.median(r["cpu_tok_s"] for r in reps),
                         tok_s_all=[r["tok_s"] for r in reps],
                         cpu_tok_s_all=[r["cpu_tok_s"] for r in reps], steps=reps[0]["steps"],
                         tokens=reps[0]["tokens"], k_hist=hist))
    report(rows, calib, engines)
    write_json(dict(args={k: str(v) for k, v in vars(args).items()}, rows=rows,
                    calibration_s=calib), args.out, "bench_auto_k")


def paired(a: dict, b: dict, key: str) -> float:
    """Median over rounds of ``a``'s figure over ``b``'s in the same round."""
    return statistics.median(x / y for x, y in zip(a[key + "_all"], b[key + "_all"]))


def report(rows: list[dict], calib: dict, engines: dict) -> None:
    by = {(r["head"], r["batch"], r["k"]): r for r in rows}
    for name, eng in engines.items():
        c = eng.core.auto_k.costs.cost
        print(f"{name}: calibration + first auto call {calib[name]:.1f} s; fitted t_draft "
              f"{tuple(round(x * 1e3, 4) for x in c.draft)} ms, t_verify "
              f"{tuple(round(x * 1e3, 4) for x in c.verify)} ms; acceptance a_1..a_4 "
              f"{[round(float(a), 2) for a in eng.core.auto_k.acceptance.conditional()[:4]]}")
    print("\n| head | batch | tokens per | " + " | ".join(f"k={k}" for k in range(9))
          + " | auto | best fixed | auto / best (paired) | auto k: steps | within 10% |")
    print("|---|---:|---|" + "---:|" * 9 + "---:|---|---:|---|---|")
    for b in (1, 64):
        auto = by[("trained", b, "auto")]
        ks = " ".join(f"{k}:{n}" for k, n in enumerate(auto["k_hist"]) if n)
        for key, label in (("tok_s", "wall s"), ("cpu_tok_s", "CPU s")):
            fixed = {k: by[("trained", b, k)][key] for k in range(9)}
            best = max(fixed, key=fixed.get)
            ratio = auto[key] / fixed[best]
            pr = paired(auto, by[("trained", b, best)], key)
            print(f"| trained | {b} | {label} | " + " | ".join(f"{fixed[k]:.0f}" for k in range(9))
                  + f" | {auto[key]:.0f} | k={best} | {ratio:.2f} ({pr:.2f}) | {ks} | "
                  + ("yes" if ratio >= 1 - TOLERANCE else "**no**") + " |")
    print("\n| head | batch | tokens per | k=0 | auto | auto / k=0 (paired) | A/A: k=0' / k=0 "
          "(paired) | steps drafting | auto k: steps | within 10% |")
    print("|---|---:|---|---:|---:|---:|---:|---:|---|---|")
    for b in (1, 64):
        base, auto, again = (by[("useless", b, k)] for k in (0, "auto", "0'"))
        hist = auto["k_hist"]
        drafting = sum(hist[1:]) / max(1, sum(hist))
        ks = " ".join(f"{k}:{n}" for k, n in enumerate(hist) if n)
        for key, label in (("tok_s", "wall s"), ("cpu_tok_s", "CPU s")):
            ratio = auto[key] / base[key]
            aa = again[key] / base[key]
            print(f"| useless | {b} | {label} | {base[key]:.0f} | {auto[key]:.0f} | "
                  f"{ratio:.2f} ({paired(auto, base, key):.2f}) | {aa:.2f} "
                  f"({paired(again, base, key):.2f}) | {drafting:.1%} | {ks} | "
                  + ("yes" if ratio >= 1 - TOLERANCE else "**no**") + " |")


if __name__ == "__main__":
    main()
