"""``specengine train-draft``: train an EAGLE-3 head (or, ``arch="mtp"``, the target
checkpoint's own MTP layer) for a policy on its own rollouts.

1. **Data.** The prompts (``train/data.py``) minus ``holdout`` held-out ones are rolled out
   by the engine itself, the policy at ``temperature`` (``samples_per_prompt`` samples each,
   at most ``max_tokens`` new tokens; when sampling, then ``greedy_rollout_tokens`` greedy
   tokens of the same prompts, shuffled in with them in training), with the head being
   warm-started (``init``) or, for a fresh head, a randomly initialised one as the drafter,
   which at k=0 only catches up. Its catch-up pass records, as it runs, the target's
   features of every verified position and the token that followed (online adaptation's
   ``FeatureBuffer``, ``drafters/adapt.py``): the training set needs no second pass of the
   target. After each batch of rollouts the buffer's sequences move to host memory. With
   checkpoints on, the set is written once to ``OUT/checkpoints/data.safetensors`` so
   ``resume`` continues on the same data.
2. **Head.** ``init``: that head dir's weights and draft vocabulary. Else a fresh head of the
   target's layer shapes whose draft vocabulary is the ``draft_vocab_size`` most frequent
   generated tokens (``train/head_init.py``).
3. **Training.** The loss and Adam of online adaptation (``drafters/draft_trainer.py``: EAGLE-3's
   training-time test unrolled ``ttt_steps`` deep exactly as the paged drafting passes run
   the head, weights ``0.8^d``; float32 masters, gradient norm clipped to 1) over
   ``epochs`` passes of shuffled batches of about ``batch_tokens`` positions; learning rate
   ``lr`` with a linear warm-up over the first 5% of the steps, then a cosine decay to 10%.
   Every ``save_every`` steps a checkpoint (masters, Adam moments, the step) replaces the
   previous one; the batch order of each epoch is a function of (``seed``, epoch), so a
   resumed run takes the same steps as an uninterrupted one.
MTP (``arch="mtp"``) runs the same steps on the layer the target checkpoint holds: the
rollouts draft with it (``init``: a checkpoint dir whose ``mtp.*`` weights replace it first,
e.g. an earlier run's output), the buffer keeps the target's final-norm hidden states, and the
loss is the same unrolled loss over the layer's maths (``drafters/mtp_math.py``); there is no
draft vocabulary.

4. **Output.** The head in the published layout in ``out`` (``SpecEngine(model, draft=out)``
   loads it; ``arch="mtp"``: the target checkpoint with the trained MTP layer,
   ``train/mtp_init.py``, which ``SpecEngine(out, draft="mtp")`` loads), then greedy
   rollouts of the held-out prompts at k = 0 and k = 1..5:
   acceptance per draft position, mean accepted length and whether each k reproduced k = 0,
   printed as a table and written to ``out/eval.json`` (and ``out/eval.png`` when matplotlib
   is installed). An EAGLE-3 head trained on recorded distributions also gets
   ``out/trees.json``: the best static draft trees of 4-32 drafts for it (``train/trees.py``).
"""

from __future__ import annotations

import json
import logging
import math
import shutil
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import Tensor, nn

from specengine.drafters.adapt import BufferedSeq, FeatureBuffer
from specengine.drafters.draft_trainer import DraftTrainer, HeadOptimizer
from specengine.drafters.eagle3 import aux_layer_inputs
from specengine.drafters.mtp_math import MTPMath
from specengine.model.config import CheckpointError
from specengine.model.loader import checkpoint_files
from specengine.sampling import MAX_TOP_LOGPROBS
from specengine.train.data import DEFAULT_PROMPT_COLUMN, read_prompts, tokenize_prompts
from specengine.train.head_init import (
    build_head,
    fresh_config,
    init_from_target,
    most_frequent,
    read_config,
    read_head,
    write_head,
)
from specengine.train.mtp_init import (
    build_mtp,
    check_mtp_init,
    check_mtp_target,
    read_mtp_tensors,
    write_mtp_checkpoint,
)
from specengine.train.trees import TREE_SIZES, TREES_FILE, tree_paths, write_trees

logger = logging.getLogger(__name__)

CHECKPOINT_DIR = "checkpoints"
DATA_FILE = "data.safetensors"
EVAL_KS = (1, 2, 3, 4, 5)
WARMUP_FRACTION = 0.05
FINAL_LR_FRACTION = 0.1
GEN_BATCH = 256  # sequences per generate call (the engine's default max_batch_size)
KV_FILL = 0.9  # share of the KV cache a call's sequences may fill (blocks round up)
GROUP_SEQS_EVAL = 16  # held-out sequences per unrolled pass of offline_acceptance
# Settings a resumed run must share with the run that wrote the checkpoint.
RESUME_KEYS = ("steps", "epochs", "lr", "batch_tokens", "ttt_steps", "seed", "draft_vocab_size",
               "init", "arch", "head_init", "norm_before_residual", "soft_labels",
               "tv_weight")
ARCHS = ("eagle3", "mtp")
HEAD_INITS = ("random", "target")
HEAD_DTYPES = ("auto", "float32", "bfloat16", "float16")
TRAIN_DTYPES = ("auto", "float32", "bfloat16")
AUTO_SAMPLES = 4  # samples per prompt when sampling (TrainDraftConfig.num_samples)
CALIBRATION_ROLLOUTS = 32  # rollouts of the first generate call, timed for the estimate


