"""Mixture-of-experts policies (Qwen3-MoE, Qwen2-MoE, Mixtral) against transformers, and the
engine's lossless guarantees on an MoE target."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint
from lossless import assert_greedy_lossless, ragged_requests
from test_model_parity import NUM_NEW, engine_logits, prompts_for

from specengine import SamplingParams, SpecEngine
from specengine.model.config import CheckpointError, ModelConfig
from specengine.model.loader import iter_checkpoint
from specengine.model.moe import SparseMoeBlock
from specengine.weights import WeightSender

# name: (arch, overrides, shard_kb)
CASES = {
    # 5 experts, top-3, renormalised, layer 0 dense (mlp_only_layers), sharded checkpoint.
    "qwen3_moe-top3-norm": ("qwen3_moe", {}, 60),
    # 7 experts, top-1, not renormalised, decoder_sparse_step=2: only layer 1 of 3 is sparse.
    "qwen3_moe-top1-step2": ("qwen3_moe", dict(num_experts=7, num_experts_per_tok=1,
                                               norm_topk_prob=False, mlp_only_layers=[],
                                               decoder_sparse_step=2, num_layers=3), None),
    # shared expert with its sigmoid gate, q/k/v biases.
    "qwen2_moe": ("qwen2_moe", {}, None),
    # top-2 of 3, always renormalised, `block_sparse_moe.experts.*.w1/w2/w3` names, tied.
    "mixtral": ("mixtral", {}, None),
}


def _build(arch: str, overrides: dict, seed: int = 0) -> torch.nn.Module:
    overrides = dict(overrides)
    num_layers = overrides.pop("num_layers", 2)
    return make_hf_model(arch, num_layers=num_layers, seed=seed, **overrides)


@pytest.fixture(scope="module", params=list(CASES))
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, overrides, shard_kb = CASES[request.param]
    hf = _build(arch, overrides)
    path = save_checkpoint(hf, tmp_path_factory.mktemp(request.param), shard_kb)
    engine = SpecEngine(path, device="cpu", dtype="float32", block_size=16, max_model_len=256,
                        max_batch_size=8)
    return request.param, hf, engine, path


def _hf_routing(hf: torch.nn.Module, ids: list[int]) -> list[Counter]:
    """Tokens per expert in every sparse layer of ``hf`` for one prompt."""
    seen: list[Counter] = []

    def hook(module, args, out) -> None:  # type: ignore[no-untyped-def]
        seen.append(Counter(out[2].flatten().tolist()))  # (logits, scores, indices)

    handles = [m.register_forward_hook(hook) for n, m in hf.named_modules()
               if n.endswith(".gate") and hasattr(m, "top_k")]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return seen


def test_layers_are_sparse_where_transformers_says(pair) -> None:
    name, hf, engine, _ = pair
    ours = [isinstance(getattr(layer, layer.mlp_name), SparseMoeBlock)
            for layer in engine.model.model.layers]
    theirs = [type(layer.mlp).__name__.endswith("SparseMoeBlock")
              for layer in hf.model.layers]
    assert ours == theirs
    assert any(ours)
    if name == "qwen3_moe-top1-step2":
        assert ours == [False, True, False]
    if name == "qwen3_moe-top3-norm":
        assert ours == [False, True]


def test_prefill_logits_match(pair) -> None:
    name, hf, engine, _ = pair
    prompts = prompts_for(hf.config.vocab_size)
    # Routing is uneven: the 1-token prompt leaves experts without a token, and across the
    # longer prompts the busiest expert gets more than its share.
    counts = _hf_routing(hf, prompts[0])
    assert all(len(c) < hf.config.num_experts if hasattr(hf.config, "num_experts")
               else len(c) < hf.config.num_local_experts for c in counts)
    busy = _hf_routing(hf, prompts[-1])
    assert any(max(c.values()) > sum(c.values()) / len(c) for c in busy)
    for ids in prompts:
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        ours = engine_logits(engine, ids)
        scale = ref.abs().max().item()
        assert (ours - ref).abs().max().item() <= 1e-4 * scale, name


def test_greedy_generation_matches_transformers(pair) -> None:
    name, hf, engine, _ = pair
    prompts = prompts_for(hf.config.vocab_size)
    outs = engine.generate(prompts, k=0, sampling=SamplingParams(temperature=0.0,
                                                                 max_tokens=NUM_NEW))
    for ids, out in zip(prompts, outs):
        with torch.no_grad():
            gen = hf.generate(torch.tensor([ids]), attention_mask=torch.ones(1, len(ids),
                              dtype=torch.long), do_sample=False, max_new_tokens=NUM_NEW,
                              min_new_tokens=NUM_NEW, output_logits=True,
                              return_dict_in_generate=True, pad_token_id=0)
        ref_tokens = gen.sequences[0, len(ids):].tolist()
        assert list(out.token_ids) == ref_tokens, name
        ref_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                        for step, t in zip(gen.logits, ref_tokens)]
        assert out.logprobs == pytest.approx(ref_logprobs, abs=1e-4)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_state_dict_uses_hf_names_and_round_trips(pair) -> None:
    name, hf, engine, path = pair
    ours = {k: v.clone() for k, v in engine.model.state_dict().items()}
    # transformers >= 5 holds merged experts in memory; its checkpoint (and ours) names them
    # one by one, so compare against the saved keys.
    saved = dict(iter_checkpoint(path))
    tied = set(ours) - set(saved)
    assert tied <= {"lm_head.weight"}, tied
    assert set(saved) <= set(ours)
    for k, v in saved.items():
        assert torch.equal(ours[k], v), k
    # load_state_dict takes the same names: a perturbed copy goes in and comes back out.
    moe_key = next(k for k in saved if ".experts.1." in k)
    changed = {k: v.clone() for k, v in ours.items()}
    assert changed[moe_key].shape == (hf.config.hidden_size, hf.config.moe_intermediate_size) \
        if moe_key.endswith(("down_proj.weight", "w2.weight")) else True
    changed[moe_key] += 1.0
    ptrs = [p.data_ptr() for p in engine.model.parameters()]
    try:
        engine.model.load_state_dict(changed)
        assert torch.equal(engine.model.state_dict()[moe_key], changed[moe_key])
        assert [p.data_ptr() for p in engine.model.parameters()] == ptrs
    finally:
        engine.model.load_state_dict(ours)


def test_config_reads_moe_fields() -> None:
    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=32, hidden_size=16,
                intermediate_size=32, num_hidden_layers=4, num_attention_heads=2,
                num_experts=6, num_experts_per_tok=2, moe_intermediate_size=8,
                decoder_sparse_step=2, mlp_only_layers=[3], norm_topk_prob=True)
    cfg = ModelConfig.from_dict(base)
    assert (cfg.model_type, cfg.num_experts, cfg.moe_layers, cfg.qk_norm) == (
        "qwen3_moe", 6, (1,), True)
    # transformers >= 5 writes `num_local_experts` for Qwen3-MoE.
    renamed = {k: v for k, v in base.items() if k != "num_experts"} | {"num_local_experts": 6}
    assert ModelConfig.from_dict(renamed).num_experts == 6
    with pytest.raises(CheckpointError, match="num_experts_per_tok"):
        ModelConfig.from_dict(base | {"num_experts_per_tok": 7})
    with pytest.raises(CheckpointError, match="decoder_sparse_step"):
        ModelConfig.from_dict(base | {"decoder_sparse_step": 0})
    with pytest.raises(CheckpointError, match="moe_intermediate_size"):
        ModelConfig.from_dict(base | {"moe_intermediate_size": 0})
    mixtral = ModelConfig.from_dict(dict(base, architectures=["MixtralForCausalLM"],
                                         num_local_experts=4))
    with pytest.raises(CheckpointError, match="sliding_window=4096"):
        ModelConfig.from_dict(dict(base, architectures=["MixtralForCausalLM"],
                                   num_local_experts=4, sliding_window=4096,
                                   max_position_embeddings=32768))
    assert ModelConfig.from_dict(dict(base, architectures=["MixtralForCausalLM"],
                                      num_local_experts=4, sliding_window=4096,
                                      max_position_embeddings=4096)).num_experts == 4
    assert (mixtral.norm_topk_prob, mixtral.moe_layers, mixtral.moe_intermediate_size,
            mixtral.qk_norm) == (True, (0, 1, 2, 3), 32, False)


def test_tensor_parallel_moe_sizes_must_divide() -> None:
    from specengine.model.tp_layers import check_tensor_parallel

    base = dict(architectures=["Qwen2MoeForCausalLM"], vocab_size=32, hidden_size=16,
                intermediate_size=32, num_hidden_layers=2, num_attention_heads=2,
                num_experts=4, num_experts_per_tok=2, moe_intermediate_size=8,
                shared_expert_intermediate_size=12)
    check_tensor_parallel(ModelConfig.from_dict(base), 2)
    with pytest.raises(ValueError, match=r"must divide moe_intermediate_size \(9\)"):
        check_tensor_parallel(ModelConfig.from_dict(base | {"moe_intermediate_size": 9}), 2)
    with pytest.raises(ValueError, match=r"shared_expert_intermediate_size \(13\)"):
        check_tensor_parallel(ModelConfig.from_dict(
            base | {"shared_expert_intermediate_size": 13}), 2)


@pytest.fixture(scope="module")
def moe_target(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    """A Qwen3-MoE target (5 experts, top-3, layer 0 dense) for the engine-level tests."""
    hf = make_hf_model("qwen3_moe", vocab_size=48, hidden_size=32, seed=1, init_std=0.2)
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("moe_target"))


def test_ngram_speculation_equals_k0_on_moe_target(moe_target) -> None:
    _, path = moe_target
    engine = SpecEngine(path, draft="ngram", device="cpu", dtype="float32", max_model_len=128,
                        max_batch_size=16)
    prompts, params = ragged_requests(48, n=10, seed=3)
    assert_greedy_lossless(engine, prompts, params, ks=(3,), trees=("binary2",))
    assert engine.stats.num_accepted_tokens > 0


def test_triton_kernels_equal_torch_backend_on_moe_target(moe_target) -> None:
    """The engine on its kernels (the fused MoE kernel under the interpreter on CPU) gives the
    PyTorch backend's greedy tokens, with and without speculation."""
    _, path = moe_target
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3]]
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (8, 4, 6)]

    def make(backend: str) -> SpecEngine:
        return SpecEngine(path, draft="ngram", device="cpu", dtype="float32",
                          max_model_len=64, max_batch_size=4, kv_cache_tokens=512,
                          kernel_backend=backend)

    base = make("torch").generate(prompts, k=0, sampling=params)
    engine = make("triton")
    for k in (0, 3):
        outs = engine.generate(prompts, k=k, sampling=params)
        for o, b in zip(outs, base):
            assert o.token_ids == b.token_ids, k
            assert o.logprobs == pytest.approx(b.logprobs, abs=1e-4)


