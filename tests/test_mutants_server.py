"""Issue 29: the rollout server's mapping of a request body onto the engine's call
(``specengine.server.schemas`` → ``SamplingParams``, ``specengine.server.app``'s
``/generate``): an explicit null takes the default, the schema is strict (types, unknown
fields, NaN, one prompt, bounded ids), and the body's sampling parameters, ``k``, ``k_max``
and ``request_id`` reach the engine, a live id staying live when a duplicate is refused.
Schema checks run on the models; the rest on a live server over the bundled pair.
``mutation/mutate.py --area server`` shows each test fails on the change it targets."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest
from server_helpers import GREEDY, bundled_engine, post_json, running_server

from specengine import AsyncSpecEngine, SamplingParams
from specengine.client import ServerError
from specengine.server.schemas import GenerateRequest, SamplingParamsBody
from specengine.server.serve import RolloutServer

# server_helpers skipped this module without FastAPI, which brings pydantic.
ValidationError = pytest.importorskip("pydantic").ValidationError


def test_explicit_null_takes_the_default() -> None:
    body = SamplingParamsBody.model_validate({"temperature": None, "top_k": None,
                                              "max_tokens": 5, "seed": None})
    assert body.to_params() == SamplingParams(max_tokens=5)


@pytest.mark.parametrize("body", [{"max_tokens": "3"}, {"top_k": 2.0}, {"ignore_eos": 1},
                                  {"temperature": "0.5"}, {"stop_token_ids": ["1"]}],
                         ids=repr)
def test_sampling_body_is_strict_about_types(body: dict) -> None:
    with pytest.raises(ValidationError):
        SamplingParamsBody.model_validate(body)


def test_sampling_body_refuses_unknown_fields_and_nan() -> None:
    with pytest.raises(ValidationError, match="temprature"):
        SamplingParamsBody.model_validate({"temprature": 0.0})
    for value in (float("nan"), float("inf")):
        with pytest.raises(ValidationError, match="temperature"):
            SamplingParamsBody.model_validate({"temperature": value})


def test_generate_body_takes_exactly_one_prompt_and_a_bounded_id() -> None:
    with pytest.raises(ValidationError, match="exactly one of"):
        GenerateRequest.model_validate({"prompt": "Q:", "prompt_token_ids": [1]})
    with pytest.raises(ValidationError, match="exactly one of"):
        GenerateRequest.model_validate({})
    GenerateRequest.model_validate({"prompt_token_ids": [1], "request_id": "r" * 256})
    with pytest.raises(ValidationError, match="request_id"):
        GenerateRequest.model_validate({"prompt_token_ids": [1], "request_id": "r" * 257})


@pytest.fixture(scope="module")
def served() -> Iterator[RolloutServer]:
    aeng = AsyncSpecEngine(bundled_engine())
    try:
        with running_server(aeng, default_k=3) as (server, _):
            yield server
    finally:
        asyncio.run(aeng.close())


PROMPT = [17, 16, 5, 10, 7, 12, 6, 9, 4, 14]


def test_body_sampling_params_reach_the_engine(served: RolloutServer) -> None:
    status, out = post_json(served.port, "/generate", {
        "prompt_token_ids": PROMPT, "request_id": "mine",
        "sampling_params": {"temperature": 0.0, "max_tokens": 3, "ignore_eos": True}})
    assert status == 200, out
    assert out["request_id"] == "mine"
    assert len(out["token_ids"]) == 3 and out["finish_reason"] == "length"


@pytest.mark.parametrize(("bad", "good", "words"),
                         [({"k": 17}, {"k": 2}, "k (draft length)"),
                          ({"k": "auto", "k_max": 17}, {"k": "auto", "k_max": 2}, "k_max must be")])
def test_body_k_and_k_max_reach_the_engine(served: RolloutServer, bad: dict, good: dict,
                                           words: str) -> None:
    status, out = post_json(served.port, "/generate", {"prompt_token_ids": PROMPT, **bad})
    assert status == 400 and words in out["error"], out
    status, out = post_json(served.port, "/generate", {
        "prompt_token_ids": PROMPT, **good,
        "sampling_params": {"temperature": 0.0, "max_tokens": 2}})
    assert status == 200, out


def test_a_refused_duplicate_id_leaves_the_live_one_live(served: RolloutServer) -> None:
    from specengine.client import SpecEngineClient

    client = SpecEngineClient(f"http://127.0.0.1:{served.port}")
    long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
    stream = client.generate_stream(PROMPT, long, request_id="dup")
    next(stream)
    with pytest.raises(ServerError) as err:
        client.generate(PROMPT, GREEDY, request_id="dup")
    assert err.value.status == 400 and "already used" in err.value.message
    assert "dup" in served.state.live  # the running request keeps its id
    client.abort("dup")
    assert list(stream)[-1].finished
