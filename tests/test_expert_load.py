"""Expert-load counters of a MoE target in ``engine.stats`` (docs/design.md §3, §21): the
distinct experts each prefill, 1-token decode and verify pass touched, checked against a
hand count from transformers' own routing of the same tokens. Padded static rows must not
count (three sequences run in a padded bucket of four rows)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint

from specengine import SamplingParams, SpecEngine

PROMPTS = [[3, 17, 9, 30, 2], [11, 4], [40, 8, 8, 21]]
NUM_EXPERTS, TOP_K = 8, 2


def _routing(hf: torch.nn.Module, ids: list[int]) -> list[list[set[int]]]:
    """``[moe layer][position]`` → the set of experts transformers routes that token to."""
    seen: list[list[set[int]]] = []

    def hook(module, args, out) -> None:  # type: ignore[no-untyped-def]
        seen.append([set(row) for row in out[2].tolist()])  # (logits, scores, indices)

    handles = [m.register_forward_hook(hook) for n, m in hf.named_modules()
               if n.endswith(".gate") and hasattr(m, "top_k")]
    try:
        with torch.no_grad():
            hf(torch.tensor([ids]))
    finally:
        for h in handles:
            h.remove()
    return seen


def _distinct(routings: list[list[list[set[int]]]], spans: list[range]) -> int:
    """Distinct experts summed over MoE layers of one pass feeding positions ``spans[i]`` of
    sequence ``i``."""
    total = 0
    for layer in range(len(routings[0])):
        hit: set[int] = set()
        for routing, span in zip(routings, spans):
            for pos in span:
                hit |= routing[layer][pos]
        total += len(hit)
    return total


@pytest.fixture(scope="module")
def moe(tmp_path_factory: pytest.TempPathFactory) -> tuple[torch.nn.Module, Path]:
    hf = make_hf_model("qwen3_moe", vocab_size=48, hidden_size=32, seed=1, init_std=0.2,
                       num_experts=NUM_EXPERTS, num_experts_per_tok=TOP_K)
    return hf, save_checkpoint(hf, tmp_path_factory.mktemp("expert_load"))


def _run(path: Path, k: int, max_tokens: int, draft: str | None = None
         ) -> tuple[list[list[int]], object]:
    engine = SpecEngine(path, draft=draft, device="cpu", dtype="float32", max_model_len=64,
                        max_batch_size=8, cuda_graphs=True)  # padded buckets on CPU too
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outs = engine.generate(PROMPTS, k=k, sampling=params)
    return [p + list(o.token_ids) for p, o in zip(PROMPTS, outs)], engine.stats


def test_decode_and_prefill_counts_equal_hand_count(moe) -> None:
    hf, path = moe
    max_tokens = 6
    full, stats = _run(path, 0, max_tokens)
    routings = [_routing(hf, ids) for ids in full]
    num_moe = len(routings[0])
    assert num_moe == 1  # layer 0 dense (mlp_only_layers), layer 1 sparse
    # one prefill pass over every prompt token
    assert stats.moe_prefill_layer_passes == num_moe
    assert stats.moe_prefill_tokens == num_moe * sum(map(len, PROMPTS))
    assert stats.moe_prefill_experts == _distinct(routings, [range(len(p)) for p in PROMPTS])
    # max_tokens - 1 decode passes, each feeding every sequence's last token (3 real rows)
    steps = max_tokens - 1
    assert stats.moe_decode_layer_passes == num_moe * steps
    assert stats.moe_decode_tokens == num_moe * steps * len(PROMPTS)
    assert stats.moe_decode_experts == sum(
        _distinct(routings, [range(len(p) + t, len(p) + t + 1) for p in PROMPTS])
        for t in range(steps))
    assert stats.moe_verify_layer_passes == 0
    assert TOP_K <= stats.experts_per_decode <= min(NUM_EXPERTS, TOP_K * len(PROMPTS))


def test_verify_counts_equal_hand_count(moe) -> None:
    """The target drafting for itself: every draft accepted, so each verify pass feeds the
    known tokens ``[last, g1, g2, g3]`` of every sequence."""
    hf, path = moe
    k, steps = 3, 3
    full, stats = _run(path, k, 1 + (k + 1) * steps, draft=str(path))
    assert stats.num_accepted_tokens == stats.num_draft_tokens == len(PROMPTS) * k * steps
    routings = [_routing(hf, ids) for ids in full]
    num_moe = len(routings[0])
    assert stats.moe_verify_layer_passes == num_moe * steps
    assert stats.moe_verify_tokens == num_moe * steps * len(PROMPTS) * (k + 1)
    assert stats.moe_verify_experts == sum(
        _distinct(routings, [range(len(p) + (k + 1) * s, len(p) + (k + 1) * (s + 1))
                             for p in PROMPTS])
        for s in range(steps))
    assert stats.moe_decode_layer_passes == 0
    # a verify pass of 4 tokens per sequence touches more experts than one token does
    assert stats.experts_per_verify > TOP_K


def test_dense_model_counts_nothing(tmp_path: Path) -> None:
    path = save_checkpoint(make_hf_model("qwen3", vocab_size=48, hidden_size=32, seed=1),
                           tmp_path / "dense")
    _, stats = _run(path, 0, 3)
    assert stats.moe_decode_layer_passes == stats.moe_prefill_experts == 0
    assert stats.experts_per_decode == 0.0
