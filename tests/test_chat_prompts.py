"""Chat messages as prompts (issue 36): ``SpecEngine.generate``, ``add_request``,
``AsyncSpecEngine`` and the server's ``/generate`` (``SpecEngineClient``) render a list of
messages with the checkpoint's chat template, exactly as the rendered text; bad
conversations are refused with their reason and change nothing."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator

import pytest
from server_helpers import bundled_engine, post_json, running_server

pytest.importorskip("jinja2")

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine  # noqa: E402
from specengine.client import SpecEngineClient  # noqa: E402
from specengine.core.requests import chat_prompt_ids  # noqa: E402

CHAT = [{"role": "user", "content": "472+385="}]
TEXT = "Q:472+385="  # what the bundled template renders CHAT as
GREEDY = SamplingParams(temperature=0.0, max_tokens=10)
GREEDY_ONE = SamplingParams(temperature=0.0, max_tokens=1)


@pytest.fixture(scope="module")
def engine() -> SpecEngine:
    return bundled_engine()


@pytest.fixture(scope="module")
def served(engine: SpecEngine) -> Iterator[SpecEngineClient]:
    aeng = AsyncSpecEngine(engine)
    try:
        with running_server(aeng, default_k=3) as (_, client):
            yield client
    finally:
        asyncio.run(aeng.close())


def test_generate_renders_messages_with_the_chat_template() -> None:
    eng = bundled_engine()
    chat, text = eng.generate([CHAT, TEXT], k=3, sampling=GREEDY)
    assert chat.prompt_token_ids == text.prompt_token_ids == tuple(eng.tokenizer.encode(TEXT))
    assert chat.token_ids == text.token_ids and chat.text == text.text
    rid = eng.add_request(CHAT, GREEDY, k=3)
    outs = {}
    while eng.has_unfinished():
        outs.update({o.request_id: o.output for o in eng.step() if o.finished})
    assert outs[rid].token_ids == text.token_ids


def test_bad_conversations_are_refused_and_change_nothing() -> None:
    eng = bundled_engine()
    with pytest.raises(ValueError, match="batch is one chat conversation"):
        eng.generate(CHAT, sampling=GREEDY_ONE)
    with pytest.raises(ValueError, match="message 0 needs a string 'role'"):
        eng.generate([[{"content": "1+2="}]], sampling=GREEDY_ONE)
    with pytest.raises(ValueError, match="content must be text"):
        eng.generate([[{"role": "user", "content": 5}]], sampling=GREEDY_ONE)
    with pytest.raises(ValueError, match="got role system"):  # the template's own refusal
        eng.generate([[{"role": "system", "content": "1+2="}]], sampling=GREEDY_ONE)
    with pytest.raises(ValueError, match="outside the tokenizer's vocabulary"):
        eng.generate([[{"role": "user", "content": "hello"}]], sampling=GREEDY_ONE)
    no_template = dataclasses.replace(eng.tokenizer, chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        chat_prompt_ids(CHAT, "prompt 0", no_template)
    with pytest.raises(ValueError, match="no tokenizer.json"):
        chat_prompt_ids(CHAT, "prompt 0", None)
    assert not eng.has_unfinished()
    assert eng.kv_cache.num_free_blocks == eng.kv_cache.num_blocks



def test_async_engine_takes_messages(engine: SpecEngine) -> None:
    want = engine.generate([TEXT], k=3, sampling=GREEDY)[0]

    async def run() -> object:
        async with AsyncSpecEngine(engine) as aeng:
            return await aeng.generate(CHAT, GREEDY, k=3)
    got = asyncio.run(run())
    assert got.token_ids == want.token_ids and got.prompt_token_ids == want.prompt_token_ids


def test_client_and_server_take_messages(served: SpecEngineClient) -> None:
    want = served.generate(TEXT, GREEDY)
    got = served.generate(CHAT, GREEDY)
    assert got.prompt_token_ids == want.prompt_token_ids and got.token_ids == want.token_ids
    group = served.generate_group(CHAT, SamplingParams(temperature=1.0, max_tokens=6, n=3,
                                                       seed=5))
    assert [o.sample_index for o in group] == [0, 1, 2]
    assert all(o.prompt_token_ids == want.prompt_token_ids for o in group)
    port = int(served.base_url.rsplit(":", 1)[1])
    status, body = post_json(port, "/generate", {"messages": CHAT, "prompt": TEXT})
    assert status == 422 and "exactly one of" in str(body["error"])
    status, body = post_json(port, "/generate", {"messages": [{"role": "system",
                                                               "content": "1"}]})
    assert status == 400 and "got role system" in body["error"]
    status, body = post_json(port, "/generate", {"messages": []})
    assert status == 422
