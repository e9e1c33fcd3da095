"""A conversation's second turn prefills only the new turn (issue 25 item 5, docs/design.md
§17): a finishing (or aborted) sequence names its full blocks of valid KV, generated tokens
included, in the prefix cache, for the target and every drafter's own KV.

Turn 2's prompt is turn 1's prompt + completion + a new user turn. Its outputs (greedy tokens,
logprobs, and with EAGLE-3 the steps and accepted drafts) equal a cache-off engine's, and at
least 90% of turn 1's tokens come from the cache. Before every request each block no cache
names is overwritten with large random values (``poison_unnamed``), so a block named with KV
that was never written (the newest token's slot, holding a rejected draft or nothing; a draft
entry the head's catch-up did not write) changes tokens or acceptance. A weight update while
turn 1 runs leaves nothing of it to hit (its KV mixes weight versions); an aborted turn names
only its valid blocks; preemption names nothing bad; no KV block leaks.
"""

from __future__ import annotations

import random
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_prefix_cache_drafters import accepted_per_step, poison_unnamed

from specengine import SamplingParams, SpecEngine
from specengine import arith_task as task
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

BS = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
KW = dict(device="cpu", dtype="float32", max_model_len=256, kv_cache_tokens=2048)
TREE = [[0], [1], [0, 0], [0, 1], [0, 0, 0]]


def arith_prompt(seed: int, n: int) -> list[int]:
    """``n`` tokens of solved problems of the task the bundled pair was trained on."""
    rng, text = random.Random(seed), ""
    while len(text) < n:
        prompt, completion = task.make_problem(rng)
        text += prompt + completion
    return task.encode(text)[:n]


# Turn 1 is 120 + 40 = 160 and 136 + 40 = 176 tokens: whole blocks, so the block of the
# newest token (whose KV slot holds a rejected draft, or nothing) would be reused by turn 2 if
# it were named; the 9 and 10 blocks before it are (90% and 91% of the turn).
TURN1 = [arith_prompt(1, 120), arith_prompt(2, 136)]
NEW = [arith_prompt(3, 20), arith_prompt(4, 25)]


def run(engine: SpecEngine, prompts: list[list[int]], **kw: object) -> list:
    poison_unnamed(engine)
    return engine.generate(prompts, sampling=GREEDY, **kw)


def turn2(turn1: list[list[int]], outs: list) -> list[list[int]]:
    return [p + list(o.token_ids) + n for p, o, n in zip(turn1, outs, NEW)]


def assert_same(got: list, want: list, steps: bool = True) -> None:
    assert [o.token_ids for o in got] == [o.token_ids for o in want]
    if steps:
        assert [(o.num_steps, o.num_draft_tokens, o.num_accepted_tokens) for o in got] == [
            (o.num_steps, o.num_draft_tokens, o.num_accepted_tokens) for o in want]
    for a, b in zip(got, want):
        np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def assert_no_leak(engine: SpecEngine) -> None:
    """Idle: every block is free or named only by a cache; once the names go, all are free."""
    caches = [engine.kv_cache]
    own = getattr(getattr(engine.drafter, "neural", engine.drafter), "kv_cache", None)
    if own is not None and own is not engine.kv_cache:
        caches.append(own)
    for cache in caches:
        assert cache.num_free_blocks == cache.num_blocks
    engine.kv_cache.invalidate_prefix_cache()
    if engine.drafter is not None:
        engine.drafter.clear_prefix_cache()
    for cache in caches:
        assert int(cache.allocator.num_free) == cache.num_blocks


def check_two_turns(on: SpecEngine, off: SpecEngine, min_cached: list[int],
                    **kw: object) -> list:
    """Turn 1 then turn 2 on ``on`` (cached) and ``off``: equal outputs, turn 2 served
    from the cache for at least ``min_cached`` tokens each and >= 90% of turn 1's tokens."""
    first = run(on, TURN1, **kw)
    assert_same(first, run(off, TURN1, **kw))
    prompts = turn2(TURN1, first)
    got = run(on, prompts, **kw)
    stats = on.stats
    want = run(off, prompts, **kw)
    assert_same(got, want)
    assert off.stats.num_cached_prompt_tokens == 0 and all(o.num_cached_tokens == 0 for o in want)
    cached = [o.num_cached_tokens for o in got]
    assert stats.num_cached_prompt_tokens == sum(cached)
    for c, m, p, o in zip(cached, min_cached, TURN1, first):
        assert m <= c <= len(p) + len(o.token_ids)
        assert c >= 0.9 * (len(p) + len(o.token_ids))
    assert_no_leak(on)
    return got