@dataclass(frozen=True)
class TrainDraftConfig:
    """Settings of :func:`train_draft` (the CLI's options; module docstring)."""

    model: Path
    prompts: Path
    out: Path
    prompt_column: str = DEFAULT_PROMPT_COLUMN
    arch: str = "eagle3"  # "mtp": the target checkpoint's MTP layer
    init: Path | None = None
    eval_prompts: Path | None = None  # held-out prompts from this file (no split of prompts)
    samples_per_prompt: int | None = None  # None: 1 greedy, AUTO_SAMPLES when sampling
    temperature: float = 1.0
    max_tokens: int = 256
    rollout_tokens: int = 100_000  # generated tokens to train on (0: one pass over the prompts)
    # greedy rollouts of the same prompts added to a sampled set, shuffled in with it (at
    # most one pass over the prompts; RESULTS.md: +0.05 greedy k=3 on unseen prompts, T=1
    # unchanged, a third more rollout time for a third as many tokens: so not the default)
    greedy_rollout_tokens: int = 0
    gen_k: int | None = None  # draft length while generating (None: 0, the drafter only
    #                          catches up, which records every position at the least cost)
    draft_vocab_size: int = 32000
    steps: int = 400  # optimiser steps (the training budget; epochs=None)
    epochs: int | None = None  # instead of steps: this many passes over the generated set
    lr: float = 3e-3
    batch_tokens: int = 2048
    ttt_steps: int = 3
    soft_labels: int = 20  # train on the policy's top-N distribution (0: the drawn tokens)
    # weight of the loss's acceptance term, w * (1 - sum_x min(p, q)) per entry
    # (drafters/adapt_math.py, "Acceptance term"): what a sampled draft's acceptance is
    tv_weight: float = 0.0
    head_init: str = "random"  # fresh head: "random", or "target" (lm_head / norm from the
    #                            target's; RESULTS.md: no gain measured, so not the default)
    head_dtype: str = "auto"  # dtype of the written head ("auto": the target's)
    # compute dtype of the loss's forward and backward (autocast; the Adam masters, the
    # curve and the evaluation stay float32). "auto": bfloat16 where the device multiplies
    # it natively (CUDA with bf16, a CPU with AVX512-BF16 or AMX), else float32
    train_dtype: str = "auto"
    norm_before_residual: bool = False  # fresh head: the residual is hidden_norm(g), not g
    seed: int = 0
    holdout: int | None = None  # None: min(64, a tenth of the prompts, at least 1)
    save_every: int = 100  # 0: no checkpoints (and no saved data)
    resume: bool = False
    overwrite: bool = False
    device: str | None = None
    dtype: str = "auto"
    num_threads: int | None = None
    eval_max_tokens: int | None = None  # None: max_tokens
    eval_temperatures: tuple[float, ...] = (0.0, 1.0)
    # the head's best trees (trees.json) evaluated too, by drafts per tree (empty: none)
    eval_trees: tuple[int, ...] = (16,)
    curve_points: int = 10  # held-out greedy acceptance measured this many times in training
    progress: bool = True

    def __post_init__(self) -> None:
        for name in ("model", "prompts", "out", "init", "eval_prompts"):
            v = getattr(self, name)
            if v is not None and not isinstance(v, Path):
                object.__setattr__(self, name, Path(v))
        for name, low in (("max_tokens", 1), ("steps", 1), ("rollout_tokens", 0),
                          ("batch_tokens", 1), ("ttt_steps", 1), ("draft_vocab_size", 1),
                          ("save_every", 0), ("seed", 0), ("curve_points", 0),
                          ("soft_labels", 0), ("greedy_rollout_tokens", 0)):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, int) or v < low:
                raise ValueError(f"train-draft: {name} must be an int >= {low}, got {v!r}")
        for name in ("holdout", "gen_k", "eval_max_tokens", "samples_per_prompt", "epochs"):
            v = getattr(self, name)
            low = 0 if name in ("holdout", "gen_k") else 1
            if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v < low):
                raise ValueError(f"train-draft: {name} must be an int >= {low}, got {v!r}")
        if not (isinstance(self.lr, (int, float)) and math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"train-draft: lr must be a finite number > 0, got {self.lr!r}")
        if not (isinstance(self.tv_weight, (int, float)) and not isinstance(self.tv_weight, bool)
                and math.isfinite(self.tv_weight) and self.tv_weight >= 0):
            raise ValueError("train-draft: tv_weight must be a finite number >= 0, got "
                             f"{self.tv_weight!r}")
        if not (isinstance(self.temperature, (int, float)) and self.temperature >= 0):
            raise ValueError(f"train-draft: temperature must be >= 0, got {self.temperature!r}")
        temps = tuple(self.eval_temperatures)
        if not temps or not all(isinstance(t, (int, float)) and not isinstance(t, bool)
                                and math.isfinite(t) and t >= 0 for t in temps):
            raise ValueError("train-draft: eval_temperatures must be one or more numbers >= 0, "
                             f"got {self.eval_temperatures!r}")
        object.__setattr__(self, "eval_temperatures", temps)
        trees = tuple(self.eval_trees)
        if not all(isinstance(n, int) and not isinstance(n, bool) and n in TREE_SIZES
                   for n in trees):
            raise ValueError(f"train-draft: eval_trees must be sizes of the trees train-draft "
                             f"writes, {TREE_SIZES}; got {self.eval_trees!r}")
        object.__setattr__(self, "eval_trees", trees)
        if self.arch not in ARCHS:
            raise ValueError(f"train-draft: arch must be one of {ARCHS}, got {self.arch!r}")
        if self.head_init not in HEAD_INITS:
            raise ValueError(f"train-draft: head_init must be one of {HEAD_INITS}, got "
                             f"{self.head_init!r}")
        if self.head_dtype not in HEAD_DTYPES:
            raise ValueError(f"train-draft: head_dtype must be one of {HEAD_DTYPES}, got "
                             f"{self.head_dtype!r}")
        if self.train_dtype not in TRAIN_DTYPES:
            raise ValueError(f"train-draft: train_dtype must be one of {TRAIN_DTYPES}, got "
                             f"{self.train_dtype!r}")
        if self.soft_labels > MAX_TOP_LOGPROBS:
            raise ValueError(f"train-draft: soft_labels is the policy's top-N per token that "
                             f"the engine reports, at most {MAX_TOP_LOGPROBS}; got "
                             f"{self.soft_labels!r}")
        if self.temperature == 0 and self.greedy_rollout_tokens:
            raise ValueError("train-draft: greedy_rollout_tokens adds greedy rollouts to a "
                             "sampled set, but temperature is 0: every rollout is greedy "
                             "already (give rollout_tokens, or a temperature > 0)")
        if self.resume and self.overwrite:
            raise ValueError("train-draft: --resume continues the run in the output dir and "
                             "--overwrite deletes it: give one of them")

    @property
    def evaluated_trees(self) -> tuple[int, ...]:
        """The tree sizes the evaluation runs: ``eval_trees`` where ``trees.json`` is written
        (an EAGLE-3 head trained on recorded distributions), else none."""
        return self.eval_trees if self.arch == "eagle3" and self.soft_labels else ()

    @property
    def num_samples(self) -> int:
        """Samples per prompt of one rollout pass: the given count, else 1 when greedy
        (repeats would be identical) and :data:`AUTO_SAMPLES` when sampling (a prompt's
        samples share its prefill, and few prompts still give varied data)."""
        if self.samples_per_prompt is not None:
            return self.samples_per_prompt
        return 1 if self.temperature == 0 else AUTO_SAMPLES



@dataclass(frozen=True)
class TrainDraftResult:
    """What a :func:`train_draft` run did: its data, the loss of every step it trained
    (``(step, loss)``, the loss of step ``s``'s batch before its update) and the evaluation."""

    out: Path
    num_train_prompts: int
    num_holdout_prompts: int
    num_seqs: int
    num_tokens: int  # trained positions (generated tokens with a depth-0 target)
    num_steps: int
    losses: tuple[tuple[int, float], ...]
    evaluation: dict[str, Any] | None
    generate_s: float
    train_s: float
    eval_s: float
    resumed_from: int | None = None
    rollout_passes: int = 0  # passes over the training prompts the rollouts started
    num_greedy_seqs: int = 0  # of num_seqs: greedy rollouts added to a sampled set
    num_greedy_tokens: int = 0  # of num_tokens: theirs
    train_dtype: str = "float32"  # the loss's compute dtype (TrainDraftConfig.train_dtype)

    def __post_init__(self) -> None:
        if (self.num_seqs < 1 or self.num_steps < 1 or not 0 <= self.num_greedy_seqs
                <= self.num_seqs or not 0 <= self.num_greedy_tokens <= self.num_tokens
                or self.train_dtype not in TRAIN_DTYPES[1:]):
            raise ValueError(f"inconsistent TrainDraftResult {self}")


