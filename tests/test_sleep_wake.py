"""Sleep and wake (issue 36): ``SpecEngine.sleep(level)`` / ``wake_up(tags)`` and SGLang's
names release every byte of the weights and KV caches, refuse requests and weight updates
while asleep (naming why), serve exactly a fresh engine's outputs after waking (level 2:
after a full weight update), leak nothing over cycles, drop and recapture the graphs, and
answer over HTTP in vLLM's and SGLang's shapes."""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from replaying_graph import ReplayingGraph

import specengine.engine as engine_module
from specengine import SamplingParams, SpecEngine
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.core.graphs import GraphRunner, build_graph_runner
from specengine.core.sleep import EngineAsleepError, unique_storages
from specengine.weights import WeightSender

PROMPTS = ["Q:472+385=", "Q:12*7=", [17, 16, 5, 10]]
PARAMS = [SamplingParams(temperature=0.0, max_tokens=16),
          SamplingParams(temperature=1.0, seed=3, max_tokens=16),
          SamplingParams(temperature=0.8, top_k=5, seed=9, max_tokens=12)]


def make(**kw: Any) -> SpecEngine:
    kw = {"device": "cpu", "kernel_backend": "torch", "kv_cache_tokens": 4096, **kw}
    return SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, **kw)


@pytest.fixture(scope="module")
def fresh_outputs() -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    return outputs(make())


def outputs(engine: SpecEngine) -> list[tuple[tuple[int, ...], tuple[float, ...]]]:
    return [(o.token_ids, o.logprobs) for o in engine.generate(PROMPTS, k=3, sampling=PARAMS)]


def sizes(engine: SpecEngine) -> list[int]:
    """Bytes of every parameter's and KV cache's storage."""
    tensors = [*engine.model.parameters(), engine.kv_cache.kv, *engine.drafter.kv_tensors()]
    return [t.untyped_storage().nbytes() for t in tensors]


def assert_idle_and_free(engine: SpecEngine) -> None:
    assert not engine.has_unfinished()
    for cache in (engine.kv_cache, engine.drafter.kv_cache):
        assert cache.num_free_blocks == cache.num_blocks
        assert cache.allocator.num_free == cache.num_blocks  # none held by the prefix cache


def test_level_1_releases_everything_and_wakes_to_a_fresh_engines_outputs(
        fresh_outputs: list) -> None:
    engine = make()
    assert outputs(engine) == fresh_outputs  # fills the prefix cache and the draft's KV too
    awake = sizes(engine)
    params = list(engine.model.parameters())
    distinct = unique_storages([*params, engine.kv_cache.kv, *engine.drafter.kv_tensors()])
    assert engine.sleep(level=1) == sum(v.numel() for v in distinct)  # tied weights once
    assert engine.is_sleeping
    assert set(sizes(engine)) == {0}
    for call in (lambda: engine.generate(PROMPTS[:1]),
                 lambda: engine.add_request(PROMPTS[0], PARAMS[0])):
        with pytest.raises(EngineAsleepError, match=r"asleep \(kv_cache, weights \(level 1\)\)"):
            call()
    with pytest.raises(EngineAsleepError, match="load_weights: the weights are released"):
        engine.load_weights(DEFAULT_TARGET)
    sender = WeightSender(transport="shared")
    handles = sender.send({"model.norm.weight": torch.ones(engine.model_config.hidden_size)},
                          version=1)
    with pytest.raises(EngineAsleepError, match="update_weights_from_shared: the weights"):
        engine.update_weights_from_shared(handles)
    sender.release(1)
    assert engine.weight_version == 0
    engine.wake_up()
    assert not engine.is_sleeping
    assert sizes(engine) == awake
    assert list(engine.model.parameters()) == params  # the same objects, refilled in place
    assert_idle_and_free(engine)
    assert outputs(engine) == fresh_outputs


