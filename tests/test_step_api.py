"""The step API (``add_request`` / ``step`` / ``abort``): requests that join while others run get
exactly ``generate``'s outputs, per-request k, and no KV block leaks under random add / abort /
step events (docs/design.md §1, §3)."""

from __future__ import annotations

import random
from collections import Counter
from pathlib import Path

import pytest
from readme_blocks import run_readme_blocks

from specengine import SamplingParams, SpecEngine
from specengine.arith_task import heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.model.weight_names import hf_named_tensors
from specengine.outputs import GenerationOutput, RequestOutput


@pytest.fixture(scope="module")
def pair() -> SpecEngine:
    return SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", kernel_backend="torch",
                      max_batch_size=8)


@pytest.fixture(scope="module")
def static_pair() -> SpecEngine:
    """The padded static path (CUDA graphs' shapes, run without capture on the CPU)."""
    return SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", kernel_backend="torch",
                      max_batch_size=8, cuda_graphs=True)


@pytest.fixture(params=["eager", "static"])
def engine(request: pytest.FixtureRequest) -> SpecEngine:
    return request.getfixturevalue("pair" if request.param == "eager" else "static_pair")


def arith_prompts(n: int) -> list[str]:
    return heldout_prompts(n, seed=3)


def params_for(n: int, sampled: bool) -> list[SamplingParams]:
    if sampled:
        return [SamplingParams(temperature=1.0, max_tokens=12 + i, seed=100 + i)
                for i in range(n)]
    return [SamplingParams(temperature=0.0, max_tokens=12 + i) for i in range(n)]


def run_staggered(engine: SpecEngine, prompts: list, params: list[SamplingParams],
                  ks: list[int], every: int = 2) -> dict[str, tuple[GenerationOutput, list[int]]]:
    """Add three requests, step ``every`` times, add three more, …, then step to the end.
    Returns request id -> (output, concatenated new_token_ids of every step)."""
    streamed: dict[str, list[int]] = {}
    done: dict[str, GenerationOutput] = {}
    ids: list[str] = []

    def take(outs: list[RequestOutput]) -> None:
        for out in outs:
            assert out.request_id not in done, "a request was reported after it finished"
            streamed[out.request_id].extend(out.new_token_ids)
            if out.finished:
                done[out.request_id] = out.output  # type: ignore[assignment]

    for start in range(0, len(prompts), 3):
        for i in range(start, min(start + 3, len(prompts))):
            rid = engine.add_request(prompts[i], params[i], k=ks[i], request_id=f"r{i}")
            streamed[rid] = []
            ids.append(rid)
        for _ in range(every):
            take(engine.step())
    while engine.has_unfinished():
        take(engine.step())
    assert engine.step() == []  # idle
    return {rid: (done[rid], streamed[rid]) for rid in ids}


def assert_same(got: GenerationOutput, want: GenerationOutput) -> None:
    assert got.token_ids == want.token_ids
    assert got.finish_reason == want.finish_reason
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


@pytest.mark.parametrize("k", [0, 3])
@pytest.mark.parametrize("sampled", [False, True])
def test_requests_joining_midway_equal_generate(pair: SpecEngine, k: int, sampled: bool) -> None:
    prompts = arith_prompts(7)
    params = params_for(len(prompts), sampled)
    expected = pair.generate(prompts, k=k, sampling=params)
    got = run_staggered(pair, prompts, params, [k] * len(prompts))
    for i, want in enumerate(expected):
        out, streamed = got[f"r{i}"]
        assert_same(out, want)
        assert tuple(streamed) == out.token_ids  # the steps' new tokens add up to the output
        assert out.text == want.text
    assert pair.kv_cache.num_free_blocks == pair.kv_cache.num_blocks
    assert pair.drafter.kv_cache.num_free_blocks == pair.drafter.kv_cache.num_blocks
    assert pair.graphs.verifier.state.num_rows == 0
    if k:
        assert pair.stats.num_draft_tokens > 0  # the span's stats counted the drafts


@pytest.mark.parametrize("sampled", [False, True])
def test_mixed_k_requests_equal_separate_generate_calls(engine: SpecEngine, sampled: bool) -> None:
    """Each request keeps its own k: a step verifies each (k, tree) group separately, so every
    request gets what a ``generate`` call with its k gives (sampled tokens depend on k)."""
    prompts = arith_prompts(6)
    params = params_for(len(prompts), sampled)
    ks = [0, 3, 1, 3, 0, 2]
    expected = {}
    for k in sorted(set(ks)):
        idx = [i for i, kk in enumerate(ks) if kk == k]
        outs = engine.generate([prompts[i] for i in idx], k=k, sampling=[params[i] for i in idx])
        expected.update(zip(idx, outs))
    got = run_staggered(engine, prompts, params, ks, every=1)
    for i in range(len(prompts)):
        out, streamed = got[f"r{i}"]
        assert_same(out, expected[i])
        assert tuple(streamed) == out.token_ids
        if ks[i] == 0:
            assert out.num_draft_tokens == 0
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    if engine.graphs.static:  # the static verify, draft and catch-up passes really ran
        assert all(engine.graphs.num_runs[kind] > 0 for kind in ("verify", "draft", "observe"))


