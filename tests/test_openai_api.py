"""The OpenAI-compatible endpoints (``specengine.server.openai_api``) through the real
``openai`` client against a live server on the bundled pair: ``models.list()``, completions
(text and token-id prompts, GRPO groups with ``n`` and a seed, logprobs, streaming) and chat
completions (the checkpoint's chat template, as transformers renders it), each equal to
``SpecEngine.generate`` on the same prompt; bad input is a 4xx in OpenAI's error shape that
leaves the engine idle and whole.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import shutil
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from readme_blocks import readme_block
from server_helpers import (
    WAIT_S,
    assert_idle_and_free,
    bundled_engine,
    in_engine,
    post_json,
    raw_request,
    running_server,
)

openai = pytest.importorskip("openai")
pytest.importorskip("jinja2")

from specengine import AsyncSpecEngine, SamplingParams  # noqa: E402
from specengine.arith_task import CHAT_TEMPLATE  # noqa: E402
from specengine.assets import DEFAULT_TARGET  # noqa: E402
from specengine.chat_template import ChatTemplateError, load_chat_template  # noqa: E402
from specengine.outputs import GenerationOutput  # noqa: E402

PROMPT = "Q:472+385="
PROMPT_IDS = [17, 16, 6, 9, 4, 12, 5, 10, 7, 14]  # PROMPT in the bundled vocabulary
MODEL = "arith-target"


@pytest.fixture(scope="module")
def aeng() -> Iterator[AsyncSpecEngine]:
    eng = AsyncSpecEngine(bundled_engine(), max_waiting=64)
    yield eng
    asyncio.run(eng.close())


@pytest.fixture(scope="module")
def served(aeng: AsyncSpecEngine) -> Iterator[tuple[object, object]]:
    with running_server(aeng) as (server, _client):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="none",
                               max_retries=0, timeout=WAIT_S)
        yield server, client


def reference(aeng: AsyncSpecEngine, prompt: list[int] | str, params: SamplingParams,
              k: int = 0) -> list[GenerationOutput]:
    """``SpecEngine.generate`` of the served engine itself (on its thread, while idle)."""
    outs = in_engine(aeng, lambda e: e.generate([prompt], k=k, sampling=params))
    tok = aeng.engine.tokenizer
    return [o if o.text is not None else
            GenerationOutput(**{**o.__dict__, "text": tok.decode(o.token_ids)}) for o in outs]


def greedy(max_tokens: int = 40, **kw: object) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kw)


def test_models_list(served) -> None:
    _, client = served
    models = client.models.list().data
    assert [m.id for m in models] == [MODEL]
    assert models[0].owned_by == "specengine" and models[0].max_model_len == 256


@pytest.mark.parametrize("prompt", [PROMPT, PROMPT_IDS], ids=["text", "token_ids"])
def test_greedy_completion_equals_generate(served, aeng, prompt) -> None:
    _, client = served
    want = reference(aeng, PROMPT_IDS, greedy())[0]
    got = client.completions.create(model=MODEL, prompt=prompt, max_tokens=40, temperature=0,
                                    logprobs=0, extra_body={"return_token_ids": True})
    (choice,) = got.choices
    assert choice.text == want.text and choice.finish_reason == want.finish_reason == "stop"
    assert choice.token_ids == list(want.token_ids)
    assert choice.prompt_token_ids == PROMPT_IDS
    # the logprob of every sampled token, exactly the engine's (JSON floats round-trip)
    assert choice.logprobs.token_logprobs == list(want.logprobs)
    # vLLM's shape for logprobs=0: per token a one-entry {token: logprob}, the sampled one
    assert choice.logprobs.top_logprobs == [{t: lp} for t, lp in zip(
        choice.logprobs.tokens, want.logprobs)]
    assert choice.logprobs.tokens == list(want.text) + ["<eos>"]
    assert choice.logprobs.text_offset == list(range(len(want.token_ids)))
    assert choice.weight_version == 0 and choice.token_weight_versions == [0] * len(
        want.token_ids)
    assert got.usage.prompt_tokens == len(PROMPT_IDS)
    assert got.usage.completion_tokens == len(want.token_ids)
    assert got.usage.total_tokens == len(PROMPT_IDS) + len(want.token_ids)
    assert got.model == MODEL and got.object == "text_completion"
    assert got.id.startswith("cmpl-")
    in_engine(aeng, assert_idle_and_free)


def test_speculative_k3_equals_k0_and_drafts_are_accepted(served, aeng) -> None:
    _, client = served
    runs = {k: client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40,
                                         temperature=0, logprobs=0, extra_body={"k": k})
            for k in (0, 3)}
    assert runs[3].choices[0].text == runs[0].choices[0].text
    assert runs[3].choices[0].logprobs.token_logprobs == pytest.approx(
        runs[0].choices[0].logprobs.token_logprobs, abs=1e-4)
    assert runs[0].choices[0].num_draft_tokens == 0
    # the EAGLE-3 head drafts, and most of its drafts are accepted (a drafter whose drafts
    # are all rejected would still give the same text, so acceptance is checked here)
    spec = runs[3].choices[0]
    assert spec.num_draft_tokens > 0
    assert spec.num_accepted_tokens > spec.num_draft_tokens // 2
    assert spec.num_steps < runs[0].choices[0].num_steps
    want = reference(aeng, PROMPT_IDS, greedy(), k=3)[0]
    assert spec.text == want.text


def test_group_of_n_samples_one_prefill_reproducible(served, aeng) -> None:
    _, client = served
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=12, temperature=3.0, n=4, seed=11,
              logprobs=0, extra_body={"return_token_ids": True, "ignore_eos": True})
    first = client.completions.create(**kw)
    stats = in_engine(aeng, lambda e: e.stats)
    again = client.completions.create(**kw)
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    assert [c.token_ids for c in first.choices] == [c.token_ids for c in again.choices]
    assert [c.text for c in first.choices] == [c.text for c in again.choices]
    assert len({tuple(c.token_ids) for c in first.choices}) > 1  # the samples differ
    # the group is SamplingParams(n=4): the same samples as in-process, the prompt's KV
    # computed once (the 3 siblings borrow it; prefix caching is off with EAGLE-3)
    want = reference(aeng, PROMPT_IDS, SamplingParams(temperature=3.0, max_tokens=12, n=4,
                                                      seed=11, ignore_eos=True))
    assert [c.token_ids for c in first.choices] == [list(o.token_ids) for o in want]
    assert [c.logprobs.token_logprobs for c in first.choices] == [
        pytest.approx(list(o.logprobs), abs=1e-4) for o in want]
    assert stats.num_prompt_tokens == 4 * len(PROMPT_IDS)
    assert stats.num_cached_prompt_tokens == 3 * len(PROMPT_IDS)
    assert first.usage.prompt_tokens == len(PROMPT_IDS)  # the prompt counts once
    assert first.usage.completion_tokens == 4 * 12


def test_greedy_group_samples_are_equal(served) -> None:
    _, client = served
    got = client.completions.create(model=MODEL, prompt=[PROMPT_IDS, "Q:47*6+385="], n=4,
                                    max_tokens=64, temperature=0)
    assert len(got.choices) == 8
    texts = [c.text for c in got.choices]
    assert texts[:4] == [texts[0]] * 4 and texts[4:] == [texts[4]] * 4
    assert texts[0].endswith("A:857") and texts[4].endswith("A:667")


def _reassemble(chunks: list) -> dict[int, dict[str, list]]:
    by_choice: dict[int, dict[str, list]] = {}
    for chunk in chunks:
        for c in chunk.choices:
            d = by_choice.setdefault(c.index, {"text": [], "ids": [], "finish": [], "lp": []})
            d["text"].append(c.text)
            d["ids"] += getattr(c, "token_ids", None) or []
            d["finish"].append(c.finish_reason)
            if c.logprobs is not None:
                d["lp"] += c.logprobs.token_logprobs
    return by_choice


def test_streamed_completion_reassembles_to_the_answer(served) -> None:
    _, client = served
    kw = dict(model=MODEL, prompt=[PROMPT, "Q:47*6+385="], max_tokens=40, temperature=1.0,
              n=2, seed=5, logprobs=0, extra_body={"return_token_ids": True, "k": 3})
    whole = client.completions.create(**kw)
    chunks = list(client.completions.create(stream=True,
                                            stream_options={"include_usage": True}, **kw))
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage
    parts = _reassemble(chunks[:-1])
    assert sorted(parts) == [0, 1, 2, 3]
    for c in whole.choices:
        got = parts[c.index]
        assert "".join(got["text"]) == c.text
        assert got["ids"] == c.token_ids
        assert got["lp"] == c.logprobs.token_logprobs  # all in the choice's last chunk
        assert got["finish"][-1] == c.finish_reason and set(got["finish"][:-1]) <= {None}
        assert len(got["text"]) > 2  # it streamed, not one piece at the end
    firsts = {}
    for chunk in chunks[:-1]:
        for c in chunk.choices:
            firsts.setdefault(c.index, c)
    assert all(firsts[i].prompt_token_ids == whole.choices[i].prompt_token_ids for i in range(4))


def test_chat_completion_equals_generate_on_the_rendered_prompt(served, aeng) -> None:
    _, client = served
    messages = [{"role": "user", "content": "472+385="}]
    want = reference(aeng, PROMPT_IDS, greedy(max_tokens=64))[0]  # "Q:" + content
    got = client.chat.completions.create(model=MODEL, messages=messages, temperature=0,
                                         max_completion_tokens=64, logprobs=True,
                                         extra_body={"return_token_ids": True})
    (choice,) = got.choices
    assert choice.message.role == "assistant" and choice.message.content == want.text
    assert choice.finish_reason == "stop" and got.object == "chat.completion"
    assert got.prompt_token_ids == PROMPT_IDS and choice.token_ids == list(want.token_ids)
    content = choice.logprobs.content
    assert [c.logprob for c in content] == list(want.logprobs)
    assert [c.token for c in content] == list(want.text) + ["<eos>"]
    assert content[0].bytes == list(want.text[0].encode()) and content[0].top_logprobs == []
    # no max_tokens: until EOS or the context is full (as vLLM)
    free = client.chat.completions.create(model=MODEL, messages=messages, temperature=0)
    assert free.choices[0].message.content == want.text
    # a list of text parts is their text, joined by newlines (vLLM's string content format)
    part = client.chat.completions.create(
        model=MODEL, temperature=0, max_tokens=64,
        messages=[{"role": "user", "content": [{"type": "text", "text": "472+385="}]}])
    assert part.choices[0].message.content == want.text
    with pytest.raises(openai.BadRequestError, match=r"'\\n' at position 6"):
        client.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": [
                {"type": "text", "text": "472+"}, {"type": "text", "text": "385="}]}])
    in_engine(aeng, assert_idle_and_free)


def test_streamed_chat_reassembles_to_the_answer(served) -> None:
    _, client = served
    kw = dict(model=MODEL, messages=[{"role": "user", "content": "47*6+385="}], n=2,
              temperature=0, extra_body={"return_token_ids": True})
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(stream=True, **kw))
    assert chunks[0].prompt_token_ids == whole.prompt_token_ids
    assert all(getattr(c, "prompt_token_ids", None) is None for c in chunks[1:])
    for index in (0, 1):
        mine = [c.choices[0] for c in chunks if c.choices and c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[0].message.content
        assert sum((c.token_ids for c in mine), []) == whole.choices[index].token_ids
        assert mine[-1].finish_reason == "stop"
        assert chunks[-1].object == "chat.completion.chunk"


RICH_TEMPLATE = """\
{%- set ns = namespace(system='') -%}
{%- for m in messages if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- endfor %}
{{ bos_token }}{% if ns.system %}<sys>{{ ns.system }}</sys>
{% endif %}
{% if tools %}Tools: {{ tools | tojson }}
{% endif %}
{% for message in messages %}
    {% if message.role == 'user' %}
