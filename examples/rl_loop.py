"""GRPO on the bundled arithmetic model: an engine process rolls out with speculative decoding,
a learner process trains, and the new weights travel over torch.distributed every step.

    python examples/rl_loop.py              # 40 steps, about a minute on 2 CPU cores
    python examples/rl_loop.py --device cuda  # learner GPU 0, engine GPU 1 (or both on one)
    python examples/rl_loop.py --quick      # 2-step smoke run
    python examples/rl_loop.py --workers 2  # rollouts on a RolloutPool of 2 Ray workers
    python examples/rl_loop.py --adapt-draft-every 128  # the engine adapts its EAGLE-3 head
                                                        # after every 128 rollouts (a step)

Two processes (``torch.multiprocessing``, spawn), joined by a Pipe for rollouts (plain lists)
and by a process group for weights (gloo on CPU, NCCL between two GPUs):

* engine (rank 1): a ``SpecEngine`` on ``specengine/assets/arith-target`` that samples G
  completions for each of P prompts with ``k=3`` drafts (the bundled EAGLE-3 head when it is
  there, else n-grams) and returns their token ids and log-probabilities;
* learner (rank 0, this process): the same checkpoint as a ``transformers`` Qwen3 in float32.
  It scores each completion (1 iff the final answer is exact), takes one GRPO step with the
  engine's log-probabilities as the old policy, and broadcasts its weights
  (``WeightSender.send``) while the engine receives them
  (``engine.update_weights_from_distributed``).

With ``--workers N`` the engine process is replaced by a ``specengine.distributed.RolloutPool``
of N Ray workers (a local Ray cluster, one engine per actor, ranks 1..N of the weight group):
each step's P x G rollouts are sharded across them (each group of G on one worker) and one
``send`` updates all of them.

Every step the learner also recomputes log pi(token) = log_softmax(logits / T) at the sampled
tokens under its own (not yet updated) weights and prints the largest difference from the
engine's: ~1e-6 means the training signal really is the current policy's.

Why T = 2 by default: the bundled model is near perfect at T = 1 (every group of samples gets
the same reward, so every advantage is 0 and there is nothing to learn). At T = 2 it solves
about 60% of the problems, and what RL has to learn is mostly sharpness: the policy gradient
asks for larger logits every step (its component along the final norm's gain is positive),
while on the weight matrices it is mostly sampling noise at this batch size. So Adam gets two
groups: the 1-D gains (norm weights, which scale the activations and so the logits) a large
step (``--gain-lr`` 2e-2) and the matrices a small one (``--lr`` 1e-4). With 1e-4 for all the
reward only creeps up (held-out 0.54 -> 0.61 in 40 steps); 1e-3 for all wrecks the model.

Files: ``rl_config.py`` (the run's configuration), ``rl_engine.py`` (the engine process and the
learner's client for it), ``grpo.py`` (advantages, loss, the learner's log-probabilities); this
one is the loop. The siblings are imported by name, so ``examples/`` must be on ``sys.path``, as
it is when this file runs as a script (the spawned engine process inherits that ``sys.path``).
"""

from __future__ import annotations

import argparse
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from grpo import grpo_step
from rl_config import LoopConfig, pick_draft
from rl_engine import MASTER_ADDRESS, EngineClient, PoolClient, free_port, start_engine

from specengine.arith_task import decode, encode, heldout_prompts, reward, training_problems


@dataclass(frozen=True)
class StepRecord:
    """What one step measured. ``version`` stamped the rollouts; the push made ``new_version``."""

    step: int
    reward: float
    accepted_length: float
    acceptance: float  # accepted drafts / drafts of the step's rollouts
    gen_s: float
    sync_s: float
    version: int
    new_version: int
    max_logprob_diff: float
    loss: float
    num_tokens: int

    def line(self) -> str:
        """The step as one line of the run's log."""
        return (f"step {self.step:3d} | reward {self.reward:.3f} | accepted len "
                f"{self.accepted_length:.2f} | accept {self.acceptance:.3f} | gen "
                f"{self.gen_s:5.2f} s | sync {self.sync_s:.3f} s"
                f" | version {self.version}->{self.new_version} | max|dlogp| "
                f"{self.max_logprob_diff:.1e} | loss {self.loss:+.4f}")


@dataclass(frozen=True)
class RunResult:
    """Per-step records, the drafter used, held-out rewards (before, after) when evaluated, and
    (when asked for) the engine's and the learner's final parameters as CPU tensors."""

    records: tuple[StepRecord, ...]
    draft: str
    eval_rewards: tuple[float, float] | None = None
    engine_params: dict[str, torch.Tensor] | None = None
    learner_params: dict[str, torch.Tensor] | None = None


