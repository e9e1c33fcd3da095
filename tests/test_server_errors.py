"""The rollout server refuses bad requests with a clear JSON 4xx and changes nothing (the
engine idle, every KV block free, the weights' version and the outputs unchanged, the server
still serving): malformed JSON, unknown fields, wrong types, out-of-range token ids, too-long
prompts, bad sampling values; unknown routes; the bearer token; a model without a tokenizer.
Live server on 127.0.0.1, raw ``http.client`` requests (test_server.py: the rest)."""

from __future__ import annotations

import asyncio
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest
from server_helpers import (
    GREEDY,
    assert_idle_and_free,
    assert_same,
    bundled_engine,
    in_engine,
    post_json,
    raw_request,
    running_server,
)

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.assets import DEFAULT_TARGET
from specengine.client import ServerError, SpecEngineClient
from specengine.server import API_KEY_ENV
from specengine.server.serve import RolloutServer


@pytest.fixture(scope="module")
def reference() -> SpecEngine:
    return bundled_engine()


@pytest.fixture(scope="module")
def aeng() -> Iterator[AsyncSpecEngine]:
    a = AsyncSpecEngine(bundled_engine())
    yield a
    asyncio.run(a.close())


@pytest.fixture(scope="module")
def served(aeng: AsyncSpecEngine) -> Iterator[tuple[RolloutServer, SpecEngineClient]]:
    with running_server(aeng, default_k=3) as pair:
        yield pair


BAD_GENERATE = [
    # (id, raw body, status, words the error must contain)
    ("malformed json", b'{"prompt_token_ids": [1, 2', 400, "malformed JSON"),
    ("not an object", b"[1, 2, 3]", 422, "JSON object"),
    ("empty body", b"", 422, "JSON object"),
    ("unknown field", b'{"prompt_token_ids": [1], "temprature": 0}', 422,
     "unknown field 'temprature'"),
    ("unknown sampling field", b'{"prompt": "Q:1+2=", "sampling_params": {"tmp": 1}}', 422,
     "unknown field 'sampling_params.tmp'"),
    ("string token id", b'{"prompt_token_ids": [1, "2"]}', 422, "prompt_token_ids.1"),
    ("float token id", b'{"prompt_token_ids": [1, 2.5]}', 422, "prompt_token_ids.1"),
    ("bool k", b'{"prompt_token_ids": [1], "k": true}', 422, "k.int: "),
    ("no prompt", b'{"k": 1}', 422, "exactly one of prompt_token_ids"),
    ("two prompts", b'{"prompt": "Q:", "prompt_token_ids": [1]}', 422, "exactly one of"),
    ("token id too big", b'{"prompt_token_ids": [1, 20]}', 400, "outside the vocabulary"),
    ("negative token id", b'{"prompt_token_ids": [-1]}', 400, "outside the vocabulary"),
    ("too-long prompt", b'{"prompt_token_ids": [%s]}' % b", ".join([b"5"] * 300), 400,
     "max_model_len is 256"),
    ("empty prompt", b'{"prompt_token_ids": []}', 400, "is empty"),
    ("unknown character", b'{"prompt": "Q:1+x="}', 400, "'x'"),
    ("bad k", b'{"prompt_token_ids": [1], "k": 17}', 400, "k (draft length)"),
    ("bad temperature", b'{"prompt_token_ids": [1], "sampling_params": {"temperature": -1}}',
     400, "temperature must be"),
    ("bad top_p", b'{"prompt_token_ids": [1], "sampling_params": {"top_p": 0}}', 400,
     "top_p must be"),
    ("bad max_tokens", b'{"prompt_token_ids": [1], "sampling_params": {"max_tokens": 0}}',
     400, "max_tokens must be"),
    ("bad n", b'{"prompt_token_ids": [1], "sampling_params": {"n": 0}}', 400,
     "n (samples per prompt) must be"),
    ("bad seed", b'{"prompt_token_ids": [1], "sampling_params": {"seed": %d}}' % 2**63, 400,
     "seed must be"),
    ("stop id out of vocab", b'{"prompt_token_ids": [1], "sampling_params": '
     b'{"stop_token_ids": [99]}}', 400, "stop_token_ids"),
    ("long request id", b'{"prompt_token_ids": [1], "request_id": "%s"}' % (b"r" * 300), 422,
     "request_id"),
]


@pytest.mark.parametrize("body,status,words", [c[1:] for c in BAD_GENERATE],
                         ids=[c[0] for c in BAD_GENERATE])