[U{% if message.name is defined %}:{{ message.name }}{% endif %}] {{ message.content }}\
{{ eos_token }}
    {% elif message.role == 'assistant' %}
[A] {% if message.reasoning_content %}<think>{{ message.reasoning_content }}</think>{% endif %}\
{% generation %}{{ message.content }}{% endgeneration %}{% if not loop.last %}{{ eos_token }}\
{% endif %}

    {% elif message.role == 'tool' %}
[T:{{ message.name }}] {{ message.content | tojson }}
    {% elif message.role != 'system' %}
{{ raise_exception('unknown role ' + message.role) }}
    {% endif %}
{% endfor %}
{% if add_generation_prompt %}[A] {% if thinking %}<think>{% endif %}{% endif %}"""

CONVERSATIONS = [
    [{"role": "user", "content": "472+385="}],
    [{"role": "user", "content": "472+385="},
     {"role": "assistant", "content": "2+5=7;A:857"}, {"role": "user", "content": "1+2="}],
    [{"role": "system", "content": "be <brief> & exact"},
     {"role": "user", "content": "what's \"1\"+1?", "name": None},
     {"role": "assistant", "content": "2", "reasoning": "1+1=2"},
     {"role": "tool", "name": "calc", "content": "<b>2</b> é"},
     {"role": "user", "content": "and 2+2?"}],
]


@pytest.mark.parametrize("where", ["bundled", "tokenizer_config", "chat_template.jinja"])
def test_chat_template_renders_as_transformers(tmp_path: Path, where: str) -> None:
    transformers = pytest.importorskip("transformers")
    path = Path(DEFAULT_TARGET)
    if where != "bundled":
        path = tmp_path / "ckpt"
        path.mkdir()
        shutil.copy(Path(DEFAULT_TARGET) / "tokenizer.json", path)
        cfg = json.loads((Path(DEFAULT_TARGET) / "tokenizer_config.json").read_text())
        cfg.update(bos_token="<pad>", chat_template=RICH_TEMPLATE)
        if where == "chat_template.jinja":  # the file wins over tokenizer_config.json's
            cfg["chat_template"] = "{{ raise_exception('not this one') }}"
            (path / "chat_template.jinja").write_text(RICH_TEMPLATE)
        (path / "tokenizer_config.json").write_text(json.dumps(cfg))
    ours = load_chat_template(path)
    theirs = transformers.AutoTokenizer.from_pretrained(str(path))
    tools = [{"type": "function", "function": {"name": "calc", "parameters": {}}}]
    for messages in CONVERSATIONS[:2] if where == "bundled" else CONVERSATIONS:
        for extra in ({}, {"tools": tools, "thinking": True}):
            want = theirs.apply_chat_template(messages, add_generation_prompt=True,
                                              tokenize=False, **extra)
            got = ours.render(messages, add_generation_prompt=True, **extra)
            assert got == want
    if where == "bundled":
        assert ours.source == CHAT_TEMPLATE
        from specengine.tokenizer import load_tokenizer

        tok = load_tokenizer(DEFAULT_TARGET)
        assert tok.chat_template == ours  # the engine's tokenizer carries it
        for messages in CONVERSATIONS[:2]:
            ids = tok.encode(ours.render(messages), add_special_tokens=False)
            want_ids = theirs.apply_chat_template(messages, add_generation_prompt=True,
                                                  tokenize=True, return_dict=False)
            assert ids == list(want_ids)
        with pytest.raises(ChatTemplateError, match="user and assistant messages only"):
            ours.render(CONVERSATIONS[2])


# (what, endpoint, body, status, param, words in the message)
BAD = [
    ("bad role", "chat", {"messages": [{"role": "wizard", "content": "1+1="}]}, 400,
     "messages.0.role", "Input should be"),
    ("role the template refuses", "chat", {"messages": [{"role": "system", "content": "x"}]},
     400, "messages", "user and assistant messages only, got role system"),
    ("image part", "chat", {"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": "x"}}]}]}, 400, "messages",
     "only text parts"),
    ("no messages", "chat", {"messages": []}, 400, "messages", "messages is empty"),
    ("echo", "cmpl", {"prompt": PROMPT, "echo": True}, 400, "echo", "echo=true"),
    ("n=0", "cmpl", {"prompt": PROMPT, "n": 0}, 400, "n", "n (samples per prompt) must be"),
    ("n over max_waiting", "cmpl", {"prompt": PROMPT, "n": 65}, 400, "n",
     "n=65 samples exceed max_waiting=64"),
    ("unknown model", "cmpl", {"prompt": PROMPT, "model": "gpt-4"}, 404, "model",
     "'gpt-4' does not exist"),
    ("presence_penalty", "chat", {"messages": [{"role": "user", "content": "1+1="}],
                                  "presence_penalty": 0.5}, 400, "presence_penalty",
     "not supported"),
    ("frequency_penalty", "cmpl", {"prompt": PROMPT, "frequency_penalty": 0.5}, 400,
     "frequency_penalty", "frequency_penalty=0.5 is not supported"),
    ("repetition_penalty", "chat", {"messages": [{"role": "user", "content": "1+1="}],
                                    "repetition_penalty": 1.1}, 400, "repetition_penalty",
     "not supported"),
    ("top_logprobs without logprobs", "chat", {"messages": [{"role": "user", "content": "x"}],
                                               "top_logprobs": 3}, 400, "top_logprobs",
     "needs logprobs=true"),
    ("top_logprobs 21", "chat", {"messages": [{"role": "user", "content": "1+1="}],
                                 "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs",
     "top_logprobs must be an int in [0, 20]"),
    ("logprobs 21", "cmpl", {"prompt": PROMPT, "logprobs": 21}, 400, "logprobs",
     "logprobs must be None or an int in [0, 20]"),
    ("min_tokens over max_tokens", "cmpl", {"prompt": PROMPT, "min_tokens": 20}, 400,
     "min_tokens", "min_tokens must be"),
    ("min_p 2", "cmpl", {"prompt": PROMPT, "min_p": 2.0}, 400, "min_p", "min_p must be"),
    ("empty stop string", "cmpl", {"prompt": PROMPT, "stop": [""]}, 400, "stop",
     "stop[0] must be a non-empty str"),
    ("logit_bias", "cmpl", {"prompt": PROMPT, "logit_bias": {"3": 5.0}}, 400, "logit_bias",
     "logit_bias"),
    ("tool_choice auto", "chat", {"messages": [{"role": "user", "content": "1+1="}],
                                  "tool_choice": "auto"}, 400, "tool_choice", "not parsed"),
    ("suffix", "cmpl", {"prompt": PROMPT, "suffix": "x"}, 400, "suffix", "suffix"),
    ("best_of", "cmpl", {"prompt": PROMPT, "best_of": 3}, 400, "best_of", "best_of"),
    ("structured output", "chat", {"messages": [{"role": "user", "content": "1+1="}],
                                   "response_format": {"type": "json_object"}}, 400,
     "response_format", "structured output"),
    ("continue_final_message", "chat", {"messages": [{"role": "user", "content": "1+1="}],
                                        "continue_final_message": True}, 400,
     "continue_final_message", "not supported"),
    ("request's chat template", "chat", {"messages": [{"role": "user", "content": "1+1="}],
                                         "chat_template": "{{ 'x' }}"}, 400, "chat_template",
     "not accepted"),
    ("bad temperature", "cmpl", {"prompt": PROMPT, "temperature": -1}, 400, "temperature",
     "temperature must be"),
    ("string temperature", "cmpl", {"prompt": PROMPT, "temperature": "hot"}, 400,
     "temperature", "temperature"),
    ("max_tokens 0", "cmpl", {"prompt": PROMPT, "max_tokens": 0}, 400, "max_tokens",
     "max_tokens must be"),
    ("bad k", "cmpl", {"prompt": PROMPT, "k": 17}, 400, "k", "k (draft length)"),
    ("token id out of vocab", "cmpl", {"prompt": [1, 2, 99]}, 400, "prompt",
     "outside the vocabulary"),
    ("empty prompt list", "cmpl", {"prompt": []}, 400, "prompt", "empty"),
    ("character outside the vocabulary", "cmpl", {"prompt": "Q:1+x="}, 400, "prompt", "'x'"),
    ("stop id out of vocab", "cmpl", {"prompt": PROMPT, "stop_token_ids": [99]}, 400,
     "stop_token_ids", "stop_token_ids"),
    ("second prompt bad", "cmpl", {"prompt": [PROMPT_IDS, [1, 2, 99]], "max_tokens": 200,
                                   "ignore_eos": True}, 400, "prompt",
     "prompt 1 has token ids outside the vocabulary"),
    ("no prompt", "cmpl", {"max_tokens": 3}, 400, "prompt", "required"),
]


@pytest.mark.parametrize("endpoint,body,status,param,words", [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_request_is_an_openai_error_and_changes_nothing(served, aeng, endpoint, body,
                                                            status, param, words) -> None:
    server, client = served
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    got_status, answer = post_json(server.port, path, {"model": MODEL, **body})
    assert got_status == status, answer
    error = answer["error"]
    assert set(answer) == {"error"} and set(error) == {"message", "type", "param", "code"}
    assert words in error["message"], error
    assert error["param"] == param and error["code"] == status
    assert error["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    in_engine(aeng, assert_idle_and_free)
    # the real client raises its error class with the message, and the server serves on
    if endpoint == "cmpl" and "prompt" in body and status == 400:
        with pytest.raises(openai.BadRequestError, match="must be|not supported|echo|empty|"
                                                         "outside|top-|stop|logit|suffix|'x'|"
                                                         "temperature|max_waiting"):
            client.completions.create(model=MODEL, prompt=body["prompt"], extra_body={
                k: v for k, v in body.items() if k != "prompt"})
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0)
    assert ok.choices[0].text.endswith("A:857")


def test_server_errors_on_v1_paths_have_openai_shape(served, aeng) -> None:
    server, client = served
    status, answer = raw_request(server.port, "POST", "/v1/completions", b"{not json")
    assert status == 400 and "malformed JSON" in answer["error"]["message"]
    status, answer = raw_request(server.port, "GET", "/v1/nothing")
    assert status == 404 and answer["error"]["message"] == "no such endpoint"
    # the other routes keep their own shape
    status, answer = post_json(server.port, "/generate", {"prompt": 5})
    assert status == 422 and isinstance(answer["error"], str)
    # unknown fields are ignored, as vLLM does
    ok = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=40, temperature=0,
                                   extra_body={"no_such_field": 1, "user": "me"})
    assert ok.choices[0].text.endswith("A:857")


def test_auth_error_on_v1_paths(aeng) -> None:
    with running_server(aeng, api_key="secret") as (server, _):
        bad = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="wrong",
                            max_retries=0, timeout=WAIT_S)
        with pytest.raises(openai.AuthenticationError) as e:
            bad.models.list()
        assert e.value.body["type"] == "authentication_error"
        good = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="secret",
                             max_retries=0, timeout=WAIT_S)
        assert good.models.list().data[0].id == MODEL


def test_served_model_name_is_the_name_on_v1(aeng) -> None:
    """``serve --served-model-name`` (``make_server(served_model_name=)``): /v1/models lists
    it, answers carry it, and the checkpoint's own name is then a 404."""
    with running_server(aeng, served_model_name="policy-v3") as (server, _):
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{server.port}/v1", api_key="x",
                               max_retries=0, timeout=WAIT_S)
        assert [m.id for m in client.models.list().data] == ["policy-v3"]
        out = client.completions.create(model="policy-v3", prompt=PROMPT, max_tokens=4,
                                        temperature=0)
        assert out.model == "policy-v3"
        with pytest.raises(openai.NotFoundError):
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)


