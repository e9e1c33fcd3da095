"""``POST /generate`` in SGLang's dialect on the live server (bundled pair, default k 3):
single and batch prompts as ``input_ids`` and ``text``, ``return_logprob`` (equal to
``SpecEngine.generate``'s), ``n`` = 4 with a seed (one group, one prefill, equal to the
in-process group), streaming; our own body still works, also with ``n`` > 1; bad SGLang
bodies are 400s naming the field and change nothing."""

from __future__ import annotations

import asyncio
import dataclasses
import http.client
import json
from collections.abc import Iterator
from typing import Any

import pytest
from server_helpers import (
    WAIT_S,
    assert_idle_and_free,
    bundled_engine,
    in_engine,
    post_json,
    running_server,
)

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.outputs import GenerationOutput
from specengine.server.serve import RolloutServer
from specengine.server.sglang_schemas import DEFAULT_MAX_NEW_TOKENS

PROMPT_IDS = [5, 6, 7, 8]
GREEDY = {"max_new_tokens": 12, "temperature": 0.0}


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
def served(server: RolloutServer) -> int:
    return server.port


def expect(out: dict[str, Any], want: GenerationOutput, rid: str | None = None,
           logprobs: bool = False) -> None:
    """An SGLang result equals the engine's output (tokens, text, meta_info)."""
    assert out["output_ids"] == list(want.token_ids)
    assert out["text"] == want.text
    meta = out["meta_info"]
    if rid is not None:
        assert meta["id"] == rid
    assert meta["prompt_tokens"] == len(want.prompt_token_ids)
    assert meta["completion_tokens"] == len(want.token_ids)
    assert meta["weight_version"] == want.weight_version == 0
    reason = meta["finish_reason"]
    assert reason["type"] == want.finish_reason
    if want.finish_reason == "length":
        assert reason["length"] == len(want.token_ids)
    else:
        assert reason["matched"] == want.token_ids[-1]
    if logprobs:
        triples = meta["output_token_logprobs"]
        assert [t for _, t, _ in triples] == list(want.token_ids)
        assert all(x is None for _, _, x in triples)
        assert [lp for lp, _, _ in triples] == pytest.approx(list(want.logprobs), abs=1e-4)
    else:
        assert "output_token_logprobs" not in meta


def test_single_input_ids_with_logprobs(served, reference) -> None:
    status, out = post_json(served, "/generate", {
        "input_ids": PROMPT_IDS, "sampling_params": GREEDY, "return_logprob": True,
        "rid": "sgl-1"})
    assert status == 200, out
    want = reference.generate([PROMPT_IDS], k=3, sampling=SamplingParams(
        temperature=0.0, max_tokens=12))[0]
    expect(out, want, "sgl-1", logprobs=True)


def test_meta_info_counts_the_prompt_tokens_served_from_the_cache(served) -> None:
    # A 72-token prompt sent twice: the second reuses its full 16-token blocks (the last
    # token is always computed), as SGLang's meta_info.cached_tokens reports.
    prompt = [3, 9, 4, 11] * 18
    body = {"input_ids": prompt, "sampling_params": GREEDY}
    first = post_json(served, "/generate", body)[1]["meta_info"]["cached_tokens"]
    status, out = post_json(served, "/generate", body)
    assert status == 200, out
    assert first == 0 and out["meta_info"]["cached_tokens"] == (len(prompt) - 1) // 16 * 16


def test_batch_of_texts_and_of_ids_in_order(served, reference) -> None:
    texts = ["Q:472*6=", "Q:385+472=", "Q:12+7="]
    sampled = {"max_new_tokens": 10, "temperature": 1.0, "top_k": 8, "sampling_seed": 3}
    status, out = post_json(served, "/generate", {
        "text": texts, "sampling_params": [GREEDY, sampled, GREEDY], "rid": ["a", "b", "c"],
        "return_logprob": [True, True, False]})
    assert status == 200, out
    want = reference.generate(texts, k=3, sampling=[
        SamplingParams(temperature=0.0, max_tokens=12),
        SamplingParams(temperature=1.0, top_k=8, seed=3, max_tokens=10),
        SamplingParams(temperature=0.0, max_tokens=12)])
    assert len(out) == 3
    for o, w, rid, lp in zip(out, want, "abc", [True, True, False]):
        expect(o, w, rid, logprobs=lp)
    status, out = post_json(served, "/generate", {"input_ids": [PROMPT_IDS, [9, 5]],
                                                  "sampling_params": GREEDY})
    assert status == 200 and len(out) == 2
    want = reference.generate([PROMPT_IDS, [9, 5]], k=3,
                              sampling=SamplingParams(temperature=0.0, max_tokens=12))
    for o, w in zip(out, want):
        expect(o, w)


