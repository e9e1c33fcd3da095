"""The engine on its real kernels (``kernel_backend="triton"``: Triton attention and rejection
sampling under the interpreter on CPU, ``_C`` KV writes and compaction) gives what the PyTorch
backend gives: the same greedy tokens as ``k=0``, and seed for seed the same sampled tokens,
so the chi-square results of the PyTorch backend carry over to the kernels."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint
from lossless import TREES
from test_eagle3 import fit_head

from specengine import SamplingParams, SpecEngine

PROMPTS = [[5, 6, 7, 5, 6, 7, 5], [9], [1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2, 3, 4, 1, 2]]


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    target = make_hf_model("qwen3", vocab_size=48, hidden_size=32, seed=1, init_std=0.2)
    draft = make_hf_model("qwen3", vocab_size=48, hidden_size=32, seed=1, init_std=0.2)
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for p in draft.parameters():
            p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return (save_checkpoint(target, tmp_path_factory.mktemp("t")),
            save_checkpoint(draft, tmp_path_factory.mktemp("d")))


def make(path: Path, backend: str, draft: str | None, **kw) -> SpecEngine:
    return SpecEngine(path, draft=draft, device="cpu", dtype="float32", max_model_len=64,
                      max_batch_size=8, kv_cache_tokens=1024, kernel_backend=backend, **kw)


def test_greedy_on_kernels_equals_k0(ckpts: tuple[Path, Path]) -> None:
    target, _ = ckpts
    engine = make(target, "triton", "ngram")
    params = [SamplingParams(temperature=0.0, max_tokens=n) for n in (12, 5, 9)]
    base = make(target, "torch", None).generate(PROMPTS, sampling=params)
    for kwargs in (dict(k=0), dict(k=3), dict(tree=TREES["binary2"])):
        outs = engine.generate(PROMPTS, sampling=params, **kwargs)
        for o, b in zip(outs, base):
            assert o.token_ids == b.token_ids, kwargs
            assert o.logprobs == pytest.approx(b.logprobs, abs=1e-4)
        assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.stats.num_accepted_tokens > 0  # the tree path accepted and compacted nodes


def test_sampled_on_kernels_equals_torch_backend(ckpts: tuple[Path, Path]) -> None:
    target, draft = ckpts
    params = [SamplingParams(temperature=0.7, top_k=10, top_p=0.9, max_tokens=8, seed=s)
              for s in range(len(PROMPTS) * 2)]
    prompts = PROMPTS * 2
    opts = {"sample": True}
    got = make(target, "triton", str(draft), draft_options=opts).generate(
        prompts, k=2, sampling=params)
    want = make(target, "torch", str(draft), draft_options=opts).generate(
        prompts, k=2, sampling=params)
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert sum(o.num_accepted_tokens for o in got) > 0
    assert sum(o.num_draft_tokens - o.num_accepted_tokens for o in got) > 0


@pytest.fixture(scope="module")
def eagle_dir(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path]:
    """A target and an EAGLE-3 head fitted to it on a few contexts (some drafts pass)."""
    hf = make_hf_model("qwen3", vocab_size=48, hidden_size=32, seed=1, init_std=0.2)
    target = save_checkpoint(hf, tmp_path_factory.mktemp("t"))
    gen = torch.Generator().manual_seed(4)
    contexts = [torch.randint(0, 48, (12,), generator=gen).tolist() for _ in range(24)]
    return target, fit_head(hf, target, tmp_path_factory.mktemp("e"), contexts + PROMPTS,
                            dropped=(0, 47))


def test_eagle3_on_kernels(eagle_dir: tuple[Path, Path]) -> None:
    """Greedy EAGLE-3 chains and trees on the kernels equal k=0; sampled EAGLE-3 drafts give
    the PyTorch backend's tokens seed for seed, with both accepts and rejects."""
    target, head = eagle_dir
    greedy = [SamplingParams(temperature=0.0, max_tokens=n) for n in (10, 4, 8)]
    base = make(target, "torch", None).generate(PROMPTS, sampling=greedy)
    engine = make(target, "triton", str(head))
    for kwargs in (dict(k=3), dict(tree=TREES["binary2"])):
        outs = engine.generate(PROMPTS, sampling=greedy, **kwargs)
        assert [o.token_ids for o in outs] == [b.token_ids for b in base], kwargs
    params = [SamplingParams(temperature=0.8, top_k=12, max_tokens=6, seed=s) for s in range(3)]
    got, want = (make(target, backend, str(head), draft_options={"sample": True}).generate(
        PROMPTS, k=2, sampling=params) for backend in ("triton", "torch"))
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert sum(o.num_accepted_tokens for o in got) > 0
    assert sum(o.num_draft_tokens - o.num_accepted_tokens for o in got) > 0


def test_sampled_eagle3_trees_on_kernels_equal_torch_backend(eagle_dir: tuple[Path, Path]
                                                            ) -> None:
    """Sampled requests' EAGLE-3 trees (children drawn from the head's q without replacement,
    judged by recursive rejection sampling) give on the kernels the PyTorch backend's tokens
    and logprobs seed for seed, with children kept and rejected: the kernel judges sampled
    children, as the reference does."""
    target, head = eagle_dir
    params = [SamplingParams(temperature=t, max_tokens=8, seed=s)
              for s, t in enumerate((1.0, 0.7, 1.0, 1.3, 1.0, 0.9))]
    got, want = (make(target, backend, str(head), draft_options={"sample": True}).generate(
        PROMPTS * 2, sampling=params, tree=TREES["binary2"]) for backend in ("triton", "torch"))
    for g, w in zip(got, want):
        assert g.token_ids == w.token_ids
        assert g.logprobs == pytest.approx(w.logprobs, abs=1e-4)
    assert sum(o.num_accepted_tokens for o in got) > 0
    assert sum(o.num_draft_tokens - o.num_accepted_tokens for o in got) > 0