def test_draining_server_refuses_new_requests(served, aeng) -> None:
    server, client = served
    server.state.draining = True
    try:
        with pytest.raises(openai.APIStatusError) as e:
            client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4)
        assert e.value.status_code == 503 and "shutting down" in e.value.message
    finally:
        server.state.draining = False


def test_closing_a_group_stream_aborts_every_sample(served, aeng) -> None:
    server, client = served
    max_tokens = 240
    stream = client.completions.create(model=MODEL, prompt=PROMPT, n=4, max_tokens=max_tokens,
                                       temperature=1.0, stream=True,
                                       extra_body={"ignore_eos": True})
    assert next(iter(stream)).choices
    live = server.state.live
    assert len(live) == 4
    # Hold the engine thread between two steps while the client leaves, so the samples
    # cannot run to their end meanwhile: the aborts queued by the handler run first.
    paused, gate = threading.Event(), threading.Event()

    def hold(_engine: object) -> None:
        paused.set()
        gate.wait(WAIT_S)

    holder = threading.Thread(target=in_engine, args=(aeng, hold))
    holder.start()
    assert paused.wait(WAIT_S)
    try:
        stream.close()
        live.wait_for(lambda s: not s, "the stream's handler to end")
    finally:
        gate.set()
        holder.join(WAIT_S)
    for _ in range(10_000):  # each call waits for the engine thread's next gap
        if not in_engine(aeng, lambda e: e.has_unfinished()):
            break
    in_engine(aeng, assert_idle_and_free)
    # aborted early: far fewer tokens than 4 samples run to max_tokens
    assert in_engine(aeng, lambda e: e.stats.num_generated_tokens) < 4 * max_tokens // 2


