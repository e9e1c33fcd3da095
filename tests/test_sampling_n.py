"""``SamplingParams(n=...)``: GRPO groups as one request (docs/design.md §17).

A group's prompt is prefilled once and its KV shared (full blocks by reference, the partial
last block copied); these tests check that this changes nothing a lone request would get:
greedy samples equal the n=1 output, a seeded group equals n lone requests with the derived
seeds on an engine that shares nothing, and one sample of a group follows the policy's law
(chi-square against the exact law from the Hugging Face model).
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint

try:
    from scipy.stats import chisquare
except ImportError:  # scipy is optional: the chi-square tests skip without it, the rest run

    def chisquare(*args, **kwargs):
        return pytest.importorskip("scipy.stats").chisquare(*args, **kwargs)
from test_sampling_lossless import processed_probs

from specengine import SamplingParams, SpecEngine
from specengine.core.prefix_cache import sample_seed

KW = dict(device="cpu", dtype="float32", max_model_len=128, kv_cache_tokens=4096)
PROMPTS = [list(range(2, 39)), list(range(40, 72)), [5, 9, 7]]  # 37, 32 (full), 3 tokens


@pytest.fixture(scope="module")
def engine(tiny_checkpoint: Path) -> SpecEngine:
    return SpecEngine(tiny_checkpoint, draft="ngram", **KW)


@pytest.mark.parametrize("k", [0, 3])
def test_greedy_group_equals_n_equals_1(engine: SpecEngine, k: int) -> None:
    params = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    lone = engine.generate(PROMPTS, k=k, sampling=params)
    group = engine.generate(PROMPTS, k=k, sampling=SamplingParams(
        temperature=0.0, max_tokens=12, ignore_eos=True, n=4))
    assert len(group) == 4 * len(PROMPTS)
    assert [o.sample_index for o in group] == [0, 1, 2, 3] * len(PROMPTS)
    for i, out in enumerate(group):  # prompt-major
        assert out.prompt_token_ids == tuple(PROMPTS[i // 4])
        assert out.token_ids == lone[i // 4].token_ids
        np.testing.assert_allclose(out.logprobs, lone[i // 4].logprobs, atol=1e-5)
    # the 3 borrowing samples of each prompt computed nothing
    assert engine.stats.num_cached_prompt_tokens >= 3 * sum(len(p) for p in PROMPTS)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


def test_seeded_group_differs_reproduces_and_equals_unshared(engine: SpecEngine,
                                                             tiny_checkpoint: Path) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True, seed=7, n=4)
    a = engine.generate(PROMPTS, sampling=params)
    b = engine.generate(PROMPTS, sampling=params)
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for p in range(len(PROMPTS)):
        assert len({o.token_ids for o in a[4 * p: 4 * p + 4]}) > 1
    # sample 0 is the lone request with the same seed (n=1 keeps its outputs)
    lone = engine.generate(PROMPTS, sampling=SamplingParams(
        temperature=1.0, max_tokens=10, ignore_eos=True, seed=7))
    assert [o.token_ids for o in lone] == [o.token_ids for o in a[::4]]
    # an engine that shares nothing, with the derived seeds, gives the same tokens
    plain = SpecEngine(tiny_checkpoint, draft="ngram", enable_prefix_caching=False, **KW)
    each = [SamplingParams(temperature=1.0, max_tokens=10, ignore_eos=True,
                           seed=sample_seed(7, i)) for _ in PROMPTS for i in range(4)]
    want = plain.generate([p for p in PROMPTS for _ in range(4)], sampling=each)
    assert plain.stats.num_cached_prompt_tokens == 0
    assert [o.token_ids for o in a] == [o.token_ids for o in want]
    for x, y in zip(a, want):
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)


def test_group_with_suffix_drafter(tiny_checkpoint: Path) -> None:
    eng = SpecEngine(tiny_checkpoint, draft="suffix", **KW)
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    lone = eng.generate(PROMPTS, sampling=greedy)
    group = eng.generate(PROMPTS, k=3, sampling=SamplingParams(
        temperature=0.0, max_tokens=16, ignore_eos=True, n=3))
    assert [o.token_ids for o in group] == [o.token_ids for o in lone for _ in range(3)]
    assert eng.stats.num_accepted_tokens > 0  # siblings' completions were drafted from


def test_step_api_group_abort_one_sample(engine: SpecEngine) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=6, ignore_eos=True, seed=1, n=3)
    ids = engine.add_request(PROMPTS[0], params, request_id="g")
    assert ids == ["g-0", "g-1", "g-2"]
    engine.step()  # prefill: one pass, two borrowers
    engine.abort("g-1")
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output
    assert sorted(done) == ["g-0", "g-2"] and done["g-2"].sample_index == 2
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks


@pytest.mark.parametrize("n", [0, -1, 1.5, True, "4"])
def test_bad_n_is_refused(engine: SpecEngine, n: object) -> None:
    with pytest.raises(ValueError, match="n \\(samples per prompt\\)"):
        SamplingParams(n=n)  # type: ignore[arg-type]


def test_taken_sample_id_adds_nothing(engine: SpecEngine) -> None:
    engine.add_request(PROMPTS[2], SamplingParams(max_tokens=2), request_id="x-1")
    with pytest.raises(ValueError, match="already used"):
        engine.add_request(PROMPTS[2], SamplingParams(max_tokens=2, n=2), request_id="x")
    assert engine.core.num_unfinished == 1
    engine.abort("x-1")
    assert not engine.has_unfinished()


def test_one_sample_of_a_group_follows_the_policy(tmp_path: Path) -> None:
    """Joint law of the first two tokens of the borrowing samples (1..3) of 1200 groups:
    the first comes from the sibling's logits with the sample's own seed, the second from a
    decode step over the shared blocks and the copied partial block."""
    vocab, prompt = 16, [3, 1, 4, 1, 5, 9, 2, 6, 5, 3, 5, 8, 9, 7, 9, 3, 2, 3]  # 18: a partial
    hf = make_hf_model("qwen3", vocab_size=vocab, seed=3, init_std=0.3)
    eng = SpecEngine(save_checkpoint(hf, tmp_path / "m"), max_batch_size=256, **KW)
    params = SamplingParams(temperature=1.0, top_k=4, max_tokens=2, ignore_eos=True, n=4)
    with torch.no_grad():
        p1 = processed_probs(hf(torch.tensor([prompt])).logits[0, -1], params)
        p2 = processed_probs(hf(torch.tensor([[*prompt, a] for a in range(vocab)]))
                             .logits[:, -1], params)
    law = (p1[:, None] * p2).numpy().ravel()
    outs = eng.generate([prompt] * 1200, sampling=params)
    counts = Counter(o.token_ids[0] * vocab + o.token_ids[1] for o in outs
                     if o.sample_index > 0)
    cells = np.flatnonzero(law > 0)
    assert sum(counts[c] for c in cells) == 3600  # never a token the filters exclude
    _, p_value = chisquare([counts[c] for c in cells], law[cells] * 3600)
    assert p_value > 1e-3


def test_eagle3_group_drafts_from_the_siblings_features() -> None:
    """The bundled EAGLE-3 head reads the target's features of every prompt position: the
    borrowing samples get the sibling's, so each sample's drafts, acceptances and tokens equal
    a lone request's."""
    from specengine.arith_task import heldout_prompts
    from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

    eng = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", max_model_len=256)
    prompts = heldout_prompts(3)
    greedy = SamplingParams(temperature=0.0, max_tokens=24)
    lone = eng.generate(prompts, k=3, sampling=greedy)
    group = eng.generate(prompts, k=3, sampling=SamplingParams(
        temperature=0.0, max_tokens=24, n=3))
    assert eng.stats.num_cached_prompt_tokens > 0
    for i, out in enumerate(group):
        ref = lone[i // 3]
        assert (out.token_ids, out.num_draft_tokens, out.num_accepted_tokens) == (
            ref.token_ids, ref.num_draft_tokens, ref.num_accepted_tokens)
    assert sum(o.num_accepted_tokens for o in lone) > 0