@dataclass
class GeneratedSet:
    """The training sequences in host memory: entry rows ``feats [N, F]`` / ``tokens [N]``
    (a :class:`~specengine.drafters.draft_trainer.FeatureSource`), the sequences' rows, the
    generated tokens' counts over the target vocabulary and the held-out prompts. With soft
    labels, ``soft_ids [N, K]`` / ``soft_logps [N, K]``: the policy's top-K distribution of
    each row's token (the row of position ``q`` holds the distribution ``x_{q+1}`` was drawn
    from; -1 ids on prompt rows and where no record matched)."""

    feats: Tensor | None = None
    tokens: Tensor = field(default_factory=lambda: torch.zeros(0, dtype=torch.int64))
    seqs: list[BufferedSeq] = field(default_factory=list)
    counts: np.ndarray = field(default_factory=lambda: np.zeros(0, dtype=np.int64))
    holdout: list[list[int]] = field(default_factory=list)
    passes: int = 0  # passes over the prompts the rollouts started (0: unknown, a resume)
    num_greedy: int = 0  # the last num_greedy sequences: greedy rollouts added to a sampled set
    soft_ids: Tensor | None = None
    soft_logps: Tensor | None = None
    num_unlabelled: int = 0  # sequences taken with labels given but none matching them
    _parts: list[tuple[Tensor, Tensor, Tensor | None, Tensor | None]] = field(
        default_factory=list)
    _num_rows: int = 0

    def take(self, buffer: FeatureBuffer, labels: SoftLabels | None = None) -> None:
        """Copy the buffer's trainable sequences (at least one generated target) to host,
        with their recorded distributions from ``labels`` when given."""
        assert buffer.feats is not None
        for s in buffer.sequences():
            if len(s.rows) <= s.num_prompt_tokens:
                continue
            rows = torch.from_numpy(s.rows).to(buffer.device)
            tokens = buffer.tokens[rows].cpu()
            soft = None
            if labels is not None:
                soft = labels.rows(tokens.numpy(), s.num_prompt_tokens)
                self.num_unlabelled += soft is None
                if soft is None:
                    soft = labels.empty(len(s.rows))
            self._parts.append((buffer.feats[rows].cpu(), tokens,
                                *(soft if soft is not None else (None, None))))
            n = len(s.rows)
            self.seqs.append(BufferedSeq(len(self.seqs), np.arange(self._num_rows,
                                                                   self._num_rows + n),
                                         s.num_prompt_tokens))
            self._num_rows += n

    def finish(self) -> None:
        """Join the parts taken so far onto the rows (it may be called again after more
        :meth:`take` calls)."""
        if self._parts:
            old = [] if self.feats is None else [(self.feats, self.tokens, self.soft_ids,
                                                  self.soft_logps)]
            parts = old + self._parts
            self.feats = torch.cat([p[0] for p in parts])
            self.tokens = torch.cat([p[1] for p in parts])
            if all(p[2] is not None for p in parts):
                self.soft_ids = torch.cat([p[2] for p in parts])  # type: ignore[misc]
                self.soft_logps = torch.cat([p[3] for p in parts])  # type: ignore[misc]
            self._parts.clear()

    @property
    def num_tokens(self) -> int:
        return sum(len(s.rows) - s.num_prompt_tokens for s in self.seqs)

    @property
    def num_greedy_tokens(self) -> int:
        return sum(len(s.rows) - s.num_prompt_tokens
                   for s in self.seqs[len(self.seqs) - self.num_greedy:])

    def save(self, path: Path) -> None:
        assert self.feats is not None
        lens = np.array([len(s.rows) for s in self.seqs], dtype=np.int64)
        plens = np.array([s.num_prompt_tokens for s in self.seqs], dtype=np.int64)
        tensors = {"feats": self.feats.contiguous(), "tokens": self.tokens,
                   "seq_lens": torch.from_numpy(lens), "prompt_lens": torch.from_numpy(plens),
                   "counts": torch.from_numpy(self.counts)}
        if self.soft_ids is not None and self.soft_logps is not None:
            tensors.update(soft_ids=self.soft_ids, soft_logps=self.soft_logps)
        save_file(tensors, str(path), metadata={"holdout": json.dumps(self.holdout),
                                                "num_greedy": str(self.num_greedy)})

    @classmethod
    def load(cls, path: Path) -> GeneratedSet:
        try:
            t = load_file(str(path))
            with safe_open(str(path), framework="pt") as f:
                meta = f.metadata()
                holdout = json.loads(meta["holdout"])
                num_greedy = int(meta.get("num_greedy", 0))  # 0: a set from before the option
        except Exception as e:  # noqa: BLE001 - any unreadable file: the same message
            raise ValueError(f"{path}: cannot read the saved training data ({e}); start "
                             "again with --overwrite") from None
        ends = np.cumsum(t["seq_lens"].numpy())
        seqs = [BufferedSeq(i, np.arange(e - n, e), int(p)) for i, (e, n, p) in enumerate(
            zip(ends, t["seq_lens"].numpy(), t["prompt_lens"].numpy()))]
        return cls(t["feats"], t["tokens"], seqs, t["counts"].numpy(), holdout,
                   num_greedy=num_greedy, soft_ids=t.get("soft_ids"),
                   soft_logps=t.get("soft_logps"))


class SoftLabels:
    """The policy's top-K distributions of one generate call's rollouts
    (``GenerationOutput.top_logprobs``: the raw distribution each generated token was drawn
    from, its K - 1 most likely tokens and the token itself), found again for the buffered
    sequences by their tokens: a buffered sequence holds ``x_1 .. x_L`` (row ``q`` fed
    ``x_{q+1}``), which must start with a recorded rollout's prompt (less its first token)
    and then its generated tokens."""

    def __init__(self, k: int) -> None:
        self.k = k  # entries per row: the top logprobs asked for plus the drawn token
        # prompt less its first token -> (generated tokens, their distributions) per rollout
        self.by_prompt: dict[tuple[int, ...], list[tuple[tuple[int, ...], Any]]] = {}

    def add(self, prompt: tuple[int, ...], generated: tuple[int, ...],
            top: tuple[dict[int, float], ...]) -> None:
        if len(top) != len(generated):
            raise ValueError("soft labels need SamplingParams.logprobs: one distribution per "
                             "generated token")
        self.by_prompt.setdefault(tuple(prompt[1:]), []).append((tuple(generated), top))

    def clear(self) -> None:
        self.by_prompt.clear()

    def empty(self, n: int) -> tuple[Tensor, Tensor]:
        return (torch.full((n, self.k), -1, dtype=torch.int32),
                torch.zeros((n, self.k), dtype=torch.float32))

    def rows(self, tokens: np.ndarray, num_prompt_tokens: int) -> tuple[Tensor, Tensor] | None:
        """``(ids [L, K], logps [L, K])`` of a buffered sequence whose rows fed ``tokens``
        (``x_1 .. x_L``), or None when no recorded rollout has these tokens."""
        p = num_prompt_tokens
        gen = tuple(tokens[p - 1:].tolist())  # x_P .. x_L: its generated tokens so far
        for generated, top in self.by_prompt.get(tuple(tokens[: p - 1].tolist()), ()):
            if generated[: len(gen)] != gen:
                continue
            ids, logps = self.empty(len(tokens))
            for q in range(p - 1, len(tokens)):  # row q: the distribution of x_{q+1}
                dist = top[q + 1 - p]
                # the K most likely first (the drawn token is in the record even when it is
                # not among the top; a full row keeps the most likely)
                best = sorted(dist.items(), key=lambda kv: -kv[1])[: self.k]
                ids[q, : len(best)] = torch.tensor([i for i, _ in best], dtype=torch.int32)
                logps[q, : len(best)] = torch.tensor([v for _, v in best])
            return ids, logps
        return None


def read_embedding(model: Path) -> nn.Embedding:
    """The target's input embeddings, read alone from its checkpoint (the head reads them;
    they are never trained)."""
    for file in checkpoint_files(model):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            names = [n for n in f.keys() if n.endswith("embed_tokens.weight")
                     and "mtp" not in n]
            if names:
                name = min(names, key=len)  # model.embed_tokens over nested copies
                return nn.Embedding.from_pretrained(f.get_tensor(name).float(), freeze=True)
    raise CheckpointError(f"{model}: no embed_tokens.weight in the checkpoint")


def check_head_fits(head_cfg: dict[str, Any], target_cfg: dict[str, Any], path: Path) -> None:
    """A warm-start head must read the target's features and vocabulary (the same checks as
    ``Eagle3Drafter``, made before any work)."""
    text = target_cfg.get("text_config") or {}
    vocab = int(target_cfg.get("vocab_size") or text.get("vocab_size"))
    hidden = int(target_cfg.get("hidden_size") or text.get("hidden_size"))
    layers = int(target_cfg.get("num_hidden_layers") or text.get("num_hidden_layers"))
    hv, hh = head_cfg.get("vocab_size"), head_cfg.get("hidden_size")
    th = head_cfg.get("target_hidden_size") or hh
    if hv != vocab:
        raise CheckpointError(f"--init head {path} has vocab_size {hv} but the target has "
                              f"{vocab}: it does not fit this target")
    if hh != hidden or th != hidden:
        raise CheckpointError(f"--init head {path} has hidden_size {hh} (target_hidden_size "
                              f"{th}) but the target's is {hidden}: it does not fit this "
                              "target")
    aux_layer_inputs(head_cfg, layers)


def _prepare_out(cfg: TrainDraftConfig) -> Path | None:
    """Check the output dir; returns the checkpoint to resume from (None: a new run)."""
    out = cfg.out
    ckpt_dir = out / CHECKPOINT_DIR
    if cfg.resume:
        steps = sorted(ckpt_dir.glob("step-*.safetensors"),
                       key=lambda p: int(p.stem.split("-")[1]))
        if not steps or not (ckpt_dir / DATA_FILE).is_file():
            raise ValueError(f"--resume: {ckpt_dir} holds no checkpoint to continue from "
                             "(is --out the dir of a run with --save-every > 0?)")
        return steps[-1]
    if out.exists() and (not out.is_dir() or any(out.iterdir())):
        if not cfg.overwrite:
            raise ValueError(f"output dir {out} exists and is not empty: pass --overwrite to "
                             "replace it, or --resume to continue its run")
    return None