def test_sampled_speculation_follows_moe_policy(tmp_path: Path) -> None:
    """Chi-square on the joint law of tokens 2 and 3 (``test_sampling_lossless``) with an MoE
    target and an MoE draft model (the target with noise on every weight)."""
    from test_sampling_lossless import (
        NUM_SEQS,
        P_MIN,
        VOCAB,
        chi_square_p,
        exact_joint,
        run_joint,
    )

    hf = make_hf_model("qwen3_moe", vocab_size=VOCAB, hidden_size=32, seed=1, init_std=0.25)
    target = save_checkpoint(hf, tmp_path / "target")
    draft = make_hf_model("qwen3_moe", vocab_size=VOCAB, hidden_size=32, seed=1, init_std=0.25)
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.05)
    engine = SpecEngine(target, draft=str(save_checkpoint(draft, tmp_path / "draft")),
                        device="cpu", dtype="float32", max_model_len=32, max_batch_size=2048,
                        kv_cache_tokens=2048 * 32, seed=11, draft_options={"sample": True})
    params = SamplingParams(temperature=0.9, top_k=10, max_tokens=3)
    counts = run_joint(engine, params, NUM_SEQS, k=2)
    assert 0 < engine.stats.num_accepted_tokens < engine.stats.num_draft_tokens
    p = chi_square_p(counts, exact_joint(hf, params), NUM_SEQS)
    assert p > P_MIN, f"chi-square p = {p:.2e}"


