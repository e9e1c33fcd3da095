"""The memory plan (``specengine.core.memory_plan``) and the KV cache sized from it on CUDA:
the figures against a hand computation for Qwen3-8B + an EAGLE-3 head on an 80 GiB card, the
plan printed by ``scripts/plan_memory.py``, the CUDA sizing (``torch.cuda.mem_get_info``
stubbed), the CPU rule unchanged, ``gpu_memory_utilization`` checked, and the one shared
draft-probability buffer of the verify pass."""

from __future__ import annotations

import importlib.util
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch

from specengine import SpecEngine
from specengine.config import EngineConfig
from specengine.core.kv_cache import CPU_KV_BUDGET_BYTES, num_kv_blocks
from specengine.core.memory_plan import (
    GIB,
    DrafterFacts,
    MemoryPlan,
    activation_bytes_with,
    kv_budget_bytes,
    largest_shape,
    max_graph_bytes,
    measure_peak_bytes,
    measured_activation_peak,
    model_params,
    plan_memory,
    verify_k_max,
)
from specengine.model.config import ModelConfig

ROOT = Path(__file__).resolve().parents[1]
V, VD, H, LAYERS, HEADS, KV_HEADS, HEAD_DIM, INTER = 151_936, 32_000, 4096, 36, 32, 8, 128, 12288
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", "vocab_size": V,
    "hidden_size": H, "intermediate_size": INTER, "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS, "head_dim": HEAD_DIM,
    "rms_norm_eps": 1e-6, "rope_theta": 1_000_000, "max_position_embeddings": 40960,
    "tie_word_embeddings": False, "hidden_act": "silu",
}
EAGLE3_HEAD = {
    "architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "vocab_size": V,
    "draft_vocab_size": VD, "hidden_size": H, "intermediate_size": INTER,
    "num_hidden_layers": 1, "num_attention_heads": HEADS, "num_key_value_heads": KV_HEADS,
    "head_dim": HEAD_DIM, "rms_norm_eps": 1e-6, "rope_theta": 1_000_000,
    "max_position_embeddings": 40960, "hidden_act": "silu",
}


def write_config(path: Path, cfg: dict) -> Path:
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(cfg))
    return path


@pytest.fixture
def pair(tmp_path: Path) -> tuple[Path, Path]:
    return write_config(tmp_path / "qwen3-8b", QWEN3_8B), write_config(tmp_path / "eagle3",
                                                                       EAGLE3_HEAD)


def config_8b(model: Path, draft: Path, **kw: object) -> EngineConfig:
    args: dict = dict(model=str(model), draft=str(draft), device="cuda", dtype="bfloat16",
                      kernel_backend="triton", cuda_graphs=True, graph_buckets=BUCKETS,
                      max_model_len=40960, max_batch_size=256,
                      draft_options=(("sample", True),))
    return EngineConfig(**{**args, **kw})


def plan_8b(model: Path, draft: Path, **kw: object) -> MemoryPlan:
    cfg = config_8b(model, draft, **kw)
    target = ModelConfig.from_dir(model)
    return plan_memory(target, cfg, 80 * GIB, DrafterFacts.from_draft(cfg.draft, target, 2),
                       k_max=8)