def test_level_2_serves_only_after_a_complete_weight_update(fresh_outputs: list) -> None:
    engine = make()
    engine.generate(PROMPTS[:1])
    engine.sleep(level=2)
    engine.wake_up()
    assert not engine.is_sleeping
    with pytest.raises(EngineAsleepError, match=r"sleep\(level=2\) dropped the weights"):
        engine.generate(PROMPTS[:1])
    some = {n: t for n, t in engine.model.state_dict().items() if ".mlp." in n}
    engine.load_weights({n: torch.zeros_like(t) for n, t in some.items()})  # a subset
    with pytest.raises(EngineAsleepError, match="have not been written since"):
        engine.add_request(PROMPTS[0], PARAMS[0])
    assert engine.load_weights(DEFAULT_TARGET) == 2
    assert_idle_and_free(engine)
    assert outputs(engine) == fresh_outputs


def test_refusals_change_nothing() -> None:
    engine = make()
    awake = sizes(engine)
    for level in (0, 3, True, "1"):
        with pytest.raises(ValueError, match="level must be 1"):
            engine.sleep(level)  # type: ignore[arg-type]
    for tags in (["weights", "kv"], [], "kv"):
        with pytest.raises(ValueError, match="tags must be a non-empty subset"):
            engine.sleep(1, tags)
    rid = engine.add_request(PROMPTS[0], PARAMS[0], k=3)
    engine.step()
    with pytest.raises(RuntimeError, match="1 requests are unfinished"):
        engine.sleep()
    assert not engine.is_sleeping and sizes(engine) == awake
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o.output for o in engine.step() if o.finished})
    assert done[rid].token_ids == make().generate(PROMPTS[:1], k=3,
                                                  sampling=PARAMS[0])[0].token_ids
    engine.sleep(tags=["kv_cache"])
    with pytest.raises(RuntimeError, match=r"\['kv_cache'\] already asleep"):
        engine.sleep(2)
    assert "weights" not in engine.sleep_state.parts  # the refused call released nothing
    engine.wake_up()
    engine.wake_up()  # awake: nothing to do
    assert sizes(engine) == awake


def test_sglang_flow_wakes_the_weights_first_then_the_kv_cache(fresh_outputs: list) -> None:
    engine = make()
    engine.release_memory_occupation()  # level 2, both parts
    engine.resume_memory_occupation(["weights"])  # room for the update; the KV still sleeps
    with pytest.raises(EngineAsleepError, match=r"asleep \(kv_cache\)"):
        engine.generate(PROMPTS[:1])
    assert engine.load_weights(DEFAULT_TARGET) == 1
    engine.resume_memory_occupation(["kv_cache"])
    assert outputs(engine) == fresh_outputs
    engine.sleep(tags=["kv_cache"])  # the KV alone: weight updates still land
    assert engine.load_weights(DEFAULT_TARGET) == 2
    engine.wake_up(["kv_cache"])
    assert outputs(engine) == fresh_outputs


def test_cycles_leak_nothing(fresh_outputs: list) -> None:
    engine = make()
    awake = sizes(engine)
    buffers = []
    for level in (1, 1, 2, 1):
        engine.generate(PROMPTS[:2], k=3, sampling=PARAMS[:2])
        engine.sleep(level)
        engine.wake_up()
        if level == 2:
            engine.load_weights(DEFAULT_TARGET)
        assert sizes(engine) == awake and not engine.sleep_state.parts
        assert_idle_and_free(engine)
        buffers.append([h.data_ptr() for h in engine.sleep_state.host_buffers])
    # level 1 keeps its host buffers for the next one; level 2 frees them
    assert buffers[0] == buffers[1] and buffers[0] and buffers[2] == []
    assert buffers[3] and len(buffers[3]) == len(buffers[0])
    assert outputs(engine) == fresh_outputs


def _emulated(*args: Any) -> GraphRunner:
    runner = build_graph_runner(*args)
    runner.graph_factory, runner.capture, runner.debug = ReplayingGraph, True, True
    return runner


