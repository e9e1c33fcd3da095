"""Server answers no earlier test pinned (issue 37), on the bundled pair behind a live server:

- SGLang's ``top_logprobs_num``: exactly N alternatives per position, most likely first, the
  policy's values (``SpecEngine.generate`` with ``logprobs=N``);
- SGLang's streamed ``index`` for a batch of prompts with ``n`` > 1: prompt p's sample i is
  ``p * n + i``, each index's last chunk equal to the non-streamed answer at that index;
- OpenAI's ``usage.prompt_tokens_details.cached_tokens`` counts each prompt's prefix-cache
  hits once, whatever ``n`` (samples admitted one by one each hit the cache: their sum would
  exceed ``prompt_tokens``); SGLang's ``meta_info.cached_tokens`` is each sample's own.
"""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from typing import Any

import pytest
from server_helpers import bundled_engine, post_json, running_server

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine

LONG = [4 + (i * 7) % 14 for i in range(40)]  # 40 tokens of the bundled vocabulary: 2 blocks+


@pytest.fixture(scope="module")
def reference() -> SpecEngine:
    return bundled_engine()


@pytest.fixture(scope="module")
def port() -> Iterator[int]:
    eng = AsyncSpecEngine(bundled_engine())
    try:
        with running_server(eng, default_k=3) as (srv, _):
            yield srv.port
    finally:
        asyncio.run(eng.close())


def sse(port: int, body: dict[str, Any]) -> list[dict[str, Any]]:
    from test_sglang_generate import sse as raw_sse

    return [e for e in raw_sse(port, body) if e != "[DONE]"]


@pytest.mark.parametrize("n,temperature", [(3, 0.0), (1, 5.0)])
def test_top_logprobs_num_gives_exactly_n_most_likely(port: int, reference: SpecEngine,
                                                      n: int, temperature: float) -> None:
    """Greedy (the emitted token is the most likely) and hot sampling (it often is not: the
    engine's per-token dict then holds N + 1 entries, SGLang's list still N)."""
    status, out = post_json(port, "/generate", {
        "input_ids": LONG[:10], "return_logprob": True, "top_logprobs_num": n,
        "sampling_params": {"max_new_tokens": 8, "temperature": temperature,
                            "sampling_seed": 3}})
    assert status == 200, out
    want = reference.generate([LONG[:10]], k=3, sampling=SamplingParams(
        temperature=temperature, max_tokens=8, logprobs=n, seed=3))[0]
    assert out["output_ids"] == list(want.token_ids)
    if temperature:
        assert any(len(alt) == n + 1 for alt in want.top_logprobs)  # the case this is about
    tops = out["meta_info"]["output_top_logprobs"]
    assert len(tops) == len(want.token_ids) == 8
    for got, alt in zip(tops, want.top_logprobs):
        best = sorted(alt.items(), key=lambda kv: -kv[1])[:n]
        assert [t for _, t, _ in got] == [t for t, _ in best]
        assert [lp for lp, _, _ in got] == pytest.approx([lp for _, lp in best], abs=1e-4)


def test_streamed_batch_with_n_indexes_every_sample(port: int) -> None:
    sp = {"max_new_tokens": 6, "temperature": 1.0, "n": 2, "sampling_seed": 5}
    body = {"input_ids": [LONG[:8], LONG[8:16], LONG[16:24]], "sampling_params": sp}
    status, answer = post_json(port, "/generate", body)
    assert status == 200 and len(answer) == 6
    last: dict[int, dict[str, Any]] = {}
    for chunk in sse(port, {**body, "stream": True}):
        last[chunk["index"]] = chunk
    assert sorted(last) == list(range(6))
    for i, a in enumerate(answer):
        assert last[i]["output_ids"] == a["output_ids"], i


@pytest.fixture(scope="module")
def one_at_a_time() -> Iterator[int]:
    """A server admitting one sequence per step: a group's samples are admitted one by one,
    so each later sample finds the prompt's blocks in the prefix cache itself."""
    from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

    eng = AsyncSpecEngine(SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu",
                                     kernel_backend="torch", max_batch_size=1,
                                     kv_cache_tokens=4096))
    try:
        with running_server(eng, default_k=3) as (srv, _):
            yield srv.port
    finally:
        asyncio.run(eng.close())


def test_cached_tokens_count_each_prompt_once(one_at_a_time: int) -> None:
    port = one_at_a_time
    prompts = [LONG, LONG[::-1]]
    for p in prompts:  # warm the prefix cache
        assert post_json(port, "/v1/completions", {
            "model": "arith-target", "prompt": p, "max_tokens": 2, "temperature": 0.0})[0] == 200
    status, out = post_json(port, "/v1/completions", {
        "model": "arith-target", "prompt": prompts, "max_tokens": 4, "n": 3,
        "temperature": 1.0, "seed": 1})
    assert status == 200, out
    usage = out["usage"]
    cached = usage["prompt_tokens_details"]["cached_tokens"]
    assert usage["prompt_tokens"] == 80
    assert cached == 2 * 32  # each prompt's 2 full blocks, once
    status, res = post_json(port, "/generate", {
        "input_ids": LONG, "sampling_params": {"max_new_tokens": 4, "temperature": 1.0,
                                               "n": 3, "sampling_seed": 2}})
    assert status == 200
    for r in res:
        assert 0 <= r["meta_info"]["cached_tokens"] <= r["meta_info"]["prompt_tokens"]
    # (SGLang answers each sample as its own request: each counts its own hits)
    assert [r["meta_info"]["cached_tokens"] for r in res] == [32, 32, 32]
