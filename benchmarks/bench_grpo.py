"""GRPO with and without drafting, same seeds: does speculation change the training signal, and
what does it buy as the policy drifts? (issue 34 item 4: the seeds' experiment in miniature.)

For each configuration the same run, from the same checkpoint and seeds: a learner (the
checkpoint as a ``transformers`` causal LM, float32, Adam) and an engine (``SpecEngine``,
float32, the configuration's drafter and k). Per step: P prompts of the task x G samples at
temperature T rolled out by the engine; rewards; the learner's log pi of the sampled tokens
against the engine's (the logprob gap); one GRPO step (``examples/grpo.py``); the learner's
weights pushed into the engine (``load_weights``, in process). The prompts and the
per-sample seeds of step s are the same in every configuration.

Configurations (``--configs``, comma-separated): ``k0`` (no drafter), ``DRAFTER-kK`` and
``DRAFTER-auto`` with DRAFTER one of ``eagle3`` (``--draft`` head), ``suffix``, ``hybrid``
(the head and the suffix drafter), ``ngram``; a ``-adapt`` suffix turns the EAGLE-3 head's
online adaptation on (``adapt_every`` = one step's rollouts). ``auto`` is ``eagle3-auto``.
``eagle3-treeN`` verifies the head's own best trees of N drafts (its ``trees.json``, written by
``train-draft``; ``generate(tree=N)``) at their depth: on a GPU at small batch the tree of 16
may beat every chain, on a CPU it does not.

Written to ``--out``: ``grpo_steps.jsonl`` (one line per configuration and step: reward,
rollout wall / CPU seconds, tokens per sequence step, acceptance per draft position, k="auto"'s
choices, logprob gap max / mean, loss), ``grpo_summary.json``, ``grpo_table.md`` and the
plots ``grpo_reward.png``, ``grpo_rollout.png``, ``grpo_acceptance.png``.

    python benchmarks/bench_grpo.py --model ~/.cache/specengine/smollm2-135m-instruct \\
        --draft /work/heads/smollm2-math-eagle3 --task math \\
        --configs k0,eagle3-k3,auto,suffix-k3,eagle3-k3-adapt,eagle3-tree16 --steps 20 \\
        --device cuda
    python benchmarks/bench_grpo.py --task arith --steps 2 --prompts 2 --group 4 \\
        --max-tokens 24 --configs k0,eagle3-k3          # the bundled pair, a smoke run
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import os
import random
import statistics
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "examples"))
from grpo import group_advantages, grpo_loss, padded, token_logprobs  # noqa: E402

logger = logging.getLogger("bench_grpo")
DRAFTERS = ("eagle3", "suffix", "hybrid", "ngram")


@dataclass(frozen=True)
class RunSpec:
    """One configuration: a drafter (None: none), its k (an int or "auto"), adaptation, and
    ``tree``: the head's own best trees of that many drafts (``trees.json``; k their depth)."""

    name: str
    drafter: str | None
    k: int | str
    adapt: bool = False
    tree: int | None = None

    def __post_init__(self) -> None:
        if self.drafter is not None and self.drafter not in DRAFTERS:
            raise ValueError(f"drafter must be one of {DRAFTERS}, got {self.drafter!r}")
        if self.k != "auto" and not (isinstance(self.k, int) and self.k >= 0):
            raise ValueError(f"k must be an int >= 0 or 'auto', got {self.k!r}")
        if self.adapt and self.drafter not in ("eagle3", "hybrid"):
            raise ValueError(f"{self.name}: adaptation needs the EAGLE-3 head")
        if self.tree is not None and (self.drafter != "eagle3" or self.k != 0
                                      or self.tree < 1):
            raise ValueError(f"{self.name}: a tree is the EAGLE-3 head's own (eagle3-treeN)")
        if (self.drafter is None) != (self.k == 0 and self.tree is None):
            raise ValueError(f"{self.name}: k=0 runs without a drafter, k>0 needs one")


def parse_config(name: str) -> RunSpec:
    """``k0``, ``auto``, ``DRAFTER-kK``, ``DRAFTER-auto``, ``eagle3-treeN`` (the head's own
    trees of N drafts; ``-adapt`` appended: adapting)."""
    base, adapt = (name[:-6], True) if name.endswith("-adapt") else (name, False)
    if base == "k0":
        return RunSpec(name, None, 0, adapt)
    if base == "auto":
        return RunSpec(name, "eagle3", "auto", adapt)
    drafter, _, k = base.rpartition("-")
    if k == "auto":
        return RunSpec(name, drafter, "auto", adapt)
    if k.startswith("tree") and k[4:].isdigit():
        return RunSpec(name, drafter, 0, adapt, tree=int(k[4:]))
    if not (k.startswith("k") and k[1:].isdigit()) or not drafter:
        raise ValueError(f"unknown configuration {name!r}: k0, auto, or DRAFTER-kK / "
                         f"DRAFTER-auto (DRAFTER in {DRAFTERS}), eagle3-treeN, optionally "
                         "-adapt")
    return RunSpec(name, drafter, int(k[1:]), adapt)