def test_expert_update_through_weight_sync_equals_fresh_engine(moe_target,
                                                               tmp_path: Path) -> None:
    """Two experts of the sparse layer change through the real sender (shared transport); the
    engine then equals a fresh engine on a checkpoint with those weights, and no parameter
    moved."""
    hf, path = moe_target
    engine = SpecEngine(path, device="cpu", dtype="float32", max_model_len=64,
                        kv_cache_tokens=512)
    prompts = [[1, 2, 3], [7, 8, 9, 10, 11]]
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    before = [(o.token_ids, o.logprobs) for o in engine.generate(prompts, sampling=greedy)]
    ptrs = {n: p.data_ptr() for n, p in engine.model.named_parameters()}
    new = make_hf_model("qwen3_moe", vocab_size=48, hidden_size=32, seed=1, init_std=0.2)
    gen = torch.Generator().manual_seed(5)
    with torch.no_grad():
        experts = new.model.layers[1].mlp.experts
        for e in (0, 3):  # transformers >= 5 keeps them merged in memory too
            experts.gate_up_proj[e].normal_(0, 0.5, generator=gen)
            experts.down_proj[e].normal_(0, 0.5, generator=gen)
    fresh_path = save_checkpoint(new, tmp_path / "new")
    update = {n: t for n, t in iter_checkpoint(fresh_path)
              if ".experts.0." in n or ".experts.3." in n}
    assert len(update) == 6
    handles = WeightSender(transport="shared").send(update, 1)
    assert engine.update_weights_from_shared(handles) == 1
    after = [(o.token_ids, o.logprobs) for o in engine.generate(prompts, sampling=greedy)]
    fresh = SpecEngine(fresh_path, device="cpu", dtype="float32", max_model_len=64,
                       kv_cache_tokens=512)
    assert after == [(o.token_ids, o.logprobs) for o in fresh.generate(prompts,
                                                                       sampling=greedy)]
    assert after != before
    assert {n: p.data_ptr() for n, p in engine.model.named_parameters()} == ptrs
    # A bad expert name or shape is refused whole, nothing written.
    bad = {"model.layers.1.mlp.experts.5.up_proj.weight": torch.zeros(48, 32),
           "model.layers.1.mlp.experts.1.up_proj.weight": torch.zeros(48, 32)}
    with pytest.raises(CheckpointError, match="experts.5"):
        engine.load_weights(bad)
    with pytest.raises(CheckpointError, match="shape"):
        engine.load_weights({"model.layers.1.mlp.experts.1.down_proj.weight":
                             torch.zeros(48, 32)})
    assert [(o.token_ids, o.logprobs) for o in engine.generate(prompts, sampling=greedy)] \
        == after


