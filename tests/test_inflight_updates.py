"""Weight updates while requests run (docs/design.md §4, ``specengine.core.inflight``): applied
between two steps without draining, every token stamped with the version that produced it;
``kv_on_update="recompute"`` makes the tokens after the switch exactly a fresh engine's with the
new weights, ``"keep"`` keeps the old KV; a draft update in flight changes acceptance only; a
bad update changes nothing; ``max_policy_lag`` ends requests that fall too far behind."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from pathlib import Path

import pytest
import torch
from checkpoints import make_hf_model, save_checkpoint

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.arith_task import heldout_prompts
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.model.config import CheckpointError
from specengine.model.weight_names import hf_named_tensors
from specengine.outputs import GenerationOutput, RequestOutput
from specengine.weights import WeightSender

PROMPTS = [[1, 2, 3], [7, 8, 9, 10, 11], [40, 41]]
MAX_TOKENS = 14


def greedy(max_tokens: int = MAX_TOKENS) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)


def tiny_engine(path: Path, **kwargs: object) -> SpecEngine:
    return SpecEngine(path, device="cpu", dtype="float32", max_model_len=64,
                      kv_cache_tokens=1024, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def new_weights(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """A second random model of the tiny checkpoint's shapes: the learner's "new" policy."""
    hf = make_hf_model("qwen3", seed=7)
    return hf.state_dict(), save_checkpoint(hf, tmp_path_factory.mktemp("new_policy"))


def add_all(engine: SpecEngine, k: int = 0, prompts: list = PROMPTS,
            params: SamplingParams | None = None) -> list[str]:
    return [engine.add_request(p, params or greedy(), k=k) for p in prompts]


def step_n(engine: SpecEngine, n: int, seen: dict[str, list[int]],
           done: dict[str, GenerationOutput]) -> None:
    """``n`` steps (or until idle), collecting streamed tokens and finished outputs."""
    for _ in range(n):
        if not engine.has_unfinished():
            return
        take(engine.step(), seen, done)


def take(outs: list[RequestOutput], seen: dict[str, list[int]],
         done: dict[str, GenerationOutput]) -> None:
    for out in outs:
        assert out.request_id not in done, "reported after it finished"
        seen.setdefault(out.request_id, []).extend(out.new_token_ids)
        if out.output is not None:
            done[out.request_id] = out.output


def assert_no_leak(engine: SpecEngine) -> None:
    assert not engine.has_unfinished()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    cache = getattr(engine.drafter, "kv_cache", None)
    if cache is not None:
        assert cache.num_free_blocks == cache.num_blocks


@pytest.mark.parametrize("k,cuda_graphs,via", [(0, False, "load"), (2, False, "load"),
                                               (2, True, "load"), (2, True, "shared")])
def test_recompute_continues_exactly_as_a_fresh_engine(
        tiny_checkpoint: Path, new_weights: tuple[dict, Path], k: int, cuda_graphs: bool,
        via: str) -> None:
    state_dict, new_dir = new_weights
    engine = tiny_engine(tiny_checkpoint, draft=str(tiny_checkpoint) if k else None,
                         cuda_graphs=cuda_graphs, kv_on_update="recompute")
    ids = add_all(engine, k)
    seen: dict[str, list[int]] = {}
    done: dict[str, GenerationOutput] = {}
    step_n(engine, 3, seen, done)
    before = {rid: list(seen[rid]) for rid in ids}
    assert all(0 < len(t) < MAX_TOKENS for t in before.values())
    preemptions = engine.scheduler.num_preemptions
    if via == "load":
        assert engine.load_weights(state_dict) == 1  # mid-flight: no refusal, no draining
    else:  # the colocated transport, in one process (its byte path needs no second one)
        handles = WeightSender(transport="shared").send(state_dict, 1, full=True)
        assert engine.update_weights_from_shared(handles) == 1
    assert engine.scheduler.num_preemptions == preemptions + len(ids)  # all re-prefilled
    step_n(engine, 10 * MAX_TOKENS, seen, done)
    assert_no_leak(engine)
    fresh = tiny_engine(new_dir).generate(
        [p + before[rid] for p, rid in zip(PROMPTS, ids)],
        sampling=[greedy(MAX_TOKENS - len(before[rid])) for rid in ids])
    for rid, want in zip(ids, fresh):
        out, n = done[rid], len(before[rid])
        assert out.token_ids[:n] == tuple(before[rid])
        assert out.token_ids[n:] == want.token_ids
        assert out.logprobs[n:] == pytest.approx(want.logprobs, abs=1e-4)
        assert out.token_weight_versions == (0,) * n + (1,) * (MAX_TOKENS - n)
        assert out.weight_version == 1 and out.finish_reason == "length"
        assert tuple(seen[rid]) == out.token_ids


def test_keep_stamps_exact_versions_without_recomputing(
        tiny_checkpoint: Path, new_weights: tuple[dict, Path]) -> None:
    engine = tiny_engine(tiny_checkpoint)  # kv_on_update="keep" is the default
    assert engine.config.kv_on_update == "keep"
    ids = add_all(engine)
    seen: dict[str, list[int]] = {}
    done: dict[str, GenerationOutput] = {}
    step_n(engine, 2, seen, done)
    n1 = {rid: len(seen[rid]) for rid in ids}
    preemptions = engine.scheduler.num_preemptions
    engine.load_weights(new_weights[0])
    step_n(engine, 3, seen, done)
    n2 = {rid: len(seen[rid]) for rid in ids}
    engine.load_weights(new_weights[0], version=7)  # a second update, an explicit version
    step_n(engine, 10 * MAX_TOKENS, seen, done)
    assert engine.scheduler.num_preemptions == preemptions  # the old KV was kept
    assert_no_leak(engine)
    for rid in ids:
        out = done[rid]
        assert out.finish_reason == "length" and len(out.token_ids) == MAX_TOKENS
        assert tuple(seen[rid]) == out.token_ids
        assert out.token_weight_versions == ((0,) * n1[rid] + (1,) * (n2[rid] - n1[rid])
                                             + (7,) * (MAX_TOKENS - n2[rid]))
        assert out.weight_version == 7


@pytest.fixture(scope="module")
def pairs() -> dict[bool, SpecEngine]:
    """The bundled EAGLE-3 pair, eager and on the padded static path."""
    return {g: SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu",
                          kernel_backend="torch", max_batch_size=8, cuda_graphs=g)
            for g in (False, True)}


@pytest.mark.parametrize("drafter", ["eagle3", "small-lm"])
@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_draft_update_in_flight_changes_acceptance_only(
        pairs: dict[bool, SpecEngine], tiny_checkpoint: Path, drafter: str,
        cuda_graphs: bool) -> None:
    if drafter == "eagle3":
        engine = pairs[cuda_graphs]
        prompts: list = heldout_prompts(3, seed=5)
        params = SamplingParams(temperature=0.0, max_tokens=16)
    else:
        engine = tiny_engine(tiny_checkpoint, draft=str(tiny_checkpoint), cuda_graphs=cuda_graphs)
        prompts, params = PROMPTS, greedy()
    expected = engine.generate(prompts, k=0, sampling=params)
    names = hf_named_tensors(engine.drafter.module)  # type: ignore[union-attr]
    gen = torch.Generator().manual_seed(0)
    stale = {n: t.detach() + 0.5 * torch.randn(t.shape, generator=gen)
             for n, t in names.items() if t.is_floating_point()}
    original = {n: t.detach().clone() for n, t in stale.items()}
    ids = add_all(engine, 3, prompts, params)
    seen: dict[str, list[int]] = {}
    done: dict[str, GenerationOutput] = {}
    step_n(engine, 2, seen, done)
    version = engine.load_weights(stale.items(), which="draft")
    step_n(engine, 2, seen, done)
    engine.load_weights(original.items(), which="draft")  # a second draft update in flight
    step_n(engine, 200, seen, done)
    assert_no_leak(engine)
    for rid, want in zip(ids, expected):
        assert done[rid].token_ids == want.token_ids  # the policy's tokens, whatever the draft
        assert done[rid].logprobs == pytest.approx(want.logprobs, abs=1e-4)
        assert set(done[rid].token_weight_versions) <= {version - 1, version, version + 1}
    assert engine.stats.num_accepted_tokens > 0  # drafting resumed after the updates


@pytest.mark.parametrize("bad", ["name", "shape"])
def test_bad_update_in_flight_changes_nothing(tiny_checkpoint: Path, bad: str) -> None:
    engine = tiny_engine(tiny_checkpoint, kv_on_update="recompute")
    expected = engine.generate(PROMPTS, sampling=greedy())
    ids = add_all(engine)
    seen: dict[str, list[int]] = {}
    done: dict[str, GenerationOutput] = {}
    step_n(engine, 3, seen, done)
    sd = {n: p + 1.0 for n, p in make_hf_model("qwen3", seed=3).state_dict().items()}
    if bad == "name":
        sd["model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    else:
        sd["model.norm.weight"] = torch.zeros(3)
    preemptions = engine.scheduler.num_preemptions
    with pytest.raises(CheckpointError, match="weights do not match"):
        engine.load_weights(sd)
    assert engine.weight_version == 0
    assert engine.scheduler.num_preemptions == preemptions  # no KV policy applied either
    step_n(engine, 10 * MAX_TOKENS, seen, done)
    assert_no_leak(engine)
    for rid, want in zip(ids, expected):
        assert done[rid].token_ids == want.token_ids
        assert done[rid].token_weight_versions == (0,) * MAX_TOKENS


def test_max_policy_lag_ends_lagging_requests(tiny_checkpoint: Path,
                                              new_weights: tuple[dict, Path]) -> None:
    engine = tiny_engine(tiny_checkpoint, max_policy_lag=1)
    seen: dict[str, list[int]] = {}
    done: dict[str, GenerationOutput] = {}
    old = engine.add_request(PROMPTS[0], greedy())
    step_n(engine, 2, seen, done)
    engine.load_weights(new_weights[0])  # lag 1: allowed
    young = engine.add_request(PROMPTS[1], greedy())  # waiting, no tokens yet
    step_n(engine, 2, seen, done)
    assert not done
    engine.load_weights(new_weights[0])  # lag 2 for `old`: it ends now, its KV freed at once
    held = sum(len(r.seq.block_table) for r in engine.core.requests.values())
    assert engine.kv_cache.num_free_blocks + held == engine.kv_cache.num_blocks
    assert len(engine.core.requests[old].seq.block_table) == 0
    outs = engine.step()  # reports it; `young` steps on
    ended = [o for o in outs if o.request_id == old]
    assert len(ended) == 1 and ended[0].finished and ended[0].new_token_ids == ()
    out = ended[0].output
    assert out is not None and out.finish_reason == "policy_lag"
    assert out.token_ids == tuple(seen[old]) and 0 < len(out.token_ids) < MAX_TOKENS
    assert out.token_weight_versions[0] == 0 and out.token_weight_versions[-1] == 1
    take(outs, seen, done)
    step_n(engine, 10 * MAX_TOKENS, seen, done)
    assert done[young].finish_reason == "length"  # its oldest token is version 1: lag 1
    assert_no_leak(engine)
    with pytest.raises(ValueError, match="max_policy_lag"):
        tiny_engine(tiny_checkpoint, max_policy_lag=-1)
    with pytest.raises(ValueError, match="kv_on_update"):
        tiny_engine(tiny_checkpoint, kv_on_update="drop")


def test_update_through_run_in_engine_while_streaming(
        tiny_checkpoint: Path, new_weights: tuple[dict, Path]) -> None:
    engine = SpecEngine(tiny_checkpoint, device="cpu", dtype="float32", max_model_len=512,
                        kv_cache_tokens=1024)
    total = 300
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)

    def update(e: SpecEngine) -> tuple[bool, int]:  # on the engine thread, between steps
        return e.has_unfinished(), e.load_weights(new_weights[0])

    async def main() -> tuple[list[int], int, GenerationOutput, bool, int]:
        async with AsyncSpecEngine(engine) as aeng:
            tokens: list[int] = []
            async with aclosing(aeng.generate_stream(PROMPTS[0], params)) as stream:
                first = await stream.__anext__()
                tokens.extend(first.new_token_ids)
                running, version = await aeng.run_in_engine(update)
                async for out in stream:
                    tokens.extend(out.new_token_ids)
            assert out.output is not None
            return tokens, len(first.new_token_ids), out.output, running, version

    tokens, n_first, out, running, version = asyncio.run(main())
    assert version == 1 and tuple(tokens) == out.token_ids and len(tokens) == total
    n_old = out.token_weight_versions.count(0)
    assert n_old >= n_first and out.token_weight_versions == (0,) * n_old + (1,) * (total - n_old)
    # Whether the update found the request still running is the thread's timing; what each
    # case must give is not: running, the tokens after it are the new version's.
    assert (n_old < total) == running
    assert_no_leak(engine)


@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_recompute_tokens_are_exactly_their_versions_policy(cuda_graphs: bool) -> None:
    """Many sampled requests with EAGLE-3 drafts and a run of updates between steps (as an
    async RL learner pushes them), some of them while sequences wait for a re-prefill: with
    ``kv_on_update="recompute"`` every token stamped v has exactly the log-probability that
    policy v (a transformers model with those weights) gives it after its prefix."""
    from transformers import AutoModelForCausalLM

    temperature, num_requests = 2.0, 32
    learner = AutoModelForCausalLM.from_pretrained(str(DEFAULT_TARGET), dtype=torch.float32)
    learner.eval()
    engine = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", dtype="float32",
                        kernel_backend="torch", max_model_len=96, kv_on_update="recompute",
                        cuda_graphs=cuda_graphs)
    states = {0: {n: p.detach().clone() for n, p in learner.named_parameters()}}
    prompts = [engine.tokenizer.encode(p) for p in heldout_prompts(num_requests, seed=9)]
    ids = [engine.add_request(p, SamplingParams(temperature=temperature, max_tokens=48,
                                                seed=1000 + i), k=3)
           for i, p in enumerate(prompts)]
    seen: dict[str, list[int]] = {}
    done: dict[str, GenerationOutput] = {}
    gen = torch.Generator().manual_seed(0)
    for num_steps in (2, 1, 1, 3, 2, 1, 4):  # steps between updates; some right after one
        step_n(engine, num_steps, seen, done)
        v = len(states)
        states[v] = {n: t + (0.02 if t.dim() == 1 else 0.002) * torch.randn(t.shape,
                                                                              generator=gen)
                     for n, t in states[v - 1].items()}
        assert engine.load_weights(states[v]) == v
    step_n(engine, 1000, seen, done)
    assert_no_leak(engine)
    outs = [done[rid] for rid in ids]
    assert len({v for o in outs for v in o.token_weight_versions}) >= 4
    width = max(len(p) + len(o.token_ids) for p, o in zip(prompts, outs))
    input_ids = torch.zeros(len(outs), width, dtype=torch.long)
    for i, (p, o) in enumerate(zip(prompts, outs)):  # right-padded: causal, nothing leaks
        input_ids[i, :len(p) + len(o.token_ids)] = torch.tensor(p + list(o.token_ids))
    checked = 0
    for v, state in states.items():
        with torch.no_grad():
            for n, p in learner.named_parameters():
                p.copy_(state[n])
            logp = torch.log_softmax(learner(input_ids=input_ids).logits / temperature, -1)
        for i, (p, o) in enumerate(zip(prompts, outs)):
            for j, (tv, lp) in enumerate(zip(o.token_weight_versions, o.logprobs)):
                if tv == v:
                    want = logp[i, len(p) + j - 1, o.token_ids[j]].item()
                    assert lp == pytest.approx(want, abs=1e-4), (i, j, v)
                    checked += 1
    assert checked == sum(len(o.token_ids) for o in outs)



@pytest.mark.parametrize("cuda_graphs", [False, True])
def test_recompute_gives_reprefilled_sequences_their_new_blocks(
        tiny_checkpoint: Path, new_weights: tuple[dict, Path], cuda_graphs: bool) -> None:
    """The update lands when a running sequence holds one block more than its tokens need (its
    last verify step's drafts crossed into it): re-prefilled, it takes one block fewer, so the
    sequences after it get other block ids than before, at the same count. Their tokens after
    the switch must still be a fresh engine's with the new weights from their prefix (a batch
    state that kept a row's old block ids would attend to the old weights' KV)."""
    # Drafts from another model: some are rejected, so a sequence can end a step holding
    # blocks for drafts it did not keep.
    engine = tiny_engine(tiny_checkpoint, draft=str(new_weights[1]), kv_on_update="recompute",
                         cuda_graphs=cuda_graphs)
    kv = engine.kv_cache
    prompts = [[1 + i] * (3 + 2 * i) for i in range(10)]
    ids = [engine.add_request(p, greedy(40), k=2) for p in prompts]
    seen: dict[str, list[int]] = {}
    done: dict[str, GenerationOutput] = {}

    def shifted() -> bool:
        running = engine.scheduler.running
        extra = [len(s.block_table) > kv.blocks_for(len(s)) for s in running]
        return any(e and not any(extra[i + 1:]) and i + 1 < len(running)
                   for i, e in enumerate(extra))

    while not shifted():
        step_n(engine, 1, seen, done)
        assert engine.has_unfinished(), "no step left a sequence holding an extra block"
    before = {rid: len(seen.get(rid, [])) for rid in ids}
    tables = {s.seq_id: list(s.block_table) for s in engine.scheduler.running}
    engine.load_weights(new_weights[0])
    step_n(engine, 1, seen, done)  # the re-prefill
    assert any(tables[s.seq_id][:len(s.block_table)] != s.block_table
               for s in engine.scheduler.running if s.seq_id in tables)
    step_n(engine, 1000, seen, done)
    assert_no_leak(engine)
    todo = [i for i, rid in enumerate(ids) if before[rid] < 40]
    want = tiny_engine(new_weights[1]).generate(
        [prompts[i] + seen[ids[i]][:before[ids[i]]] for i in todo],
        sampling=[greedy(40 - before[ids[i]]) for i in todo])
    for i, w in zip(todo, want):
        out, n = done[ids[i]], before[ids[i]]
        assert out.token_ids[n:] == w.token_ids, i
        assert out.logprobs[n:] == pytest.approx(w.logprobs, abs=1e-4)