@dataclass(frozen=True)
class Task:
    """Prompts (a stream of problems), their token ids, completions' text and rewards."""

    problems: Callable[[int], Iterator[Any]]
    encode: Callable[[Any], list[int]]
    decode: Callable[[list[int]], str]
    reward: Callable[[Any, str], float]


def make_task(name: str, model: str, format_reward: float = 0.0) -> Task:
    if name == "arith":
        from specengine import arith_task as t

        return Task(lambda seed: (p for p, _ in t.training_problems(seed)), t.encode, t.decode,
                    t.reward)
    if name == "math":
        from transformers import AutoTokenizer

        from specengine import math_task as m

        tok = AutoTokenizer.from_pretrained(model)

        def encode(problem: Any) -> list[int]:
            ids = tok.apply_chat_template(m.messages(problem), add_generation_prompt=True,
                                          tokenize=True)
            return list(ids["input_ids"] if isinstance(ids, dict) or hasattr(ids, "keys")
                        else ids)

        # + format_reward for a parsable answer line, right or wrong: a 135M policy is
        # rarely right, and a group whose rewards are all 0 has no advantage to learn from
        return Task(m.training_problems, encode,
                    lambda ids: tok.decode(ids, skip_special_tokens=True),
                    lambda problem, text: m.reward(problem, text) + format_reward * (
                        m.answer_of(text) is not None))
    raise ValueError(f"task must be 'math' or 'arith', got {name!r}")


def draft_arg(spec: RunSpec, head: str | None) -> str | tuple[str, str] | None:
    if spec.drafter in ("eagle3", "hybrid") and not head:
        raise ValueError(f"{spec.name} needs --draft HEAD_DIR")
    return {None: None, "eagle3": head, "suffix": "suffix", "ngram": "ngram",
            "hybrid": (head, "suffix")}[spec.drafter]


def engine_kwargs(spec: RunSpec, args: argparse.Namespace, device: str) -> dict[str, Any]:
    rollouts = args.prompts * args.group
    kw: dict[str, Any] = dict(device=device, dtype="float32", seed=args.seed,
                              max_batch_size=rollouts)
    if device.startswith("cuda"):  # the learner shares the GPU
        kw["gpu_memory_utilization"] = args.gpu_memory_utilization
        kw["cuda_graphs"] = args.cuda_graphs
    if spec.adapt:
        # one adaptation per step (after its rollouts), on the last two steps' tokens
        kw["draft_options"] = {"adapt_every": rollouts, "adapt_steps": args.adapt_steps,
                               "adapt_lr": args.adapt_lr,
                               "adapt_buffer_tokens": 2 * rollouts * (args.max_tokens + 16),
                               "adapt_batch_tokens": 2048}
    return kw


