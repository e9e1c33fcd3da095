"""GRPO on the bundled arithmetic model: an engine process rolls out with speculative decoding,
a learner process trains, and the new weights travel over torch.distributed every step.

    python examples/rl_loop.py              # 40 steps, about a minute on 2 CPU cores
    python examples/rl_loop.py --device cuda  # learner GPU 0, engine GPU 1 (or both on one)
    python examples/rl_loop.py --quick      # 2-step smoke run

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
"""

from __future__ import annotations

import argparse
import random
import socket
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from multiprocessing.connection import Connection
from pathlib import Path

import torch
import torch.multiprocessing as mp

from specengine.arith_task import decode, encode, heldout_prompts, reward, training_problems
from specengine.cli import DEFAULT_DRAFT, DEFAULT_TARGET

MASTER_ADDRESS = "127.0.0.1"
LEARNER_RANK, ENGINE_RANK, WORLD_SIZE = 0, 1, 2


@dataclass(frozen=True)
class LoopConfig:
    """One RL run. ``draft`` None picks the bundled EAGLE-3 head if present, else ``"ngram"``.
    On CUDA the learner uses GPU 0 and the engine GPU 1 when there are two; ``backend`` None is
    then NCCL, and gloo otherwise (NCCL cannot pair two ranks on one GPU; gloo goes through host
    copies)."""

    model: str = str(DEFAULT_TARGET)
    draft: str | None = None
    steps: int = 40
    num_prompts: int = 16  # P prompts per step
    group_size: int = 8  # G samples per prompt
    k: int = 3
    temperature: float = 2.0
    max_tokens: int = 64
    lr: float = 1e-4  # Adam lr of the weight matrices
    gain_lr: float = 2e-2  # Adam lr of the 1-D gains (norm weights)
    clip_eps: float = 0.2
    seed: int = 0
    device: str = "cpu"
    backend: str | None = None
    timeout_s: float = 120.0
    eval_prompts: int = 0  # held-out prompts scored before and after training (0: skip)

    def __post_init__(self) -> None:
        for name in ("steps", "num_prompts", "max_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.group_size < 2:
            raise ValueError(f"group_size must be >= 2 (advantages are relative to the group), "
                             f"got {self.group_size}")
        if not self.temperature > 0:
            raise ValueError(f"temperature must be > 0 (sampled rollouts), got {self.temperature}")
        if not (min(self.lr, self.gain_lr) > 0 and 0 < self.clip_eps < 1
                and self.eval_prompts >= 0):
            raise ValueError("need lr > 0, gain_lr > 0, 0 < clip_eps < 1, eval_prompts >= 0")
        if self.device not in ("cpu", "cuda"):
            raise ValueError(f"device must be 'cpu' or 'cuda', got {self.device!r}")

    @property
    def dist_backend(self) -> str:
        two_gpus = self.device == "cuda" and torch.cuda.device_count() > 1
        return self.backend or ("nccl" if two_gpus else "gloo")


@dataclass(frozen=True)
class StepRecord:
    """What one step measured. ``version`` stamped the rollouts; the push made ``new_version``."""

    step: int
    reward: float
    accepted_length: float
    gen_s: float
    sync_s: float
    version: int
    new_version: int
    max_logprob_diff: float
    loss: float
    num_tokens: int

    def line(self) -> str:
        return (f"step {self.step:3d} | reward {self.reward:.3f} | accepted len "
                f"{self.accepted_length:.2f} | gen {self.gen_s:5.2f} s | sync {self.sync_s:.3f} s"
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


def pick_draft(cfg: LoopConfig) -> str:
    """The configured drafter, else the bundled EAGLE-3 head if it exists, else n-grams."""
    if cfg.draft is not None:
        return cfg.draft
    return str(DEFAULT_DRAFT) if DEFAULT_DRAFT.is_dir() else "ngram"


def free_port() -> int:
    with socket.socket() as s:
        s.bind((MASTER_ADDRESS, 0))
        return s.getsockname()[1]


# --- engine process ----------------------------------------------------------------------------
def engine_worker(cfg: LoopConfig, draft: str, port: int, conn: Connection) -> None:
    """Rank 1: build the engine, join the weight group, then serve commands from the Pipe until
    ``stop``. Any failure is sent back as a traceback so the learner raises instead of hanging."""
    from specengine import SamplingParams, SpecEngine

    torch.set_num_threads(1)  # the two processes take turns; the CPU is small
    try:
        device = "cpu" if cfg.device == "cpu" else f"cuda:{min(1, torch.cuda.device_count() - 1)}"
        if device != "cpu":
            torch.cuda.set_device(device)  # NCCL's group uses the current device
        # float32 on every device: the logprob check compares with the float32 learner
        engine = SpecEngine(cfg.model, draft=draft, device=device, dtype="float32", seed=cfg.seed,
                            max_model_len=min(256, 32 + cfg.max_tokens))
        conn.send(("built", None))
        engine.init_weight_update_group(MASTER_ADDRESS, port, ENGINE_RANK, WORLD_SIZE,
                                        backend=cfg.dist_backend, timeout_s=cfg.timeout_s)
        while True:
            cmd, arg = conn.recv()
            if cmd == "generate":
                prompts, seeds = arg
                params = [SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                         seed=s) for s in seeds]
                t0 = time.perf_counter()
                outs = engine.generate(prompts, k=cfg.k, sampling=params)
                gen_s = time.perf_counter() - t0
                conn.send(("rollouts", {
                    "token_ids": [list(o.token_ids) for o in outs],
                    "logprobs": [list(o.logprobs) for o in outs],
                    "versions": [o.weight_version for o in outs],
                    "accepted_length": engine.stats.mean_accepted_length,
                    "gen_s": gen_s,
                }))
            elif cmd == "sync":
                conn.send(("synced", engine.update_weights_from_distributed(
                    which="policy", src_rank=LEARNER_RANK)))
            elif cmd == "params":
                conn.send(("params", {n: p.detach().cpu().clone()
                                      for n, p in engine.model.named_parameters()}))
            elif cmd == "stop":
                break
            else:
                raise ValueError(f"unknown command {cmd!r}")
        engine.close_weight_update_group()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


class EngineClient:
    """The learner's end of the Pipe: waits for answers, raising if the engine failed or died."""

    def __init__(self, conn: Connection, proc: mp.process.BaseProcess, timeout_s: float) -> None:
        self.conn, self.proc, self.timeout_s = conn, proc, timeout_s

    def recv(self, expect: str) -> object:
        deadline = time.monotonic() + self.timeout_s
        while not self.conn.poll(0.1):
            if not self.proc.is_alive():
                raise RuntimeError(f"engine process exited (code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine gave no {expect!r} within {self.timeout_s} s")
        tag, payload = self.conn.recv()
        if tag == "error":
            raise RuntimeError(f"engine process failed:\n{payload}")
        if tag != expect:
            raise RuntimeError(f"engine answered {tag!r}, expected {expect!r}")
        return payload

    def call(self, cmd: str, arg: object = None) -> object:
        self.conn.send((cmd, arg))
        return self.recv({"generate": "rollouts", "sync": "synced", "params": "params"}[cmd])


# --- learner: scoring, GRPO ----------------------------------------------------------------------
def token_logprobs(model: torch.nn.Module, prompt_ids: list[list[int]],
                   token_ids: list[list[int]], temperature: float
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """``[N, T]`` float32 log pi(token_ids[i][j]) = log_softmax(logits / temperature) and its
    0/1 mask (T = longest completion). One right-padded forward: padding sits after every real
    token, so causal attention never lets a real position see it."""
    device = next(model.parameters()).device
    seqs = [p + t for p, t in zip(prompt_ids, token_ids)]
    n, width = len(seqs), max(map(len, seqs))
    input_ids = torch.zeros(n, width, dtype=torch.long, device=device)
    attn = torch.zeros(n, width, dtype=torch.long, device=device)
    for i, s in enumerate(seqs):
        input_ids[i, : len(s)] = torch.tensor(s, device=device)
        attn[i, : len(s)] = 1
    logits = model(input_ids=input_ids, attention_mask=attn).logits.float()
    t_max = max(map(len, token_ids))
    j = torch.arange(t_max, device=device)
    starts = torch.tensor([len(p) for p in prompt_ids], device=device)
    lens = torch.tensor([len(t) for t in token_ids], device=device)
    mask = (j[None, :] < lens[:, None]).float()
    # completion token j of row i sits at position len(prompt)+j, predicted by the logits one
    # position earlier; positions past the row's end are clamped and masked out.
    pos = (starts[:, None] - 1 + j[None, :]).clamp(max=width - 1)
    rows = logits.gather(1, pos[:, :, None].expand(-1, -1, logits.shape[-1]))
    targets = input_ids.gather(1, (pos + 1).clamp(max=width - 1))
    logp = torch.log_softmax(rows / temperature, dim=-1).gather(2, targets[:, :, None])[..., 0]
    return logp * mask, mask


def group_advantages(rewards: list[float], group_size: int, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: each sample's reward minus its group's mean, over the group's (population) std + eps;
    a group whose samples all score the same gets advantage 0."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group_size)
    adv = (r - r.mean(dim=1, keepdim=True)) / (r.std(dim=1, unbiased=False, keepdim=True) + eps)
    return adv.flatten()


def grpo_loss(new_logp: torch.Tensor, old_logp: torch.Tensor, adv: torch.Tensor,
              mask: torch.Tensor, clip_eps: float) -> torch.Tensor:
    """-mean over completion tokens of min(ratio * A, clip(ratio, 1 +- eps) * A), ratio =
    exp(log pi_new - log pi_old). On-policy (one inner step) the ratio is 1 in value and its
    gradient is grad log pi_new, so this is the policy gradient; the clip only matters off
    policy."""
    ratio = torch.exp(new_logp - old_logp)
    a = adv.to(new_logp.device)[:, None]
    surrogate = torch.minimum(ratio * a, ratio.clamp(1 - clip_eps, 1 + clip_eps) * a)
    return -(surrogate * mask).sum() / mask.sum()


def load_learner(cfg: LoopConfig) -> torch.nn.Module:
    """The checkpoint as a transformers causal LM in float32, in training mode."""
    from transformers import AutoModelForCausalLM
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    device = "cuda:0" if cfg.device == "cuda" else "cpu"
    return AutoModelForCausalLM.from_pretrained(cfg.model, dtype=torch.float32).to(device).train()


def padded(rows: list[list[float]], like: torch.Tensor) -> torch.Tensor:
    out = torch.zeros_like(like)
    for i, r in enumerate(rows):
        out[i, : len(r)] = torch.tensor(r, dtype=out.dtype)
    return out


def grpo_step(model: torch.nn.Module, opt: torch.optim.Optimizer, cfg: LoopConfig,
              prompt_ids: list[list[int]], ro: dict, rewards: list[float]
              ) -> tuple[float, float, int]:
    """One GRPO update from the engine's rollouts ``ro``; returns the loss, the largest
    |engine - learner| logprob difference (before the update) and the number of tokens."""
    new_logp, mask = token_logprobs(model, prompt_ids, ro["token_ids"], cfg.temperature)
    old_logp = padded(ro["logprobs"], new_logp)
    max_diff = ((new_logp.detach() - old_logp).abs() * mask).max().item()
    loss = grpo_loss(new_logp, old_logp, group_advantages(rewards, cfg.group_size), mask,
                     cfg.clip_eps)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()
    return loss.item(), max_diff, int(mask.sum().item())


# --- the loop ------------------------------------------------------------------------------------
def run(cfg: LoopConfig, on_step: Callable[[StepRecord], None] | None = None,
        fetch_params: bool = False) -> RunResult:
    """Spawn the engine, then per step: roll out, score, check the engine's logprobs against the
    learner's, take one GRPO step, push the weights. Returns the records (and, with
    ``fetch_params``, both sides' final parameters)."""
    from specengine.weight_sync import WeightSender

    torch.manual_seed(cfg.seed)
    torch.set_num_threads(1)
    draft = pick_draft(cfg)
    port = free_port()
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=engine_worker, args=(cfg, draft, port, child), daemon=True)
    proc.start()
    engine = EngineClient(parent, proc, cfg.timeout_s)
    sender = None
    try:
        model = load_learner(cfg)
        params = list(model.parameters())
        opt = torch.optim.Adam([{"params": [p for p in params if p.dim() > 1]},
                                {"params": [p for p in params if p.dim() == 1],
                                 "lr": cfg.gain_lr}], lr=cfg.lr)
        engine.recv("built")
        # rendezvous: this constructor and the engine's init_weight_update_group meet here
        sender = WeightSender(MASTER_ADDRESS, port, WORLD_SIZE, backend=cfg.dist_backend,
                              timeout_s=cfg.timeout_s)
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
            loss, max_diff, num_tokens = grpo_step(model, opt, cfg, prompt_ids, ro, rewards)
            # push: the engine starts receiving, then this process broadcasts
            t0 = time.perf_counter()
            engine.conn.send(("sync", None))
            sender.send(((n, p.detach()) for n, p in model.named_parameters()), version + 1,
                        which="policy")
            new_version = engine.recv("synced")
            rec = StepRecord(step, sum(rewards) / len(rewards), ro["accepted_length"],
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
        parent.send(("stop", None))
        proc.join(cfg.timeout_s)
        return RunResult(tuple(records), draft, eval_rewards, engine_params, learner_params)
    finally:
        if sender is not None:
            sender.close()
        if proc.is_alive():
            proc.terminate()
            proc.join()


def evaluate(engine: EngineClient, cfg: LoopConfig) -> float:
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
    defaults = LoopConfig()
    for name in ("steps", "num_prompts", "group_size", "k", "temperature", "max_tokens", "lr",
                 "gain_lr", "seed"):  # defaults and help from LoopConfig, one source of truth
        value = getattr(defaults, name)
        p.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value,
                       help=f"default {value}")
    a = vars(p.parse_args(argv))
    if a.pop("quick"):
        a.update(steps=2, num_prompts=2, group_size=4, eval_prompts=0)
    cfg = LoopConfig(**a)
    print(f"GRPO: {cfg.steps} steps x {cfg.num_prompts} prompts x {cfg.group_size} samples, "
          f"T={cfg.temperature}, k={cfg.k}, drafter {Path(pick_draft(cfg)).name}, lr {cfg.lr} "
          f"(gains {cfg.gain_lr}), weights over {cfg.dist_backend}", flush=True)
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