def test_tree_and_chain_requests_together(pair: SpecEngine) -> None:
    prompts = arith_prompts(4)
    params = params_for(4, sampled=False)
    tree = [(0,), (1,), (0, 0), (0, 0, 0)]
    want_tree = pair.generate(prompts[:2], sampling=params[:2], tree=tree)
    want_chain = pair.generate(prompts[2:], k=2, sampling=params[2:])
    ids = [pair.add_request(p, sp, tree=tree) for p, sp in zip(prompts[:2], params[:2])]
    ids += [pair.add_request(p, sp, k=2) for p, sp in zip(prompts[2:], params[2:])]
    done = {}
    while pair.has_unfinished():
        done.update((o.request_id, o.output) for o in pair.step() if o.finished)
    for rid, want in zip(ids, want_tree + want_chain):
        assert_same(done[rid], want)


def test_abort_mid_generation_frees_at_once(engine: SpecEngine) -> None:
    prompts = arith_prompts(3)
    params = params_for(3, sampled=False)
    expected = engine.generate(prompts, k=3, sampling=params)
    ids = [engine.add_request(p, sp, k=3) for p, sp in zip(prompts, params)]
    seen: dict[str, list[int]] = {rid: [] for rid in ids}
    for _ in range(3):  # prefill + two verify steps
        for out in engine.step():
            seen[out.request_id].extend(out.new_token_ids)
    held = len(engine.core.requests[ids[1]].seq.block_table)
    assert held > 0
    free_before = engine.kv_cache.num_free_blocks
    aborted = engine.abort(ids[1])
    assert engine.kv_cache.num_free_blocks == free_before + held  # freed now, not at a step
    assert aborted.finished and aborted.output is not None
    assert aborted.output.finish_reason == "abort"
    assert aborted.output.token_ids == tuple(seen[ids[1]])  # what was made so far
    assert aborted.output.token_ids == expected[1].token_ids[:len(seen[ids[1]])]
    assert aborted.new_token_ids == ()
    assert engine.drafter.num_states == 2  # the drafter let go of its state too
    done = {}
    while engine.has_unfinished():
        for out in engine.step():
            assert out.request_id != ids[1]
            if out.finished:
                done[out.request_id] = out.output
    assert_same(done[ids[0]], expected[0])
    assert_same(done[ids[2]], expected[2])
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.drafter.kv_cache.num_free_blocks == engine.drafter.kv_cache.num_blocks


def test_bad_request_ids_raise_and_change_nothing(pair: SpecEngine) -> None:
    prompt = arith_prompts(1)[0]
    greedy = SamplingParams(temperature=0.0, max_tokens=4)
    rid = pair.add_request(prompt, greedy, request_id="a")
    assert rid == "a"
    with pytest.raises(ValueError, match="'a' is already used"):
        pair.add_request(prompt, greedy, request_id="a")
    for bad in ("", 7):
        with pytest.raises(ValueError, match="request_id must be a non-empty str"):
            pair.add_request(prompt, greedy, request_id=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="k .* must be an int"):
        pair.add_request(prompt, greedy, k=99)
    with pytest.raises(ValueError, match="params must be a SamplingParams"):
        pair.add_request(prompt, {"temperature": 0.0})  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="unknown request id 'nope'"):
        pair.abort("nope")
    with pytest.raises(RuntimeError, match="generate needs an idle engine"):
        pair.generate([prompt])
    assert pair.core.num_unfinished == 1  # only "a"
    auto = pair.add_request(prompt, greedy)
    assert auto != "a"
    while pair.has_unfinished():
        pair.step()
    with pytest.raises(ValueError, match="'a' already finished"):
        pair.abort("a")
    # A finished id may be used again.
    assert pair.add_request(prompt, greedy, request_id="a") == "a"
    assert pair.abort("a").output.finish_reason == "abort"  # type: ignore[union-attr]
    assert not pair.has_unfinished()
    assert pair.kv_cache.num_free_blocks == pair.kv_cache.num_blocks


