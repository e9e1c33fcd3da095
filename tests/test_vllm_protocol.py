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

import pytest
from server_helpers import bundled_engine, post_json, running_server

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.server.serve import RolloutServer

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