def test_async_engine_group_stream_and_generate_refusal(aeng) -> None:
    params = SamplingParams(temperature=1.0, max_tokens=6, n=3, seed=4, ignore_eos=True)

    async def run() -> list:
        outs = []
        async for out in aeng.generate_stream(PROMPT_IDS, params, request_id="g"):
            outs.append(out)
        with pytest.raises(ValueError, match="iterate generate_stream"):
            await aeng.generate(PROMPT_IDS, params)
        return outs

    outs = asyncio.run(run())
    finals = sorted((o.output for o in outs if o.finished), key=lambda o: o.sample_index)
    assert {o.request_id for o in outs} == {"g-0", "g-1", "g-2"}
    want = in_engine(aeng, lambda e: e.generate([PROMPT_IDS], sampling=params))
    assert [o.token_ids for o in finals] == [o.token_ids for o in want]
    in_engine(aeng, assert_idle_and_free)


def test_readme_example_runs_as_written(served) -> None:
    server, _ = served
    code = readme_block("### Use it from your RL framework").replace(
        "http://127.0.0.1:8000", f"http://127.0.0.1:{server.port}")
    assert code.count(str(server.port)) == 2  # both URLs pointed at the test server
    ns: dict[str, object] = {"__name__": "readme_example"}
    exec(compile(code, "README.md (Use it from your RL framework)", "exec"), ns)
    group, chat = ns["group"], ns["chat"]
    assert ns["model"] == "arith-target"  # as its comment says
    assert len(group.choices) == 4 and {c.finish_reason for c in group.choices} == {"stop"}
    assert all(c.num_accepted_tokens > 0 for c in group.choices)  # k=3 drafts, accepted
    assert chat.choices[0].message.content.endswith("A:857")


