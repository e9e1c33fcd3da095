"""Policy lag (docs/design.md §4, ``specengine.core.inflight``): a request's own
``SamplingParams.max_policy_lag`` overrides the engine's, and ``policy_lag_action="restart"``
starts a lagging request again from its prompt: its completion is then exactly a fresh engine's
on the new weights (same seed), every token of the new version, its stream says
``restarted=True`` once, and no KV block is left behind."""

from __future__ import annotations

import asyncio
from contextlib import aclosing
from pathlib import Path

import pytest
from checkpoints import make_hf_model, save_checkpoint
from test_inflight_updates import MAX_TOKENS, PROMPTS, assert_no_leak, greedy, tiny_engine

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.outputs import GenerationOutput, RequestOutput


@pytest.fixture(scope="module")
def new_policy(tmp_path_factory: pytest.TempPathFactory) -> tuple[dict, Path]:
    """The learner's next policy: another random model of the tiny checkpoint's shapes."""
    hf = make_hf_model("qwen3", seed=11)
    return hf.state_dict(), save_checkpoint(hf, tmp_path_factory.mktemp("next_policy"))


class Consumer:
    """What a streaming client keeps per request: the tokens so far, started again when an
    output says ``restarted``; and each request's final output."""

    def __init__(self) -> None:
        self.tokens: dict[str, list[int]] = {}
        self.restarts: dict[str, list[int]] = {}  # request id -> output index of each restart
        self.num_outputs: dict[str, int] = {}
        self.done: dict[str, GenerationOutput] = {}

    def take(self, outs: list[RequestOutput]) -> None:
        for out in outs:
            rid = out.request_id
            assert rid not in self.done, "reported after it finished"
            n = self.num_outputs[rid] = self.num_outputs.get(rid, 0) + 1
            if out.restarted:
                self.restarts.setdefault(rid, []).append(n)
                self.tokens[rid] = []
            self.tokens.setdefault(rid, []).extend(out.new_token_ids)
            if out.output is not None:
                self.done[rid] = out.output
                assert tuple(self.tokens[rid]) == out.output.token_ids

    def steps(self, engine: SpecEngine, n: int) -> None:
        for _ in range(n):
            if not engine.has_unfinished():
                return
            self.take(engine.step())


def fresh_run(new_dir: Path, draft: str | None, prompts: list, params: list[SamplingParams],
              k: int) -> list[GenerationOutput]:
    """What an engine that had the new policy from the start generates (same draft)."""
    return tiny_engine(new_dir, draft=draft).generate(prompts, k=k, sampling=params)


@pytest.mark.parametrize("k,cuda_graphs,kv_on_update,sampled", [
    (0, False, "keep", False), (2, False, "keep", False), (2, True, "recompute", False),
    (0, False, "keep", True), (2, True, "keep", True)])
def test_restart_equals_a_fresh_engine_from_the_prompt(
        tiny_checkpoint: Path, new_policy: tuple[dict, Path], k: int, cuda_graphs: bool,
        kv_on_update: str, sampled: bool) -> None:
    draft = str(tiny_checkpoint) if k else None
    engine = tiny_engine(tiny_checkpoint, draft=draft, cuda_graphs=cuda_graphs,
                         kv_on_update=kv_on_update, max_policy_lag=0,
                         policy_lag_action="restart")
    params = [SamplingParams(temperature=1.0, max_tokens=MAX_TOKENS, ignore_eos=True,
                             seed=50 + i) if sampled else greedy() for i in range(len(PROMPTS))]
    ids = [engine.add_request(p, sp, k=k, request_id=f"r{i}")
           for i, (p, sp) in enumerate(zip(PROMPTS, params))]
    client = Consumer()
    client.steps(engine, 3)
    reported = dict(client.num_outputs)
    assert all(0 < len(client.tokens[rid]) < MAX_TOKENS for rid in ids)
    assert engine.load_weights(new_policy[0]) == 1
    # Restarted at once: every block and drafter state is free, the requests wait, unfinished.
    assert engine.has_unfinished() and not engine.scheduler.running
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    draft_cache = getattr(engine.drafter, "kv_cache", None)
    assert draft_cache is None or draft_cache.num_free_blocks == draft_cache.num_blocks
    client.steps(engine, 20 * MAX_TOKENS)
    assert_no_leak(engine)
    want = fresh_run(new_policy[1], draft, PROMPTS, params, k)
    for rid, w in zip(ids, want):
        out = client.done[rid]
        assert client.restarts[rid] == [reported[rid] + 1]  # its first output after the update
        assert out.token_ids == w.token_ids and out.finish_reason == "length"
        assert out.logprobs == pytest.approx(w.logprobs, abs=1e-4)
        assert (out.num_steps, out.num_draft_tokens, out.num_accepted_tokens) == (
            w.num_steps, w.num_draft_tokens, w.num_accepted_tokens)  # counters start anew
        assert out.token_weight_versions == (1,) * MAX_TOKENS and out.weight_version == 1