# ---- equality and reuse --------------------------------------------------------------------
def test_k0_turn_two_reuses_turn_one_completion() -> None:
    """No drafter (the k = 0 baseline): every full block of turn 1 but the newest token's is
    reused (159 // 16 = 9 of 10 blocks, 175 // 16 = 10 of 11)."""
    on = SpecEngine(DEFAULT_TARGET, **KW)
    off = SpecEngine(DEFAULT_TARGET, enable_prefix_caching=False, **KW)
    check_two_turns(on, off, [9 * BS, 10 * BS], k=0)


@pytest.mark.parametrize("tree", [None, TREE], ids=["chain", "tree"])
@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "static"])
def test_eagle3_turn_two_equals_cache_off(cuda_graphs: bool, tree: list | None) -> None:
    """EAGLE-3 k = 3, chain and tree, eager (the head's own named blocks) and static (its
    entries in the target's blocks): turn 2 equals the cache-off engine's to the token, the
    step and the accepted draft."""
    on = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=cuda_graphs, **KW)
    off = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=cuda_graphs,
                     enable_prefix_caching=False, **KW)
    kw = {"k": 3} if tree is None else {"k": 3, "tree": tree}
    got = check_two_turns(on, off, [9 * BS, 10 * BS], **kw)
    assert accepted_per_step(got) > 0.5  # the head drafts well on its task


def test_mtp_turn_two_is_served_from_the_cache(tmp_path: Path) -> None:
    """MTP layers (a FeatureDrafter like the head), eager and static."""
    from checkpoints import make_hf_model, save_checkpoint
    from test_mtp import add_mtp_weights

    hf = make_hf_model("qwen3", vocab_size=20, mtp_num_hidden_layers=1)
    path = save_checkpoint(hf, tmp_path / "mtp")
    add_mtp_weights(hf, path)
    for cuda_graphs in (False, True):
        on = SpecEngine(path, "mtp", cuda_graphs=cuda_graphs, **KW)
        off = SpecEngine(path, "mtp", cuda_graphs=cuda_graphs, enable_prefix_caching=False,
                         **KW)
        check_two_turns(on, off, [9 * BS, 10 * BS], k=2)


@pytest.mark.parametrize("cuda_graphs", [False, True], ids=["eager", "static"])
def test_small_lm_turn_two_reuses_its_own_blocks(cuda_graphs: bool) -> None:
    """The target as its own small-LM draft (every greedy draft is accepted unless the draft
    reads K/V it did not write): its own cache names turn 1's blocks up to its last cached
    token, so its turn-2 prompt pass reuses them, and every draft is still accepted."""
    on = SpecEngine(DEFAULT_TARGET, str(DEFAULT_TARGET), cuda_graphs=cuda_graphs, **KW)
    off = SpecEngine(DEFAULT_TARGET, str(DEFAULT_TARGET), cuda_graphs=cuda_graphs,
                     enable_prefix_caching=False, **KW)
    first = run(on, TURN1, k=3)
    before = on.drafter.prefix.num_reused_tokens
    prompts = turn2(TURN1, first)
    got = run(on, prompts, k=3)
    assert_same(got, run(off, prompts, k=3))
    assert all(o.num_accepted_tokens == o.num_draft_tokens > 0 for o in got)
    # (the LM's K/V of turn 1 ends a token or two before its newest: 9 and 10 blocks)
    assert on.drafter.prefix.num_reused_tokens - before == (9 + 10) * BS
    assert_no_leak(on)


def test_ngram_turn_two_is_served_from_the_cache() -> None:
    """n-gram drafts (no KV of their own): verify writes the KV of rejected drafts into the
    slots after the accepted path; none of them is named."""
    on = SpecEngine(DEFAULT_TARGET, "ngram", **KW)
    off = SpecEngine(DEFAULT_TARGET, "ngram", enable_prefix_caching=False, **KW)
    got = check_two_turns(on, off, [9 * BS, 10 * BS], k=3)
    assert sum(o.num_draft_tokens for o in got) > sum(o.num_accepted_tokens for o in got) > 0


# ---- what must not be named ----------------------------------------------------------------
def perturbed_target() -> dict[str, torch.Tensor]:
    tensors = load_file(Path(DEFAULT_TARGET) / "model.safetensors")
    g = torch.Generator().manual_seed(3)
    names = [n for n in tensors if "mlp.down_proj" in n]
    return {n: (tensors[n].float() * (1 + 0.5 * torch.randn(tensors[n].shape, generator=g)))
            .to(torch.bfloat16).float() for n in names}