def test_weight_update_applies_between_steps_of_unfinished_requests(pair: SpecEngine) -> None:
    """In flight (docs/design.md §4; tests/test_inflight_updates.py covers it in depth)."""
    norm = "model.norm.weight"
    same = {norm: hf_named_tensors(pair.model)[norm].detach().clone()}
    rid = pair.add_request(arith_prompts(1)[0], SamplingParams(temperature=0.0, max_tokens=4))
    pair.step()
    version = pair.weight_version
    assert pair.load_weights(same) == version + 1  # no refusal, no draining
    out = pair.abort(rid).output
    assert out is not None and out.token_weight_versions == (version,)
    assert out.weight_version == version + 1


# ---- random add / abort / step events ---------------------------------------------------------
def kv_accounting(engine: SpecEngine) -> None:
    """Free blocks + blocks held by live sequences == all blocks, none held twice; the same for
    a drafter with its own cache."""
    live = [r.seq for r in engine.core.requests.values()]
    held = Counter(b for s in live for b in s.block_table)  # shared prompt blocks (§17)
    named = set(engine.kv_cache.prefix.hash_of) if engine.kv_cache.prefix is not None else set()
    refs = engine.kv_cache.allocator.ref_counts().tolist()
    assert refs == [held[b] + (b in named) for b in range(len(refs))]
    assert engine.kv_cache.num_free_blocks + len(held) == engine.kv_cache.num_blocks
    cache = getattr(engine.drafter, "kv_cache", None)
    if cache is not None:
        states = engine.drafter._states  # type: ignore[union-attr]
        assert set(states) <= {s.seq_id for s in live}
        dheld = [b for st in states.values() for b in st.block_table]
        assert len(dheld) == len(set(dheld))
        assert cache.num_free_blocks + len(dheld) == cache.num_blocks


@pytest.mark.parametrize("draft,num_events", [("ngram", 10_000), ("self", 1_500)])
def test_random_add_abort_step_events_leak_nothing(tiny_checkpoint: Path, draft: str,
                                                   num_events: int) -> None:
    """A small cache (preemption happens), k in {0, 2}, greedy: after every event the blocks
    add up, and every request that finishes has the reference output of its prompt."""
    engine = SpecEngine(tiny_checkpoint, draft=str(tiny_checkpoint) if draft == "self" else draft,
                        device="cpu", dtype="float32", max_model_len=64, max_batch_size=8,
                        kv_cache_tokens=96)
    rng = random.Random(0)
    pool = [[rng.randrange(128) for _ in range(rng.randrange(1, 20))] for _ in range(12)]
    greedy = SamplingParams(temperature=0.0, max_tokens=8)
    reference = [o.token_ids for o in engine.generate(pool, sampling=greedy)]
    live: dict[str, tuple[int, int, list[int]]] = {}  # id -> (prompt, max_tokens, streamed)
    finished = aborted = 0
    next_id = 0
    for _ in range(num_events):
        roll = rng.random()
        if roll < 0.25 and len(live) < 10:
            p, m = rng.randrange(len(pool)), rng.randrange(1, 9)
            rid = engine.add_request(pool[p], SamplingParams(temperature=0.0, max_tokens=m),
                                     k=rng.choice((0, 2)), request_id=f"q{next_id}")
            next_id += 1
            live[rid] = (p, m, [])
        elif roll < 0.35 and live:
            rid = rng.choice(sorted(live))
            p, m, streamed = live.pop(rid)
            out = engine.abort(rid)
            assert out.finished and out.output is not None
            assert out.output.finish_reason == "abort"
            assert out.output.token_ids == tuple(streamed) + out.new_token_ids
            assert out.output.token_ids == reference[p][:len(out.output.token_ids)]
            aborted += 1
            with pytest.raises(ValueError, match="already finished"):
                engine.abort(rid)
        else:
            for out in engine.step():
                p, m, streamed = live[out.request_id]
                streamed.extend(out.new_token_ids)
                if out.finished:
                    del live[out.request_id]
                    assert out.output.token_ids == tuple(streamed)  # type: ignore[union-attr]
                    assert out.output.token_ids == reference[p][:m]  # type: ignore[union-attr]
                    finished += 1
        kv_accounting(engine)
        assert engine.core.num_unfinished == len(live)
    while engine.has_unfinished():
        engine.step()
        kv_accounting(engine)
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.scheduler.num_preemptions > 0
    assert finished > 100 and aborted > 50


def test_readme_step_api_example_runs(capsys: pytest.CaptureFixture[str]) -> None:
    """The README's step-API block, after its first Usage block (which makes ``engine``)."""
    ns = run_readme_blocks("## Usage\n", "### The step API")
    engine = ns["engine"]
    assert not engine.has_unfinished()  # type: ignore[attr-defined]
    printed = capsys.readouterr().out
    assert "aborted abort" in printed and f"{ns['rid']} '" in printed
    assert ns["final"].output.token_ids == tuple(ns["tokens"]["plain"])  # type: ignore[index]
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks  # type: ignore[attr-defined]