def test_request_lag_overrides_the_engines(tiny_checkpoint: Path,
                                           new_policy: tuple[dict, Path]) -> None:
    engine = tiny_engine(tiny_checkpoint, max_policy_lag=1)  # action "finish" by default
    client = Consumer()
    strict = engine.add_request(PROMPTS[0], SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, max_policy_lag=0))
    lax = engine.add_request(PROMPTS[1], SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, max_policy_lag=3))
    default = engine.add_request(PROMPTS[2], greedy())  # the engine's limit, 1
    client.steps(engine, 2)
    engine.load_weights(new_policy[0])  # lag 1 for all
    assert len(engine.core.requests[strict].seq.block_table) == 0  # ended, freed at once
    client.steps(engine, 2)
    assert client.done[strict].finish_reason == "policy_lag"
    assert default not in client.done and lax not in client.done
    engine.load_weights(new_policy[0])  # lag 2
    client.steps(engine, 2)
    assert client.done[default].finish_reason == "policy_lag"
    assert lax not in client.done
    client.steps(engine, 20 * MAX_TOKENS)
    out = client.done[lax]
    assert out.finish_reason == "length" and set(out.token_weight_versions) == {0, 1, 2}
    assert not client.restarts
    assert_no_leak(engine)


def test_request_lag_without_an_engine_limit_restarts_only_that_request(
        tiny_checkpoint: Path, new_policy: tuple[dict, Path]) -> None:
    engine = tiny_engine(tiny_checkpoint, policy_lag_action="restart")  # no engine-wide limit
    client = Consumer()
    strict = engine.add_request(PROMPTS[0], SamplingParams(
        temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, max_policy_lag=0))
    free = engine.add_request(PROMPTS[1], greedy())
    client.steps(engine, 3)
    n_old = len(client.tokens[free])
    engine.load_weights(new_policy[0])
    client.steps(engine, 20 * MAX_TOKENS)
    assert_no_leak(engine)
    assert list(client.restarts) == [strict]
    assert client.done[strict].token_weight_versions == (1,) * MAX_TOKENS
    assert client.done[strict].token_ids == fresh_run(
        new_policy[1], None, [PROMPTS[0]], [greedy()], 0)[0].token_ids
    assert client.done[free].token_weight_versions == (0,) * n_old + (1,) * (MAX_TOKENS - n_old)


def test_abort_after_restart_reports_the_restart_and_frees_all(
        tiny_checkpoint: Path, new_policy: tuple[dict, Path]) -> None:
    engine = tiny_engine(tiny_checkpoint, draft=str(tiny_checkpoint), max_policy_lag=0,
                         policy_lag_action="restart")
    rid = engine.add_request(PROMPTS[0], greedy(), k=2)
    other = engine.add_request(PROMPTS[1], greedy(), k=2)
    client = Consumer()
    client.steps(engine, 2)
    engine.load_weights(new_policy[0])
    out = engine.abort(rid)  # before it made a token of the new version
    assert out.restarted and out.finished and out.new_token_ids == ()
    assert out.output is not None and out.output.finish_reason == "abort"
    assert out.output.token_ids == () and out.output.token_weight_versions == ()
    client.steps(engine, 20 * MAX_TOKENS)
    assert rid not in client.num_outputs or client.num_outputs[rid] == 2  # never again
    assert client.restarts == {other: [3]}
    assert_no_leak(engine)
    # The engine goes on serving: the next request is a fresh engine's on the new weights.
    assert engine.generate([PROMPTS[2]], sampling=greedy())[0].token_ids == fresh_run(
        new_policy[1], None, [PROMPTS[2]], [greedy()], 0)[0].token_ids


def test_restart_through_the_async_stream(tiny_checkpoint: Path,
                                          new_policy: tuple[dict, Path]) -> None:
    engine = SpecEngine(tiny_checkpoint, device="cpu", dtype="float32", max_model_len=512,
                        kv_cache_tokens=1024, max_policy_lag=0, policy_lag_action="restart")
    total = 300
    params = SamplingParams(temperature=0.0, max_tokens=total, ignore_eos=True)

    def update(e: SpecEngine) -> tuple[bool, int]:  # on the engine thread, between steps
        return e.has_unfinished(), e.load_weights(new_policy[0])

    async def main() -> tuple[list[int], list[bool], GenerationOutput, bool]:
        async with AsyncSpecEngine(engine) as aeng:
            tokens: list[int] = []
            flags: list[bool] = []
            async with aclosing(aeng.generate_stream(PROMPTS[0], params)) as stream:
                first = await stream.__anext__()
                tokens.extend(first.new_token_ids)
                running, _ = await aeng.run_in_engine(update)
                async for out in stream:
                    flags.append(out.restarted)
                    if out.restarted:
                        tokens = []
                    tokens.extend(out.new_token_ids)
            assert out.output is not None
            return tokens, flags, out.output, running

    tokens, flags, out, running = asyncio.run(main())
    assert tuple(tokens) == out.token_ids and len(tokens) == total
    assert_no_leak(engine)
    # Whether the update found the request running is the thread's timing; what each case
    # must give is not.
    if running:  # outputs of steps before the update may still be queued: one restart
        assert flags.count(True) == 1
        assert out.token_weight_versions == (1,) * total
        fresh = SpecEngine(new_policy[1], device="cpu", dtype="float32", max_model_len=512,
                           kv_cache_tokens=1024)
        assert out.token_ids == fresh.generate([PROMPTS[0]], sampling=params)[0].token_ids
    else:
        assert not any(flags) and out.token_weight_versions == (0,) * total


@pytest.mark.parametrize("bad", [-1, True, 1.5, "2"])
def test_bad_policy_lag_settings_are_refused(tiny_checkpoint: Path, bad: object) -> None:
    with pytest.raises(ValueError, match="max_policy_lag"):
        SamplingParams(max_policy_lag=bad)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_policy_lag"):
        tiny_engine(tiny_checkpoint, max_policy_lag=bad)
    with pytest.raises(ValueError, match="policy_lag_action"):
        tiny_engine(tiny_checkpoint, policy_lag_action="drop")