def test_incremental_text_holds_back_split_characters() -> None:
    """Streamed text with a byte-level tokenizer (one token per byte): a character split
    over tokens comes out whole once complete, never as U+FFFD; a final output that ends
    mid-character gives its rest in the last chunk."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    from specengine.server.openai_api import IncrementalText
    from specengine.tokenizer import TextTokenizer

    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    tok = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(alphabet)}, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    text = "aé中🙂b"
    ids = tok.encode(text).ids
    assert len(ids) == len(text.encode())
    inc = IncrementalText(TextTokenizer(tok), skip_special_tokens=True)
    deltas = [inc.push([t]) for t in ids]
    assert "".join(deltas) == text and not any("\ufffd" in d for d in deltas)
    assert [d for d in deltas if d] == list(text)
    assert inc.finish(tok.decode(ids)) == ""
    cut = ids[:-2]  # "aé中" and 3 of the emoji's 4 bytes
    inc = IncrementalText(TextTokenizer(tok), skip_special_tokens=True)
    streamed = "".join(inc.push([t]) for t in cut)
    assert streamed == "aé中"
    full = tok.decode(cut)
    assert streamed + inc.finish(full) == full and full.endswith("\ufffd")


def test_async_engine_group_admission_is_all_or_nothing(aeng) -> None:
    """A group takes n of the max_waiting slots (64 here), all or none; its sample ids are
    reserved together; a refused group leaves no slot or id taken."""
    from specengine.async_loop import EngineOverloadedError

    long = SamplingParams(temperature=1.0, max_tokens=200, n=40, ignore_eos=True)

    async def run() -> None:
        first = aeng.generate_stream(PROMPT_IDS, long, request_id="big")
        async with contextlib.aclosing(first):
            await anext(first)
            assert aeng.num_unfinished == 40
            with pytest.raises(EngineOverloadedError, match="group of n=40 would pass"):
                await anext(aeng.generate_stream(PROMPT_IDS, long, request_id="more"))
            with pytest.raises(ValueError, match=r"\['big-0', 'big-1'\] of the 2 samples"):
                await anext(aeng.generate_stream(PROMPT_IDS, SamplingParams(n=2),
                                                 request_id="big"))
            assert aeng.num_unfinished == 40
        small = SamplingParams(temperature=0.0, max_tokens=4, n=24)  # fits beside 40: 64
        outs = [o async for o in aeng.generate_stream(PROMPT_IDS, small, request_id="more")]
        assert sum(o.finished for o in outs) == 24

    asyncio.run(run())
    in_engine(aeng, assert_idle_and_free)


# ---- sampling fields passed through (issue 25) ------------------------------------------------
LONG = "Q:47*6+385="


def _spelled(tok: object, token: int) -> str:
    """A token's own text, special tokens spelled out (as logprob answers show them)."""
    return tok.tokenizer.decode([token], skip_special_tokens=False)  # type: ignore[attr-defined]