def test_memory_plan_counts_the_experts() -> None:
    """The memory plan's weight count equals the MoE model's parameters (so the KV cache is
    sized from what is really left)."""
    from specengine.core.memory_plan import model_params
    from specengine.model.llama import CausalLM

    base = dict(architectures=["Qwen3MoeForCausalLM"], vocab_size=320, hidden_size=64,
                intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, num_experts=5, num_experts_per_tok=2,
                moe_intermediate_size=24, mlp_only_layers=[1])
    for extra in ({}, {"architectures": ["Qwen2MoeForCausalLM"],
                       "shared_expert_intermediate_size": 40},
                  {"architectures": ["MixtralForCausalLM"], "num_local_experts": 3}):
        cfg = ModelConfig.from_dict({**base, **extra})
        with torch.device("meta"):
            model = CausalLM(cfg)
        assert model_params(cfg) == sum(p.numel() for p in model.parameters()), extra


def test_readme_moe_example_runs_as_written() -> None:
    from readme_blocks import readme_block

    ns: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(readme_block("### Supported architectures\n"), "README.md (MoE example)",
                 "exec"), ns)
    assert ns["moe"].model.config.moe_layers == (0, 1)  # type: ignore[attr-defined]
    assert len(ns["spec"][0].token_ids) == 24  # type: ignore[index]