class ConfigRun:
    """One configuration's run, a GRPO step at a time (``step``), so configurations can run
    one after another or interleaved step by step (``--interleave``); ``close`` frees it."""

    def __init__(self, spec: RunSpec, args: argparse.Namespace, task: Task) -> None:
        from transformers import AutoModelForCausalLM
        from transformers.utils import logging as hf_logging

        from specengine import SpecEngine

        hf_logging.disable_progress_bar()
        self.spec, self.args, self.task = spec, args, task
        self.device = device = "cuda:0" if args.device == "cuda" else "cpu"
        torch.manual_seed(args.seed)
        self.learner = self.opt = None
        if not args.no_learner:
            self.learner = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.float32)
            self.learner = self.learner.to(device).train()
            self.opt = torch.optim.Adam(self.learner.parameters(), lr=args.lr)
        self.engine = SpecEngine(args.model, draft=draft_arg(spec, args.draft),
                                 **engine_kwargs(spec, args, device))
        self.problems = task.problems(args.seed)
        self.rng = random.Random(args.seed)

    def step(self, step: int) -> dict[str, Any]:
        """Rollouts of this step's prompts (the same prompts and seeds in every
        configuration), then the learner's update and the push; the step's record."""
        from specengine import SamplingParams

        args, task, engine, learner = self.args, self.task, self.engine, self.learner
        prompts = [next(self.problems) for _ in range(args.prompts)]
        group = [p for p in prompts for _ in range(args.group)]
        prompt_ids = [task.encode(p) for p in group]
        params = [SamplingParams(temperature=args.temperature, max_tokens=args.max_tokens,
                                 seed=self.rng.getrandbits(62)) for _ in group]
        _sync(self.device)
        w0, c0 = time.perf_counter(), time.process_time()
        outs = engine.generate(prompt_ids, k=self.spec.k, sampling=params, tree=self.spec.tree)
        rollout_s, rollout_cpu_s = time.perf_counter() - w0, time.process_time() - c0
        st = engine.stats
        tokens = [list(o.token_ids) for o in outs]
        rewards = [task.reward(p, task.decode(t)) for p, t in zip(group, tokens)]
        # the learner: log pi of the sampled tokens (before its update) vs the engine's
        w0 = time.perf_counter()
        gap_max = gap_mean = loss_value = version = None
        if learner is not None:
            new_logp, mask = token_logprobs(learner, prompt_ids, tokens, args.temperature)
            old_logp = padded([list(o.logprobs) for o in outs], new_logp)
            gap = (new_logp.detach() - old_logp).abs() * mask
            loss = grpo_loss(new_logp, old_logp, group_advantages(rewards, args.group),
                             mask, args.clip_eps)
            self.opt.zero_grad(set_to_none=True)
            loss.backward()
            self.opt.step()
            gap_max, gap_mean = float(gap.max()), float(gap.sum() / mask.sum())
            loss_value = loss.item()
        learn_s = time.perf_counter() - w0
        w0 = time.perf_counter()
        if learner is not None:
            version = engine.load_weights((n, p.detach()) for n, p in learner.named_parameters())
        _sync(self.device)
        prop, acc = st.proposed_per_position, st.accepted_per_position
        rec = dict(
            config=self.spec.name, step=step, reward=sum(rewards) / len(rewards),
            rollout_s=rollout_s, rollout_cpu_s=rollout_cpu_s, learn_s=learn_s,
            push_s=time.perf_counter() - w0, version=version,
            tokens=sum(map(len, tokens)), engine_steps=st.num_steps,
            tokens_per_step=st.num_step_tokens / max(st.num_seq_steps, 1),
            acceptance=st.num_accepted_tokens / max(st.num_draft_tokens, 1),
            acceptance_per_position=[a / p if p else None for a, p in zip(acc, prop)],
            proposed_per_position=list(prop), auto_k_steps=list(st.auto_k_steps),
            logprob_gap_max=gap_max, logprob_gap_mean=gap_mean, loss=loss_value,
            load=os.getloadavg()[0])
        logger.info("%s step %d: reward %.3f, rollout %.2f s, %.2f tok/step, gap %s",
                    self.spec.name, step, rec["reward"], rollout_s, rec["tokens_per_step"],
                    gap_max)
        return rec

    def close(self) -> None:
        self.engine.close()
        self.engine = self.learner = self.opt = None
        if self.device.startswith("cuda"):
            torch.cuda.empty_cache()


def run_config(spec: RunSpec, args: argparse.Namespace, task: Task,
               on_record: Callable[[dict[str, Any]], None] | None = None
               ) -> list[dict[str, Any]]:
    """The run of one configuration: a record per step (each also handed to ``on_record``
    as it is made, so a run cut short keeps its steps)."""
    run = ConfigRun(spec, args, task)
    records = []
    try:
        for step in tqdm(range(args.steps), desc=spec.name, leave=False):
            records.append(run.step(step))
            if on_record is not None:
                on_record(records[-1])
    finally:
        run.close()
    return records


def run_interleaved(configs: list[RunSpec], args: argparse.Namespace, task: Task,
                    on_record: Callable[[dict[str, Any]], None]) -> None:
    """Every configuration's engine at once, one GRPO step of each in a shuffled order per
    step: on a shared machine the load drifts over all of them alike, so their times can be
    compared step by step (paired), not only run against run."""
    runs = [ConfigRun(spec, args, task) for spec in configs]
    order = random.Random(args.seed)
    try:
        for step in tqdm(range(args.steps), desc="interleaved", leave=False):
            for run in order.sample(runs, len(runs)):
                on_record(run.step(step))
    finally:
        for run in runs:
            run.close()


