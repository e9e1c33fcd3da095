"""Parity with Hugging Face transformers on random checkpoints the test writes itself."""

from __future__ import annotations

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint

from specengine import SamplingParams, SpecEngine
from specengine.core.sequence import Sequence

PROMPT_LENS = (1, 15, 16, 17, 40)
NUM_NEW = 32


def prompts_for(vocab: int, seed: int = 1) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (n,), generator=g).tolist() for n in PROMPT_LENS]


def engine_logits(engine: SpecEngine, ids: list[int]) -> torch.Tensor:
    """All-position logits ``[T, V]`` of one prompt through the engine's paged prefill."""
    seq = Sequence(-1, ids, SamplingParams(), 0, ())
    engine.kv_cache.ensure(seq, len(ids))
    try:
        _, out = engine.runner.prefill((seq,))
        return engine.model.compute_logits(out.hidden)
    finally:
        engine.kv_cache.free(seq)


CASES = [
    ("llama", None),  # llama3 rope scaling, GQA, untied
    ("qwen2", None),  # biases, tied
    ("qwen3", 40),  # q/k norm, sharded checkpoint (~40 KB shards)
    ("llama_yarn", None),  # yarn scaling, tied
]


@pytest.fixture(scope="module", params=CASES, ids=[c[0] for c in CASES])
def pair(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    arch, shard_kb = request.param
    hf = make_hf_model(arch)
    path = save_checkpoint(hf, tmp_path_factory.mktemp(arch), shard_kb)
    if shard_kb is not None:
        assert (path / "model.safetensors.index.json").is_file(), "expected a sharded checkpoint"
    engine = SpecEngine(path, device="cpu", dtype="float32", block_size=16, max_model_len=256,
                        max_batch_size=8)
    return hf, engine


def test_prefill_logits_match(pair) -> None:
    hf, engine = pair
    for ids in prompts_for(hf.config.vocab_size):
        with torch.no_grad():
            ref = hf(torch.tensor([ids])).logits[0].float()
        ours = engine_logits(engine, ids)
        scale = ref.abs().max().item()
        assert (ours - ref).abs().max().item() <= 1e-4 * scale


def test_greedy_generation_matches_transformers(pair) -> None:
    hf, engine = pair
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
        assert list(out.token_ids) == ref_tokens
        ref_logprobs = [torch.log_softmax(step[0].float(), -1)[t].item()
                        for step, t in zip(gen.logits, ref_tokens)]
        assert out.logprobs == pytest.approx(ref_logprobs, abs=1e-4)
        assert out.finish_reason == "length"
        assert out.prompt_token_ids == tuple(ids)
    # Every block went back to the allocator.
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
