"""Asynchronous GRPO on the bundled arithmetic model: the learner trains on batch n while the
engine generates batch n+1 (one step of policy lag), and the learner's new weights reach the
engine in flight, between two decode steps of that generation.

    python examples/async_rl.py                 # sync, then async: 20 steps each, ~1.5 min
                                                # on 2 CPU cores
    python examples/async_rl.py --mode async --steps 40 --eval-prompts 256
    python examples/async_rl.py --quick         # 2-step smoke run of both loops

One process. The engine is an ``AsyncSpecEngine`` (its step loop runs in a background thread);
the learner (``transformers`` Qwen3, float32, as in ``rl_loop.py``) trains in an executor
thread so the event loop keeps feeding the engine. Weights travel through the colocated
transport: ``WeightSender(transport="shared").send`` packs them, and the engine thread copies
them in with ``update_weights_from_shared`` between two steps (``run_in_engine``) while batch
n+1 is being generated, without draining it.

* sync loop: generate batch n, train on it, push; the learner waits for every batch.
* async loop: batch n+1 is submitted as soon as batch n is in, before training on batch n;
  the push of version n+1 lands while batch n+1 runs, so its tokens carry version n (before
  the push) or n+1 (after). With ``kv_on_update="recompute"`` (the default here) every token
  stamped with version v is exactly pi_v's, so the learner's check of the engine's
  log-probabilities still holds for the tokens of its own version; the older tokens are
  off-policy by one version, which GRPO's clipped importance ratio (the engine's logprobs are
  the behaviour policy's) accounts for. ``max_policy_lag=1`` guards the bound.

The figure to look at is the exposed generation time: how long the learner waits for rollouts
per step. The sync loop waits for all of every batch; the async loop only for what generation
takes beyond training + push (and for the first batch). Both loops draw the same prompts and
seeds, so their step-0 batches are identical. ``--json PATH`` writes every step's record.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from grpo import group_advantages, grpo_loss, padded, token_logprobs
from rl_config import LoopConfig, pick_draft
from rl_loop import load_learner

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.arith_task import decode, encode, heldout_prompts, reward, training_problems
from specengine.weights import WeightSender

MODES = ("sync", "async")


@dataclass(frozen=True)
class Batch:
    """One batch of rollouts: prompts (G consecutive samples each), completions, the engine's
    log-probabilities and per-token weight versions, and its generation wall time."""

    prompts: list[str]
    prompt_ids: list[list[int]]
    token_ids: list[list[int]]
    logprobs: list[list[float]]
    versions: list[list[int]]
    gen_s: float


@dataclass(frozen=True)
class StepRecord:
    """One step. ``learner_version`` is the policy the learner held when it trained on the
    batch; ``min_version`` / ``max_version`` bound the batch's token versions."""

    step: int
    reward: float
    learner_version: int
    min_version: int
    max_version: int
    frac_current: float  # tokens of the learner's own version
    wait_s: float  # exposed generation: the learner waiting for this batch
    gen_s: float
    train_s: float
    push_s: float
    max_logprob_diff: float  # over the tokens of the learner's version
    loss: float
    num_tokens: int

    def line(self, mode: str) -> str:
        return (f"{mode:5s} step {self.step:3d} | reward {self.reward:.3f} | versions "
                f"{self.min_version}..{self.max_version} (learner {self.learner_version}, "
                f"{self.frac_current:4.0%} current) | wait {self.wait_s:5.2f} s of gen "
                f"{self.gen_s:5.2f} s | train {self.train_s:5.2f} s | push {self.push_s:.3f} s"
                f" | max|dlogp| {self.max_logprob_diff:.1e}")


@dataclass(frozen=True)
class LoopResult:
    mode: str
    records: tuple[StepRecord, ...]
    wall_s: float
    eval_rewards: tuple[float, float] | None

    @property
    def exposed_gen_s(self) -> float:
        return sum(r.wait_s for r in self.records)


def build_engine(cfg: LoopConfig, kv_on_update: str) -> SpecEngine:
    device = "cuda" if cfg.device == "cuda" else "cpu"
    return SpecEngine(cfg.model, draft=pick_draft(cfg), device=device, dtype="float32",
                      seed=cfg.seed, max_model_len=min(256, 32 + cfg.max_tokens),
                      kv_on_update=kv_on_update, max_policy_lag=1)