def test_default_max_new_tokens_is_sglangs(served) -> None:
    status, out = post_json(served, "/generate", {
        "input_ids": PROMPT_IDS, "sampling_params": {"temperature": 0.0, "ignore_eos": True}})
    assert status == 200
    assert out["meta_info"]["completion_tokens"] == DEFAULT_MAX_NEW_TOKENS
    assert out["meta_info"]["finish_reason"] == {"type": "length",
                                                 "length": DEFAULT_MAX_NEW_TOKENS}


def test_group_of_four_is_one_prefill_and_reproducible(served, aeng, reference) -> None:
    prompt = [5, 9, 6, 7, 8, 5, 9]
    sp = {"max_new_tokens": 12, "temperature": 1.5, "n": 4, "sampling_seed": 11}
    want = reference.generate([prompt], k=3, sampling=SamplingParams(
        temperature=1.5, max_tokens=12, n=4, seed=11))
    assert len({w.token_ids for w in want}) > 1  # the samples differ
    status, out = post_json(served, "/generate", {"input_ids": prompt, "sampling_params": sp,
                                                  "rid": "grp"})
    assert status == 200, out
    stats = in_engine(aeng, lambda e: e.stats)
    num_prompt = len(prompt)
    assert stats.num_prompt_tokens == 4 * num_prompt
    assert stats.num_computed_prompt_tokens == num_prompt  # one prefill for the group
    assert [o["meta_info"]["id"] for o in out] == [f"grp-{i}" for i in range(4)]
    for o, w in zip(out, want):
        expect(o, w)
    again = post_json(served, "/generate", {"input_ids": prompt, "sampling_params": sp})[1]
    assert [o["output_ids"] for o in again] == [o["output_ids"] for o in out]
    # Our own body: the same group, answered as our outputs.
    status, ours = post_json(served, "/generate", {
        "prompt_token_ids": prompt, "request_id": "g2", "sampling_params": {
            "max_tokens": 12, "temperature": 1.5, "n": 4, "seed": 11}})
    assert status == 200 and ours["request_id"] == "g2", ours
    assert [o["request_id"] for o in ours["outputs"]] == [f"g2-{i}" for i in range(4)]
    for o, w in zip(ours["outputs"], want):
        assert o["token_ids"] == list(w.token_ids) and o["sample_index"] == w.sample_index
        assert o["logprobs"] == pytest.approx(list(w.logprobs), abs=1e-4)
    in_engine(aeng, assert_idle_and_free)


