#!/usr/bin/env python
"""Train the bundled EAGLE-3 head (``specengine/assets/arith-eagle3``) for the bundled target.

The head (:class:`specengine.drafters.eagle3.Eagle3Head`, the very module the engine runs)
reads the frozen target's hidden states (outputs of layers 0, 1 and 2 of the 4-layer target,
``eagle_aux_hidden_state_layer_ids``) and the target's embeddings. Training data are task
sequences (prompt + trace + ``<eos>``); the labels are the target's own greedy next tokens.
EAGLE-3's training-time test: the head is unrolled ``--ttt-steps`` times on its own output
hidden states, where the step-``s`` entry at position ``i`` attends to the target-fed entries
at positions ``<= i - s`` and to its own chain's entries of steps ``1 .. s`` (exactly what it
sees when drafting after verified position ``i - s``). Step ``s``'s loss is weighted
``0.8 ** s``. The draft vocabulary drops ``<pad>`` (so ``d2t`` is exercised).

At the end the head is saved in the published layout (config.json with
``architectures: ["LlamaForCausalLMEagle3"]``, ``draft_vocab_size``, ``eagle_config``;
``model.safetensors`` with ``fc``, ``midlayer.*``, ``norm``, ``lm_head``, ``d2t``, ``t2d``)
and the engine measures greedy k=3 on held-out prompts (mean accepted length, equality to
k=0). Reproducible from ``--seed``.

    python scripts/train_eagle3.py                # about 5 min on one idle core
    python scripts/train_eagle3.py --steps 50 --out /tmp/h   # smoke run
"""

from __future__ import annotations

import argparse
import json
import math
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import Tensor
from transformers import AutoModelForCausalLM

from specengine import arith_task as task
from specengine.drafters.eagle3 import Eagle3Head
from specengine.model.attention import AttentionBackend
from specengine.model.config import ModelConfig
from specengine.model.weight_names import hf_named_tensors

REPO = Path(__file__).resolve().parents[1]
TARGET = REPO / "specengine" / "assets" / "arith-target"
DEFAULT_OUT = REPO / "specengine" / "assets" / "arith-eagle3"
AUX_IDS = [0, 1, 2]  # outputs of these target layers = inputs of layers 1, 2, 3
DROPPED = (task.PAD_ID,)  # target ids without a draft id


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--out", type=Path, default=DEFAULT_OUT)
    p.add_argument("--steps", type=int, default=250)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--warmup", type=int, default=50)
    p.add_argument("--ttt-steps", type=int, default=4, help="unrolled draft steps per sample")
    p.add_argument("--intermediate", type=int, default=256)
    p.add_argument("--dtype", choices=("bfloat16", "float32"), default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-seed", type=int, default=7, help="task stream seed (not held-out)")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--eval-n", type=int, default=64, help="held-out prompts in the final eval")
    return p.parse_args()


def head_config(target: dict, args: argparse.Namespace) -> dict:
    keep = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "rms_norm_eps", "rope_parameters", "max_position_embeddings", "vocab_size")
    return {
        "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama",
        **{k: target[k] for k in keep}, "intermediate_size": args.intermediate,
        "num_hidden_layers": 1, "hidden_act": "silu", "attention_bias": False,
        "tie_word_embeddings": False, "draft_vocab_size": target["vocab_size"] - len(DROPPED),
        "target_hidden_size": target["hidden_size"],
        "eagle_config": {"eagle_aux_hidden_state_layer_ids": AUX_IDS,
                         "use_aux_hidden_state": True},
        "torch_dtype": args.dtype,
    }