def test_graphs_are_dropped_and_recaptured(monkeypatch: pytest.MonkeyPatch,
                                            fresh_outputs: list) -> None:
    """The CPU emulator of CUDA graphs (tests/replaying_graph.py) fails a replay whose
    captured tensors moved: sleeping drops the graphs, waking captures them again."""
    monkeypatch.setattr(engine_module, "build_graph_runner", functools.partial(_emulated))
    engine = make(cuda_graphs=True, capture="startup", capture_ks=(0, 3),
                  graph_buckets=(1, 2, 4), max_batch_size=4)
    runner = engine.graphs
    at_start = runner.num_graphs
    assert at_start > 0
    assert outputs(engine) == fresh_outputs
    engine.sleep(1)
    assert runner.num_graphs == 0
    engine.wake_up(["weights"])
    assert runner.num_graphs == 0  # the KV cache still sleeps: nothing to capture over
    captures = runner.num_captures
    engine.wake_up(["kv_cache"])
    assert runner.num_graphs == at_start and runner.num_captures == captures + at_start
    assert runner.graph_stats.num_startup == at_start  # the stats describe the new graphs
    assert outputs(engine) == fresh_outputs
    lazy = make(cuda_graphs=True, capture="lazy", graph_buckets=(1, 2, 4), max_batch_size=4)
    assert lazy.graphs.capture  # (the emulator)
    outputs(lazy)
    lazy.sleep(1)
    lazy.wake_up()
    assert lazy.graphs.num_graphs == 0  # captured again at first use
    assert outputs(lazy) == fresh_outputs and lazy.graphs.num_graphs > 0


# ---- over HTTP ---------------------------------------------------------------------------
@pytest.fixture(scope="module")
def served() -> Iterator[tuple[Any, int]]:
    pytest.importorskip("fastapi")
    from server_helpers import running_server

    from specengine import AsyncSpecEngine

    aeng = AsyncSpecEngine(make(max_batch_size=64))
    try:
        with running_server(aeng) as (server, client):
            yield client, server.port
    finally:
        asyncio.run(aeng.close())


def test_http_sleep_wake_in_vllm_and_sglang_shapes(served: tuple[Any, int]) -> None:
    from server_helpers import post_json, raw_request

    from specengine.client import ServerError

    client, port = served
    greedy = SamplingParams(temperature=0.0, max_tokens=12)
    want = client.generate(PROMPTS[0], greedy, k=3)
    assert client.is_sleeping() is False
    assert client.sleep(level=1) > 0
    assert raw_request(port, "GET", "/is_sleeping") == (200, {"is_sleeping": True})
    status, body = post_json(port, "/generate", {"prompt": PROMPTS[0]})
    assert status == 503 and "asleep" in body["error"]
    with pytest.raises(ServerError, match="already asleep") as exc:
        client.sleep(level=2)
    assert exc.value.status == 409
    status, body = post_json(port, "/load_weights", {"path": str(DEFAULT_TARGET)})
    assert status == 503 and "weights are released" in body["error"]
    client.wake_up()
    assert client.generate(PROMPTS[0], greedy, k=3).token_ids == want.token_ids
    status, body = raw_request(port, "POST", "/sleep?level=3")
    assert status == 400 and "level must be 1" in body["error"]
    status, body = raw_request(port, "POST", "/wake_up?tags=gpu")
    assert status == 400 and "tags must be" in body["error"]
    # SGLang: release drops the weights; resume, then an update refills them
    status, body = post_json(port, "/release_memory_occupation", {})
    assert status == 200 and body["success"] and body["released_bytes"] > 0
    status, body = post_json(port, "/resume_memory_occupation", {"tags": ["weights"]})
    assert status == 200 and client.is_sleeping()
    assert client.load_weights(str(DEFAULT_TARGET)) == 1
    status, body = post_json(port, "/resume_memory_occupation", {"tags": None})
    assert status == 200 and not client.is_sleeping()
    out = client.generate(PROMPTS[0], greedy, k=3)
    assert out.token_ids == want.token_ids and out.weight_version == 1
    status, body = post_json(port, "/release_memory_occupation", {"tag": ["weights"]})
    assert status == 422 and not client.is_sleeping()