def load_learner(cfg: LoopConfig) -> torch.nn.Module:
    """The checkpoint as a transformers causal LM in float32, in training mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = "cuda:0" if cfg.device == "cuda" else "cpu"
    return AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).to(device).train()


def run(cfg: LoopConfig, on_step: Callable[[StepRecord], None] | None = None,
        fetch_params: bool = False) -> RunResult:
    """Spawn the engine, then per step: roll out, score, check the engine's logprobs against the
    learner's, take one GRPO step, push the weights. Returns the records (and, with
    ``fetch_params``, both sides' final parameters)."""
    from specengine.weights import WeightSender

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    draft = pick_draft(cfg)
    port = free_port()
    engine = start_engine(cfg, draft, port)  # an engine process, or a pool of Ray workers
    sender = None
    try:
        model = load_learner(cfg)
        params = list(model.parameters())
        opt = torch.optim.Adam([{"params": [p for p in params if p.dim() > 1]},
                                {"params": [p for p in params if p.dim() == 1],
                                 "lr": cfg.gain_lr}], lr=cfg.lr)
        # rendezvous: this constructor and the engines' init_weight_update_group meet here
        engine.join_begin()
        sender = WeightSender(MASTER_ADDRESS, port, engine.world_size, backend=cfg.dist_backend,
                              timeout_s=cfg.timeout_s)
        engine.join_end()
        records: list[StepRecord] = []
        eval_rewards = engine_params = learner_params = None
        if cfg.eval_prompts:
            before = evaluate(engine, cfg)
        problems = training_problems()
        rng = random.Random(cfg.seed)
        version = 0
        for step in range(cfg.steps):
            prompts = [next(problems)[0] for _ in range(cfg.num_prompts)]
            group = [p for p in prompts for _ in range(cfg.group_size)]
            prompt_ids = [encode(p) for p in group]
            ro = engine.call("generate", (prompt_ids, [rng.getrandbits(62) for _ in group]))
            if set(ro["versions"]) != {version}:
                raise RuntimeError(f"rollouts carry versions {set(ro['versions'])}, "
                                   f"expected {version}")
            rewards = [reward(p, decode(t)) for p, t in zip(group, ro["token_ids"])]
            loss, max_diff, num_tokens = grpo_step(
                model, opt, prompt_ids, ro["token_ids"], ro["logprobs"], rewards,
                temperature=cfg.temperature, group_size=cfg.group_size, clip_eps=cfg.clip_eps)
            # push: the engines start receiving, then this process broadcasts to all of them
            t0 = time.perf_counter()
            engine.sync_begin()
            sender.send(((n, p.detach()) for n, p in model.named_parameters()), version + 1,
                        which="policy")
            new_version = engine.sync_end()
            rec = StepRecord(step, sum(rewards) / len(rewards), ro["accepted_length"],
                             ro["acceptance"],
                             ro["gen_s"], time.perf_counter() - t0, version, new_version,
                             max_diff, loss, num_tokens)
            records.append(rec)
            if on_step is not None:
                on_step(rec)
            version = new_version
        if cfg.eval_prompts:
            eval_rewards = (before, evaluate(engine, cfg))
        if fetch_params:
            engine_params = engine.call("params")
            learner_params = {n: p.detach().cpu().clone() for n, p in model.named_parameters()}
        engine.stop()
        return RunResult(tuple(records), draft, eval_rewards, engine_params, learner_params)
    finally:
        if sender is not None:
            sender.close()
        engine.close()


def evaluate(engine: EngineClient | PoolClient, cfg: LoopConfig) -> float:
    """Mean reward of one sample per held-out prompt at the training temperature, with fixed
    seeds so that the before/after numbers differ only by the weights."""
    prompts = heldout_prompts(cfg.eval_prompts)
    ro = engine.call("generate", ([encode(p) for p in prompts], list(range(len(prompts)))))
    return sum(reward(p, decode(t)) for p, t in zip(prompts, ro["token_ids"])) / len(prompts)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=" ".join(__doc__.split("\n\n")[0].split()))
    p.add_argument("--quick", action="store_true", help="smoke run: 2 steps, 2 prompts x 4")
    p.add_argument("--draft", default=None, help="drafter (default: bundled head, else ngram)")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--eval-prompts", type=int, default=256,
                   help="held-out prompts scored before and after (0: skip)")
    p.add_argument("--workers", type=int, default=0,
                   help="roll out on a RolloutPool of N Ray workers, all updated by one send "
                        "(0: one engine process)")
    defaults = LoopConfig()
    for name in ("steps", "num_prompts", "group_size", "k", "temperature", "max_tokens", "lr",
                 "gain_lr", "seed", "adapt_draft_every", "adapt_draft_steps",
                 "adapt_draft_lr"):
        # defaults and help from LoopConfig, one source of truth
        value = getattr(defaults, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value,
                       help=f"default {value}")
    a = vars(p.parse_args(argv))
    if a.pop("quick"):
        a.update(steps=2, num_prompts=2, group_size=4, eval_prompts=0)
    cfg = LoopConfig(**a)
    print(f"GRPO: {cfg.steps} steps x {cfg.num_prompts} prompts x {cfg.group_size} samples, "
          f"T={cfg.temperature}, k={cfg.k}, drafter {Path(pick_draft(cfg)).name}, lr {cfg.lr} "
          f"(gains {cfg.gain_lr}), weights over {cfg.dist_backend}"
          + (f" to {cfg.workers} Ray workers" if cfg.workers else ""), flush=True)
    t0 = time.perf_counter()
    res = run(cfg, on_step=lambda r: print(r.line(), flush=True))
    recs = res.records
    n = max(1, min(5, len(recs) // 2))
    print(f"mean reward, first {n} steps: {sum(r.reward for r in recs[:n]) / n:.3f}; "
          f"last {n}: {sum(r.reward for r in recs[-n:]) / n:.3f}")
    if res.eval_rewards is not None:
        print(f"held-out reward at T={cfg.temperature} ({cfg.eval_prompts} prompts): "
              f"{res.eval_rewards[0]:.3f} before, {res.eval_rewards[1]:.3f} after")
    print(f"max |engine - learner logprob| over all steps: "
          f"{max(r.max_logprob_diff for r in recs):.1e}; total {time.perf_counter() - t0:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