class TTTAttention(AttentionBackend):
    """Dense attention for the unrolled steps of one batch ``[B, T]``: keys of every step so
    far are kept; step ``s``'s query at ``i`` sees step 0 at ``<= i - s`` and step ``t >= 1``
    at ``i - s + t`` (its own chain)."""

    def __init__(self, batch: int, length: int) -> None:
        self.b, self.t = batch, length
        self.keys: list[Tensor] = []
        self.values: list[Tensor] = []

    def write_kv(self, k, v, k_cache, v_cache, meta) -> None:  # type: ignore[no-untyped-def]
        self.keys.append(k.view(self.b, self.t, *k.shape[1:]))
        self.values.append(v.view(self.b, self.t, *v.shape[1:]))

    def attend(self, q, k_cache, v_cache, meta, scale):  # type: ignore[no-untyped-def]
        s, t = len(self.keys) - 1, self.t
        i = torch.arange(t)[:, None]
        j = torch.arange(t)[None, :]
        blocks = [j <= i - s] + [j == i - s + step for step in range(1, s + 1)]
        mask = torch.cat(blocks, dim=1) | torch.cat(
            [torch.zeros(t, s * t, dtype=torch.bool), torch.eye(t, dtype=torch.bool)], 1)
        group = q.shape[1] // self.keys[0].shape[2]
        k = torch.cat(self.keys, 1).transpose(1, 2).repeat_interleave(group, 1)
        v = torch.cat(self.values, 1).transpose(1, 2).repeat_interleave(group, 1)
        qb = q.view(self.b, t, *q.shape[1:]).transpose(1, 2)
        o = F.scaled_dot_product_attention(qb, k, v, attn_mask=mask, scale=scale)
        return o.transpose(1, 2).reshape(self.b * t, *q.shape[1:])


def make_batch(stream, batch: int) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded ids ``[B, T]``, lengths and prompt lengths."""
    seqs, plens = [], []
    for _ in range(batch):
        prompt, completion = next(stream)
        p = task.encode(prompt)
        seqs.append(p + task.encode(completion) + [task.EOS_ID])
        plens.append(len(p))
    width = max(len(s) for s in seqs)
    ids = torch.full((batch, width), task.PAD_ID, dtype=torch.long)
    for r, s in enumerate(seqs):
        ids[r, : len(s)] = torch.tensor(s)
    return ids, torch.tensor([len(s) for s in seqs]), torch.tensor(plens)


@torch.no_grad()
def target_pass(target: torch.nn.Module, ids: Tensor) -> tuple[Tensor, Tensor]:
    """Fused aux features ``[B, T, 3H]`` and the target's greedy next token ``[B, T]``."""
    out = target(ids, output_hidden_states=True)
    feats = torch.cat([out.hidden_states[i + 1] for i in AUX_IDS], dim=-1)
    return feats, out.logits.argmax(-1)


def ttt_loss(head: Eagle3Head, ids: Tensor, lens: Tensor, plens: Tensor, feats: Tensor,
             greedy: Tensor, steps: int, t2d: Tensor) -> tuple[Tensor, list[float]]:
    """Entry ``i`` reads ``(features or g, x_{i+1})`` at position ``i`` and predicts the
    target's greedy token after ``x_{<= i+1}`` (``greedy[:, i+1]``)."""
    b, t = ids.shape[0], ids.shape[1] - 1
    tokens = ids[:, 1:].reshape(-1)
    pos = torch.arange(t).repeat(b)
    labels = t2d[greedy[:, 1:]]  # draft id of the target's choice (-1: none)
    i = torch.arange(t)[None, :]
    base = (i + 2 < lens[:, None]) & (i + 2 >= plens[:, None]) & (labels >= 0)
    backend, no_cache = TTTAttention(b, t), torch.zeros(2, 1, 1)
    hidden = feats[:, :-1].reshape(b * t, -1)
    total, accs = torch.zeros(()), []
    for s in range(steps):
        if s > 0:  # the chain's previous entry sits one position earlier
            prev = hidden.view(b, t, -1)
            hidden = torch.cat([torch.zeros_like(prev[:, :1]), prev[:, :-1]], 1).reshape(b * t, -1)
        hidden, _ = head(tokens, hidden, pos, no_cache, None, backend)  # type: ignore[arg-type]
        logits = head.draft_logits(hidden).view(b, t, -1)
        valid = base & (i >= s)
        loss = F.cross_entropy(logits[valid], labels[valid])
        total = total + 0.8**s * loss
        accs.append((logits[valid].argmax(-1) == labels[valid]).float().mean().item())
    return total, accs