def test_bad_generate_request_is_a_clear_4xx_and_changes_nothing(
        served, aeng, reference, body: bytes, status: int, words: str) -> None:
    server, client = served
    got_status, answer = raw_request(server.port, "POST", "/generate", body)
    assert got_status == status, answer
    assert set(answer) == {"error"} and words in answer["error"], answer
    in_engine(aeng, assert_idle_and_free)
    assert in_engine(aeng, lambda e: e.weight_version) == 0
    assert_same(client.generate([5, 6, 7], GREEDY),
                reference.generate([[5, 6, 7]], k=3, sampling=GREEDY)[0])


def test_unknown_route_and_method_are_json_errors(served) -> None:
    server, _ = served
    status, answer = raw_request(server.port, "GET", "/nope")
    assert status == 404 and answer == {"error": "no such endpoint"}
    status, answer = raw_request(server.port, "GET", "/generate")
    assert status == 405 and "Method Not Allowed" in answer["error"]


def test_api_key_is_required_on_every_endpoint(aeng, reference) -> None:
    with running_server(aeng, api_key="s3cret", default_k=3) as (server, client):
        port = server.port
        calls = [("GET", "/health", None), ("GET", "/metrics", None),
                 ("POST", "/generate", b'{"prompt_token_ids": [1, 2]}'),
                 ("POST", "/abort", b'{"request_id": "x"}'),
                 ("POST", "/load_weights", b'{"path": "/nonexistent"}'),
                 ("POST", "/init_weight_update_group", b"{}"),
                 ("POST", "/update_weights_from_distributed", b"{}"),
                 ("POST", "/generate", b"{not json"), ("GET", "/nope", None)]
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "s3cret"},
                        {"Authorization": "Basic s3cret"}, {"Authorization": "Bearers3cret"}):
            for method, path, body in calls:
                status, answer = raw_request(port, method, path, body, headers)
                assert status == 401 and "unauthorized" in answer["error"], (path, headers)
        assert client.health()["status"] == "ok"  # the client sends the token
        assert_same(client.generate([1, 2], GREEDY),
                    reference.generate([[1, 2]], k=3, sampling=GREEDY)[0])
        assert "specengine_weight_version" in client.metrics()
        with pytest.raises(ServerError) as err:
            SpecEngineClient(client.base_url, api_key="wrong").health()
        assert err.value.status == 401
    in_engine(aeng, assert_idle_and_free)


def test_api_key_from_the_environment(aeng, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(API_KEY_ENV, "from-env")
    with running_server(aeng) as (server, client):
        status, _ = raw_request(server.port, "GET", "/health")
        assert status == 401
        assert SpecEngineClient(client.base_url, api_key="from-env").health()["status"] == "ok"


@pytest.fixture(scope="module")
def no_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The bundled target without its tokenizer files."""
    path = tmp_path_factory.mktemp("no_tokenizer")
    for name in ("config.json", "model.safetensors"):
        shutil.copy(Path(DEFAULT_TARGET) / name, path / name)
    return path


def test_text_prompt_without_a_tokenizer_is_a_400(no_tokenizer: Path) -> None:
    eng = SpecEngine(no_tokenizer, device="cpu", kernel_backend="torch", kv_cache_tokens=1024)
    assert eng.tokenizer is None and eng.drafter is None
    want = eng.generate([[5, 6, 7]], sampling=GREEDY)[0]
    a = AsyncSpecEngine(eng)
    try:
        with running_server(a) as (server, client):
            status, answer = post_json(server.port, "/generate", {"prompt": "Q:1+2="})
            assert status == 400 and "no tokenizer" in answer["error"]
            with pytest.raises(ServerError) as err:  # k > 0 without a drafter
                client.generate([5, 6, 7], GREEDY, k=2)
            assert err.value.status == 400 and "needs a drafter" in err.value.message
            assert client.generate([5, 6, 7], GREEDY) == want  # default k: 0
    finally:
        asyncio.run(a.close())


def test_build_app_refuses_bad_options(aeng, no_tokenizer: Path) -> None:
    from specengine.server.app import build_app

    with pytest.raises(ValueError, match="default_k must be"):
        build_app(aeng, default_k=17)
    with pytest.raises(ValueError, match="api_key"):
        build_app(aeng, api_key="")
    plain = AsyncSpecEngine(SpecEngine(no_tokenizer, device="cpu", kernel_backend="torch",
                                       kv_cache_tokens=1024))
    try:
        with pytest.raises(ValueError, match="needs a drafter"):
            build_app(plain, default_k=3)
    finally:
        asyncio.run(plain.close())


def test_schema_mirrors_sampling_params() -> None:
    """Every SamplingParams field can be sent, and nothing else (the schema must follow the
    dataclass when a field is added)."""
    import dataclasses

    from specengine.server.schemas import SamplingParamsBody

    assert set(SamplingParamsBody.model_fields) == {
        f.name for f in dataclasses.fields(SamplingParams)}