def test_qwen3_8b_eagle3_on_an_80gb_card(pair: tuple[Path, Path]) -> None:
    plan = plan_8b(*pair)
    e = 2  # bf16
    # Target weights: embeddings and an untied LM head; per layer q/k/v/o, gate/up/down, two
    # RMSNorms and Qwen3's q/k norms; the final norm.
    layer = H * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * H + 3 * H * INTER \
        + 2 * H + 2 * HEAD_DIM
    assert layer == 192_946_432
    target_params = 2 * V * H + LAYERS * layer + H
    assert target_params == 8_190_735_360  # Qwen3-8B's 8.19B
    assert plan.target_weight_bytes == e * target_params
    # The head: fc 3H->H, q/k/v from 2H, o, the MLP, three norms (input, hidden, post-attn),
    # the final norm, an LM head over the draft vocabulary; d2t int64 per draft id, the inverse
    # map (t2d as columns) int32 per target id.
    head = 3 * H * H + 2 * H * (HEADS + 2 * KV_HEADS) * HEAD_DIM + HEADS * HEAD_DIM * H \
        + 3 * H * INTER + 3 * H + H + H * VD
    assert plan.draft_weight_bytes == e * head + 8 * VD + 4 * V
    # KV per token: 2 (K, V) x layers x kv_heads x head_dim x 2 bytes; the head's one layer.
    assert plan.kv_bytes_per_token == 2 * LAYERS * KV_HEADS * HEAD_DIM * e \
        + 2 * 1 * KV_HEADS * HEAD_DIM * e == 151_552
    # Static buffers: one [256, 8, VD] float32 probability buffer for every sampled shape (8
    # columns: the largest k the engine verifies, DEFAULT_K_MAX; 16 would be twice that),
    # over the head's 32,000-id draft vocabulary (the target's 151,936 took 1.16 GiB);
    # hidden + 3 aux [256 * 9, H] bf16 that every verify graph writes as views; per verify
    # graph (bucket b, N = 1 .. 9 fed) packed [b, 3N+1] float64 and the sampler's outputs
    # (as much again).
    assert plan.draft_probs_bytes == 256 * 8 * VD * 4 == 262_144_000  # 0.244 GiB
    assert plan.shared_output_bytes == 256 * 9 * H * e * 4 == 75_497_472  # 0.070 GiB
    assert plan.graph_output_bytes == sum(2 * 8 * b * (3 * n + 1)
                                          for b in BUCKETS for n in range(1, 10))
    # (Each graph owning its hidden + aux outputs, as before, took 0.70 GiB.)
    assert sum(b * n * H * e * 4 for b in BUCKETS for n in range(1, 10)) == 753_500_160
    max_blocks = -(-(40960 + 64) // 16)
    assert plan.fixed_buffer_bytes == 256 * 63 * 8 + 256 * (8 * 8 + 4 * max_blocks + 2 * 4) \
        + 257 * H * e
    assert plan.num_graphs == len(BUCKETS) * (9 + 9 + 8)  # verify, catch-up, draft loop
    # Activations: a token at a layer's peak holds 2H + 3I plus the returned (1 + 3) H; the
    # prefill chunk of 16384 then runs the head (5H + 3I) while the 4H are held; plus the
    # last 256 tokens' logits (bf16 + float32). Verify: 256 x 9 tokens and their bf16
    # logits. Eager and graph pools each reach their peak.
    per_token = e * (2 * H + 3 * INTER + 4 * H)
    prefill = 16384 * (e * 4 * H + e * (5 * H + 3 * INTER)) + 256 * V * (e + 4)
    # + the search scratch (64 KiB per row), the tiles' statistics (75 tiles of 2,048 tokens
    # per row, a float32 and two int64 each) and the split partials' bound (2 x 192 SMs x
    # 312 B: pass 1's 5 float32 + 2 int32, the search's 34 int64 + 3 float32)
    verify = 256 * 9 * per_token + 256 * 9 * V * e + 256 * 9 * 64 * 1024 \
        + 256 * 9 * 75 * 20 + 2 * 192 * 312
    assert (plan.prefill_activation_bytes, plan.verify_activation_bytes) == (prefill, verify)
    assert plan.activation_bytes == prefill + verify
    # The KV cache: what is left of 0.9 x 80 GiB, in whole 16-token blocks.
    left = int(0.9 * 80 * GIB) - plan.weight_bytes - plan.activation_bytes - plan.static_bytes
    assert plan.kv_tokens == left // 151_552 // 16 * 16
    assert plan.kv_cache_bytes == plan.kv_tokens * 151_552
    # The bounds: graphs and static buffers <= 4 GB, KV cache >= 50 GB.
    assert plan.static_bytes <= 4e9
    assert plan.kv_cache_bytes >= 50e9
    assert plan.used_bytes <= plan.budget_bytes < plan.used_bytes + 16 * 151_552
    # The graph budget's bytes: activations (a capture's warm-up and the graphs' pool) plus
    # the graphs and static buffers.
    # the graphs and static buffers, and the budget's remainder (under one KV block at 8B).
    assert 0 <= plan.unused_bytes < 16 * 151_552
    assert plan.graph_budget_bytes == prefill + verify + plan.draft_probs_bytes \
        + plan.shared_output_bytes + plan.graph_output_bytes + plan.fixed_buffer_bytes \
        + plan.budget_bytes - plan.used_bytes


def test_the_plan_and_the_engine_agree_on_k_max(pair: tuple[Path, Path]) -> None:
    # Unless told otherwise the plan counts shapes and probability columns up to the k the
    # engine verifies: DEFAULT_K_MAX, or the largest captured k when that is larger.
    assert verify_k_max(config_8b(*pair)) == 8
    assert verify_k_max(config_8b(*pair, capture_ks=(0, 1))) == 8
    assert verify_k_max(config_8b(*pair, capture_ks=(0, 12))) == 12
    target = ModelConfig.from_dir(pair[0])
    for ks, width in ((None, 8), ((0, 2), 8), ((3, 12), 12)):
        cfg = config_8b(*pair, capture_ks=ks)
        plan = plan_memory(target, cfg, 80 * GIB, DrafterFacts.from_draft(cfg.draft, target, 2))
        assert plan.draft_probs_bytes == 256 * width * VD * 4
        assert plan == plan_memory(target, cfg, 80 * GIB,
                                   DrafterFacts.from_draft(cfg.draft, target, 2), k_max=width)


def test_the_graph_budget_bytes(pair: tuple[Path, Path], monkeypatch: pytest.MonkeyPatch) -> None:
    total = 80 * GIB
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total // 2, total))
    cfg = config_8b(*pair)
    target = ModelConfig.from_dir(pair[0])
    plan = plan_memory(target, cfg, total, DrafterFacts.from_draft(cfg.draft, target, 2))
    cuda = torch.device("cuda")
    assert max_graph_bytes(cfg, target, cuda) == plan.graph_budget_bytes > 3 * GIB
    assert max_graph_bytes(replace(cfg, max_graph_bytes=5), target, cuda) == 5
    assert max_graph_bytes(replace(cfg, max_graph_bytes=0), target, cuda) == 0
    assert max_graph_bytes(cfg, target, torch.device("cpu")) is None  # nothing reserved there
    assert max_graph_bytes(replace(cfg, max_graph_bytes=7), target, torch.device("cpu")) == 7


def test_sharing_is_what_keeps_static_buffers_small(pair: tuple[Path, Path]) -> None:
    # Per (bucket, k) probability buffers (draft loop + verify pass, as before) would be
    # 2 x sum(b) x sum(k) x V x 4 bytes: ~22 GB, more than the whole plan's static part.
    per_shape = 2 * sum(BUCKETS) * sum(range(1, 9)) * V * 4
    assert per_shape > 5 * plan_8b(*pair).static_bytes
    greedy = plan_8b(*pair, draft_options=(("sample", False),))
    assert greedy.draft_probs_bytes == 0
    # An EAGLE-3 head samples unless told not to (Eagle3Drafter's default): so does its plan.
    assert plan_8b(*pair, draft_options=()) == plan_8b(*pair)
    assert greedy.kv_tokens > plan_8b(*pair).kv_tokens
    eager = plan_8b(*pair, cuda_graphs=False)
    assert eager.num_graphs == eager.graph_output_bytes == eager.shared_output_bytes == 0
    assert eager.activation_bytes == eager.prefill_activation_bytes


def test_the_command_prints_the_plan(pair: tuple[Path, Path],
                                     capsys: pytest.CaptureFixture[str]) -> None:
    spec = importlib.util.spec_from_file_location("plan_memory", ROOT / "scripts/plan_memory.py")
    script = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(script)  # type: ignore[union-attr]
    model, draft = pair
    assert script.main(["--model", str(model), "--draft", str(draft), "--gpu-memory-gb", "80",
                        "--k-max", "8", "--sample"]) == 0
    out = capsys.readouterr().out
    plan = plan_8b(model, draft)
    kv = [line for line in out.splitlines() if line.startswith("KV cache")]
    assert len(kv) == 1
    assert f"{plan.kv_tokens:,} tokens x 151,552 B" in kv[0]
    assert f"{plan.kv_cache_bytes / GIB:.3f} GiB" in kv[0]
    assert out == plan.format() + "\n"
    # Without --k-max the script plans the engine's own largest k (8 by default), not 16.
    assert script.main(["--model", str(model), "--draft", str(draft), "--gpu-memory-gb", "80",
                        "--sample"]) == 0
    assert capsys.readouterr().out == out


def test_model_params_count_the_modules() -> None:
    from specengine.drafters.eagle3 import Eagle3Head
    from specengine.model.llama import CausalLM

    small = {**QWEN3_8B, "vocab_size": 320, "hidden_size": 64, "intermediate_size": 96,
             "num_hidden_layers": 3, "num_attention_heads": 4, "num_key_value_heads": 2,
             "head_dim": 16}
    for extra in ({}, {"tie_word_embeddings": True},
                  {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2"},
                  {"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                   "attention_bias": True, "mlp_bias": True}):
        cfg = ModelConfig.from_dict({**small, **extra})
        with torch.device("meta"):
            model = CausalLM(cfg)
        assert model_params(cfg) == sum(p.numel() for p in model.parameters()), extra
    head_cfg = ModelConfig.from_dict({**small, "architectures": ["LlamaForCausalLM"],
                                      "model_type": "llama", "num_hidden_layers": 1})
    with torch.device("meta"):
        head = Eagle3Head(head_cfg, 100, torch.nn.Embedding(320, 64))
    facts = DrafterFacts.eagle3(head_cfg, 100, 2)
    assert facts.weight_params == sum(p.numel() for p in head.parameters())
    assert facts.extra_weight_bytes == head.draft_to_target.numel() * 8 \
        + head.target_to_draft.numel() * 4
    assert facts.draft_vocab_size == 100  # its distributions' width
    assert DrafterFacts.eagle3(head_cfg, 320, 2).draft_vocab_size == 0  # the target's


def test_drafter_facts_from_the_draft_argument(pair: tuple[Path, Path],
                                               tiny_checkpoint: Path) -> None:
    model, draft = pair
    target = ModelConfig.from_dir(model)
    assert DrafterFacts.from_draft(None, target, 2) is None
    for host in ("ngram", "suffix"):
        assert DrafterFacts.from_draft(host, target, 2) == DrafterFacts.host()
    assert DrafterFacts.from_draft(str(draft), target, 2).kind == "eagle3"
    assert DrafterFacts.from_draft((str(draft), "suffix"), target, 2).kind == "eagle3"
    assert DrafterFacts.from_draft("mtp", target, 2).kind == "mtp"
    lm = DrafterFacts.from_draft(str(tiny_checkpoint), target, 2)
    small = ModelConfig.from_dir(tiny_checkpoint)
    assert (lm.kind, lm.weight_params) == ("lm", model_params(small))
    # No drafter: one token per row, no draft loop or catch-up graphs.
    plain = plan_memory(target, config_8b(model, draft), 80 * GIB, None, k_max=8)
    assert plain.num_graphs == len(BUCKETS)
    assert plain.draft_probs_bytes == 0


@pytest.mark.parametrize("bad", [{"kind": "tree"}, {"weight_params": -1},
                                 {"num_aux": 1.5}])
def test_drafter_facts_refuse_bad_values(bad: dict) -> None:
    with pytest.raises(ValueError, match="kind|weight_params|num_aux"):
        replace(DrafterFacts.host(), **bad)


def test_memory_plan_checks(pair: tuple[Path, Path]) -> None:
    plan = plan_8b(*pair)
    with pytest.raises(ValueError, match="gpu_memory_utilization"):
        replace(plan, gpu_memory_utilization=1.5)
    with pytest.raises(ValueError, match="draft_probs_bytes must be >= 0"):
        replace(plan, draft_probs_bytes=-1)
    with pytest.raises(ValueError, match="kv_tokens \\* kv_bytes_per_token"):
        replace(plan, kv_tokens=plan.kv_tokens + 1)
    target = ModelConfig.from_dir(pair[0])
    for k_max in (0, 17):
        with pytest.raises(ValueError, match="k_max"):
            plan_memory(target, config_8b(*pair), 80 * GIB, None, k_max=k_max)


def test_a_small_card_leaves_no_kv_cache(pair: tuple[Path, Path]) -> None:
    cfg = config_8b(*pair)
    target = ModelConfig.from_dir(pair[0])
    plan = plan_memory(target, cfg, 16 * GIB, DrafterFacts.from_draft(cfg.draft, target, 2))
    assert plan.kv_tokens == plan.kv_cache_bytes == 0


# ---- sizing the cache -----------------------------------------------------------------------
def test_cuda_sizing_follows_the_plan(pair: tuple[Path, Path],
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    # On CUDA the plan's activations and static buffers come first, the weights are measured
    # (in use already); the drafter's cache, sized first, and the target's get equal tokens.
    total, weights = 80 * GIB, 17 * 10**9
    state = {"free": total - weights}
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (state["free"], total))
    cfg = config_8b(*pair, max_num_batched_tokens=8192)
    target = ModelConfig.from_dir(pair[0])
    cuda = torch.device("cuda")
    plan = plan_memory(target, cfg, total, DrafterFacts.from_draft(cfg.draft, target, 2))
    draft_bpt = 2 * KV_HEADS * HEAD_DIM * 2
    blocks = num_kv_blocks(cfg, target, cuda, extra_bytes_per_token=draft_bpt)
    left = int(0.9 * total) - weights - plan.activation_bytes - plan.static_bytes
    assert blocks == left // 151_552 // 16
    state["free"] -= blocks * 16 * draft_bpt  # the drafter's cache is allocated
    assert num_kv_blocks(cfg, target, cuda) == blocks
    # Less of the card: less cache, by exactly the share taken away.
    state["free"] += blocks * 16 * draft_bpt
    half = num_kv_blocks(replace(cfg, gpu_memory_utilization=0.5), target, cuda,
                         extra_bytes_per_token=draft_bpt)
    assert half == (left - int(0.9 * total) + int(0.5 * total)) // 151_552 // 16
    # kv_cache_tokens still overrides.
    assert num_kv_blocks(replace(cfg, kv_cache_tokens=4096), target, cuda) == 256


# ---- the largest-shape dry run (CUDA) and the sizing around its measurement ----------------
def test_the_sizing_arithmetic_with_given_numbers(pair: tuple[Path, Path]) -> None:
    # KV budget = utilisation x card - in use - activations - static buffers, never < 0.
    assert kv_budget_bytes(80 * GIB, 0.9, 17 * 10**9, 5 * GIB, GIB) == \
        int(0.9 * 80 * GIB) - 17 * 10**9 - 6 * GIB == 53_866_960_384
    assert kv_budget_bytes(80 * GIB, 0.5, 30 * GIB, 9 * GIB, 2 * GIB) == 0
    # The measured peak replaces the plan's eager activations when larger; the plan is the
    # floor (the drafter's pass over the chunk is planned, not measured); the graphs' pool
    # stays as planned.
    plan = plan_8b(*pair)
    eager = max(plan.prefill_activation_bytes, plan.verify_activation_bytes)
    pool = plan.activation_bytes - eager
    assert pool == plan.verify_activation_bytes  # graphs on: one pool at the verify peak
    assert activation_bytes_with(plan, None) == plan.activation_bytes
    assert activation_bytes_with(plan, eager + 3 * GIB) == plan.activation_bytes + 3 * GIB
    assert activation_bytes_with(plan, eager // 2) == plan.activation_bytes
    # The shape the dry run feeds: the 16,384-token chunk, and the full verify pass's
    # 256 x 9 logits rows (its tokens are fewer than the chunk's).
    cfg = config_8b(*pair)
    assert largest_shape(cfg, True) == (16384, 256 * 9)
    assert largest_shape(replace(cfg, max_num_batched_tokens=2048), True) == (2304, 2304)
    assert largest_shape(cfg, False) == (16384, 256)


def test_cuda_sizing_uses_the_measured_peak(pair: tuple[Path, Path],
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    total, weights = 80 * GIB, 17 * 10**9
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (total - weights, total))
    cfg = config_8b(*pair, max_num_batched_tokens=8192)
    target = ModelConfig.from_dir(pair[0])
    cuda = torch.device("cuda")
    plan = plan_memory(target, cfg, total, DrafterFacts.from_draft(cfg.draft, target, 2))
    planned = num_kv_blocks(cfg, target, cuda)
    assert num_kv_blocks(cfg, target, cuda, measured_peak=1) == planned  # below the plan
    peak = max(plan.prefill_activation_bytes, plan.verify_activation_bytes) + 2 * GIB
    measured = num_kv_blocks(cfg, target, cuda, measured_peak=peak)
    left = int(0.9 * total) - weights - (plan.activation_bytes + 2 * GIB) - plan.static_bytes
    target_bpt = 2 * LAYERS * KV_HEADS * HEAD_DIM * 2  # the target's cache alone here
    assert measured == left // target_bpt // 16 < planned
    # 2 GiB more activations: 2 GiB less cache, to the block.
    assert (planned - measured) * 16 * target_bpt == pytest.approx(2 * GIB, abs=16 * target_bpt)


def test_the_dry_run_is_cuda_only_and_only_for_utilisation_sizing(
        tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import specengine.engine as engine_module

    cfg = EngineConfig(model=str(tiny_checkpoint), device="cpu")
    assert measured_activation_peak(cfg, None, torch.device("cpu")) is None  # type: ignore
    cuda_cfg = replace(cfg, device="cuda", kv_cache_tokens=4096, kernel_backend="triton")
    assert measured_activation_peak(cuda_cfg, None, torch.device("cuda")) is None  # type: ignore
    # The engine hands what it measured to both caches' sizing (on the CPU: nothing).
    seen = []
    real = engine_module.num_kv_blocks
    monkeypatch.setattr(engine_module, "num_kv_blocks",
                        lambda *a, **kw: seen.append(kw.get("measured_peak")) or real(*a, **kw))
    engine = SpecEngine(tiny_checkpoint, str(tiny_checkpoint), device="cpu", dtype="float32",
                        max_model_len=64, max_batch_size=2)
    assert seen == [None] and engine.draft_context.measured_peak is None
    monkeypatch.setattr(engine_module, "measured_activation_peak", lambda *a: 12345)
    seen.clear()
    engine = SpecEngine(tiny_checkpoint, str(tiny_checkpoint), device="cpu", dtype="float32",
                        max_model_len=64, max_batch_size=2)
    assert seen == [12345] and engine.draft_context.measured_peak == 12345


def test_cpu_engine_sizes_its_cache_as_before(tiny_checkpoint: Path) -> None:
    engine = SpecEngine(tiny_checkpoint, device="cpu", dtype="float32", max_model_len=512,
                        max_batch_size=8)
    mc = engine.model_config
    bpt = 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4
    wanted = 8 * (512 + 16 + 1)  # max_batch_size full sequences + the longest chain
    assert engine.kv_cache.num_blocks == min(wanted, CPU_KV_BUDGET_BYTES // bpt) // 16
    big = replace(engine.config, max_batch_size=4096, max_model_len=4096)
    assert num_kv_blocks(big, mc, torch.device("cpu")) == CPU_KV_BUDGET_BYTES // bpt // 16
    # gpu_memory_utilization does not touch the CPU rule.
    assert num_kv_blocks(replace(big, gpu_memory_utilization=0.1), mc,
                         torch.device("cpu")) == CPU_KV_BUDGET_BYTES // bpt // 16


@pytest.mark.parametrize("bad", [0, 0.0, -0.5, 1.01, 2, True, "0.9", float("nan")])
def test_gpu_memory_utilization_outside_0_1_is_refused(bad: object,
                                                       tiny_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"gpu_memory_utilization must be a fraction in "
                                         r"\(0, 1\]"):
        EngineConfig(model="m", gpu_memory_utilization=bad)  # type: ignore[arg-type]
    if bad == 1.01:  # the engine's keyword reaches the check before any weight is read
        with pytest.raises(ValueError, match="gpu_memory_utilization"):
            SpecEngine(tiny_checkpoint, device="cpu", gpu_memory_utilization=bad)


def test_gpu_memory_utilization_in_range_is_kept() -> None:
    assert EngineConfig(model="m", gpu_memory_utilization=1).gpu_memory_utilization == 1
    assert EngineConfig(model="m").gpu_memory_utilization == 0.9


def test_measuring_needs_cuda() -> None:
    with pytest.raises(ValueError, match="CUDA"):
        measure_peak_bytes(lambda: None, torch.device("cpu"))


# ---- the shared draft-probability buffer ----------------------------------------------------
def test_one_probability_buffer_for_every_shape(tiny_checkpoint: Path) -> None:
    engine = SpecEngine(tiny_checkpoint, device="cpu", dtype="float32", cuda_graphs=True,
                        graph_buckets=(1, 2, 4, 8), max_model_len=96, kv_cache_tokens=4096,
                        max_batch_size=8)
    verifier = engine.graphs.verifier
    assert verifier.max_prob_drafts == verify_k_max(engine.config) == 8  # not MAX_K (16)
    small, large = verifier.probs_view(2, 3), verifier.probs_view(8, 8)
    assert small is verifier.probs_view(2, 3)  # made once: a captured graph's address
    # Draft j of row r has one address in every shape: a loop of 3 drafts writes where the
    # verify pass of k = 5 reads.
    assert small[1, 2].data_ptr() == large[1, 2].data_ptr() == verifier.probs_view(4, 5)[1, 2] \
        .data_ptr()
    assert small.untyped_storage().data_ptr() == large.untyped_storage().data_ptr()
    assert large.untyped_storage().nbytes() == 8 * 8 * engine.model_config.vocab_size * 4
    # Shapes past it get their own (more rows than the batch holds, more drafts).
    for rows, drafts in ((9, 2), (2, 9), (8, 16)):
        own = verifier.probs_view(rows, drafts)
        assert own.shape == (rows, drafts, engine.model_config.vocab_size)
        assert own.untyped_storage().data_ptr() != large.untyped_storage().data_ptr()


def test_sampled_drafts_write_the_verify_buffer_in_place(tiny_checkpoint: Path) -> None:
    from specengine import SamplingParams

    engine = SpecEngine(tiny_checkpoint, str(tiny_checkpoint), device="cpu", dtype="float32",
                        cuda_graphs=True, graph_buckets=(1, 2, 4, 8), max_model_len=96,
                        kv_cache_tokens=4096, max_batch_size=8, draft_options={"sample": True})
    verifier = engine.graphs.verifier
    copies = []
    real = torch.Tensor.copy_

    def spy(dst: torch.Tensor, src: torch.Tensor, *a: object, **kw: object) -> torch.Tensor:
        if verifier._probs_all is not None and \
                dst.untyped_storage().data_ptr() == verifier._probs_all.untyped_storage() \
                .data_ptr():
            copies.append(tuple(dst.shape))
        return real(dst, src, *a, **kw)

    prompts = [[5, 9, 2, 7], [1, 2, 3], [8] * 11]
    params = SamplingParams(temperature=1.0, max_tokens=9, seed=3)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(torch.Tensor, "copy_", spy)
        engine.generate(prompts, k=3, sampling=params)
    assert engine.graphs.num_runs["lm-draft"] > 0
    assert copies == []  # the draft loop wrote the distributions where the pass reads them
    shared = {v.untyped_storage().data_ptr() for v in verifier._probs.values()}
    assert shared == {verifier._probs_all.untyped_storage().data_ptr()}


def test_the_buffer_is_as_wide_as_the_largest_captured_k(tiny_checkpoint: Path) -> None:
    engine = SpecEngine(tiny_checkpoint, device="cpu", dtype="float32", cuda_graphs=True,
                        graph_buckets=(1, 2), max_model_len=96, kv_cache_tokens=1024,
                        max_batch_size=2, capture_ks=(1, 11))
    verifier = engine.graphs.verifier
    assert verifier.max_prob_drafts == 11
    view = verifier.probs_view(2, 11)
    assert view.untyped_storage().nbytes() == 2 * 11 * engine.model_config.vocab_size * 4


def test_a_k_past_the_buffer_still_equals_eager(tiny_checkpoint: Path) -> None:
    """k = 10 > the 8 columns: the draft loop and the verify pass share a buffer of their own."""
    from test_static_path import both_paths

    from specengine import SamplingParams

    params = [SamplingParams(temperature=1.0, max_tokens=14 + 3 * i, seed=5 + i)
              for i in range(3)]
    static = both_paths(tiny_checkpoint, str(tiny_checkpoint), [[5, 9, 2, 7], [1, 2, 3], [8] * 11],
                        10, params, draft_options={"sample": True}, max_model_len=96,
                        kv_cache_tokens=4096, max_batch_size=4, replay=True,
                        static_passes=("verify", "lm-draft"))[1]
    verifier = static.graphs.verifier
    assert verifier.max_prob_drafts == 8
    wide = [key for key in verifier._probs if key[1] == 10]
    assert wide and all(verifier._probs[key].untyped_storage().data_ptr()
                        != verifier._probs_all.untyped_storage().data_ptr() for key in wide)


def test_a_small_model_may_capture_into_what_the_plan_leaves_unused() -> None:
    """The bundled pair on an 80 GiB card: its KV cache stops at max_batch_size full sequences,
    so nearly all of the budget is unused, and the graph budget includes it. Before, the budget
    was the planned activations and buffers alone (tens of MB), less than two captures
    reserved on an H200, and every shape after the startup's first ran eagerly."""
    from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

    cfg = EngineConfig(model=str(DEFAULT_TARGET), draft=str(DEFAULT_DRAFT), device="cuda",
                       dtype="bfloat16", cuda_graphs=True, graph_buckets=BUCKETS,
                       max_batch_size=256)
    target = ModelConfig.from_dir(DEFAULT_TARGET)
    plan = plan_memory(target, cfg, 80 * GIB, DrafterFacts.from_draft(cfg.draft, target, 2))
    assert plan.kv_tokens == cfg.max_batch_size * (cfg.max_model_len + 17) // 16 * 16
    assert plan.activation_bytes + plan.static_bytes < 1 * GIB  # what the budget was
    assert plan.unused_bytes == plan.budget_bytes - plan.used_bytes > 60 * GIB
    assert plan.graph_budget_bytes == plan.activation_bytes + plan.static_bytes \
        + plan.unused_bytes