def save_head(head: Eagle3Head, cfg: dict, out: Path, dtype: torch.dtype, vocab: int) -> None:
    out.mkdir(parents=True, exist_ok=True)
    # Checkpoint (HF) names: the merged qkv / gate-up parameters as their HF parts.
    tensors = {n: p.detach().to(dtype).contiguous() for n, p in hf_named_tensors(head).items()}
    d2t_ids = head.draft_to_target
    tensors["d2t"] = (d2t_ids - torch.arange(d2t_ids.numel())).to(torch.int64)
    t2d = torch.zeros(vocab, dtype=torch.bool)
    t2d[d2t_ids] = True
    tensors["t2d"] = t2d
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text(json.dumps(cfg, indent=2) + "\n")


def evaluate(out: Path, n: int) -> None:
    from specengine import SamplingParams, SpecEngine

    engine = SpecEngine(TARGET, draft=str(out), device="cpu", max_batch_size=n)
    prompts = task.heldout_prompts(n)
    params = SamplingParams(temperature=0.0, max_tokens=64)
    base = engine.generate(prompts, k=0, sampling=params)
    for k in (1, 3, 5):
        outs = engine.generate(prompts, k=k, sampling=params)
        same = sum(o.token_ids == b.token_ids for o, b in zip(outs, base))
        st = engine.stats
        rates = ", ".join(f"{r:.2f}" for r in st.acceptance_rate_per_position)
        print(f"held-out k={k}: mean accepted length {st.mean_accepted_length:.2f}, acceptance "
              f"per position [{rates}], identical to k=0: {same}/{n}")


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    random.seed(args.seed)
    target = AutoModelForCausalLM.from_pretrained(str(TARGET), dtype=torch.float32).eval()
    target.requires_grad_(False)
    tcfg = json.loads((TARGET / "config.json").read_text())
    cfg = head_config(tcfg, args)
    mc = ModelConfig.from_dict({**cfg, "architectures": ["LlamaForCausalLM"]})
    vocab = tcfg["vocab_size"]
    head = Eagle3Head(mc, cfg["draft_vocab_size"], target.model.embed_tokens)
    kept = torch.tensor([t for t in range(vocab) if t not in DROPPED])
    head.draft_to_target.copy_(kept)
    t2d = torch.full((vocab,), -1, dtype=torch.long)
    t2d[kept] = torch.arange(kept.numel())
    print(f"head params: {sum(p.numel() for p in head.parameters()):,}")
    opt = torch.optim.AdamW(head.parameters(), lr=args.lr, weight_decay=0.0)
    stream = task.training_problems(args.data_seed)
    start = time.time()
    for step in range(args.steps):
        frac = max(0, step - args.warmup) / max(1, args.steps - args.warmup)
        lr = args.lr * min(1.0, (step + 1) / max(1, args.warmup)) * (0.05 + 0.95 * 0.5 * (
            1 + math.cos(math.pi * frac)))
        for g in opt.param_groups:
            g["lr"] = lr
        ids, lens, plens = make_batch(stream, args.batch)
        feats, greedy = target_pass(target, ids)
        loss, accs = ttt_loss(head, ids, lens, plens, feats, greedy, args.ttt_steps, t2d)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
        opt.step()
        if step % 50 == 0 or step == args.steps - 1:
            acc = " ".join(f"{a:.3f}" for a in accs)
            print(f"step {step:4d}  loss {loss.item():.4f}  top-1 per unrolled step [{acc}]  "
                  f"{time.time() - start:.0f}s", flush=True)
    save_head(head, cfg, args.out, getattr(torch, args.dtype), vocab)
    size = sum(f.stat().st_size for f in args.out.iterdir())
    print(f"saved {args.out} ({size / 1024:.0f} KB) after {time.time() - start:.0f}s")
    evaluate(args.out, args.eval_n)


if __name__ == "__main__":
    main()
