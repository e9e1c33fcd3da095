"""Prefix caching with every drafter (docs/design.md §17, ``specengine.drafters.draft_prefix``).

A cached prefix serves the target and the draft: with the bundled EAGLE-3 head (eager: its own
named blocks; static path: its entries in the target's blocks), MTP layers and a small LM, a
repeated 512-token prompt is served from the cache, outputs (greedy and seeded sampled) and
k=3 acceptance equal a cache-off engine's, and every weight update of either model (policy,
draft, ``adapt_draft``) leaves nothing to hit.

Acceptance catches a draft KV that was not written for a cached prefix: before every request
each block the caches do not name (target's and draft's) is overwritten with large random
values, so an entry the drafter reads without having written it (for this request or the one
that computed the cached block) is garbage, its drafts are rejected and acceptance falls
(with the draft's blocks of a hit left unwritten, from 0.26 to 0.07 accepted drafts a step on
the bundled head). A correct engine never reads an unwritten entry, so its acceptance equals
the cache-off engine's to the last token.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from specengine import SamplingParams, SpecEngine
from specengine import arith_task as task
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.core.prefix_cache import block_hashes
from specengine.drafters.draft_model import DraftModelDrafter
from specengine.drafters.feature_drafter import FeatureDrafter

BS = 16
PROMPT_LEN = 512
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
SAMPLED = SamplingParams(temperature=1.0, seed=7, max_tokens=24, ignore_eos=True)
KW = dict(device="cpu", dtype="float32", max_model_len=640, kv_cache_tokens=4096)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled target with room for 512-token prompts (its config says 256 positions;
    rope has no limit of its own): the same weights, max_position_embeddings 1024."""
    path = tmp_path_factory.mktemp("arith_long") / "target"
    shutil.copytree(DEFAULT_TARGET, path)
    cfg = json.loads((path / "config.json").read_text())
    cfg["max_position_embeddings"] = 1024
    (path / "config.json").write_text(json.dumps(cfg))
    return path


def arith_prompt(seed: int, n: int = PROMPT_LEN) -> list[int]:
    """``n`` tokens of solved problems of the task the bundled pair was trained on."""
    rng, text = random.Random(seed), ""
    while len(text) < n:
        prompt, completion = task.make_problem(rng)
        text += prompt + completion
    return task.encode(text)[:n]


PROMPTS = [arith_prompt(1), arith_prompt(2)]


def poison_unnamed(engine: SpecEngine) -> None:
    """Overwrite every KV block no prefix cache names (the engine is idle: those are all the
    blocks nobody may read) with large random values, in the target's and the drafter's
    caches."""
    g = torch.Generator().manual_seed(0)
    caches = [engine.kv_cache]
    drafter = getattr(engine.drafter, "neural", engine.drafter)
    own = getattr(drafter, "kv_cache", None)
    if own is not None:
        caches.append(own)
    for cache in caches:
        named = set(cache.prefix.hash_of) if cache.prefix is not None else set()
        if cache is own and getattr(drafter, "shared_tables", False):
            named = set(engine.kv_cache.prefix.hash_of) if engine.kv_cache.prefix else set()
        free = [b for b in range(cache.num_blocks) if b not in named]
        shape = cache.kv[:, :, free].shape
        cache.kv[:, :, free] = 30 * torch.randn(shape, generator=g).to(cache.kv.dtype)


def generate(engine: SpecEngine, params: SamplingParams, k: int = 3,
             prompts: list[list[int]] = PROMPTS) -> list:
    poison_unnamed(engine)
    return engine.generate(prompts, sampling=params, k=k)


def accepted_per_step(outs: list) -> float:
    return sum(o.num_accepted_tokens for o in outs) / sum(o.num_steps for o in outs)


