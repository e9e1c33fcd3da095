"""SGLang's weight-update protocol against a running ``specengine serve`` process.

The learner here is written from SGLang's documentation and the RL frameworks that drive it
(slime, AReaL, OpenRLHF): it makes its group as SGLang's ``init_custom_process_group`` does
(a ``tcp://`` rendezvous as rank 0, the store prefixed by the group name, torch's group
constructor under that name) while it posts ``/init_weights_update_group``; per update it
posts ``/update_weights_from_distributed`` (names, dtypes, shapes, group_name) while it
broadcasts each tensor from rank 0, in order. Gloo, this process as the learner (its HTTP
calls on threads), the server a separate process.
"""

from __future__ import annotations

import asyncio
import signal
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from net_helpers import Background, free_port
from safetensors.torch import load_file, save_file
from server_helpers import bundled_engine, running_server
from sglang_helpers import WAIT_S, get, init_custom_process_group, post, serve_process

from specengine import AsyncSpecEngine, SamplingParams
from specengine.arith_task import heldout_prompts
from specengine.assets import DEFAULT_TARGET

PROMPTS = heldout_prompts(4, seed=25)
GREEDY = {"max_new_tokens": 16, "temperature": 0.0}
GROUP = "rl_weight_sync"


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    """The bundled target's tensors, the MLPs perturbed (enough to change greedy outputs)."""
    sd = load_file(str(Path(DEFAULT_TARGET) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen) if ".mlp." in n else t
            for n, t in sd.items()}


def served_tokens(port: int) -> list[list[int]]:
    status, out = post(port, "/generate", {"text": PROMPTS, "sampling_params": GREEDY})
    assert status == 200, out
    return [o["output_ids"] for o in out]


def fresh_tokens(weights: dict[str, torch.Tensor] | None) -> list[list[int]]:
    eng = bundled_engine()
    if weights is not None:
        eng.load_weights(weights)
    outs = eng.generate(PROMPTS, k=3, sampling=SamplingParams(temperature=0.0, max_tokens=16))
    return [list(o.token_ids) for o in outs]


def announce(tensors: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """The body a learner posts: names, dtypes as ``str(dtype)`` without ``torch.``, shapes."""
    return {"names": [n for n, _ in tensors],
            "dtypes": [str(t.dtype).split(".")[-1] for _, t in tensors],
            "shapes": [list(t.shape) for _, t in tensors], "group_name": GROUP,
            "flush_cache": True}


def update(port: int, pg: dist.ProcessGroup, tensors: list[tuple[str, torch.Tensor]]
           ) -> tuple[int, dict[str, Any]]:
    """Post the update and, meanwhile, broadcast every tensor from rank 0 (each returns only
    once the engine received it); then the answer."""
    call = Background(lambda: post(port, "/update_weights_from_distributed",
                                   announce(tensors)), WAIT_S)
    for _, t in tensors:
        dist.broadcast(t.contiguous(), src=0, group=pg)
    return call.result()  # type: ignore[return-value]


def test_sglang_learner_updates_a_running_server_all_or_nothing() -> None:
    before = fresh_tokens(None)
    new = new_weights(seed=7)
    want = fresh_tokens(new)
    assert want != before  # the update must show
    with serve_process() as (proc, port, log):
        assert served_tokens(port) == before
        assert get(port, "/get_model_info")["weight_version"] == 0
        master = free_port()
        init = Background(lambda: post(port, "/init_weights_update_group", {
            "master_address": "127.0.0.1", "master_port": master, "rank_offset": 1,
            "world_size": 2, "group_name": GROUP, "backend": "gloo"}), WAIT_S)
        pg = init_custom_process_group(f"tcp://127.0.0.1:{master}", 2, 0, GROUP,
                                       timedelta(seconds=WAIT_S))
        status, answer = init.result()  # type: ignore[misc]
        assert status == 200 and answer["success"], answer

        good = list(new.items())
        bad_name = [*good[:3], ("model.layers.0.mlp.bogus.weight", torch.ones(4, 4)),
                    *good[3:]]
        bad_shape = [(n, t[:-1] if n == "model.norm.weight" else t) for n, t in good]
        bad_dtype = [(n, t.to(torch.int64) if n == good[1][0] else t) for n, t in good]
        for tensors, words in [(bad_name, "model.layers.0.mlp.bogus.weight"),
                               (bad_shape, "model.norm.weight"), (bad_dtype, good[1][0])]:
            status, answer = update(port, pg, tensors)  # every broadcast returned
            assert status == 400 and not answer["success"], answer
            assert words in answer["message"], answer
            assert get(port, "/get_model_info")["weight_version"] == 0
            assert served_tokens(port) == before  # nothing changed

        # The step loop runs while an update waits for the learner's broadcasts.
        call = Background(lambda: post(port, "/update_weights_from_distributed",
                                       announce(good)), WAIT_S)
        assert served_tokens(port) == before
        for _, t in good:
            dist.broadcast(t.contiguous(), src=0, group=pg)
        status, answer = call.result()  # type: ignore[misc]
        assert status == 200 and answer["success"] and answer["weight_version"] == 1, answer
        assert served_tokens(port) == want
        status, out = post(port, "/generate", {"input_ids": [5, 6, 7],
                                               "sampling_params": GREEDY})
        assert out["meta_info"]["weight_version"] == 1

        # A partial update with a version of the learner's: only the MLP of layer 0.
        part = [(n, t) for n, t in new_weights(seed=8).items() if ".layers.0.mlp." in n]
        call = Background(lambda: post(port, "/update_weights_from_distributed", {
            **announce(part), "weight_version": "5"}), WAIT_S)
        for _, t in part:
            dist.broadcast(t.contiguous(), src=0, group=pg)
        status, answer = call.result()  # type: ignore[misc]
        assert status == 200 and answer["weight_version"] == 5, answer
        assert get(port, "/get_model_info")["weight_version"] == 5

        # Sizes it cannot know (a dtype torch lacks): refused, the group marked out of step.
        status, answer = post(port, "/update_weights_from_distributed",
                              {**announce(part), "dtypes": ["float33"] * len(part)})
        assert status == 400 and "'float33' is not a torch dtype" in answer["message"]
        status, answer = post(port, "/update_weights_from_distributed", announce(part))
        assert status == 400 and "out of step" in answer["message"], answer
        assert get(port, "/get_model_info")["weight_version"] == 5

        status, answer = post(port, "/destroy_weights_update_group", {"group_name": GROUP})
        assert status == 200 and answer["success"], answer
        dist.destroy_process_group(pg)
        status, answer = post(port, "/update_weights_from_distributed", announce(part))
        assert status == 400 and "no weight-update group" in answer["message"]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0, "".join(log)


def test_update_weights_from_disk_is_all_or_nothing(tmp_path: Path) -> None:
    new = new_weights(seed=3)
    want = fresh_tokens(new)
    good = tmp_path / "good"
    good.mkdir()
    save_file({n: t.contiguous() for n, t in new.items()}, str(good / "model.safetensors"))
    bad = tmp_path / "bad"
    bad.mkdir()
    save_file({**{n: t.contiguous() for n, t in new.items()},
               "model.norm.weight": torch.ones(3)}, str(bad / "model.safetensors"))
    before = fresh_tokens(None)
    with serve_process() as (_, port, _log):
        for path, words in [(bad, "model.norm.weight"), (tmp_path / "none", "none")]:
            status, answer = post(port, "/update_weights_from_disk", {"model_path": str(path)})
            assert status == 400 and not answer["success"] and words in answer["message"]
            assert served_tokens(port) == before
        status, answer = post(port, "/update_weights_from_disk", {"model_path": str(good)})
        assert status == 200 and answer["success"] and answer["weight_version"] == 1, answer
        assert served_tokens(port) == want


@pytest.mark.parametrize("body,words", [
    ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 0, "world_size": 2,
      "group_name": "g", "backend": "gloo"}, "rank_offset"),
    ({"master_address": "127.0.0.1", "master_port": 1, "rank_offset": 1, "world_size": 2,
      "group_name": "g", "backend": "mpi"}, "backend"),
    ({"master_port": 1, "rank_offset": 1, "world_size": 2, "group_name": "g"},
     "master_address"),
])
def test_bad_init_bodies_are_refused_naming_the_field(body: dict, words: str) -> None:
    aeng = AsyncSpecEngine(bundled_engine())
    try:
        with running_server(aeng, default_k=3) as (server, client):
            status, answer = post(server.port, "/init_weights_update_group", body)
            assert status == 400 and words in answer["error"], answer
            assert client.health()["status"] == "ok"
    finally:
        asyncio.run(aeng.close())


