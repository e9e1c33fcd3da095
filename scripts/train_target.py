#!/usr/bin/env python
"""Train the bundled arithmetic target model (``specengine/assets/arith-target``).

A small Qwen3ForCausalLM trained from scratch on CPU on :mod:`specengine.arith_task`: the loss
covers the completion and ``<eos>`` only (the prompt is masked). At the end the weights are
saved (``save_pretrained``, safetensors, bfloat16 by default) with the task's
``tokenizer.json``, the saved checkpoint is reloaded, and its greedy accuracy on held-out
prompts is measured with HF ``generate``.

    python scripts/train_target.py                       # defaults: about 8 min on 2 idle cores
    python scripts/train_target.py --steps 200 --out /tmp/t   # quick smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
from tqdm import tqdm
from transformers import GenerationConfig, Qwen3Config, Qwen3ForCausalLM

from specengine import arith_task as task

REPO = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO / "specengine" / "assets" / "arith-target"


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT, help="output directory")
    p.add_argument("--steps", type=int, default=800, help="optimizer steps")
    p.add_argument("--batch", type=int, default=128, help="sequences per step")
    p.add_argument("--lr", type=float, default=3e-3, help="peak learning rate (AdamW)")
    p.add_argument("--warmup", type=int, default=100, help="linear warm-up steps")
    p.add_argument("--weight-decay", type=float, default=0.01)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--head-dim", type=int, default=32)
    p.add_argument("--intermediate", type=int, default=512)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16",
                   help="dtype of the saved weights (training is float32)")
    p.add_argument("--seed", type=int, default=0, help="torch seed (the data seed is "
                   "arith_task.TRAIN_SEED)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--eval-every", type=int, default=200,
                   help="greedy accuracy on 100 validation prompts every N steps (0: never)")
    p.add_argument("--eval-n", type=int, default=200, help="held-out prompts in the final eval")
    return p.parse_args()


def make_config(args: argparse.Namespace) -> Qwen3Config:
    return Qwen3Config(
        vocab_size=len(task.VOCAB),
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_hidden_layers=args.layers,
        num_attention_heads=args.heads,
        num_key_value_heads=args.kv_heads,
        head_dim=args.head_dim,
        max_position_embeddings=256,
        rms_norm_eps=1e-6,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        tie_word_embeddings=True,
        attention_bias=False,
        use_cache=True,
        bos_token_id=None,
        eos_token_id=task.EOS_ID,
        pad_token_id=task.PAD_ID,
        architectures=["Qwen3ForCausalLM"],
    )


def make_batch(stream, batch: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Right-padded ``input_ids``, ``attention_mask`` and ``labels`` (prompt and pad = -100)."""
    seqs: list[tuple[list[int], int]] = []
    for _ in range(batch):
        prompt, completion = next(stream)
        p_ids = task.encode(prompt)
        seqs.append((p_ids + task.encode(completion) + [task.EOS_ID], len(p_ids)))
    width = max(len(s) for s, _ in seqs)
    ids = torch.full((batch, width), task.PAD_ID, dtype=torch.long)
    mask = torch.zeros((batch, width), dtype=torch.long)
    labels = torch.full((batch, width), -100, dtype=torch.long)
    for i, (s, n_prompt) in enumerate(seqs):
        ids[i, : len(s)] = torch.tensor(s)
        mask[i, : len(s)] = 1
        labels[i, n_prompt: len(s)] = torch.tensor(s[n_prompt:])
    return ids, mask, labels


@torch.no_grad()
def greedy_completions(model: Qwen3ForCausalLM, prompts: list[str],
                       max_new_tokens: int = 64) -> list[str]:
    """Greedy HF ``generate`` on ``prompts``, batched by prompt length (so no padding)."""
    model.eval()
    by_len: dict[int, list[int]] = {}
    for i, p in enumerate(prompts):
        by_len.setdefault(len(p), []).append(i)
    out: list[str] = [""] * len(prompts)
    for idx in by_len.values():
        ids = torch.tensor([task.encode(prompts[i]) for i in idx])
        gen = model.generate(
            input_ids=ids,
            attention_mask=torch.ones_like(ids),
            do_sample=False,
            max_new_tokens=max_new_tokens,
            eos_token_id=task.EOS_ID,
            pad_token_id=task.PAD_ID,
        )
        for row, i in enumerate(idx):
            new = gen[row, ids.shape[1]:].tolist()
            if task.EOS_ID in new:
                new = new[: new.index(task.EOS_ID)]
            out[i] = task.decode(new)
    return out