def assert_same(got: list, want: list) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    assert [(o.num_steps, o.num_draft_tokens, o.num_accepted_tokens) for o in got] == [
        (o.num_steps, o.num_draft_tokens, o.num_accepted_tokens) for o in want]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def check_served_from_cache(on: SpecEngine, off: SpecEngine, min_acceptance: float) -> None:
    """Greedy then seeded sampled, each twice on ``on`` (the second time from the cache) and
    once on ``off``: equal outputs and acceptance, >= 90% of the prompt tokens reused."""
    for params in (GREEDY, SAMPLED):
        want = generate(off, params)
        assert off.stats.num_cached_prompt_tokens == 0
        first = generate(on, params)
        assert_same(first, want)
        again = generate(on, params)
        stats = on.stats
        assert stats.num_prompt_tokens == len(PROMPTS) * PROMPT_LEN
        # (512 - 1) // 16 = 31 blocks each; the last token is always computed
        assert stats.num_cached_prompt_tokens == len(PROMPTS) * 31 * BS
        assert stats.num_cached_prompt_tokens >= 0.9 * stats.num_prompt_tokens
        assert_same(again, want)
        assert accepted_per_step(again) == accepted_per_step(want) >= min_acceptance


# ---- names -------------------------------------------------------------------------------------
def test_names_with_the_next_token_cover_what_an_entry_reads() -> None:
    a = list(range(2, 50))
    b = a[:16] + [99] + a[17:]  # the first token after block 0 differs
    plain, named = block_hashes(a, BS, 2), block_hashes(a, BS, 2, next_token=True)
    assert named != plain and len(set(named)) == 2
    assert block_hashes(b, BS, 1) == plain[:1]  # block 0's own tokens are equal ...
    assert block_hashes(b, BS, 1, next_token=True) != named[:1]  # ... its entries are not
    assert block_hashes(a[:33], BS, 2, next_token=True) == named
    with pytest.raises(ValueError, match="need 33 tokens"):
        block_hashes(a[:32], BS, 2, next_token=True)


# ---- EAGLE-3, MTP, small LM ----------------------------------------------------------------------
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "static"])
def test_eagle3_repeated_prompt_is_served_from_the_cache(target: Path,
                                                         cuda_graphs: bool) -> None:
    """Eager: the head's own blocks are named like the target's and reused (its prompt pass
    computes only the 16 new positions). Static path: its entries live in the target's
    blocks, which serve both."""
    on = SpecEngine(target, DEFAULT_DRAFT, cuda_graphs=cuda_graphs, **KW)
    off = SpecEngine(target, DEFAULT_DRAFT, cuda_graphs=cuda_graphs,
                     enable_prefix_caching=False, **KW)
    drafter = on.drafter
    assert isinstance(drafter, FeatureDrafter) and drafter.shared_tables == cuda_graphs
    check_served_from_cache(on, off, min_acceptance=0.2)
    if not cuda_graphs:  # the head reused 31 blocks of each prompt, 3 times over
        assert drafter.prefix is not None
        assert drafter.prefix.num_reused_tokens == 3 * len(PROMPTS) * 31 * BS


def test_static_path_names_no_block_the_drafter_did_not_write(target: Path) -> None:
    """A k=0 request does not run the head over its prompt: on the static path (the head's
    entries live in the target's blocks) its blocks are not named, so a k=3 request of the
    same prompt computes its prompt again, with the head's entries, and accepts as a
    cache-off engine does."""
    on = SpecEngine(target, DEFAULT_DRAFT, cuda_graphs=True, **KW)
    off = SpecEngine(target, DEFAULT_DRAFT, cuda_graphs=True, enable_prefix_caching=False, **KW)
    generate(on, GREEDY, k=0)
    got = generate(on, GREEDY)
    cached = on.stats.num_cached_prompt_tokens
    want = generate(off, GREEDY)
    assert_same(got, want)  # (a hit on blocks without the head's entries: acceptance falls)
    assert cached == 0
    again = generate(on, GREEDY)  # named now
    assert on.stats.num_cached_prompt_tokens == len(PROMPTS) * 31 * BS
    assert_same(again, want)