def sse(port: int, body: dict[str, Any]) -> list[Any]:
    """The events of a streamed answer (``[DONE]`` as the string)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("POST", "/generate", json.dumps(body).encode(),
                     {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200, resp.read()
        events = []
        for line in resp.read().decode().split("\n\n"):
            if line.startswith("data: "):
                data = line.removeprefix("data: ")
                events.append(data if data == "[DONE]" else json.loads(data))
        return events
    finally:
        conn.close()


def test_stream_carries_the_ids_so_far_then_the_result(served, reference) -> None:
    events = sse(served, {"input_ids": PROMPT_IDS, "sampling_params": GREEDY,
                          "stream": True, "return_logprob": True, "rid": "s1"})
    assert events[-1] == "[DONE]" and len(events) > 2
    want = reference.generate([PROMPT_IDS], k=3, sampling=SamplingParams(
        temperature=0.0, max_tokens=12))[0]
    chunks = events[:-1]
    for prev, cur in zip(chunks, chunks[1:]):  # cumulative, as SGLang streams by default
        assert cur["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])
    expect(chunks[-1], want, "s1", logprobs=True)
    # A group streams every sample, each chunk with its index.
    events = sse(served, {"text": "Q:385+472=", "stream": True, "sampling_params": {
        "max_new_tokens": 8, "temperature": 1.0, "n": 2, "sampling_seed": 4}})
    finals = {c["index"]: c for c in events[:-1] if c["meta_info"]["finish_reason"]}
    want = reference.generate(["Q:385+472="], k=3, sampling=SamplingParams(
        temperature=1.0, max_tokens=8, n=2, seed=4))
    assert sorted(finals) == [0, 1]
    for i, w in enumerate(want):
        expect(finals[i], w)


def test_our_body_still_works(served, reference) -> None:
    status, out = post_json(served, "/generate", {
        "prompt_token_ids": PROMPT_IDS, "sampling_params": {"max_tokens": 12,
                                                            "temperature": 0.0}})
    want = reference.generate([PROMPT_IDS], k=3, sampling=SamplingParams(
        temperature=0.0, max_tokens=12))[0]
    assert status == 200 and out["token_ids"] == list(want.token_ids), out
    assert set(out) == {"request_id", *(f.name for f in dataclasses.fields(GenerationOutput))}


BAD = [  # (id, body, words the 400 must contain)
    ("two prompts", {"text": "Q:", "input_ids": [1]}, "exactly one of text and input_ids"),
    ("typo", {"input_ids": [1], "sampling_params": {"max_new_token": 3}},
     "unknown field 'sampling_params.max_new_token'"),
    ("unknown top field", {"input_ids": [1], "return_logprobs": True},
     "unknown field 'return_logprobs'"),
    ("rid list on one prompt", {"input_ids": [1], "rid": ["a"]}, "rid"),
    ("rid list too short", {"text": ["Q:", "Q:1"], "rid": ["a"]}, "rid"),
    ("same rids", {"text": ["Q:", "Q:1"], "rid": ["a", "a"]}, "rid"),
    ("empty batch", {"text": []}, "the batch is empty"),
    ("top logprobs 21", {"input_ids": [1], "return_logprob": True, "top_logprobs_num": 21},
     "top_logprobs_num: an int in [0, 20]"),
    ("empty stop string", {"input_ids": [1], "sampling_params": {"stop": ["1", ""]}},
     "stop[1] must be a non-empty str"),
    ("min_p 2", {"input_ids": [1], "sampling_params": {"min_p": 2.0}}, "min_p must be"),
    ("logprob start", {"input_ids": [1], "logprob_start_len": 0}, "logprob_start_len"),
    ("two seeds", {"input_ids": [1], "sampling_params": {"seed": 1, "sampling_seed": 2}},
     "one of seed and sampling_seed"),
    ("bad temperature", {"input_ids": [1], "sampling_params": {"temperature": -1}},
     "temperature must be"),
    ("bad n", {"input_ids": [1], "sampling_params": {"n": 0}}, "n (samples per prompt)"),
    ("token out of vocab", {"input_ids": [1, 99]}, "outside the vocabulary"),
    ("bad character", {"text": "Q:x"}, "'x'"),
    ("bad prompt in batch", {"text": ["Q:1", "Q:x"]}, "'x'"),
    ("string max tokens", {"input_ids": [1], "sampling_params": {"max_new_tokens": "3"}},
     "sampling_params.max_new_tokens"),
]
PENALTIES = [("repetition_penalty", 1.2, 1.0), ("frequency_penalty", 0.5, 0.0),
             ("presence_penalty", -0.5, 0.0)]


@pytest.mark.parametrize("body,words", [c[1:] for c in BAD], ids=[c[0] for c in BAD])
def test_bad_sglang_body_is_a_400_naming_the_field(served, aeng, reference, body, words
                                                   ) -> None:
    status, answer = post_json(served, "/generate", body)
    assert status == 400, answer
    assert set(answer) == {"error"} and words in answer["error"], answer
    in_engine(aeng, assert_idle_and_free)
    status, out = post_json(served, "/generate", {"input_ids": PROMPT_IDS,
                                                  "sampling_params": GREEDY})
    assert status == 200  # the server still serves
    expect(out, reference.generate([PROMPT_IDS], k=3, sampling=SamplingParams(
        temperature=0.0, max_tokens=12))[0])


@pytest.mark.parametrize("field,value,off", PENALTIES, ids=[c[0] for c in PENALTIES])
def test_penalties_are_refused_by_name(served, aeng, field, value, off) -> None:
    status, answer = post_json(served, "/generate", {"input_ids": [1],
                                                     "sampling_params": {field: value}})
    assert status == 400 and f"{field} is not supported" in answer["error"], answer
    in_engine(aeng, assert_idle_and_free)
    # Its off value is no request for it: accepted.
    status, _ = post_json(served, "/generate", {
        "input_ids": [1], "sampling_params": {"max_new_tokens": 2, field: off}})
    assert status == 200
    in_engine(aeng, assert_idle_and_free)


def test_model_info_flush_cache_health_and_abort(served, aeng) -> None:
    port = served
    info = json.loads(_get(port, "/get_model_info"))
    assert info["weight_version"] == 0 and info["is_generation"] is True
    assert info["model_path"] == aeng.engine.config.model
    assert json.loads(_get(port, "/health_generate"))["status"] == "ok"
    status, answer = post_json(port, "/flush_cache", {})
    assert status == 200 and answer["success"]
    status, answer = post_json(port, "/abort_request", {"rid": "nobody"})
    assert status == 200 and answer["aborted"] == []
    in_engine(aeng, assert_idle_and_free)


def _get(port: int, path: str) -> str:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        assert resp.status == 200
        return resp.read().decode()
    finally:
        conn.close()


def test_abort_request_ends_every_sample_of_a_group(server, aeng) -> None:
    conn = http.client.HTTPConnection("127.0.0.1", server.port, timeout=WAIT_S)
    try:
        conn.request("POST", "/generate", json.dumps({
            "input_ids": PROMPT_IDS, "rid": "long", "stream": True, "sampling_params": {
                "max_new_tokens": 200, "ignore_eos": True, "n": 2, "temperature": 1.0,
                "sampling_seed": 1}}).encode(), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        assert resp.status == 200
        assert resp.readline().startswith(b"data: {")  # both samples are in the engine
        status, answer = post_json(server.port, "/abort_request", {"rid": "long"})
        assert status == 200 and answer["aborted"] == ["long-0", "long-1"], answer
        events = [line.removeprefix("data: ") for line in resp.read().decode().split("\n\n")
                  if line.startswith("data: ")]
    finally:
        conn.close()
    assert events[-1] == "[DONE]"
    finals = [json.loads(e) for e in events[:-1]]
    finals = {c["index"]: c for c in finals if c["meta_info"]["finish_reason"]}
    assert sorted(finals) == [0, 1]
    for c in finals.values():
        assert c["meta_info"]["finish_reason"]["type"] == "abort"
        assert len(c["output_ids"]) < 200
    in_engine(aeng, assert_idle_and_free)


def test_our_body_streams_a_group(served, reference) -> None:
    prompt = [5, 9, 6, 7, 8, 5, 9]
    events = sse(served, {"prompt_token_ids": prompt, "request_id": "gs", "stream": True,
                          "sampling_params": {"max_tokens": 8, "temperature": 1.5, "n": 2,
                                              "seed": 5}})
    assert events[-1] == "[DONE]"
    want = reference.generate([prompt], k=3, sampling=SamplingParams(
        temperature=1.5, max_tokens=8, n=2, seed=5))
    tokens: dict[str, list[int]] = {"gs-0": [], "gs-1": []}
    finals = {}
    for e in events[:-1]:
        tokens[e["request_id"]].extend(e["new_token_ids"])
        if e["finished"]:
            finals[e["request_id"]] = e["output"]
    for i, w in enumerate(want):
        assert tokens[f"gs-{i}"] == finals[f"gs-{i}"]["token_ids"] == list(w.token_ids)
        assert finals[f"gs-{i}"]["sample_index"] == i


def test_python_client_reads_a_group(served, reference) -> None:
    """``SpecEngineClient.generate_group`` returns the n outputs of one group (sample order);
    ``generate`` refuses a group's answer instead of returning a wrong single output."""
    from specengine.client import SpecEngineClient

    client = SpecEngineClient(f"http://127.0.0.1:{served}")
    prompt = [5, 9, 6, 7]
    params = SamplingParams(temperature=1.5, max_tokens=10, n=3, seed=5)
    want = reference.generate([prompt], k=3, sampling=params)
    got = client.generate_group(prompt, params, k=3, request_id="cg")
    assert [g.token_ids for g in got] == [w.token_ids for w in want]
    assert [g.sample_index for g in got] == [0, 1, 2]
    with pytest.raises(ValueError, match="generate_group"):
        client.generate(prompt, params, k=3)
    single = client.generate_group(prompt, SamplingParams(temperature=0.0, max_tokens=10), k=3)
    assert [g.token_ids for g in single] == [
        reference.generate([prompt], k=3, sampling=SamplingParams(temperature=0.0,
                                                                   max_tokens=10))[0].token_ids]