def run_with_update(engine: SpecEngine, prompts: list[list[int]], update_after: int,
                    **kw: object) -> list:
    """Turn 1 through the step API, a policy update after ``update_after`` steps (the KV
    computed so far is kept: ``kv_on_update="keep"``)."""
    poison_unnamed(engine)
    ids = [engine.add_request(p, GREEDY, **kw) for p in prompts]
    done: dict[str, object] = {}
    steps = 0
    while engine.has_unfinished():
        for out in engine.step():
            if out.finished:
                done[out.request_id] = out.output
        steps += 1
        if steps == update_after:
            engine.load_weights(perturbed_target())
    return [done[i] for i in ids]


@pytest.mark.parametrize("draft", [None, DEFAULT_DRAFT, str(DEFAULT_TARGET)],
                         ids=["k0", "eagle3", "small_lm"])
def test_a_turn_spanning_a_weight_update_names_nothing(draft: str | None) -> None:
    """Turn 1's KV before the update is of the old weights: none of its blocks may be named
    at its end (for the target or the head), so turn 2 is computed whole and equals a fresh
    engine's with the new weights."""
    kw = {"k": 0 if draft is None else 3}
    eng = SpecEngine(DEFAULT_TARGET, draft, **KW)
    first = run_with_update(eng, TURN1, update_after=4, **kw)
    assert len(eng.kv_cache.prefix) == 0
    if draft is not None:  # nor the drafter's own blocks
        assert len(eng.drafter.prefix.cache) == 0
    prompts = turn2(TURN1, first)
    got = run(eng, prompts, **kw)
    assert eng.stats.num_cached_prompt_tokens == 0
    fresh = SpecEngine(DEFAULT_TARGET, draft, **KW)
    fresh.load_weights(perturbed_target())
    assert_same(got, run(fresh, prompts, **kw))
    assert_no_leak(eng)


def test_an_update_between_turns_leaves_nothing_to_hit() -> None:
    eng = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, **KW)
    first = run(eng, TURN1, k=3)
    eng.load_weights(perturbed_target())
    run(eng, turn2(TURN1, first), k=3)
    assert eng.stats.num_cached_prompt_tokens == 0


def test_aborted_turn_names_its_valid_blocks() -> None:
    """A request aborted mid-way names its full blocks up to the position before its newest
    token; a conversation continuing from its tokens reuses them with the cache-off output."""
    on = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, **KW)
    off = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, enable_prefix_caching=False, **KW)
    poison_unnamed(on)
    rid = on.add_request(TURN1[0], GREEDY, k=3)
    for _ in range(6):
        on.step()
    out = on.abort(rid).output
    assert out.finish_reason == "abort" and 0 < len(out.token_ids) < GREEDY.max_tokens
    n = len(TURN1[0]) + len(out.token_ids)
    prompts = [TURN1[0] + list(out.token_ids) + NEW[0]]
    got = run(on, prompts, k=3)
    assert got[0].num_cached_tokens == (n - 1) // BS * BS
    assert_same(got, run(off, prompts, k=3))
    assert_no_leak(on)


def test_preempted_turns_name_nothing_bad() -> None:
    """A cache too small for both turns at once: sequences are preempted and re-prefilled
    (prompt + generated tokens); turn 2 still equals the cache-off engine's."""
    kw = dict(KW, kv_cache_tokens=18 * BS, max_batch_size=2)
    on = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, **kw)
    off = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, enable_prefix_caching=False, **kw)
    first = run(on, TURN1, k=3)
    assert on.scheduler.num_preemptions > 0
    assert_same(first, run(off, TURN1, k=3), steps=False)
    prompts = turn2(TURN1, first)
    assert_same(run(on, prompts, k=3), run(off, prompts, k=3), steps=False)
    assert_no_leak(on)


def test_static_head_names_no_block_of_a_k0_turn() -> None:
    """On the static path the head's entries live in the target's blocks and a k = 0 request
    never runs the head past its prompt: its generated blocks are not named, so a k = 3 turn 2
    computes them (with the head's entries) and accepts as the cache-off engine does."""
    on = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=True, **KW)
    off = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, cuda_graphs=True,
                     enable_prefix_caching=False, **KW)
    first = run(on, TURN1, k=0)
    prompts = turn2(TURN1, first)
    got = run(on, prompts, k=3)
    assert on.stats.num_cached_prompt_tokens == 0
    assert_same(got, run(off, prompts, k=3))