def test_eager_head_cuts_a_target_hit_to_its_own_blocks(target: Path) -> None:
    """Eagerly, a k=0 request names the target's blocks only; a k=3 request then reuses none
    (the head cannot write entries of positions the target does not compute), names the
    head's blocks, and the next one reuses both."""
    on = SpecEngine(target, DEFAULT_DRAFT, **KW)
    generate(on, GREEDY, k=0)
    # (each finished sequence names its 535 // 16 = 33 full blocks: prompt and completion)
    assert len(on.kv_cache.prefix) == len(PROMPTS) * 33 and len(on.drafter.prefix.cache) == 0
    want = generate(on, GREEDY)
    assert on.stats.num_cached_prompt_tokens == 0
    assert len(on.drafter.prefix.cache) >= len(PROMPTS) * 31
    assert_same(generate(on, GREEDY), want)
    assert on.stats.num_cached_prompt_tokens == len(PROMPTS) * 31 * BS


def test_mtp_repeated_prompt_is_served_from_the_cache(tmp_path: Path) -> None:
    """MTP layers are a FeatureDrafter like the EAGLE-3 head: eagerly and on the static path."""
    from checkpoints import make_hf_model, save_checkpoint
    from test_mtp import add_mtp_weights

    hf = make_hf_model("qwen3", vocab_size=20, mtp_num_hidden_layers=1,
                       max_position_embeddings=1024)
    path = save_checkpoint(hf, tmp_path / "mtp")
    add_mtp_weights(hf, path)
    for cuda_graphs in (False, True):
        on = SpecEngine(path, "mtp", cuda_graphs=cuda_graphs, **KW)
        off = SpecEngine(path, "mtp", cuda_graphs=cuda_graphs, enable_prefix_caching=False,
                         **KW)
        # (random MTP layers accept nothing on these prompts: this checks reuse and exact
        # outputs; the entries' being written is checked through EAGLE-3, the same
        # FeatureDrafter code)
        check_served_from_cache(on, off, min_acceptance=0.0)


def test_small_lm_repeated_prompt_is_served_from_the_cache(target: Path) -> None:
    """The target as its own small-LM draft: every greedy draft is accepted, unless the draft
    reads K/V it did not write for a cached prefix."""
    for cuda_graphs in (False, True):
        on = SpecEngine(target, str(target), cuda_graphs=cuda_graphs, **KW)
        off = SpecEngine(target, str(target), cuda_graphs=cuda_graphs,
                         enable_prefix_caching=False, **KW)
        check_served_from_cache(on, off, min_acceptance=0.5)
        drafter = on.drafter
        assert isinstance(drafter, DraftModelDrafter) and drafter.prefix is not None
        # its prompt pass feeds tokens 0..510 (the newest is fed when it drafts): 31 blocks
        assert drafter.prefix.num_reused_tokens == 3 * len(PROMPTS) * 31 * BS
        again = generate(on, GREEDY)
        assert all(o.num_accepted_tokens == o.num_draft_tokens for o in again)


# ---- weight updates of either model --------------------------------------------------------------
def perturbed(path: Path, names: tuple[str, ...], seed: int) -> dict[str, torch.Tensor]:
    """New values of ``names`` (bf16-exact, as the checkpoints store them)."""
    tensors = load_file(path / "model.safetensors")
    g = torch.Generator().manual_seed(seed)
    return {n: (tensors[n].float() * (1 + 0.5 * torch.randn(tensors[n].shape, generator=g)))
            .to(torch.bfloat16).float() for n in names}


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "static"])
def test_draft_update_leaves_nothing_to_hit(target: Path, tmp_path: Path,
                                            cuda_graphs: bool) -> None:
    """After ``load_weights(which="draft")`` the same prompt is computed again, target and
    head, and the outputs equal a fresh engine's with the new head (seeded sampled: the
    drafts decide which tokens the same draws give)."""
    new = perturbed(Path(DEFAULT_DRAFT), ("midlayer.self_attn.o_proj.weight",
                                          "midlayer.mlp.down_proj.weight"), seed=1)
    head = tmp_path / "head"
    shutil.copytree(DEFAULT_DRAFT, head)
    tensors = load_file(Path(DEFAULT_DRAFT) / "model.safetensors")
    save_file({**tensors, **{n: t.to(tensors[n].dtype) for n, t in new.items()}},
              str(head / "model.safetensors"))
    eng = SpecEngine(target, DEFAULT_DRAFT, cuda_graphs=cuda_graphs, **KW)
    generate(eng, SAMPLED)
    assert len(eng.kv_cache.prefix) > 0
    eng.load_weights(new, which="draft")
    assert len(eng.kv_cache.prefix) == 0
    if not cuda_graphs:
        assert len(eng.drafter.prefix.cache) == 0
    got = generate(eng, SAMPLED)
    assert eng.stats.num_cached_prompt_tokens == 0
    fresh = SpecEngine(target, head, cuda_graphs=cuda_graphs, **KW)
    assert_same(got, generate(fresh, SAMPLED))