def accuracy(model: Qwen3ForCausalLM, prompts: list[str]) -> float:
    comps = greedy_completions(model, prompts)
    return sum(task.reward(p, c) for p, c in zip(prompts, comps)) / len(prompts)


def lr_at(step: int, args: argparse.Namespace) -> float:
    if step < args.warmup:
        return args.lr * (step + 1) / args.warmup
    frac = (step - args.warmup) / max(1, args.steps - args.warmup)
    return args.lr * (0.05 + 0.95 * 0.5 * (1.0 + math.cos(math.pi * frac)))


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)

    config = make_config(args)
    model = Qwen3ForCausalLM(config)
    n_params = sum(p.numel() for p in model.parameters())
    print(f"params: {n_params:,}  vocab: {len(task.VOCAB)}  eos_id: {task.EOS_ID}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": args.weight_decay},
         {"params": no_decay, "weight_decay": 0.0}],
        lr=args.lr, betas=(0.9, 0.98), eps=1e-8,
    )
    stream = task.training_problems(task.TRAIN_SEED)
    # Mid-training monitoring uses its own seed: the held-out prompts stay for the end.
    val_prompts = task.heldout_prompts(100, seed=4321)

    t0 = time.time()
    bar = tqdm(range(args.steps), desc="train", dynamic_ncols=True)
    ema = None
    for step in bar:
        model.train()
        for group in opt.param_groups:
            group["lr"] = lr_at(step, args)
        ids, mask, labels = make_batch(stream, args.batch)
        loss = model(input_ids=ids, attention_mask=mask, labels=labels).loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        ema = loss.item() if ema is None else 0.98 * ema + 0.02 * loss.item()
        bar.set_postfix(loss=f"{ema:.4f}", lr=f"{lr_at(step, args):.2e}")
        if args.eval_every and (step + 1) % args.eval_every == 0 and step + 1 < args.steps:
            acc = accuracy(model, val_prompts)
            tqdm.write(f"step {step + 1}: loss {ema:.4f}  val greedy acc {acc:.3f}")
    train_s = time.time() - t0
    print(f"training: {args.steps} steps in {train_s / 60:.1f} min")

    args.out.mkdir(parents=True, exist_ok=True)
    model.generation_config = GenerationConfig(
        do_sample=False, eos_token_id=task.EOS_ID, pad_token_id=task.PAD_ID,
        max_new_tokens=64,
    )
    save_dtype = getattr(torch, args.dtype)
    model.to(save_dtype).save_pretrained(args.out, safe_serialization=True)
    task.write_tokenizer_json(args.out / "tokenizer.json")
    (args.out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "pad_token": task.PAD,
        "eos_token": task.EOS,
        "model_max_length": 256,
        "clean_up_tokenization_spaces": False,
        "chat_template": task.CHAT_TEMPLATE,
    }, indent=2) + "\n")
    size = sum(f.stat().st_size for f in args.out.iterdir() if f.is_file())
    print(f"saved {args.out} ({size / 1e6:.2f} MB, weights {args.dtype})")

    # Evaluate the checkpoint as saved (bfloat16 weights, computed in float32).
    reloaded = Qwen3ForCausalLM.from_pretrained(args.out, dtype=torch.float32)
    held = task.heldout_prompts(args.eval_n)
    comps = greedy_completions(reloaded, held)
    acc = sum(task.reward(p, c) for p, c in zip(held, comps)) / len(held)
    again = greedy_completions(reloaded, held)
    for p, c in list(zip(held, comps))[:5]:
        print(f"  {p}{c}   reward={task.reward(p, c):.0f}")
    print(f"held-out greedy accuracy ({len(held)} prompts, HF generate): {acc:.3f}")
    print(f"greedy decode deterministic across two runs: {comps == again}")


if __name__ == "__main__":
    main()