def test_eager_head_names_only_entries_its_catch_up_wrote() -> None:
    """The head's catch-up skips a sequence's finishing step, so its entries of that step's
    positions hold the step's tree drafts: its own blocks are named up to its last catch-up.
    Turn 1 is 106 + 40 = 146 tokens and its last step starts before position 144: the target
    names 9 blocks, the head 8, and turn 2's hit is cut to the 8 both hold (naming the head's
    9th changes turn 2's acceptance: 21 steps instead of 20)."""
    on = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, **KW)
    off = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, enable_prefix_caching=False, **KW)
    turn1, kw = [arith_prompt(1, 106)], {"k": 3, "tree": TREE}
    first = run(on, turn1, **kw)
    assert len(on.kv_cache.prefix) == 145 // BS and len(on.drafter.prefix.cache) == 8
    prompts = [turn1[0] + list(first[0].token_ids) + NEW[0]]
    got = run(on, prompts, **kw)
    assert got[0].num_cached_tokens == 8 * BS
    assert_same(got, run(off, prompts, **kw))


def test_eager_head_names_nothing_past_a_skipped_catch_up() -> None:
    """A step whose catch-up the head skips (as a k="auto" step at k = 0 does; here its
    ``observe`` is skipped once, at the 8th call) leaves entries unwritten: the head's
    blocks are named only up to there (its later catch-ups do not fill the gap), so turn 2's
    hit stops there and its acceptance equals the cache-off engine's (naming past the gap:
    39 steps instead of 21)."""
    on = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, **KW)
    off = SpecEngine(DEFAULT_TARGET, DEFAULT_DRAFT, enable_prefix_caching=False, **KW)
    drafter, calls = on.drafter, []
    observe = drafter.observe

    def skipping(seqs: tuple, target: object, rows: list) -> None:
        calls.append(1)
        if len(calls) != 8:
            observe(seqs, target, rows)

    drafter.observe = skipping
    first = run(on, TURN1[:1], k=3)
    del drafter.observe
    prompts = [TURN1[0] + list(first[0].token_ids) + NEW[0]]
    got = run(on, prompts, k=3)
    assert 0 < got[0].num_cached_tokens < (len(prompts[0]) - len(NEW[0]) - 1) // BS * BS
    assert_same(got, run(off, prompts, k=3))


# ---- over HTTP ---------------------------------------------------------------------------------
def test_openai_chat_second_turn_reports_cached_tokens() -> None:
    """Two chat turns through the real ``openai`` client against a live server (EAGLE-3,
    k=3): turn 2's ``usage.prompt_tokens_details.cached_tokens`` (vLLM's field) counts turn
    1's prompt and answer, in full blocks, and its answer equals a cache-off engine's."""
    import asyncio

    openai = pytest.importorskip("openai")
    pytest.importorskip("jinja2")
    from server_helpers import WAIT_S, bundled_engine, running_server

    from specengine import AsyncSpecEngine

    rng, text = random.Random(6), ""
    while len(text) < 110:  # solved problems, then a question: "Q:" + content
        prompt, completion = task.make_problem(rng)
        text += prompt + completion
    content = text[2:] + task.make_problem(rng)[0]
    aeng = AsyncSpecEngine(bundled_engine(), max_waiting=8)
    try:
        with running_server(aeng) as (server, _client):
            client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1",
                                   api_key="none", max_retries=0, timeout=WAIT_S)
            model = client.models.list().data[0].id
            kw = dict(model=model, temperature=0, max_tokens=64,
                      extra_body={"k": 3, "return_token_ids": True})
            messages = [{"role": "user", "content": content}]
            one = client.chat.completions.create(messages=messages, **kw)
            assert one.usage.prompt_tokens_details.cached_tokens == 0
            messages += [{"role": "assistant", "content": one.choices[0].message.content},
                         {"role": "user", "content": "361+220="}]
            two = client.chat.completions.create(messages=messages, **kw)
    finally:
        asyncio.run(aeng.close())
    turn1 = list(one.prompt_token_ids) + list(one.choices[0].token_ids)
    assert list(two.prompt_token_ids[: len(turn1)]) == turn1  # the template re-renders it
    cached = two.usage.prompt_tokens_details.cached_tokens
    # every full block of turn 1 but its newest token's (the head caught up on them all)
    assert cached == (len(turn1) - 1) // BS * BS >= 0.9 * len(turn1)
    off = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", kernel_backend="torch",
                     kv_cache_tokens=4096, enable_prefix_caching=False)
    want = off.generate([list(two.prompt_token_ids)], k=3,
                        sampling=SamplingParams(temperature=0.0, max_tokens=64))[0]
    assert list(two.choices[0].token_ids) == list(want.token_ids)