def test_small_lm_draft_and_policy_updates_clear_its_names(target: Path) -> None:
    """The small LM's own names go with every update: the draft's (its K/V changed) and the
    policy's (every name of either model goes); afterwards it equals a fresh engine."""
    eng = SpecEngine(target, str(target), **KW)
    generate(eng, GREEDY)
    drafter = eng.drafter
    assert isinstance(drafter, DraftModelDrafter) and len(drafter.prefix.cache) > 0
    new = perturbed(target, ("model.layers.0.mlp.down_proj.weight",), seed=2)
    eng.load_weights(new, which="draft")
    assert len(drafter.prefix.cache) == 0 and len(eng.kv_cache.prefix) == 0
    generate(eng, GREEDY)
    assert eng.stats.num_cached_prompt_tokens == 0 and len(drafter.prefix.cache) > 0
    eng.load_weights(new, which="policy")
    assert len(drafter.prefix.cache) == 0 and len(eng.kv_cache.prefix) == 0
    got = generate(eng, SAMPLED)
    assert eng.stats.num_cached_prompt_tokens == 0
    fresh = SpecEngine(target, str(target), **KW)
    fresh.load_weights(new, which="policy")
    fresh.load_weights(new, which="draft")
    assert_same(got, generate(fresh, SAMPLED))


def test_adapt_draft_clears_the_names(target: Path) -> None:
    """Online adaptation changes the head in place: every name, the target's (its blocks hold
    the head's entries on the static path) and the head's own, is dropped. With a rollout
    buffer, hits are refused anyway: adaptation trains on sequences from position 0."""
    for cuda_graphs in (False, True):
        eng = SpecEngine(target, DEFAULT_DRAFT, cuda_graphs=cuda_graphs,
                         draft_options={"adapt_buffer_tokens": 4096}, **KW)
        generate(eng, GREEDY)
        generate(eng, GREEDY)
        assert eng.stats.num_cached_prompt_tokens == 0  # refused: the buffer needs position 0
        assert len(eng.kv_cache.prefix) > 0
        eng.adapt_draft(steps=2)
        assert len(eng.kv_cache.prefix) == 0


def test_named_draft_blocks_give_way_when_the_draft_cache_runs_short(target: Path) -> None:
    """The small LM's named blocks nobody holds count as free: a draft cache full of them
    evicts them (least recently released first) when its running rows grow."""
    kw = {**KW, "kv_cache_tokens": 1536}  # 96 blocks: two 512-token prompts take 70
    eng = SpecEngine(target, str(target), **kw)
    other = [arith_prompt(3), arith_prompt(4)]
    generate(eng, GREEDY)
    drafter = eng.drafter
    assert isinstance(drafter, DraftModelDrafter)
    # (each released sequence names its 33 full blocks: 32 of prompt, 1 of completion)
    assert len(drafter.prefix.cache.evictable) == len(PROMPTS) * 33
    got = generate(eng, GREEDY, prompts=other)  # needs blocks only eviction can give
    assert drafter.prefix.cache.num_evicted > 0
    assert all(o.num_accepted_tokens == o.num_draft_tokens for o in got)
    want = generate(SpecEngine(target, str(target), enable_prefix_caching=False, **kw), GREEDY,
                    prompts=other)
    assert_same(got, want)