def _sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def summarize(records: list[dict[str, Any]], configs: list[RunSpec]) -> list[dict[str, Any]]:
    """Per configuration: totals, means, and rollout time against k0 and the best fixed k."""
    rows = []
    for spec in configs:
        rs = [r for r in records if r["config"] == spec.name]
        if not rs:
            continue
        half = max(1, len(rs) // 2)
        pos = [[r["acceptance_per_position"][j] for r in rs
                if j < len(r["acceptance_per_position"])
                and r["acceptance_per_position"][j] is not None] for j in range(8)]
        rows.append(dict(
            config=spec.name, k=spec.k if spec.tree is None else f"tree{spec.tree}",
            drafter=spec.drafter, adapt=spec.adapt,
            steps=len(rs), reward_first=statistics.mean(r["reward"] for r in rs[:half]),
            reward_last=statistics.mean(r["reward"] for r in rs[-half:]),
            reward_mean=statistics.mean(r["reward"] for r in rs),
            rollout_s=sum(r["rollout_s"] for r in rs),
            rollout_cpu_s=sum(r["rollout_cpu_s"] for r in rs),
            tokens=sum(r["tokens"] for r in rs),
            tokens_per_step=statistics.mean(r["tokens_per_step"] for r in rs),
            acceptance_per_position=[statistics.mean(p) if p else None for p in pos[:4]],
            logprob_gap_max=max((r["logprob_gap_max"] for r in rs
                                 if r["logprob_gap_max"] is not None), default=None)))
    # On a shared CPU the process's CPU seconds are the cost (wall time also counts the
    # other processes' turns, which change from one configuration's run to the next).
    # Per generated token too: configurations sample different completions (another k draws
    # other random numbers), so their lengths differ by chance.
    for r in rows:
        r["cpu_ms_per_token"] = 1e3 * r["rollout_cpu_s"] / max(r["tokens"], 1)
    for key, suffix in (("rollout_s", ""), ("rollout_cpu_s", "_cpu"),
                        ("cpu_ms_per_token", "_cpu_tok")):
        base = {r["config"]: r[key] for r in rows}
        fixed = [r[key] for r in rows if isinstance(r["k"], int) and not r["adapt"]]
        best = min(fixed) if fixed else None
        for r in rows:
            r["vs_k0" + suffix] = r[key] / base["k0"] if base.get("k0") else None
            r["vs_best_fixed" + suffix] = r[key] / best if best else None
    return rows


def table(rows: list[dict[str, Any]]) -> str:
    def f(x: Any, spec: str) -> str:
        return "-" if x is None else format(x, spec)

    lines = ["| config | reward (first half -> last) | rollout wall s | rollout CPU s | "
             "CPU vs k0 | CPU vs best fixed | CPU ms/token (vs best fixed) | tokens/step | "
             "accept pos 1 / 2 / 3 | max logprob gap |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        acc = " / ".join(f(a, ".2f") for a in r["acceptance_per_position"][:3])
        lines.append(f"| {r['config']} | {r['reward_first']:.3f} -> {r['reward_last']:.3f} | "
                     f"{r['rollout_s']:.1f} | {r['rollout_cpu_s']:.1f} | "
                     f"{f(r['vs_k0_cpu'], '.2f')} | {f(r['vs_best_fixed_cpu'], '.2f')} | "
                     f"{r['cpu_ms_per_token']:.2f} ({f(r['vs_best_fixed_cpu_tok'], '.2f')}) | "
                     f"{r['tokens_per_step']:.2f} | {acc} | {f(r['logprob_gap_max'], '.1e')} |")
    return "\n".join(lines)


def plots(records: list[dict[str, Any]], configs: list[RunSpec], out: Path) -> None:
    import benchlib

    plt = benchlib.pyplot()
    if plt is None:
        return
    names = [c.name for c in configs]
    for key, label, name in (("reward", "mean reward", "grpo_reward"),
                             ("rollout_cpu_s", "rollout CPU s", "grpo_rollout")):
        fig, ax = plt.subplots(figsize=(7, 4))
        for c in names:
            rs = [r for r in records if r["config"] == c]
            ax.plot([r["step"] for r in rs], [r[key] for r in rs], marker=".", label=c)
        ax.set_xlabel("GRPO step")
        ax.set_ylabel(label)
        ax.legend(fontsize=8)
        benchlib.save_figure(fig, out, name)
    fig, ax = plt.subplots(figsize=(7, 4))
    for c in names:
        rs = [r for r in records if r["config"] == c]
        for j, style in zip(range(3), ("-", "--", ":")):
            ys = [r["acceptance_per_position"][j] if j < len(r["acceptance_per_position"])
                  else None for r in rs]
            if any(y is not None for y in ys):
                ax.plot([r["step"] for r in rs], [float("nan") if y is None else y for y in ys],
                        style, label=f"{c} pos {j + 1}")
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("acceptance at draft position")
    ax.legend(fontsize=7, ncol=2)
    benchlib.save_figure(fig, out, "grpo_acceptance")


def run_all(args: argparse.Namespace, configs: list[RunSpec],
            records: list[dict[str, Any]]) -> None:
    """Every configuration in turn (until ``--budget-s``); records are appended to
    ``records`` and written to ``grpo_steps.jsonl`` as they come."""
    task = make_task(args.task, args.model, args.format_reward)
    args.out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    with open(args.out / "grpo_steps.jsonl", "w") as f:
        def keep(rec: dict[str, Any]) -> None:
            f.write(json.dumps(rec) + "\n")
            f.flush()
            records.append(rec)

        if args.interleave:
            run_interleaved(configs, args, task, keep)
            return
        for spec in configs:
            if args.budget_s is not None and time.perf_counter() - start > args.budget_s:
                logger.warning("time budget spent: %s and later configurations not run",
                               spec.name)
                break
            run_config(spec, args, task, keep)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default=None, help="target dir (default: the task's model)")
    ap.add_argument("--draft", default=None, help="EAGLE-3 head dir (eagle3 / hybrid / auto)")
    ap.add_argument("--task", choices=("math", "arith"), default="math")
    ap.add_argument("--configs", default="k0,eagle3-k3,auto,suffix-k3,eagle3-k3-adapt")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--prompts", type=int, default=4, help="prompts per step")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt")
    ap.add_argument("--max-tokens", type=int, default=128)
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--format-reward", type=float, default=0.0,
                    help="math task: reward added for a parsable answer line (shaping: the "
                         "small policy is rarely right)")
    ap.add_argument("--clip-eps", type=float, default=0.2)
    ap.add_argument("--adapt-steps", type=int, default=8)
    ap.add_argument("--adapt-lr", type=float, default=3e-4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    ap.add_argument("--cuda-graphs", action=argparse.BooleanOptionalAction, default=True)
    ap.add_argument("--gpu-memory-utilization", type=float, default=0.3)
    ap.add_argument("--budget-s", type=float, default=None,
                    help="start no configuration after this many seconds (the rest is "
                         "left out of the table; a lent GPU's command has a time limit)")
    ap.add_argument("--out", type=Path, default=HERE / "out" / "grpo")
    ap.add_argument("--no-learner", action="store_true",
                    help="rollouts only, of a fixed policy (no learner, no push): the cost "
                         "side (k='auto' against fixed k) where a learner step does not fit")
    ap.add_argument("--interleave", action="store_true",
                    help="all configurations' engines at once, one step of each in turn "
                         "(shuffled per step): paired times on a shared machine")
    ap.add_argument("--summarize-only", action="store_true",
                    help="no runs: the table and plots again from --out's grpo_steps.jsonl")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO if os.environ.get("BENCH_VERBOSE") else
                        logging.WARNING)
    if min(args.steps, args.prompts, args.max_tokens) < 1 or args.group < 2:
        ap.error("need steps, prompts, max-tokens >= 1 and group >= 2")
    configs = [parse_config(c) for c in args.configs.split(",") if c]
    if args.model is None:
        if args.task == "math":
            args.model = os.path.expanduser("~/.cache/specengine/smollm2-135m-instruct")
        else:
            from specengine.cli import DEFAULT_DRAFT, DEFAULT_TARGET

            args.model = str(DEFAULT_TARGET)
            args.draft = args.draft or str(DEFAULT_DRAFT)
    records: list[dict[str, Any]] = []
    if args.summarize_only:
        lines = (args.out / "grpo_steps.jsonl").read_text().splitlines()
        records = [json.loads(line) for line in lines]
        done = {r["config"] for r in records}
        configs = [c for c in configs if c.name in done]
    else:
        run_all(args, configs, records)
    rows = summarize(records, configs)
    setup = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items()}
    setup["load"] = os.getloadavg()[0]
    setup["configs"] = [dataclasses.asdict(c) for c in configs]
    (args.out / "grpo_summary.json").write_text(json.dumps(dict(setup=setup, rows=rows),
                                                           indent=1))
    md = table(rows)
    (args.out / "grpo_table.md").write_text(md + "\n")
    plots(records, configs, args.out)
    print(md)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