def _settings(cfg: TrainDraftConfig) -> dict[str, Any]:
    d = asdict(cfg)
    return {k: (str(d[k]) if isinstance(d[k], Path) else d[k]) for k in RESUME_KEYS}


def epoch_batches(seqs: list[BufferedSeq], batch_tokens: int, seed: int, epoch: int
                  ) -> list[list[int]]:
    """Epoch ``epoch``'s batches: a permutation drawn from ``(seed, epoch)`` cut into runs
    of at most ``batch_tokens`` positions (a longer sequence makes a batch of its own)."""
    order = np.random.default_rng([seed, epoch]).permutation(len(seqs))
    out: list[list[int]] = []
    cur: list[int] = []
    n = 0
    for i in order:
        size = len(seqs[i].rows)
        if cur and n + size > batch_tokens:
            out.append(cur)
            cur, n = [], 0
        cur.append(int(i))
        n += size
    if cur:
        out.append(cur)
    return out


def learning_rate(step: int, total: int, lr: float) -> float:
    """Linear warm-up over the first 5% of the steps, then a cosine decay to 10% of ``lr``."""
    warmup = max(1, round(WARMUP_FRACTION * total))
    if step < warmup:
        return lr * (step + 1) / warmup
    frac = (step - warmup) / max(1, total - warmup)
    return lr * (FINAL_LR_FRACTION + (1 - FINAL_LR_FRACTION) * 0.5 * (1 + math.cos(math.pi
                                                                                   * frac)))


def _progress(total: int | None, desc: str, enabled: bool, initial: int = 0,
              unit: str = "step") -> Any:
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc=desc, disable=not enabled, unit=unit,
                dynamic_ncols=True)


def _engine(cfg: TrainDraftConfig, draft: Path | str | None, model: Path | None = None,
            **kw: Any) -> Any:
    from specengine.engine import SpecEngine

    return SpecEngine(model or cfg.model, draft=None if draft is None else str(draft),
                      device=cfg.device, dtype=cfg.dtype, seed=cfg.seed,
                      num_threads=cfg.num_threads, **kw)


@dataclass
class RolloutProgress:
    """Where the rollouts stand (what the calibration callback and the plan read)."""

    num_rollouts: int = 0
    num_tokens: int = 0  # generated tokens
    num_prompts: int = 0  # prompt passes started (a prompt with n samples counts once)
    passes: int = 0  # complete passes over the prompts
    started: int = 0  # passes started (a partial last pass counts)
    seconds: float = 0.0


def _run_rollouts(engine: Any, prompts: list[list[int]], params: list[Any], k: int,
                  on_done: Any) -> None:
    """Roll out ``prompts`` (one :class:`SamplingParams` each) through the engine's step API,
    calling ``on_done(output)`` as each rollout finishes (per-rollout progress)."""
    for p, sp in zip(prompts, params):
        engine.add_request(p, sp, k=k)
    while engine.has_unfinished():  # (an error ends the run: the caller closes the engine)
        for out in engine.step():
            if out.output is not None:
                on_done(out.output)