def _stop_in_middle(aeng: AsyncSpecEngine) -> tuple[str, str]:
    """A two-character stop string from the middle of LONG's greedy text, and that text."""
    full = reference(aeng, LONG, greedy(64))[0].text
    assert full is not None and len(full) > 6
    return full[len(full) // 2: len(full) // 2 + 2], full


@pytest.mark.parametrize("include", [False, True], ids=["cut", "kept"])
def test_completion_stop_string_equals_generate_and_k3_equals_k0(served, aeng,
                                                                 include) -> None:
    _, client = served
    stop, full = _stop_in_middle(aeng)
    want = reference(aeng, LONG, greedy(64, stop=(stop,), include_stop_str_in_output=include,
                                        logprobs=2))[0]
    assert want.stop_reason == stop and want.text != full  # the stop string cut it
    answers = {k: client.completions.create(
        model=MODEL, prompt=LONG, max_tokens=64, temperature=0, stop=stop, logprobs=2,
        extra_body={"k": k, "return_token_ids": True,
                    "include_stop_str_in_output": include}).choices[0] for k in (0, 3)}
    for k, c in answers.items():
        assert c.text == want.text and c.finish_reason == "stop" and c.stop_reason == stop, k
        assert c.token_ids == list(want.token_ids)
        assert c.logprobs.token_logprobs == pytest.approx(list(want.logprobs), abs=1e-4)
        tok = aeng.engine.tokenizer
        wanted = [{_spelled(tok, t): lp for t, lp in alt.items()} for alt in want.top_logprobs]
        # the same alternatives; k = 3's values come from the verify pass (float rounding)
        assert [list(d) for d in c.logprobs.top_logprobs] == [list(d) for d in wanted], k
        for got_d, want_d in zip(c.logprobs.top_logprobs, wanted, strict=True):
            assert list(got_d.values()) == (list(want_d.values()) if k == 0 else
                                            pytest.approx(list(want_d.values()), abs=1e-4))
        assert all(len(d) in (2, 3) for d in c.logprobs.top_logprobs)
    assert answers[3].num_accepted_tokens > 0  # speculation ran and its drafts were kept
    # a list of stop strings: the first found wins (here the only one that occurs)
    listed = client.completions.create(model=MODEL, prompt=LONG, max_tokens=64, temperature=0,
                                       stop=["@@", stop]).choices[0]
    assert listed.text == reference(aeng, LONG, greedy(64, stop=("@@", stop)))[0].text
    in_engine(aeng, assert_idle_and_free)


def test_streamed_stop_string_cuts_the_streamed_text_as_the_final(served, aeng) -> None:
    _, client = served
    stop, _ = _stop_in_middle(aeng)
    want = reference(aeng, LONG, greedy(64, stop=(stop,)))[0]
    for k in (0, 3):
        chunks = list(client.completions.create(model=MODEL, prompt=LONG, max_tokens=64,
                                                temperature=0, stop=[stop], stream=True,
                                                extra_body={"k": k}))
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert "".join(texts) == want.text, (k, texts)
        assert chunks[-1].choices[0].finish_reason == "stop"
        assert chunks[-1].choices[0].stop_reason == stop


def test_min_tokens_and_min_p_equal_generate_with_the_same_seed(served, aeng) -> None:
    _, client = served
    for kw in ({"min_tokens": 12}, {"min_p": 0.3}, {"min_p": 0.05, "min_tokens": 3}):
        params = SamplingParams(temperature=1.0, max_tokens=24, seed=11, **kw)
        want = reference(aeng, PROMPT_IDS, params)[0]
        got = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=24,
                                        temperature=1.0, seed=11, logprobs=0,
                                        extra_body={"k": 0, "return_token_ids": True, **kw})
        c = got.choices[0]
        assert c.token_ids == list(want.token_ids) and c.text == want.text, kw
        assert c.logprobs.token_logprobs == list(want.logprobs)
        if "min_tokens" in kw:
            assert len(c.token_ids) >= kw["min_tokens"]
    # min_tokens holds off EOS: greedy, the answer is longer than without it
    short = reference(aeng, PROMPT_IDS, greedy(40))[0]
    long = client.completions.create(model=MODEL, prompt=PROMPT_IDS, max_tokens=40,
                                     temperature=0, extra_body={
                                         "min_tokens": len(short.token_ids) + 2,
                                         "return_token_ids": True}).choices[0]
    assert long.token_ids == list(reference(aeng, PROMPT_IDS, greedy(
        40, min_tokens=len(short.token_ids) + 2))[0].token_ids)
    assert len(long.token_ids) >= len(short.token_ids) + 2


