"""Engines for the host-overhead benchmark: the bundled pair, or dummy-weight targets with
random EAGLE-3 heads.

A dummy target is a ``config.json`` only (the engine fills it with random weights under
``load_format="dummy"``): either a named 8B shape (``bench_generate.SHAPES``) or a small Qwen3
with a given number of layers and hidden size. The EAGLE-3 head needs real files (the drafter
has no dummy format): its parameter names and shapes are taken from
``specengine.drafters.eagle3.Eagle3Head`` built on the meta device, filled with random values
and written as safetensors next to the target.
"""

from __future__ import annotations

import argparse
import inspect
import json
from pathlib import Path

import torch


def small_target_config(layers: int, hidden: int, vocab: int) -> dict:
    """A Qwen3 config with ``layers`` decoder layers of width ``hidden`` (head_dim 32 below
    512, else 64; 4 query heads per KV head)."""
    head_dim = 32 if hidden < 512 else 64
    heads = max(1, hidden // head_dim)
    return dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=hidden,
                intermediate_size=3 * hidden, num_hidden_layers=layers,
                num_attention_heads=heads, num_key_value_heads=max(1, heads // 4),
                head_dim=head_dim, vocab_size=vocab, rms_norm_eps=1e-6, rope_theta=10000.0,
                max_position_embeddings=4096, tie_word_embeddings=False, eos_token_id=0)


def write_target(root: Path, config: dict) -> Path:
    """``root/target/config.json`` (weights come from ``load_format="dummy"``)."""
    path = root / "target"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    return path


def write_eagle3_head(root: Path, target_config: dict, seed: int = 0) -> Path:
    """``root/eagle3``: a one-layer EAGLE-3 head with random bf16 weights, shaped for the
    target (same hidden size and vocabulary, reads the inputs of three target layers)."""
    from safetensors.torch import save_file

    from specengine.drafters.eagle3 import Eagle3Head
    from specengine.model.config import ModelConfig
    from specengine.model.weight_names import hf_named_tensors

    h, vocab = target_config["hidden_size"], target_config["vocab_size"]
    n = target_config["num_hidden_layers"]
    heads = target_config["num_attention_heads"]
    cfg = dict(architectures=["LlamaForCausalLMEagle3"], model_type="llama", hidden_size=h,
               intermediate_size=target_config["intermediate_size"],
               num_attention_heads=heads,
               num_key_value_heads=target_config["num_key_value_heads"],
               head_dim=target_config.get("head_dim", h // heads), num_hidden_layers=1,
               rms_norm_eps=1e-6, rope_theta=10000.0,
               max_position_embeddings=target_config["max_position_embeddings"],
               vocab_size=vocab, draft_vocab_size=vocab, target_hidden_size=h,
               eagle_config=dict(eagle_aux_hidden_state_layer_ids=[min(2, n - 1), n // 2,
                                                                max(0, n - 3)]),
               torch_dtype="bfloat16")
    mc = ModelConfig.from_dict({**cfg, "architectures": ["LlamaForCausalLM"]})
    with torch.device("meta"):
        head = Eagle3Head(mc, vocab, torch.nn.Embedding(vocab, h))
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for name, p in hf_named_tensors(head).items():  # checkpoint names (q_proj, not qkv_proj)
        if name.endswith("norm.weight"):
            tensors[name] = torch.ones(p.shape, dtype=torch.bfloat16)
        else:
            tensors[name] = (torch.randn(p.shape, generator=gen) * 0.02).to(torch.bfloat16)
    path = root / "eagle3"
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file(tensors, str(path / "model.safetensors"))
    return path


def graphs_supported() -> bool:
    """Whether this engine takes ``cuda_graphs=`` (the benchmark then runs both settings)."""
    from specengine import SpecEngine

    return "cuda_graphs" in inspect.signature(SpecEngine.__init__).parameters


def build_engine(args: argparse.Namespace, backend: str, graphs: bool | None, root: Path):
    """The engine of one benchmark setting: the bundled pair, or a dummy-weight target (small or
    8B-shaped, written under ``root`` once) with a random EAGLE-3 head."""
    from specengine import SpecEngine
    from specengine.cli import DEFAULT_DRAFT, DEFAULT_TARGET

    kw: dict = dict(device=args.device, kernel_backend=backend,
                    max_batch_size=max(args.batches))
    if graphs is not None:
        kw["cuda_graphs"] = graphs
    if args.model == "bundled":
        return SpecEngine(DEFAULT_TARGET, draft=str(DEFAULT_DRAFT), **kw)
    if args.model == "dummy":
        cfg = small_target_config(args.layers, args.hidden, args.vocab)
    else:
        from bench_generate import SHAPES

        cfg = dict(SHAPES[args.model])
    target = root / "target"
    if not target.exists():
        write_target(root, cfg)
        write_eagle3_head(root, cfg)
    max_len = args.prompt_len + args.max_new + 16
    return SpecEngine(target, draft=str(root / "eagle3"), load_format="dummy",
                      dtype=args.dtype, max_model_len=max_len,
                      kv_cache_tokens=max(args.batches) * (max_len + 16), **kw)


def prompts_for(engine, args: argparse.Namespace, batch: int) -> list:
    """``batch`` prompts: held-out task prompts (bundled), else random ids of --prompt-len."""
    if args.model == "bundled":
        from specengine.arith_task import heldout_prompts

        return heldout_prompts(batch, seed=7)
    g = torch.Generator().manual_seed(batch)
    vocab = engine.model_config.vocab_size
    return torch.randint(1, vocab, (batch, args.prompt_len), generator=g).tolist()