async def rollout(aeng: AsyncSpecEngine, cfg: LoopConfig, prompts: list[str],
                  seeds: list[int]) -> Batch:
    t0 = time.perf_counter()
    ids = [encode(p) for p in prompts]
    outs = await asyncio.gather(*(
        aeng.generate(p, SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                        seed=s), k=cfg.k) for p, s in zip(ids, seeds)))
    return Batch(prompts, ids, [list(o.token_ids) for o in outs],
                 [list(o.logprobs) for o in outs], [list(o.token_weight_versions) for o in outs],
                 time.perf_counter() - t0)


def train(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: LoopConfig, batch: Batch,
          version: int) -> tuple[float, float, float, int, float]:
    """One GRPO step on ``batch`` with the engine's logprobs as the behaviour policy. Returns
    the mean reward, the loss, the largest |engine - learner| logprob over the tokens of the
    learner's ``version``, the token count and the share of those tokens."""
    rewards = [reward(p, decode(t)) for p, t in zip(batch.prompts, batch.token_ids)]
    new_logp, mask = token_logprobs(model, batch.prompt_ids, batch.token_ids, cfg.temperature)
    old_logp = padded(batch.logprobs, new_logp)
    current = mask * (padded([[float(v) for v in vs] for vs in batch.versions], new_logp)
                      == version)
    max_diff = ((new_logp.detach() - old_logp).abs() * current).max().item()
    loss = grpo_loss(new_logp, old_logp, group_advantages(rewards, cfg.group_size), mask,
                     cfg.clip_eps)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    num_tokens = int(mask.sum().item())
    return (sum(rewards) / len(rewards), loss.item(), max_diff, num_tokens,
            current.sum().item() / max(1, num_tokens))


async def push(aeng: AsyncSpecEngine, sender: WeightSender, model: torch.nn.Module,
               version: int) -> None:
    """Pack the learner's parameters and have the engine thread copy them in between two
    steps, while requests may be running."""
    handles = sender.send(((n, p.detach()) for n, p in model.named_parameters()), version)
    got = await aeng.run_in_engine(lambda e: e.update_weights_from_shared(handles))
    sender.release(version)
    if got != version:
        raise RuntimeError(f"engine reports version {got}, expected {version}")


def evaluate(engine: SpecEngine, cfg: LoopConfig) -> float:
    """Mean reward of one sample per held-out prompt, fixed seeds (as in ``rl_loop.py``)."""
    prompts = heldout_prompts(cfg.eval_prompts)
    params = [SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=i)
              for i in range(len(prompts))]
    outs = engine.generate([encode(p) for p in prompts], k=cfg.k, sampling=params)
    return sum(reward(p, decode(o.token_ids)) for p, o in zip(prompts, outs)) / len(prompts)


async def run_loop(cfg: LoopConfig, mode: str, kv_on_update: str = "recompute",
                   on_step: Callable[[str, StepRecord], None] | None = None) -> LoopResult:
    """``cfg.steps`` GRPO steps in ``mode`` (``"sync"`` or ``"async"``) from the checkpoint."""
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    torch.manual_seed(cfg.seed)
    engine = build_engine(cfg, kv_on_update)
    model = load_learner(cfg)
    params = list(model.parameters())
    opt = torch.optim.Adam([{"params": [p for p in params if p.dim() > 1]},
                            {"params": [p for p in params if p.dim() == 1], "lr": cfg.gain_lr}],
                           lr=cfg.lr)
    before = evaluate(engine, cfg) if cfg.eval_prompts else None
    problems, rng = training_problems(), random.Random(cfg.seed)

    def draw() -> tuple[list[str], list[int]]:  # the same prompts and seeds in both modes
        prompts = [next(problems)[0] for _ in range(cfg.num_prompts)]
        group = [p for p in prompts for _ in range(cfg.group_size)]
        return group, [rng.getrandbits(62) for _ in group]

    loop = asyncio.get_running_loop()
    records: list[StepRecord] = []
    t_start = time.perf_counter()
    with WeightSender(transport="shared") as sender:
        async with AsyncSpecEngine(engine) as aeng:
            pending = asyncio.ensure_future(rollout(aeng, cfg, *draw()))
            for step in range(cfg.steps):
                t0 = time.perf_counter()
                batch = await pending
                wait_s = time.perf_counter() - t0
                more = step + 1 < cfg.steps
                if mode == "async" and more:  # batch n+1 generates while we train on n
                    pending = asyncio.ensure_future(rollout(aeng, cfg, *draw()))
                t1 = time.perf_counter()
                mean_reward, loss, max_diff, num_tokens, frac = await loop.run_in_executor(
                    None, train, model, opt, cfg, batch, step)
                t2 = time.perf_counter()
                await push(aeng, sender, model, step + 1)
                t3 = time.perf_counter()
                if mode == "sync" and more:
                    pending = asyncio.ensure_future(rollout(aeng, cfg, *draw()))
                flat = [v for vs in batch.versions for v in vs]
                rec = StepRecord(step, mean_reward, step, min(flat), max(flat), frac, wait_s,
                                 batch.gen_s, t2 - t1, t3 - t2, max_diff, loss, num_tokens)
                records.append(rec)
                if on_step is not None:
                    on_step(mode, rec)
    wall_s = time.perf_counter() - t_start
    after = evaluate(engine, cfg) if cfg.eval_prompts else None
    return LoopResult(mode, tuple(records), wall_s,
                      None if before is None else (before, after))  # type: ignore[arg-type]