# ---- sampling fields passed through (issue 25) ------------------------------------------------
LONG = "Q:47*6+385="


def _stop_in_middle(reference: SpecEngine) -> str:
    """A two-character stop string from the middle of LONG's greedy text."""
    full = reference.generate([LONG], k=0, sampling=SamplingParams(
        temperature=0.0, max_tokens=64))[0].text
    assert full is not None and len(full) > 6
    return full[len(full) // 2: len(full) // 2 + 2]


@pytest.mark.parametrize("as_list", [False, True], ids=["str", "list"])
def test_stop_string_equals_generate_and_k3_equals_k0(served, reference, as_list) -> None:
    stop = _stop_in_middle(reference)
    want = reference.generate([LONG], k=0, sampling=SamplingParams(
        temperature=0.0, max_tokens=64, stop=(stop,)))[0]
    assert want.stop_reason == stop
    for k in (0, 3):
        status, out = post_json(served, "/generate", {
            "text": LONG, "k": k, "sampling_params": {
                "max_new_tokens": 64, "temperature": 0.0,
                "stop": ["@@", stop] if as_list else stop}})
        assert status == 200, out
        assert out["text"] == want.text and out["output_ids"] == list(want.token_ids), k
        assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
        if k == 3:
            assert out["meta_info"]["num_accepted_tokens"] > 0


def test_min_new_tokens_and_min_p_equal_generate_with_the_same_seed(served, reference
                                                                    ) -> None:
    for sp, kw in (({"min_new_tokens": 12}, {"min_tokens": 12}), ({"min_p": 0.3}, {"min_p": 0.3}),
                   ({"min_p": 0.05, "min_new_tokens": 3}, {"min_p": 0.05, "min_tokens": 3})):
        want = reference.generate([PROMPT_IDS], k=0, sampling=SamplingParams(
            temperature=1.0, max_tokens=24, seed=11, **kw))[0]
        status, out = post_json(served, "/generate", {
            "input_ids": PROMPT_IDS, "k": 0, "return_logprob": True, "sampling_params": {
                "max_new_tokens": 24, "temperature": 1.0, "sampling_seed": 11, **sp}})
        assert status == 200, out
        assert out["output_ids"] == list(want.token_ids) and out["text"] == want.text, sp
        assert [lp for lp, _, _ in out["meta_info"]["output_token_logprobs"]] == list(
            want.logprobs)
    short = reference.generate([PROMPT_IDS], k=0, sampling=SamplingParams(
        temperature=0.0, max_tokens=40))[0]
    status, out = post_json(served, "/generate", {"input_ids": PROMPT_IDS, "sampling_params": {
        "max_new_tokens": 40, "temperature": 0.0,
        "min_new_tokens": len(short.token_ids) + 2}})
    assert len(out["output_ids"]) >= len(short.token_ids) + 2  # EOS was held off


def test_top_logprobs_num_equals_generation_output(served, reference) -> None:
    want = reference.generate([LONG], k=0, sampling=SamplingParams(
        temperature=0.0, max_tokens=24, logprobs=3))[0]
    for k in (0, 3):
        status, out = post_json(served, "/generate", {
            "text": LONG, "k": k, "return_logprob": True, "top_logprobs_num": 3,
            "sampling_params": {"max_new_tokens": 24, "temperature": 0.0}})
        assert status == 200, out
        tops = out["meta_info"]["output_top_logprobs"]
        assert len(tops) == len(want.token_ids)
        for got, alt in zip(tops, want.top_logprobs, strict=True):
            best = sorted(alt.items(), key=lambda kv: -kv[1])[:3]
            assert [t for _, t, _ in got] == [t for t, _ in best], k
            assert all(x is None for _, _, x in got)
            assert [lp for lp, _, _ in got] == pytest.approx(
                [lp for _, lp in best], abs=0 if k == 0 else 1e-4)
    # without return_logprob there are no logprobs at all (as SGLang)
    status, out = post_json(served, "/generate", {
        "text": LONG, "top_logprobs_num": 3, "sampling_params": {"max_new_tokens": 4}})
    assert status == 200 and "output_top_logprobs" not in out["meta_info"]


def _stream_and_answer(port: int, body: dict[str, Any]) -> tuple[list[dict[str, Any]],
                                                                  dict[str, Any]]:
    """The chunks of ``body`` streamed, and its non-streamed answer."""
    events = sse(port, {**body, "stream": True})
    assert events[-1] == "[DONE]", events[-1]
    status, answer = post_json(port, "/generate", body)
    assert status == 200, answer
    return events[:-1], answer


def _assert_stream_is_the_answer(chunks: list[dict[str, Any]], answer: dict[str, Any]
                                 ) -> None:
    """SGLang's default stream (cumulative text and ids) ends in exactly the non-streamed
    answer, and every chunk is a prefix of it: what a client showed is never taken back."""
    final = chunks[-1]
    assert final["text"] == answer["text"] and final["output_ids"] == answer["output_ids"]
    assert final["meta_info"]["finish_reason"] == answer["meta_info"]["finish_reason"]
    assert final["meta_info"]["completion_tokens"] == len(answer["output_ids"])
    deltas = []
    for prev, cur in zip([{"text": "", "output_ids": []}, *chunks], chunks):
        assert cur["text"].startswith(prev["text"]), (prev["text"], cur["text"])
        assert cur["output_ids"][:len(prev["output_ids"])] == prev["output_ids"]
        assert cur["meta_info"]["completion_tokens"] == len(cur["output_ids"])
        deltas.append(cur["text"][len(prev["text"]):])
    assert "".join(deltas) == answer["text"]
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def _stop_across_a_chunk(port: int, reference: SpecEngine) -> tuple[str, int]:
    """A stop string of three tokens of LONG's greedy text whose first occurrence spans a
    chunk boundary of the k=3 stream, and the number of tokens before it."""
    chunks = sse(port, {"text": LONG, "k": 3, "stream": True, "sampling_params": {
        "max_new_tokens": 64, "temperature": 0.0}})[:-1]
    ids = chunks[-1]["output_ids"]
    tok = reference.tokenizer
    assert tok is not None
    text = tok.decode(ids)
    offsets = [len(tok.decode(ids[:j])) for j in range(len(ids) + 1)]
    bounds = [len(c["output_ids"]) for c in chunks[:-1]]
    for b in sorted(bounds, key=lambda b: abs(b - len(ids) // 2)):  # the middle ones first
        lo, hi = b - 2, b + 1  # tokens b-2, b-1 (ending a chunk) and b (starting the next)
        if lo < 1 or hi >= len(ids):
            continue
        stop = text[offsets[lo]:offsets[hi]]
        if len(stop) >= 3 and text.find(stop) == offsets[lo]:
            return stop, lo
    raise AssertionError(f"no stop string spans a chunk boundary of {bounds} in {text!r}")


@pytest.mark.parametrize("k", [0, 3])
def test_streamed_stop_string_is_held_back_and_ends_as_the_answer(served, reference, k
                                                                  ) -> None:
    stop, before = _stop_across_a_chunk(served, reference)
    want = reference.generate([LONG], k=0, sampling=SamplingParams(
        temperature=0.0, max_tokens=64, stop=(stop,)))[0]
    assert want.stop_reason == stop and not want.text.endswith(stop[0])  # type: ignore
    body = {"text": LONG, "k": k, "sampling_params": {
        "max_new_tokens": 64, "temperature": 0.0, "stop": ["@@@@", stop]}}
    chunks, answer = _stream_and_answer(served, body)
    assert answer["text"] == want.text and answer["output_ids"] == list(want.token_ids)
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    # the stop string's first token was streamed before the token that completed it
    assert any(len(c["output_ids"]) > before for c in chunks[:-1]), k
    _assert_stream_is_the_answer(chunks, answer)
    # SGLang's no_stop_trim keeps the matched string (vLLM's include_stop_str_in_output)
    body["sampling_params"]["no_stop_trim"] = True  # type: ignore[index]
    chunks, answer = _stream_and_answer(served, body)
    assert answer["text"] == want.text + stop  # type: ignore[operator]
    assert answer["output_ids"] == list(want.token_ids)
    _assert_stream_is_the_answer(chunks, answer)


@pytest.mark.parametrize("k", [0, 3])
def test_stop_string_that_never_occurs_streams_the_whole_text(served, reference, k) -> None:
    want = reference.generate([LONG], k=0, sampling=SamplingParams(
        temperature=0.0, max_tokens=64))[0]
    assert want.text
    never = want.text[-3:] + "\N{SNOWMAN}"  # its start ends the text: held back, then given
    chunks, answer = _stream_and_answer(served, {"text": LONG, "k": k, "sampling_params": {
        "max_new_tokens": 64, "temperature": 0.0, "stop": never}})
    assert answer["text"] == want.text and answer["output_ids"] == list(want.token_ids)
    assert answer["meta_info"]["finish_reason"]["matched"] == want.token_ids[-1]
    _assert_stream_is_the_answer(chunks, answer)