def generate_set(cfg: TrainDraftConfig, prompts: list[list[int]], gen_head: Path | str,
                 vocab_size: int, init_tensors: dict[str, Tensor] | None = None,
                 holdout: list[list[int]] | None = None,
                 on_calibrated: Any = None) -> tuple[GeneratedSet, GeneratedSet | None]:
    """Roll out ``prompts`` with the engine, keeping what its catch-up pass computes, until
    ``cfg.rollout_tokens`` tokens were generated: passes over the prompts in a seeded order,
    ``cfg.num_samples`` samples each, each pass with new seeds (only one pass when greedy);
    ``rollout_tokens=0``: exactly one pass. Then ``cfg.greedy_rollout_tokens``
    greedy tokens of the same prompts in the same order (one pass at most), appended as the
    set's last ``num_greedy`` sequences. ``gen_head``: the draft (a head dir, or
    ``"mtp"``); ``init_tensors`` replace the MTP layer's weights first. The first call rolls
    out about :data:`CALIBRATION_ROLLOUTS` sequences and then calls ``on_calibrated(data,
    progress)`` (the estimate). Then greedy rollouts of ``holdout`` (the training curve's
    held-out set, returned second)."""
    from specengine.sampling import SamplingParams

    n = cfg.num_samples
    eval_tokens = cfg.eval_max_tokens or cfg.max_tokens
    longest = max(len(p) for p in prompts + (holdout or [])) + max(cfg.max_tokens, eval_tokens)
    # a call's sequences must fit the KV caches at once: the drafter's own cache holds as many
    # tokens as the target's but shares no prompt between a prompt's samples
    probe = _engine(cfg, gen_head, max_batch_size=max(GEN_BATCH, n))
    kv_tokens = probe.kv_cache.num_blocks * probe.kv_cache.block_size
    probe.close()

    def per_call(n: int) -> int:  # prompts per generate call at n samples each
        return max(1, min(GEN_BATCH // n, int(KV_FILL * kv_tokens) // (n * longest)))

    capacity = per_call(n) * n * longest  # a whole call's sequences fit: none loses its start
    engine = _engine(cfg, gen_head, max_batch_size=max(GEN_BATCH, n),
                     draft_options={"adapt_buffer_tokens": capacity})
    if init_tensors is not None:
        engine.load_weights(init_tensors, which="draft")
    k = cfg.gen_k or 0
    if k == 0:  # no drafts: the drafter only catches up, recording every position
        engine.drafter.catch_up_at_k0 = True
    buffer = engine.drafter.adapter.buffer
    data = GeneratedSet(counts=np.zeros(vocab_size, dtype=np.int64))
    # the policy's top-N distribution of every generated token (+1: the drawn token)
    labels = SoftLabels(cfg.soft_labels + 1) if cfg.soft_labels else None

    def roll(temperature: float, n: int, budget: int, desc: str, calibrate: bool,
             on_first: Any = None) -> RolloutProgress:
        """Passes over the prompts at ``temperature``, ``n`` samples each (new seeds every
        pass; greedy: one pass at most), until ``budget`` generated tokens (0: one pass).
        ``calibrate``: the first call is about :data:`CALIBRATION_ROLLOUTS` rollouts, then
        ``on_first(data, progress)``."""
        bar = _progress(budget if budget else None, desc, cfg.progress, unit="tok")
        st = RolloutProgress()
        t0 = time.perf_counter()

        def done(o: Any) -> None:
            ids = np.asarray(o.token_ids, dtype=np.int64)
            if labels is not None:
                labels.add(o.prompt_token_ids, o.token_ids, o.top_logprobs)
            data.counts += np.bincount(ids, minlength=vocab_size)[:vocab_size]
            st.num_rollouts += 1
            st.num_tokens += len(ids)
            bar.update(len(ids))
            bar.set_postfix(rollouts=st.num_rollouts, prompts=st.num_prompts,
                            tok_s=f"{st.num_tokens / (time.perf_counter() - t0):.1f}")

        order = np.random.default_rng([cfg.seed, 2]).permutation(len(prompts))
        pos = 0
        try:
            while True:
                if pos >= len(order):
                    st.passes += 1
                    pos = 0
                    if not budget or temperature == 0:
                        break
                    order = np.random.default_rng([cfg.seed, 2, st.passes]).permutation(
                        len(prompts))
                if budget and st.num_tokens >= budget:
                    break
                if st.num_rollouts == 0 and calibrate:  # timed for the estimate
                    m = max(1, min(per_call(n), CALIBRATION_ROLLOUTS // n))
                elif budget:  # as many prompts as the budget still needs, at the mean length
                    # (at first the longest: no call overshoots by more than its last prompt)
                    mean = (st.num_tokens / st.num_rollouts if st.num_rollouts
                            else cfg.max_tokens)
                    m = min(per_call(n), max(1, math.ceil((budget - st.num_tokens)
                                                          / max(mean, 1.0) / n)))
                else:
                    m = per_call(n)
                idx = order[pos: pos + m]
                pos += len(idx)
                st.num_prompts += len(idx)
                params = [SamplingParams(temperature=temperature, max_tokens=cfg.max_tokens,
                                         n=n, logprobs=cfg.soft_labels or None,
                                         seed=(cfg.seed * 1_000_003 + st.passes * 7_919
                                               + int(i) * 31 + 17) % (2**62))
                          for i in idx]
                first = st.num_rollouts == 0
                _run_rollouts(engine, [prompts[int(i)] for i in idx], params, k, done)
                data.take(buffer, labels)
                buffer.clear()
                if labels is not None:
                    labels.clear()
                st.seconds = time.perf_counter() - t0
                if first and on_first is not None:
                    on_first(data, st)
        finally:
            bar.close()
        st.started = st.passes + (1 if pos > 0 else 0)
        return st

    try:
        st = roll(cfg.temperature, n, cfg.rollout_tokens, "rollouts", True, on_calibrated)
        data.passes = st.started
        if cfg.rollout_tokens and st.num_tokens < cfg.rollout_tokens:
            logger.warning("train-draft: the rollouts gave %d tokens, fewer than "
                           "rollout_tokens %d (%s)", st.num_tokens, cfg.rollout_tokens,
                           "greedy: one pass over the prompts, whose repeats would be "
                           "identical" if cfg.temperature == 0 else "")
        if cfg.greedy_rollout_tokens:
            num_sampled = len(data.seqs)
            gst = roll(0.0, 1, cfg.greedy_rollout_tokens, "greedy rollouts", False)
            data.num_greedy = len(data.seqs) - num_sampled
            logger.info("greedy rollouts: %d tokens of %d prompts in %.0f s%s", gst.num_tokens,
                        gst.num_prompts, gst.seconds, " (one pass over the prompts: fewer "
                        f"than the {cfg.greedy_rollout_tokens:,} asked)"
                        if gst.num_tokens < cfg.greedy_rollout_tokens else "")
        held = None
        if holdout:
            held = GeneratedSet(counts=np.zeros(vocab_size, dtype=np.int64))
            greedy = SamplingParams(temperature=0.0, max_tokens=eval_tokens)
            hbar = _progress(len(holdout), "held-out rollouts", cfg.progress, unit="rollout")
            for i in range(0, len(holdout), GEN_BATCH):
                chunk = holdout[i: i + GEN_BATCH]
                _run_rollouts(engine, chunk, [greedy] * len(chunk), k,
                              lambda o: hbar.update(1))
                held.take(buffer)
                buffer.clear()
            hbar.close()
            held.finish()
    finally:
        engine.close()
    data.finish()
    if not data.seqs:
        raise ValueError("train-draft: the rollouts produced no sequence to train on (every "
                         "completion ended at its first token?)")
    return data, held


def evaluate(cfg: TrainDraftConfig, prompts: list[list[int]],
             draft_options: dict[str, Any] | None = None) -> dict[str, Any]:
    """Rollouts of ``prompts`` with the head in ``cfg.out`` at k = 0 and 1..5, at each of
    ``cfg.eval_temperatures`` (greedy: whether each k reproduced k = 0; sampling: seeded,
    the policy's distribution whatever k, so only the acceptance is compared).
    ``draft_options``: the drafter's (e.g. ``{"sample": False}``); None: its defaults."""
    batch = max(1, min(len(prompts), GEN_BATCH))
    mtp = cfg.arch == "mtp"  # the output is then the target with its MTP layers
    engine = _engine(cfg, "mtp" if mtp else cfg.out, cfg.out if mtp else None,
                     max_batch_size=batch, draft_options=draft_options)
    max_tokens = cfg.eval_max_tokens or cfg.max_tokens
    by_temp: dict[str, Any] = {}
    # the head's best trees (greedy ones for greedy rows, sampled ones else), when written
    sizes = cfg.evaluated_trees if (cfg.out / TREES_FILE).is_file() else ()
    trees: dict[str, Any] = {}
    try:
        for temp in cfg.eval_temperatures:
            params = eval_sampling(cfg, float(temp), len(prompts), max_tokens)
            base = engine.generate(prompts, k=0, sampling=params) if temp == 0 else None
            key = f"{float(temp):g}"
            by_temp[key] = {str(k): eval_row(engine, prompts, params, base, k=k)
                            for k in EVAL_KS}
            for n in sizes:
                paths = tree_paths(cfg.out, "greedy" if temp == 0 else "sampled", n)
                depth = max(len(p) for p in paths)
                trees.setdefault(key, {})[str(n)] = {
                    "depth": depth, "paths": [list(p) for p in paths],
                    **eval_row(engine, prompts, params, base, k=depth, tree=paths)}
    finally:
        engine.close()
    first = by_temp[f"{float(cfg.eval_temperatures[0]):g}"]
    out = {"num_prompts": len(prompts), "temperature": float(cfg.eval_temperatures[0]),
           "max_tokens": max_tokens, "k": first, "by_temperature": by_temp}
    if trees:
        out["trees"] = trees
    return out


def eval_sampling(cfg: TrainDraftConfig, temperature: float, num: int,
                  max_tokens: int) -> list[Any]:
    """The evaluation's sampling parameters: one seed per prompt, the same for every k."""
    from specengine.sampling import SamplingParams

    return [SamplingParams(temperature=temperature, max_tokens=max_tokens,
                           seed=cfg.seed * 7_919 + i) for i in range(num)]


def eval_row(engine: Any, prompts: list[list[int]], params: list[Any], base: list[Any] | None,
             **generate_kw: Any) -> dict[str, Any]:
    """One ``engine.generate(prompts, sampling=params, **generate_kw)`` as an evaluation row:
    mean accepted length, acceptance per position and per draft, generated tokens and, with
    the k=0 outputs ``base`` (greedy), how many outputs equal them."""
    outs = engine.generate(prompts, sampling=params, **generate_kw)
    st = engine.stats
    row = {"mean_accepted_length": st.mean_accepted_length,
           "acceptance_per_position": list(st.acceptance_rate_per_position),
           "acceptance_per_draft": st.num_accepted_tokens / max(1, st.num_draft_tokens),
           "generated_tokens": sum(len(o.token_ids) for o in outs)}
    if base is not None:
        row["identical_to_k0"] = sum(a.token_ids == b.token_ids for a, b in zip(outs, base))
    return row


def format_table(evaluation: dict[str, Any]) -> str:
    n = evaluation["num_prompts"]
    by_temp = evaluation.get("by_temperature") or {f"{evaluation['temperature']:g}":
                                                   evaluation["k"]}
    lines = []
    for temp, rows in by_temp.items():
        greedy = float(temp) == 0
        lines += [f"held-out evaluation: {n} prompts, "
                  + ("greedy" if greedy else f"sampling at temperature {temp}")
                  + f", at most {evaluation['max_tokens']} tokens",
                  f"{'k':>2} | {'mean accepted length':>20} | "
                  + (f"{'identical to k=0':>16} | " if greedy else "")
                  + "acceptance per position"]
        for k, r in rows.items():
            lines.append(f"{k:>2} | {r['mean_accepted_length']:>20.2f} | "
                         f"{_cells(r, greedy, n)}")
        for size, r in evaluation.get("trees", {}).get(temp, {}).items():
            lines.append(f"the head's best tree of {size} drafts, depth {r['depth']}: "
                         f"{r['mean_accepted_length']:.2f} | {_cells(r, greedy, n)}")
    return "\n".join(lines)


def _cells(row: dict[str, Any], greedy: bool, num_prompts: int) -> str:
    """A table row's last cells: (greedy) identical to k=0, then acceptance per position."""
    acc = " ".join(f"{a:.2f}" for a in row["acceptance_per_position"])
    same = (f"{str(row['identical_to_k0']) + '/' + str(num_prompts):>16} | "
            if greedy and "identical_to_k0" in row else "")
    return same + acc


def offline_acceptance(trainer: DraftTrainer, params: dict[str, Tensor], held: GeneratedSet,
                       ks: tuple[int, ...] = EVAL_KS) -> dict[str, Any]:
    """Greedy speculative decoding of the held-out greedy rollouts replayed with the head's
    unrolled maths (no target pass): from each sequence's first anchor, a step at ``k``
    accepts the drafts up to the first that differs from the policy's token, then the next
    step starts after the kept tokens, as the engine's greedy steps do. Returns per k the
    mean accepted length and the acceptance per position (the engine's definitions)."""
    depth = max(ks)
    saved = trainer.depth
    trainer.depth = depth
    try:
        proposed = {k: np.zeros(k) for k in ks}
        accepted = {k: np.zeros(k) for k in ks}
        steps = {k: 0 for k in ks}
        kept = {k: 0 for k in ks}
        with torch.no_grad():
            for i in range(0, len(held.seqs), GROUP_SEQS_EVAL):
                seqs = held.seqs[i: i + GROUP_SEQS_EVAL]
                feats, ids, valid, targets = trainer.batch(held, seqs)
                logits = trainer.math.unroll(params, feats, ids, valid, depth)
                hit = torch.stack([(lg.argmax(-1) == tg) & (tg >= 0)
                                   for lg, tg in zip(logits, targets)], -1).cpu().numpy()
                for b, s in enumerate(seqs):
                    end = len(s.rows) - 1  # the last position with a next token
                    for k in ks:
                        a = s.num_prompt_tokens - 1
                        while a < end:
                            n = 0
                            while n < k and hit[b, a, n]:
                                n += 1
                            width = min(k, end - a)  # drafts past the end are not made
                            proposed[k][:width] += 1
                            accepted[k][:n] += 1
                            steps[k] += 1
                            kept[k] += n + 1
                            a += n + 1
    finally:
        trainer.depth = saved
    return {str(k): {"mean_accepted_length": kept[k] / max(1, steps[k]),
                     "acceptance_per_position": (accepted[k] / np.maximum(proposed[k], 1))
                     .tolist()} for k in ks}


def plot(evaluation: dict[str, Any], path: Path) -> bool:
    """Acceptance per position and mean accepted length by k, when matplotlib is there."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    fig, (a, b) = plt.subplots(1, 2, figsize=(9, 3.5))
    for k, r in evaluation["k"].items():
        acc = r["acceptance_per_position"]
        a.plot(range(1, len(acc) + 1), acc, marker="o", label=f"k={k}")
    a.set(xlabel="draft position", ylabel="acceptance rate", ylim=(0, 1.02))
    a.legend()
    ks = [int(k) for k in evaluation["k"]]
    b.plot(ks, [r["mean_accepted_length"] for r in evaluation["k"].values()], marker="o")
    b.plot(ks, [k + 1 for k in ks], ls=":", color="gray", label="k + 1 (all accepted)")
    b.set(xlabel="k", ylabel="mean accepted length")
    b.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return True


def _split(prompts: list[list[int]], holdout: int | None, seed: int
           ) -> tuple[list[list[int]], list[list[int]]]:
    n = len(prompts)
    if holdout is None:
        holdout = min(64, max(1, n // 10)) if n > 1 else 0
    if holdout >= n:
        raise ValueError(f"--holdout {holdout} leaves no training prompt ({n} prompts)")
    order = np.random.default_rng([seed, 1]).permutation(n)
    held = {int(i) for i in order[:holdout]}
    return ([p for i, p in enumerate(prompts) if i not in held],
            [prompts[int(i)] for i in order[:holdout]])


def train_draft(cfg: TrainDraftConfig | None = None, /, **kwargs: Any) -> TrainDraftResult:
    """Generate, train and evaluate an EAGLE-3 head or MTP layer (module docstring). Give a
    :class:`TrainDraftConfig` or its fields as keywords. Bad input raises ``ValueError``
    (``CheckpointError`` for a head or checkpoint that does not fit) before the output dir is
    touched."""
    cfg = cfg if cfg is not None else TrainDraftConfig(**kwargs)
    if not cfg.model.is_dir():
        raise ValueError(f"--model {cfg.model}: no such directory")
    if cfg.out.resolve() == cfg.model.resolve():
        raise ValueError(f"--out {cfg.out} is the --model dir: give another dir (the model is "
                         "read, never written)")
    target_cfg = read_config(cfg.model)
    mtp = cfg.arch == "mtp"
    if mtp:
        check_mtp_target(cfg.model, target_cfg)
    device = torch.device(cfg.device if cfg.device not in (None, "auto") else
                          ("cuda" if torch.cuda.is_available() else "cpu"))
    compute_dtype = train_compute_dtype(cfg.train_dtype, device)
    resume_from = _prepare_out(cfg)
    init_cfg = init_tensors = None
    if mtp and cfg.init is not None:
        init_tensors = read_mtp_tensors(cfg.init)
        check_mtp_init(cfg.model, init_tensors, cfg.init)
    elif cfg.init is not None:
        init_cfg = read_config(cfg.init)
        check_head_fits(init_cfg, target_cfg, cfg.init)
    ckpt_dir = cfg.out / CHECKPOINT_DIR
    embed = read_embedding(cfg.model)
    vocab = embed.num_embeddings
    t0 = time.perf_counter()
    held = None
    if resume_from is None:
        prompts = tokenize_prompts(cfg.model, read_prompts(cfg.prompts, cfg.prompt_column))
        if cfg.eval_prompts is not None:  # the task's own held-out split, all of it
            train_prompts = prompts
            holdout = tokenize_prompts(cfg.model, read_prompts(cfg.eval_prompts,
                                                               cfg.prompt_column))
            if cfg.holdout is not None:
                holdout = holdout[: cfg.holdout]
        else:
            train_prompts, holdout = _split(prompts, cfg.holdout, cfg.seed)
        logger.info("%s", plan_text(cfg, len(train_prompts), len(holdout), device))

        def calibrated(part: GeneratedSet, st: RolloutProgress) -> None:
            logger.info("%s", estimate_text(cfg, part, st, len(train_prompts), len(holdout),
                                            embed, target_cfg, device, vocab))

        with tempfile.TemporaryDirectory(prefix="specengine-gen-head-") as tmp:
            if mtp:
                gen_head: Path | str = "mtp"
            elif cfg.init is not None:
                gen_head = cfg.init
            else:  # a random head that only drives the capture (its catch-up pass)
                torch.manual_seed(cfg.seed)
                gen_cfg = fresh_config(target_cfg, min(vocab, cfg.draft_vocab_size), "float32")
                write_head(build_head(gen_cfg, embed, torch.device("cpu")), gen_cfg, tmp,
                           torch.float32)
                gen_head = Path(tmp)
            data, held = generate_set(cfg, train_prompts, gen_head, vocab, init_tensors,
                                      holdout if cfg.curve_points else None, calibrated)
        data.holdout = holdout
        if cfg.overwrite and cfg.out.exists():  # only once the rollouts succeeded
            shutil.rmtree(cfg.out) if cfg.out.is_dir() else cfg.out.unlink()
        cfg.out.mkdir(parents=True, exist_ok=True)
        if cfg.save_every:
            ckpt_dir.mkdir(exist_ok=True)
            data.save(ckpt_dir / DATA_FILE)
            (ckpt_dir / "settings.json").write_text(json.dumps(
                {**_settings(cfg), "num_train_prompts": len(train_prompts)}, indent=2))
        num_train_prompts, start = len(train_prompts), 0
    else:
        saved = json.loads((ckpt_dir / "settings.json").read_text())
        saved.setdefault("arch", "eagle3")  # runs from before --arch
        saved.setdefault("tv_weight", 0.0)  # runs from before --tv-weight
        now = _settings(cfg)
        diff = {k: (saved.get(k), now[k]) for k in RESUME_KEYS if saved.get(k) != now[k]}
        if diff:
            raise ValueError("--resume: these settings differ from the run being resumed "
                             f"(saved, given): {diff}; give the run's own settings")
        data = GeneratedSet.load(ckpt_dir / DATA_FILE)
        num_train_prompts = int(saved.get("num_train_prompts", 0))
        start = int(resume_from.stem.split("-")[1])
    gen_s = time.perf_counter() - t0
    embed = embed.to(device)
    head, head_cfg, head_math = _make_head(cfg, target_cfg, embed, device, data.counts,
                                           init_tensors, init_cfg)
    opt = HeadOptimizer(head)
    if resume_from is not None:
        opt.load_state_dict(load_file(str(resume_from), device=str(device)))
    trainer = DraftTrainer(head, embed, device, depth=cfg.ttt_steps,
                           batch_tokens=cfg.batch_tokens, seed=cfg.seed, math=head_math,
                           tv_weight=cfg.tv_weight)
    schedule = training_schedule(data.seqs, cfg)
    total = len(schedule)
    if start > total:
        raise ValueError(f"--resume: the checkpoint is at step {start} but this run has "
                         f"{total} steps")
    logger.info("training: %d steps of about %d positions (%.1f passes over %d generated "
                "tokens in %d sequences, %d of them greedy, shuffled together)", total,
                cfg.batch_tokens, sum(len(b) for b in schedule) / max(1, len(data.seqs)),
                data.num_tokens, len(data.seqs), data.num_greedy)
    curve_at = set()
    if held is not None and held.seqs and cfg.curve_points and not mtp:
        curve_at = {max(1, round(total * (i + 1) / cfg.curve_points))
                    for i in range(cfg.curve_points)} | {0}
    curve: list[dict[str, Any]] = []
    losses: list[tuple[int, float]] = []
    bar = _progress(total, "train", cfg.progress, initial=start)
    t1 = time.perf_counter()
    positions = trained = 0
    try:
        for step in range(start, total):
            if step in curve_at:
                curve.append(_curve_point(trainer, opt, held, step, trained))
            batch = [data.seqs[i] for i in schedule[step]]
            with torch.enable_grad(), loss_autocast(device, compute_dtype):
                loss = trainer.objective(data, batch, opt.masters)
            opt.step(loss, learning_rate(step, total, cfg.lr))
            losses.append((step, float(loss.detach())))
            positions += sum(len(s.rows) for s in batch)
            trained += sum(len(s.rows) - s.num_prompt_tokens for s in batch)
            bar.update(1)
            bar.set_postfix(loss=f"{losses[-1][1]:.4f}",
                            tok_s=f"{positions / (time.perf_counter() - t1):.0f}")
            done = step + 1
            if cfg.save_every and done % cfg.save_every == 0 and done < total:
                _save_checkpoint(opt, ckpt_dir, done)
        if total in curve_at:
            curve.append(_curve_point(trainer, opt, held, total, trained))
    finally:
        bar.close()
    train_s = time.perf_counter() - t1
    opt.sync_out()
    if mtp:  # the target checkpoint, its mtp.* tensors trained (same names and dtypes)
        write_mtp_checkpoint(cfg.model, head, cfg.out)
    else:
        write_head(head, head_cfg, cfg.out, head_save_dtype(cfg, target_cfg))
    logger.info("wrote the %s to %s after %d steps (%.1f s)", "checkpoint with the trained "
                "MTP layer" if mtp else "head", cfg.out, total, train_s)
    if not mtp and data.soft_ids is not None and data.seqs:
        trees = write_trees(trainer, opt.masters, data, data.seqs, cfg.out)
        logger.info("wrote %s: the best static trees of %s drafts for greedy and sampled "
                    "requests (expected accepted drafts per step, sampled: %s)", TREES_FILE,
                    "/".join(trees["trees"]["sampled"]), trees["expected_accepted_drafts"]
                    ["sampled"])
    t2 = time.perf_counter()
    evaluation = None
    if data.holdout:
        evaluation = evaluate(cfg, data.holdout)
        evaluation["training"] = {"num_seqs": len(data.seqs), "num_tokens": data.num_tokens,
                                  "num_greedy_seqs": data.num_greedy,
                                  "num_greedy_tokens": data.num_greedy_tokens,
                                  "steps": total, "final_loss": losses[-1][1] if losses
                                  else None, "generate_s": gen_s, "train_s": train_s,
                                  "train_dtype": dtype_name(compute_dtype),
                                  "tv_weight": cfg.tv_weight}
        if curve:
            evaluation["curve"] = curve
        (cfg.out / "eval.json").write_text(json.dumps(evaluation, indent=2) + "\n")
        plot(evaluation, cfg.out / "eval.png")
    return TrainDraftResult(cfg.out, num_train_prompts, len(data.holdout),
                            len(data.seqs), data.num_tokens, total, tuple(losses), evaluation,
                            gen_s, train_s, time.perf_counter() - t2,
                            None if resume_from is None else start, data.passes,
                            data.num_greedy, data.num_greedy_tokens, dtype_name(compute_dtype))


def _make_head(cfg: TrainDraftConfig, target_cfg: dict[str, Any], embed: nn.Embedding,
               device: torch.device, counts: np.ndarray,
               init_tensors: dict[str, Tensor] | None, init_cfg: dict[str, Any] | None
               ) -> tuple[nn.Module, dict[str, Any] | None, MTPMath | None]:
    """The head to train, its config (None for MTP) and its maths (None: EAGLE-3's)."""
    if cfg.arch == "mtp":
        head = build_mtp(cfg.model, embed, device, init_tensors if init_tensors is not None
                         else read_mtp_tensors(cfg.model, "--model"))
        return head, None, MTPMath(head, embed)
    if cfg.init is not None:
        _, head = read_head(cfg.init, embed, device)
        return head, init_cfg, None
    vocab = embed.num_embeddings
    head_cfg = fresh_config(target_cfg, min(vocab, cfg.draft_vocab_size), "bfloat16")
    if cfg.norm_before_residual:
        head_cfg["norm_before_residual"] = True
    torch.manual_seed(cfg.seed)
    head = build_head(head_cfg, embed, device,
                      draft_to_target=most_frequent(counts, head_cfg["draft_vocab_size"]))
    if cfg.head_init == "target":
        init_from_target(head, cfg.model, embed)
    return head, head_cfg, None


def cpu_has_native_bf16(cpuinfo: str = "/proc/cpuinfo") -> bool:
    """Whether this CPU multiplies bfloat16 natively (AVX512-BF16 or AMX: bf16 matmuls at
    about 4x float32's rate, RESULTS.md); False where the flags cannot be read."""
    try:
        text = Path(cpuinfo).read_text()
    except OSError:
        return False
    flags = set()
    for line in text.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[-1].split())
    return bool(flags & {"avx512_bf16", "amx_bf16"})


def train_compute_dtype(name: str, device: torch.device) -> torch.dtype:
    """The compute dtype of the loss (``TrainDraftConfig.train_dtype``) on ``device``."""
    if name == "float32":
        return torch.float32
    cuda = device.type == "cuda"
    if name == "bfloat16":
        if cuda and not torch.cuda.is_bf16_supported():
            raise ValueError("train-draft: --train-dtype bfloat16 needs a GPU that computes "
                             "bfloat16 (compute capability 8.0 or newer); give --train-dtype "
                             "float32")
        return torch.bfloat16
    native = torch.cuda.is_bf16_supported() if cuda else (
        device.type == "cpu" and cpu_has_native_bf16())
    return torch.bfloat16 if native else torch.float32


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def loss_autocast(device: torch.device, dtype: torch.dtype) -> Any:
    """The loss's forward (and so its backward) in ``dtype`` where it multiplies matrices:
    autocast keeps reductions (softmax, the cross-entropy) in float32 and the gradients
    reach the float32 masters as float32."""
    return torch.autocast(device.type, dtype=dtype, enabled=dtype != torch.float32)


def head_save_dtype(cfg: TrainDraftConfig, target_cfg: dict[str, Any]) -> torch.dtype:
    """``cfg.head_dtype``, or the target's dtype for ``"auto"`` (bfloat16 when unnamed)."""
    name = cfg.head_dtype if cfg.head_dtype != "auto" else str(
        target_cfg.get("torch_dtype") or target_cfg.get("dtype") or "bfloat16")
    return getattr(torch, name, torch.bfloat16)


def training_schedule(seqs: list[BufferedSeq], cfg: TrainDraftConfig) -> list[list[int]]:
    """The batches of every step: ``cfg.steps`` steps (``cfg.epochs`` passes instead when
    given) cut from shuffled passes over the generated set, so the budget is the same
    whatever the number of prompts or sequences."""
    if cfg.epochs is not None:
        return [b for e in range(cfg.epochs)
                for b in epoch_batches(seqs, cfg.batch_tokens, cfg.seed, e)]
    out: list[list[int]] = []
    epoch = 0
    while len(out) < cfg.steps:
        out += epoch_batches(seqs, cfg.batch_tokens, cfg.seed, epoch)
        epoch += 1
    return out[: cfg.steps]


def _curve_point(trainer: DraftTrainer, opt: HeadOptimizer, held: GeneratedSet | None,
                 step: int, trained: int) -> dict[str, Any]:
    assert held is not None
    acc = offline_acceptance(trainer, opt.masters, held)
    logger.info("step %d (%d trained tokens): held-out greedy mean accepted length %s", step,
                trained, " ".join(f"k={k}: {r['mean_accepted_length']:.2f}"
                                  for k, r in acc.items()))
    return {"step": step, "trained_tokens": trained, "greedy": acc}


def plan_text(cfg: TrainDraftConfig, num_train: int, num_holdout: int,
              device: torch.device) -> str:
    """What the run will do, printed before any work."""
    n = cfg.num_samples
    if cfg.rollout_tokens:
        data = (f"rollouts until {cfg.rollout_tokens:,} generated tokens: passes over the "
                f"{num_train} training prompts in a seeded order, {n} sample(s) each"
                + (" (greedy: one pass at most)" if cfg.temperature == 0 else
                   ", new seeds every pass"))
    else:
        data = f"one pass over the {num_train} training prompts, {n} sample(s) each"
    train = (f"{cfg.epochs} passes over the generated set" if cfg.epochs is not None
             else f"{cfg.steps} optimiser steps")
    head = (f"warm start from {cfg.init}" if cfg.init is not None else
            "the checkpoint's MTP layer" if cfg.arch == "mtp" else
            f"fresh EAGLE-3 head, draft vocabulary of the {cfg.draft_vocab_size} most frequent "
            "generated tokens, " + ("output side from the target" if cfg.head_init ==
                                     "target" else "random init"))
    temps = ", ".join("greedy" if t == 0 else f"T={t:g}" for t in cfg.eval_temperatures)
    dt = train_compute_dtype(cfg.train_dtype, device)
    compute = dtype_name(dt) + ("" if dt == torch.float32 else " (autocast, float32 masters)")
    return "\n".join([
        f"train-draft plan ({device.type}):",
        f"  data:      {data}; temperature {cfg.temperature:g}, at most {cfg.max_tokens} "
        f"tokens per rollout, k={cfg.gen_k or 0} while generating"
        + (f"; then greedy rollouts of the same prompts until {cfg.greedy_rollout_tokens:,} "
           "tokens (one pass at most), shuffled in with them" if cfg.greedy_rollout_tokens
           else ""),
        f"  head:      {head}",
        f"  training:  {train} of about {cfg.batch_tokens} positions, lr {cfg.lr:g}, "
        f"{cfg.ttt_steps} unrolled steps, seed {cfg.seed}, computed in {compute}, "
        + (f"targets: the policy's top-{cfg.soft_labels} distribution of each token"
           if cfg.soft_labels else "targets: the drawn tokens")
        + (f", plus {cfg.tv_weight:g} x the rejection probability" if cfg.tv_weight else ""),
        f"  held out:  {num_holdout} prompts; evaluation at k=0..{max(EVAL_KS)}"
        + (f" and with the head's best tree of {'/'.join(map(str, cfg.evaluated_trees))} "
           "drafts" if cfg.evaluated_trees else "")
        + f" ({temps}), "
        f"at most {cfg.eval_max_tokens or cfg.max_tokens} tokens"
        + (f"; greedy acceptance curve at {cfg.curve_points} points" if cfg.curve_points
           and num_holdout else ""),
        "  estimate:  after the first rollouts (timed)"])


def estimate_text(cfg: TrainDraftConfig, part: GeneratedSet, st: RolloutProgress,
                  num_train: int, num_holdout: int, embed: nn.Embedding, target_cfg: dict[str, Any],
                  device: torch.device, vocab: int) -> str:
    """Minutes the run should take, from the first rollouts' rate and one timed training
    step on them (a throwaway fresh head: the real one needs every rollout's counts)."""
    rate = st.num_tokens / max(st.seconds, 1e-9)  # generated tokens per second
    if cfg.rollout_tokens:
        left = max(0, cfg.rollout_tokens - st.num_tokens)
        total_tokens = cfg.rollout_tokens
    else:
        left = st.num_tokens / max(1, st.num_rollouts) * max(
            0, cfg.num_samples * num_train - st.num_rollouts)
        total_tokens = st.num_tokens + left
    # the greedy rollouts at the sampled rate: low, since one sample per prompt shares no
    # prefill (SmolLM2, RESULTS.md: 129 against 217 tokens/s; the total stayed an upper bound)
    greedy = min(cfg.greedy_rollout_tokens,
                 num_train * st.num_tokens / max(1, st.num_rollouts))
    gen_s = (left + greedy) / max(rate, 1e-9)
    total_tokens += greedy
    mean_rows = 1.0
    step_s = float("nan")
    part.finish()
    if part.seqs and cfg.arch == "eagle3":
        mean_rows = float(np.mean([len(s.rows) for s in part.seqs]))
        hc = fresh_config(target_cfg, min(vocab, cfg.draft_vocab_size), "float32")
        head = build_head(hc, embed.to(device), device,
                          draft_to_target=most_frequent(part.counts, hc["draft_vocab_size"]))
        trainer = DraftTrainer(head, embed.to(device), device, depth=cfg.ttt_steps,
                               batch_tokens=cfg.batch_tokens, seed=cfg.seed,
                               tv_weight=cfg.tv_weight)
        opt = HeadOptimizer(head)
        batch = trainer.pick(part.seqs)
        scale = cfg.batch_tokens / max(1, sum(len(s.rows) for s in batch))
        t = time.perf_counter()
        with torch.enable_grad(), loss_autocast(device, train_compute_dtype(cfg.train_dtype,
                                                                            device)):
            loss = trainer.objective(part, batch, opt.masters)
        loss.backward()
        step_s = (time.perf_counter() - t) * max(1.0, scale)
    if cfg.epochs is not None:
        rows = total_tokens / max(1.0, st.num_tokens / max(1, len(part.seqs))) * mean_rows
        steps = cfg.epochs * rows / cfg.batch_tokens
    else:
        steps = cfg.steps
    train_s = steps * step_s
    eval_tokens = num_holdout * (cfg.eval_max_tokens or cfg.max_tokens) * 0.6
    # at most: a step at k verifies k + 1 tokens and may keep only one (compute-bound CPU)
    eval_s = eval_tokens * (1 + sum(k + 1 for k in EVAL_KS)
                            + sum(n + 1 for n in cfg.evaluated_trees)) \
        * len(cfg.eval_temperatures) / max(rate, 1e-9)
    held_s = num_holdout * (cfg.eval_max_tokens or cfg.max_tokens) * 0.6 / max(rate, 1e-9)
    total = gen_s + held_s + train_s + eval_s
    return (f"estimate (from {st.num_rollouts} rollouts, {st.num_tokens} tokens in "
            f"{st.seconds:.0f} s = {rate:.1f} tok/s, and one timed training step of "
            f"{step_s:.1f} s): rollouts ~{(gen_s + held_s) / 60:.1f} min more, training "
            f"~{train_s / 60:.1f} min ({steps:.0f} steps), evaluation at most {eval_s / 60:.1f} "
            f"min; total at most {(st.seconds + total) / 60:.1f} min")


def _save_checkpoint(opt: HeadOptimizer, ckpt_dir: Path, step: int) -> None:
    """Masters and moments at ``step``; the previous checkpoint goes once this one is whole."""
    ckpt_dir.mkdir(parents=True, exist_ok=True)
    tmp = ckpt_dir / f"step-{step}.safetensors.tmp"
    save_file({n: t.detach().cpu().contiguous() for n, t in opt.state_dict().items()},
              str(tmp))
    tmp.replace(ckpt_dir / f"step-{step}.safetensors")
    for old in ckpt_dir.glob("step-*.safetensors"):
        if old.stem != f"step-{step}":
            old.unlink()