def summary(results: list[LoopResult]) -> list[str]:
    lines = []
    for res in results:
        recs = res.records
        curve = " ".join(f"{r.reward:.2f}" for r in recs)
        gen_s = sum(r.gen_s for r in recs)
        lines.append(f"{res.mode:5s}: exposed generation {res.exposed_gen_s:6.2f} s "
                     f"({res.exposed_gen_s / len(recs):.2f} s/step) of {gen_s:6.2f} s "
                     f"generating; wall {res.wall_s:6.2f} s; reward curve [{curve}]")
        if res.eval_rewards is not None:
            lines.append(f"{res.mode:5s}: held-out reward {res.eval_rewards[0]:.3f} before, "
                         f"{res.eval_rewards[1]:.3f} after")
    if len(results) == 2 and results[1].exposed_gen_s > 0:
        s, a = results
        lines.append(f"async / sync: exposed generation {a.exposed_gen_s / s.exposed_gen_s:.2f}x,"
                     f" wall {a.wall_s / s.wall_s:.2f}x")
    return lines


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--mode", default="both", choices=("both", *MODES))
    p.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 2 prompts x 4")
    p.add_argument("--kv-on-update", default="recompute", choices=("keep", "recompute"))
    p.add_argument("--draft", default=None, help="drafter (default: bundled head, else ngram)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--eval-prompts", type=int, default=0,
                   help="held-out prompts scored before and after each loop (0: skip)")
    p.add_argument("--json", type=Path, default=None, help="write every step's record here")
    defaults = LoopConfig(steps=20, num_prompts=8)
    for name in ("steps", "num_prompts", "group_size", "k", "temperature", "max_tokens", "lr",
                 "gain_lr", "seed"):
        value = getattr(defaults, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value,
                       help=f"default {value}")
    a = vars(p.parse_args(argv))
    mode, kv_on_update, json_path = a.pop("mode"), a.pop("kv_on_update"), a.pop("json")
    if a.pop("quick"):
        a.update(steps=2, num_prompts=2, group_size=4, eval_prompts=0)
    cfg = LoopConfig(**a)
    modes = MODES if mode == "both" else (mode,)
    torch.set_num_threads(1)  # learner and engine threads share a small CPU
    print(f"GRPO {' vs '.join(modes)}: {cfg.steps} steps x {cfg.num_prompts} prompts x "
          f"{cfg.group_size} samples, T={cfg.temperature}, k={cfg.k}, drafter "
          f"{Path(pick_draft(cfg)).name}, kv_on_update={kv_on_update}", flush=True)
    results = [asyncio.run(run_loop(cfg, m, kv_on_update,
                                    lambda m, r: print(r.line(m), flush=True)))
               for m in modes]
    for line in summary(results):
        print(line)
    if json_path is not None:
        json_path.write_text(json.dumps({
            "config": asdict(cfg), "kv_on_update": kv_on_update,
            "loops": {r.mode: {"exposed_gen_s": r.exposed_gen_s, "wall_s": r.wall_s,
                               "eval_rewards": r.eval_rewards,
                               "steps": [asdict(x) for x in r.records]} for r in results},
        }, indent=1, allow_nan=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