def test_nccl_without_cuda_is_refused_before_the_rendezvous_and_gloo_then_works() -> None:
    """``backend: "nccl"`` on a server that cannot use it (the engine on the CPU; a torch
    without NCCL) is a 400 naming why, answered before any rendezvous (nobody listens at the
    master port: had it tried, it would fail only after ``timeout_s``), and it leaves nothing
    behind: the same group name then joins over gloo and an update goes through."""
    name = "nccl_then_gloo"
    part = [(n, t) for n, t in new_weights(seed=9).items() if ".layers.0.mlp." in n]
    with serve_process() as (proc, port, log):
        master = free_port()
        body = {"master_address": "127.0.0.1", "master_port": master, "rank_offset": 1,
                "world_size": 2, "group_name": name, "backend": "nccl", "timeout_s": 30}
        status, answer = post(port, "/init_weights_update_group", body)
        assert status == 400 and not answer["success"], answer
        assert "backend='nccl' cannot be used here" in answer["message"], answer
        assert "the engine runs on cpu" in answer["message"], answer
        if not dist.is_nccl_available():
            assert "built without NCCL" in answer["message"], answer

        init = Background(lambda: post(port, "/init_weights_update_group", {
            **body, "backend": "gloo"}), WAIT_S)
        pg = init_custom_process_group(f"tcp://127.0.0.1:{master}", 2, 0, name,
                                       timedelta(seconds=WAIT_S))
        status, answer = init.result()  # type: ignore[misc]
        assert status == 200 and answer["success"], answer
        call = Background(lambda: post(port, "/update_weights_from_distributed", {
            **announce(part), "group_name": name}), WAIT_S)
        for _, t in part:
            dist.broadcast(t.contiguous(), src=0, group=pg)
        status, answer = call.result()  # type: ignore[misc]
        assert status == 200 and answer["weight_version"] == 1, answer
        status, answer = post(port, "/destroy_weights_update_group", {"group_name": name})
        assert status == 200 and answer["success"], answer
        dist.destroy_process_group(pg)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(WAIT_S) == 0, "".join(log)