def test_chat_stop_min_p_and_top_logprobs_equal_generate(served, aeng) -> None:
    _, client = served
    stop, _ = _stop_in_middle(aeng)
    messages = [{"role": "user", "content": LONG.removeprefix("Q:")}]  # renders as LONG
    want = reference(aeng, LONG, greedy(64, stop=(stop,), logprobs=3))[0]
    for k in (0, 3):
        got = client.chat.completions.create(
            model=MODEL, messages=messages, temperature=0, max_completion_tokens=64,
            stop=stop, logprobs=True, top_logprobs=3, extra_body={"k": k}).choices[0]
        assert got.message.content == want.text and got.finish_reason == "stop", k
        assert got.stop_reason == stop
        content = got.logprobs.content
        assert [c.logprob for c in content] == pytest.approx(list(want.logprobs), abs=1e-4)
        tok = aeng.engine.tokenizer
        for c, alt in zip(content, want.top_logprobs, strict=True):
            best = sorted(alt.items(), key=lambda kv: -kv[1])[:3]
            assert [t.token for t in c.top_logprobs] == [_spelled(tok, t) for t, _ in best]
            assert [t.logprob for t in c.top_logprobs] == pytest.approx(
                [lp for _, lp in best], abs=0 if k == 0 else 1e-4)
            assert all(t.bytes == list(t.token.encode()) for t in c.top_logprobs)
    sampled = SamplingParams(temperature=1.0, max_tokens=24, seed=3, min_p=0.2, min_tokens=5)
    want = reference(aeng, LONG, sampled)[0]
    got = client.chat.completions.create(
        model=MODEL, messages=messages, temperature=1.0, max_completion_tokens=24, seed=3,
        extra_body={"k": 0, "min_p": 0.2, "min_tokens": 5, "return_token_ids": True})
    assert got.choices[0].token_ids == list(want.token_ids)
    in_engine(aeng, assert_idle_and_free)