def test_bench_moe_smoke_gives_gpu_check_rows(tmp_path: Path) -> None:
    """``benchmarks/bench_moe.py --smoke`` (CPU: the loop only) writes the JSON the GPU check
    reads; without the fused rows the speed check is a SKIP, never a PASS."""
    import subprocess
    import sys

    bench = Path(__file__).resolve().parent.parent / "benchmarks"
    proc = subprocess.run([sys.executable, str(bench / "bench_moe.py"), "--smoke", "--out",
                           str(tmp_path)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    sys.path.insert(0, str(bench))
    import gpu_check_rows as gr

    rows = gr.parse_moe(gr.StepRun("moe", 0, False, proc.stdout, tmp_path))
    by_check = {r.check: r for r in rows}
    assert by_check["fused MoE vs per-expert loop"].verdict == "SKIP"
    touched = by_check["MoE experts touched smoke"]
    # More tokens per pass touch more distinct experts (12 experts, top-2).
    counts = [int(part.split(": ")[1]) for part in touched.result.split(" / ")]
    assert counts == sorted(counts) and counts[0] == 2 and counts[-1] <= 12
    # The verdict follows the figures: fused rows slower than the loop at one size FAIL.
    import json

    def verdict(fused_us: list[float]) -> str:
        rows = []
        for t, f in zip((1, 4), fused_us):
            base = dict(model="m", tokens=t, distinct_experts=t, ratio=2.0)
            rows += [dict(base, impl="fused", time_us=f), dict(base, impl="loop", time_us=10.0)]
        (tmp_path / "moe.json").write_text(json.dumps({"rows": rows}))
        out = gr.parse_moe(gr.StepRun("moe", 0, False, "", tmp_path))
        return next(r.verdict for r in out if r.check == "fused MoE vs per-expert loop")

    assert verdict([5.0, 9.0]) == "PASS"
    assert verdict([5.0, 11.0]) == "FAIL"


def test_eagle3_speculation_equals_k0_on_moe_target(moe_target, tmp_path: Path) -> None:
    """A (dense) EAGLE-3 head fitted to an MoE target drafts, and k=3 chains and a tree give
    exactly the tokens of k=0."""
    from test_eagle3 import fit_head

    hf, path = moe_target
    prompts, params = ragged_requests(48, n=8, seed=5)
    head = fit_head(hf, path, tmp_path / "head", [p for p in prompts if len(p) > 2])
    engine = SpecEngine(path, draft=str(head), device="cpu", dtype="float32",
                        max_model_len=128, max_batch_size=8)
    assert_greedy_lossless(engine, prompts, params, ks=(3,), trees=("binary2",))
    assert engine.stats.num_accepted_tokens > 0


def test_static_path_replayed_equals_eager_on_moe_target(moe_target) -> None:
    """The bucket-padded static path with captured-and-replayed passes (``ReplayingGraph``,
    a CUDA graph's semantics on the CPU) gives the eager path's outputs on an MoE target:
    the sparse block adds nothing a replay would get wrong."""
    from test_static_path import both_paths, mixed_params

    _, path = moe_target
    prompts = [[5, 6, 7, 5, 6, 7, 5], [9], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3], [3, 3, 3]]
    engines = both_paths(path, "ngram", prompts, 3, mixed_params(4, 1.0, 7), replay=True,
                         max_batch_size=4)
    assert engines[1].graphs.num_replays > engines[1].graphs.num_captures


def test_moe_decode_step_blocks_the_host_once(moe_target) -> None:
    """On its kernels (the fused MoE under the interpreter) a decode step of an MoE target
    still reads the device once and makes no blocking host-to-device copy: routing and the
    expert alignment stay on the device (a CUDA graph could not hold them otherwise)."""
    from test_step_syncs import count_step_transfers

    _, path = moe_target
    engine = SpecEngine(path, "ngram", device="cpu", dtype="float32", kernel_backend="triton",
                        cuda_graphs=True, graph_buckets=(1, 2, 4), max_model_len=64,
                        kv_cache_tokens=512)
    steps = count_step_transfers(engine, [[5, 6, 7, 5, 6, 7], [9, 8]], 3, None,
                                 SamplingParams(temperature=0.0, max_tokens=5))
    assert len(steps) >= 2
    for d2h, h2d in steps:
        assert sum(d2h.values()) == 1, f"device->host reads in one step: {dict(d2h)}"
        assert not h2d, f"blocking host->device copies in one step: {dict(h2d)}"


@pytest.mark.parametrize("arch", ["qwen3_moe", "qwen2_moe"])
def test_tensor_parallel_2_equals_1_with_an_expert_update(arch: str, tmp_path: Path) -> None:
    """``tensor_parallel_size=2`` (every expert's inner dimension split over the ranks, the
    shared expert too) gives one rank's greedy tokens, logprobs within 1e-5, for k=0 and k=3;
    an update of two experts from a learner's ``WeightSender`` lands on both ranks' slices and
    equals a fresh engine on those weights."""
    from net_helpers import ThreadLearner, free_port
    from test_tensor_parallel import assert_close, outputs

    hf = make_hf_model(arch, vocab_size=64, hidden_size=32, seed=2, init_std=0.2)
    path = save_checkpoint(hf, tmp_path / "old")
    prompts = [[5, 9, 14, 5, 9, 14, 5], [30, 31, 32, 33, 30, 31]]

    def make(p: Path, tp: int) -> SpecEngine:
        return SpecEngine(p, draft="ngram", device="cpu", dtype="float32", max_model_len=64,
                          kv_cache_tokens=1024, tensor_parallel_size=tp)

    one = make(path, 1)
    new = make_hf_model(arch, vocab_size=64, hidden_size=32, seed=2, init_std=0.2)
    gen = torch.Generator().manual_seed(9)
    with torch.no_grad():
        experts = new.model.layers[1].mlp.experts
        for e in (0, 2):
            experts.gate_up_proj[e].normal_(0, 0.5, generator=gen)
            experts.down_proj[e].normal_(0, 0.5, generator=gen)
    new_path = save_checkpoint(new, tmp_path / "new")
    update = {n: t for n, t in iter_checkpoint(new_path)
              if ".layers.1.mlp.experts.0." in n or ".layers.1.mlp.experts.2." in n}
    assert len(update) == 6
    port = free_port()
    with make(path, 2) as two:
        inner = two.model.model.layers[1].mlp.experts.w13.shape[1]
        assert inner == one.model.model.layers[1].mlp.experts.w13.shape[1] // 2
        for k in (0, 3):
            assert_close(outputs(two, prompts, k), outputs(one, prompts, k))
        learner = ThreadLearner(port, 3, 60.0)
        two.init_weight_update_group("127.0.0.1", port, 1, 3, backend="gloo", timeout_s=60.0)
        assert learner.join() is None
        learner.send(update, version=1)
        assert two.update_weights_from_distributed() == 1
        assert learner.join() is None
        after = outputs(two, prompts, 0)
        two.close_weight_update_group()
        learner.sender.close()  # type: ignore[union-attr]
    assert after != outputs(one, prompts, 0)
    assert_close(after, outputs(make(new_path, 1), prompts, 0))