def test_a_distributed_update_to_sleeping_weights_fails_on_both_sides(
        fresh_outputs: list) -> None:
    """The refusal comes after the handshake: the learner raises too (no hang), and the
    group takes the next update once the weights are awake."""
    from net_helpers import Background, free_port
    from safetensors.torch import load_file

    from specengine.weights import WeightSender
    from specengine.weights.protocol import WeightSyncError

    engine = make()
    port = free_port()
    joining = Background(lambda: WeightSender("127.0.0.1", port, world_size=2,
                                              backend="gloo", timeout_s=30.0))
    engine.init_weight_update_group("127.0.0.1", port, 1, 2, backend="gloo", timeout_s=30.0)
    sender = joining.result()
    state = load_file(f"{DEFAULT_TARGET}/model.safetensors")
    try:
        engine.sleep(level=2)
        sending = Background(lambda: sender.send(state, version=5))
        with pytest.raises(WeightSyncError, match="WeightsAsleepError: .* released by sleep"):
            engine.update_weights_from_distributed()
        with pytest.raises(WeightSyncError):
            sending.result()
        engine.wake_up()
        sending = Background(lambda: sender.send(state, version=6))
        assert engine.update_weights_from_distributed() == 6
        sending.result()
        assert outputs(engine) == fresh_outputs
    finally:
        engine.close_weight_update_group()
        sender.close()


def test_readme_sleep_wake_runs_as_written() -> None:
    from readme_blocks import run_readme_blocks

    ns = run_readme_blocks("## Usage", "### Sleep and wake: sharing the GPU with the trainer")
    engine = ns["engine"]
    assert ns["released"] > 0 and not engine.is_sleeping  # type: ignore[attr-defined]
    assert engine.weight_version == 1  # type: ignore[attr-defined]
    want = make().generate(ns["prompts"], k=3, sampling=ns["greedy"])  # type: ignore[arg-type]
    got = engine.generate(ns["prompts"], k=3, sampling=ns["greedy"])  # type: ignore[attr-defined]
    assert [o.token_ids for o in got] == [o.token_ids for o in want]


def test_sglang_update_to_sleeping_weights_is_refused_and_drained() -> None:
    """SGLang's learner broadcasts every tensor whatever the answer: a refusal while the
    weights sleep must drain them (no hang) and leave the group usable after resuming. (A
    server process of its own: the learner's named group and the server's cannot share one.)"""
    pytest.importorskip("fastapi")
    from datetime import timedelta

    import torch.distributed as dist
    from net_helpers import Background, free_port
    from safetensors.torch import load_file
    from sglang_helpers import get, init_custom_process_group, post, serve_process

    tensors = list(load_file(f"{DEFAULT_TARGET}/model.safetensors").items())
    body = {"names": [n for n, _ in tensors], "group_name": "sleepy",
            "dtypes": [str(t.dtype).split(".")[-1] for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors]}
    with serve_process() as (_, port, log):
        master = free_port()
        init = Background(lambda: post(port, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": master, "rank_offset": 1,
            "world_size": 2, "group_name": "sleepy", "backend": "gloo"}))
        pg = init_custom_process_group(f"tcp://127.0.0.1:{master}", 2, 0, "sleepy",
                                       timedelta(seconds=60))
        assert init.result()[0] == 200  # type: ignore[index]

        def update() -> tuple[int, dict[str, Any]]:
            call = Background(lambda: post(port, "/update_weights_from_distributed", body))
            for _, t in tensors:
                dist.broadcast(t.contiguous(), src=0, group=pg)
            return call.result()  # type: ignore[return-value]

        try:
            assert post(port, "/release_memory_occupation", {})[0] == 200
            status, answer = update()  # every broadcast returned: drained
            assert status == 503 and "released by sleep" in answer["message"], answer
            assert post(port, "/resume_memory_occupation", {})[0] == 200
            status, answer = update()
            assert status == 200 and answer["weight_version"] == 1, answer
            out = post(port, "/generate", {"text": PROMPTS[0], "sampling_params": {
                "temperature": 0.0, "max_new_tokens": 12}})[1]
            want = make().generate(PROMPTS[:1], k=3, sampling=SamplingParams(
                temperature=0.0, max_tokens=12))[0].token_ids
            assert out["output_ids"] == list(want), "".join(log)
            assert get(port, "/get_model_info")["weight_version"] == 1
        finally:
            dist.destroy_process_group(pg)
