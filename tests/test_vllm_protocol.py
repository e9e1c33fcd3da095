"""vLLM's server protocol where RL frameworks use it, driven by TRL's own ``VLLMClient``
(``trl.generation.vllm_client``, server mode) against a live server on the bundled pair.

TRL's client refuses to start without vLLM installed (it imports vLLM's weight-transfer
engine for ``init_communicator`` only); generation needs nothing of vLLM, so its
availability check is patched here and every request and answer is TRL's unmodified code:
``/health``, ``/v1/models``, ``/v1/completions`` with ``return_token_ids`` and
``return_tokens_as_token_ids``, its ``parse_logprobs`` of vLLM's logprobs shape (``logprobs``
0 and N), ``/get_world_size``, ``/server_info``, ``/reset_prefix_cache``.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from net_helpers import Background, free_port
from safetensors.torch import load_file
from server_helpers import WAIT_S, bundled_engine, post_json, running_server

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.assets import DEFAULT_TARGET
from specengine.server.serve import RolloutServer
from specengine.weights.group import WeightGroup
from specengine.weights.vllm_receiver import chunks

vllm_client = pytest.importorskip("trl.generation.vllm_client")
PROMPTS = [[5, 6, 7], [5, 6, 8, 9]]


@pytest.fixture(scope="module")
def reference() -> SpecEngine:
    return bundled_engine()


@pytest.fixture(scope="module")
def aeng() -> Iterator[AsyncSpecEngine]:
    eng = AsyncSpecEngine(bundled_engine())
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def server(aeng: AsyncSpecEngine) -> Iterator[RolloutServer]:
    with running_server(aeng, default_k=3) as (srv, _):
        yield srv


@pytest.fixture(scope="module")
def trl_client(server: RolloutServer) -> object:
    mp = pytest.MonkeyPatch()
    mp.setattr(vllm_client, "is_vllm_available", lambda: True)  # generation needs no vLLM
    try:
        return vllm_client.VLLMClient(base_url=f"http://127.0.0.1:{server.port}")
    finally:
        mp.undo()


def test_trl_generate_with_logprobs_0_equals_the_engine(trl_client, reference) -> None:
    got = trl_client.generate(PROMPTS, n=2, temperature=0.0, max_tokens=10, logprobs=0)
    assert got["prompt_ids"] == PROMPTS
    want = reference.generate(PROMPTS, k=3, sampling=SamplingParams(temperature=0.0,
                                                                    max_tokens=10))
    # prompt-major, n per prompt; greedy samples are equal
    for i, ids in enumerate(got["completion_ids"]):
        w = want[i // 2]
        assert ids == list(w.token_ids)
        # one logprob per token (the sampled one), its id the token's
        assert got["logprob_token_ids"][i] == [[t] for t in w.token_ids]
        assert [x[0] for x in got["logprobs"][i]] == pytest.approx(list(w.logprobs), abs=1e-4)


def test_trl_generate_with_top_logprobs_sorted_with_the_sampled_token(trl_client, reference
                                                                      ) -> None:
    got = trl_client.generate([PROMPTS[0]], n=1, temperature=1.0, max_tokens=8, logprobs=3,
                              generation_kwargs={"seed": 7})
    want = reference.generate([PROMPTS[0]], k=3, sampling=SamplingParams(
        temperature=1.0, max_tokens=8, seed=7, logprobs=3))[0]
    assert got["completion_ids"][0] == list(want.token_ids)
    for pos, (ids, lps) in enumerate(zip(got["logprob_token_ids"][0], got["logprobs"][0],
                                         strict=True)):
        alt = want.top_logprobs[pos]
        assert want.token_ids[pos] in ids and 3 <= len(ids) <= 4
        assert lps == sorted(lps, reverse=True)
        assert dict(zip(ids, lps)) == pytest.approx(
            {t: alt.get(t, want.logprobs[pos]) for t in ids}, abs=1e-4)


def test_completions_logprobs_0_is_vllms_shape(server, reference) -> None:
    status, answer = post_json(server.port, "/v1/completions", {
        "prompt": PROMPTS[0], "max_tokens": 5, "temperature": 0.0, "logprobs": 0,
        "return_tokens_as_token_ids": True})
    assert status == 200, answer
    lp = answer["choices"][0]["logprobs"]
    want = reference.generate([PROMPTS[0]], k=3, sampling=SamplingParams(
        temperature=0.0, max_tokens=5))[0]
    assert lp["tokens"] == [f"token_id:{t}" for t in want.token_ids]
    # a list of one-entry dicts, as vLLM's (TRL's parser reads it), not null
    assert lp["top_logprobs"] == [{f"token_id:{t}": v} for t, v in zip(
        want.token_ids, lp["token_logprobs"])]


def test_world_size_server_info_and_prefix_cache_reset(trl_client, server, aeng) -> None:
    assert trl_client.get_world_size() == 1
    info = trl_client.get_server_info()
    assert info["weight_transfer_config"] is None
    assert info["model_config"]["max_model_len"] == aeng.engine.config.max_model_len
    trl_client.reset_prefix_cache()  # raises on anything but a 200
    status, answer = post_json(server.port, "/reset_prefix_cache", {})
    assert status == 200 and answer == {"success": True}
    # TRL refuses weight sync by name (no weight-transfer engine) instead of hanging
    with pytest.raises(RuntimeError, match="no weight-transfer engine"):
        trl_client.init_communicator(device="cpu")
    assert json.loads(json.dumps(info))  # plain JSON


# ---- vLLM's weight-transfer endpoints, a gloo learner that packs as vLLM's producer -------
def packed_producer(group: object, tensors: list[tuple[str, torch.Tensor]],
                    buffer_bytes: int) -> int:
    """The learner's side as vLLM's ``packed_nccl_broadcast_producer`` lays it out (written
    from its description): consecutive tensors' bytes end to end, a chunk broadcast once its
    size exceeds ``buffer_bytes``. Returns how many chunks were sent."""
    pending: list[torch.Tensor] = []
    total, sent = 0, 0
    for i, (_, t) in enumerate(tensors):
        pending.append(t.contiguous().view(torch.uint8).view(-1))
        total += pending[-1].numel()
        if total > buffer_bytes or i == len(tensors) - 1:
            group.broadcast(torch.cat(pending), 0)  # type: ignore[attr-defined]
            pending, total, sent = [], 0, sent + 1
    return sent


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    sd = load_file(str(Path(DEFAULT_TARGET) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen) if ".mlp." in n else t
            for n, t in sd.items()}


def announce(tensors: list[tuple[str, torch.Tensor]], **extra: object) -> dict[str, Any]:
    return {"update_info": {
        "names": [n for n, _ in tensors],
        "dtype_names": [str(t.dtype).removeprefix("torch.") for _, t in tensors],
        "shapes": [list(t.shape) for _, t in tensors], **extra}}


def test_weight_transfer_packed_and_unpacked_between_start_and_finish(reference) -> None:
    eng = AsyncSpecEngine(bundled_engine())  # its own: the weights change
    try:
        with running_server(eng, default_k=3) as (srv, client):
            port = srv.port
            master = free_port()
            learner = Background(lambda: WeightGroup("127.0.0.1", master, 0, 2, "gloo",
                                                     WAIT_S))
            status, answer = post_json(port, "/init_weight_transfer_engine", {"init_info": {
                "master_address": "127.0.0.1", "master_port": master, "rank_offset": 1,
                "world_size": 2, "packed": True, "backend": "gloo"}})
            assert status == 200, answer
            group = learner.result()
            # a second learner while this one answers: refused now, never a rendezvous hang
            status, answer = post_json(port, "/init_weight_transfer_engine", {"init_info": {
                "master_address": "127.0.0.1", "master_port": free_port(),
                "world_size": 2, "backend": "gloo"}})
            assert status == 409 and "still answers" in answer["error"], answer

            new = list(new_weights(seed=21).items())
            half = len(new) // 2
            assert post_json(port, "/start_weight_update", {})[0] == 200
            buffer = 64 * 1024  # small: the first half goes in several chunks
            call = Background(lambda: post_json(port, "/update_weights", announce(
                new[:half], packed=True, packed_buffer_size_bytes=buffer)))
            assert packed_producer(group, new[:half], buffer) > 1
            status, answer = call.result()  # type: ignore[misc]
            assert status == 200 and answer["received"] == half, answer
            assert client.weight_version() == 0  # nothing lands before finish
            call = Background(lambda: post_json(port, "/update_weights", announce(
                new[half:], packed=False)))
            for _, t in new[half:]:
                group.broadcast(t.contiguous(), 0)
            assert call.result()[0] == 200  # type: ignore[index]
            status, answer = post_json(port, "/finish_weight_update", {})
            assert status == 200 and answer["weight_version"] == 1, answer
            assert client.weight_version() == 1

            prompt = [5, 6, 7]
            status, out = post_json(port, "/v1/completions", {
                "prompt": prompt, "max_tokens": 12, "temperature": 0.0, "logprobs": 0,
                "return_token_ids": True})
            assert status == 200, out
            reference.load_weights(dict(new))
            try:
                want = reference.generate([prompt], k=3, sampling=SamplingParams(
                    temperature=0.0, max_tokens=12))[0]
            finally:
                reference.load_weights(load_file(str(Path(DEFAULT_TARGET) /
                                                     "model.safetensors")))
            choice = out["choices"][0]
            assert choice["token_ids"] == list(want.token_ids)
            assert choice["logprobs"]["token_logprobs"] == pytest.approx(
                list(want.logprobs), abs=1e-4)
            group.close()
    finally:
        asyncio.run(eng.close())


def test_chunks_close_once_the_buffer_is_exceeded() -> None:
    assert chunks([4, 4, 4, 4], 8) == [[0, 1, 2], [3]]
    assert chunks([10, 1], 8) == [[0], [1]]
    assert chunks([1, 1], 8) == [[0, 1]]
