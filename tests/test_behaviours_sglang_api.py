"""SGLang's native API (``specengine.server.sglang_api``) on an app built for each test, in this
process (FastAPI's ``TestClient``: no socket, no server thread), so every test runs the routes
that ``mount`` adds to that app:

- ``/generate`` in SGLang's dialect: one prompt, a group (``n`` > 1) or a batch, answered as the
  engine's outputs (a list, prompt-major, for a batch or a group); streamed with each chunk's
  ``index``; ``skip_special_tokens: false`` keeps the special tokens in the text, cut where
  the engine cut it; our own dialect with ``n`` > 1 (one group) and with one sample;
- ``/pause_generation`` aborts what is in flight and holds new requests until
  ``/continue_generation``; ``/abort_request`` by a group's id, or all;
- the weight routes: a learner's group joined, an update broadcast and committed, the group
  replaced once its learner is gone and refused while it answers, destroyed; a checkpoint
  from disk (the learner's version, ``keep_pause``, ``abort_all_requests``); a weight
  operation waits for another one in progress, and is refused (409) once it waited
  ``LOCK_WAIT_S``; SGLang's ``{"success", "message"}`` answers;
- ``/get_model_info``, ``/health_generate``, ``/flush_cache``; the OpenAPI schema documents
  the bodies the routes read themselves; ``mount`` needs ``build_app``'s routes.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import re
import threading
import types
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

pytest.importorskip("fastapi")  # the server tests skip without it (test_optional_deps)

import torch  # noqa: E402
from fastapi import FastAPI  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402
from net_helpers import WAIT_S, Background  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from server_helpers import bundled_engine  # noqa: E402
from test_behaviours_sglang_group import JOIN_S, Learner, free_port  # noqa: E402

from specengine import AsyncSpecEngine, SamplingParams  # noqa: E402
from specengine.assets import DEFAULT_TARGET  # noqa: E402
from specengine.outputs import GenerationOutput  # noqa: E402
from specengine.server import sglang_api  # noqa: E402
from specengine.server.app import build_app  # noqa: E402

PROMPT = [5, 9, 6, 7, 8]
LONG = [4 + (i * 7) % 14 for i in range(40)]  # 40 tokens: two full prefix-cache blocks
GREEDY = {"max_new_tokens": 12, "temperature": 0.0}
ENDLESS = {"max_new_tokens": 200, "ignore_eos": True, "temperature": 1.0, "sampling_seed": 1}
NORM = "model.norm.weight"


@pytest.fixture(scope="module")
def aeng() -> Iterator[AsyncSpecEngine]:
    """One engine for every test (the weight tests write the bundled weights back), so a
    test's outcome does not depend on which ran before it."""
    eng = AsyncSpecEngine(bundled_engine())
    yield eng
    asyncio.run(eng.close())


@pytest.fixture
def client(aeng: AsyncSpecEngine) -> Iterator[TestClient]:
    with TestClient(build_app(aeng, default_k=3)) as c:
        yield c


def post(client: TestClient, path: str, body: object) -> tuple[int, Any]:
    r = client.post(path, content=json.dumps(body).encode(),
                    headers={"Content-Type": "application/json"})
    return r.status_code, r.json()


def read_events(lines: Iterator[str]) -> list[Any]:
    return [json.loads(x[6:]) if x != "data: [DONE]" else "[DONE]"
            for x in lines if x.startswith("data: ")]


def stream(client: TestClient, body: dict[str, Any]) -> list[Any]:
    """The events of a streamed ``/generate`` (``"[DONE]"`` as the string)."""
    with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        return read_events(r.iter_lines())


def want(aeng: AsyncSpecEngine, prompt: list[int] | str, **params: Any
         ) -> list[GenerationOutput]:
    """The engine's own outputs (every sample of a group, in order) for ``prompt``."""
    async def run() -> list[GenerationOutput]:
        finals: dict[int, GenerationOutput] = {}
        async for out in aeng.generate_stream(prompt, SamplingParams(**params), k=3):
            if out.output is not None:
                finals[out.output.sample_index] = out.output
        return [finals[i] for i in sorted(finals)]
    return asyncio.run(run())


def is_result_of(got: dict[str, Any], out: Any) -> None:
    assert got["output_ids"] == list(out.token_ids) and got["text"] == out.text


# ---- /generate, SGLang's dialect -------------------------------------------------------------
def test_one_prompt_is_answered_as_one_result_with_a_fresh_id(client, aeng) -> None:
    status, out = post(client, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})
    assert status == 200 and isinstance(out, dict), out
    w = want(aeng, PROMPT, temperature=0.0, max_tokens=12)[0]
    is_result_of(out, w)
    assert re.fullmatch("sgl-[0-9a-f]{32}", out["meta_info"]["id"]), out["meta_info"]["id"]
    again = post(client, "/generate", {"input_ids": PROMPT, "sampling_params": GREEDY})[1]
    assert again["meta_info"]["id"] != out["meta_info"]["id"]


def test_a_group_and_a_batch_are_lists_prompt_major(client, aeng) -> None:
    sp = {"max_new_tokens": 6, "temperature": 1.0, "n": 2, "sampling_seed": 5}
    status, out = post(client, "/generate", {"input_ids": PROMPT, "sampling_params": sp,
                                             "rid": "one"})
    assert status == 200 and isinstance(out, list) and len(out) == 2, out
    group = want(aeng, PROMPT, temperature=1.0, max_tokens=6, n=2, seed=5)
    for got, w, i in zip(out, group, range(2)):
        is_result_of(got, w)
        assert got["meta_info"]["id"] == f"one-{i}"
    texts = ["Q:12+7=", "Q:385+472="]
    status, out = post(client, "/generate", {"text": texts, "sampling_params": sp,
                                             "rid": ["a", "b"], "return_logprob": [True, False]})
    assert status == 200 and len(out) == 4, out
    assert [o["meta_info"]["id"] for o in out] == ["a-0", "a-1", "b-0", "b-1"]
    for p, text in enumerate(texts):
        for i, w in enumerate(want(aeng, text, temperature=1.0, max_tokens=6, n=2,
                                   seed=5)):
            is_result_of(out[2 * p + i], w)
    assert "output_token_logprobs" in out[0]["meta_info"]
    assert "output_token_logprobs" not in out[2]["meta_info"]


def test_a_streamed_batch_of_groups_indexes_each_sample(client, aeng) -> None:
    """Prompt p's sample i is ``index`` p * n + i; a chunk before the last carries the ids so
    far, the prompt's length where it is known (ids; a text's only at the end) and the
    engine's weight version; each index's last chunk is the non-streamed answer."""
    sp = {"max_new_tokens": 5, "temperature": 1.0, "n": 2, "sampling_seed": 7}
    body = {"input_ids": [PROMPT, LONG[:7], LONG[7:10]], "sampling_params": sp}
    answer = post(client, "/generate", body)[1]
    chunks = stream(client, body)
    assert chunks[-1] == "[DONE]"
    last: dict[int, dict[str, Any]] = {}
    ids: dict[int, set[str]] = {}
    for c in chunks[:-1]:
        last[c["index"]] = c
        ids.setdefault(c["index"], set()).add(c["meta_info"]["id"])
        prompt = body["input_ids"][c["index"] // 2]  # type: ignore[index]
        if c["meta_info"]["finish_reason"] is None:
            final = answer[c["index"]]["output_ids"]  # each sample's own ids so far
            assert final[:len(c["output_ids"])] == c["output_ids"], c
            assert c["meta_info"]["prompt_tokens"] == len(prompt)
            assert c["meta_info"]["completion_tokens"] == len(c["output_ids"])
            assert c["meta_info"]["weight_version"] == aeng.engine.weight_version
    assert sorted(last) == list(range(6))
    for i, a in enumerate(answer):
        assert last[i]["output_ids"] == a["output_ids"] and last[i]["text"] == a["text"], i
        assert len(ids[i]) == 1 and ids[i].pop().endswith(f"-{i % 2}")  # the sample's own id
    # one prompt, one sample: no index; a text prompt's length is not known before the end
    chunks = stream(client, {"text": "Q:12+7=", "sampling_params": GREEDY})[:-1]
    assert len(chunks) > 1 and all("index" not in c for c in chunks)
    assert all(c["meta_info"]["prompt_tokens"] is None for c in chunks[:-1])
    assert chunks[-1]["meta_info"]["prompt_tokens"] == len("Q:12+7=")


def test_skip_special_tokens_false_keeps_them_in_the_text(client, aeng) -> None:
    w = want(aeng, "Q:12+7=", temperature=0.0, max_tokens=40)[0]
    assert w.finish_reason == "stop" and w.stop_reason is None  # ended by EOS
    tok = aeng.engine.tokenizer.tokenizer  # type: ignore[union-attr]
    full = tok.decode(list(w.token_ids), skip_special_tokens=False)
    assert full != w.text and full.startswith(w.text)  # the EOS token shows
    sp = {"max_new_tokens": 40, "temperature": 0.0, "skip_special_tokens": False}
    out = post(client, "/generate", {"text": "Q:12+7=", "sampling_params": sp})[1]
    assert out["text"] == full and out["output_ids"] == list(w.token_ids)
    chunks = stream(client, {"text": "Q:12+7=", "sampling_params": sp})
    assert chunks[-2]["text"] == full
    batch = post(client, "/generate", {"text": ["Q:12+7=", "Q:12+7="], "sampling_params": [
        sp, {**sp, "skip_special_tokens": True}]})[1]
    assert [b["text"] for b in batch] == [full, w.text]
    # cut where the engine cut: before a stop string, or after it with no_stop_trim
    stop = w.text[4:6]  # type: ignore[index]
    cut = want(aeng, "Q:12+7=", temperature=0.0, max_tokens=40, stop=(stop,))[0]
    assert cut.stop_reason == stop
    out = post(client, "/generate", {"text": "Q:12+7=", "sampling_params": {**sp,
                                                                           "stop": stop}})[1]
    assert out["text"] == cut.text
    out = post(client, "/generate", {"text": "Q:12+7=", "sampling_params": {
        **sp, "stop": stop, "no_stop_trim": True}})[1]
    assert out["text"] == cut.text + stop  # type: ignore[operator]


def test_a_batch_prompt_the_engine_refuses_is_named(client) -> None:
    status, out = post(client, "/generate", {"input_ids": [PROMPT, [1, 99]]})
    assert status == 400 and out["error"].startswith("batch item 1: "), out
    status, out = post(client, "/generate", {"input_ids": [1, 99]})
    assert status == 400 and "batch item" not in out["error"], out


# ---- /generate, our dialect ------------------------------------------------------------------
def test_our_body_with_n_is_one_group_and_with_one_sample_one_output(client, aeng
                                                                     ) -> None:
    params = {"max_tokens": 6, "temperature": 1.0, "n": 2, "seed": 3}
    group = want(aeng, PROMPT, temperature=1.0, max_tokens=6, n=2, seed=3)
    status, out = post(client, "/generate", {"prompt_token_ids": PROMPT, "request_id": "ours",
                                             "sampling_params": params})
    assert status == 200 and out["request_id"] == "ours", out
    assert [o["request_id"] for o in out["outputs"]] == ["ours-0", "ours-1"]
    assert [o["token_ids"] for o in out["outputs"]] == [list(w.token_ids) for w in group]
    status, out = post(client, "/generate", {"prompt_token_ids": PROMPT,
                                             "sampling_params": params})
    assert status == 200 and re.fullmatch("http-[0-9a-f]{32}", out["request_id"]), out
    events = stream(client, {"prompt_token_ids": PROMPT, "request_id": "s",
                             "sampling_params": params})
    assert events[-1] == "[DONE]"
    tokens: dict[str, list[int]] = {"s-0": [], "s-1": []}
    for e in events[:-1]:
        assert set(e) == {"request_id", "new_token_ids", "finished", "restarted", "output"}
        assert e["restarted"] is False
        tokens[e["request_id"]].extend(e["new_token_ids"])
        assert (e["output"] is not None) == e["finished"]
        if e["finished"]:
            assert e["output"]["token_ids"] == tokens[e["request_id"]]
    assert [tokens["s-0"], tokens["s-1"]] == [list(w.token_ids) for w in group]
    one = want(aeng, PROMPT, temperature=0.0, max_tokens=6)[0]
    for n in (None, 1):
        sp = {"max_tokens": 6, "temperature": 0.0} | ({} if n is None else {"n": n})
        status, out = post(client, "/generate", {"prompt_token_ids": PROMPT,
                                                 "request_id": "single", "sampling_params": sp})
        assert status == 200 and out["request_id"] == "single", out
        assert out["token_ids"] == list(one.token_ids) and "outputs" not in out


def test_a_request_id_in_use_is_refused(client) -> None:
    """A group's samples are in flight under ``f"{rid}-{i}"``: those ids are in use."""
    with client.stream("POST", "/generate", json={"input_ids": PROMPT, "rid": "busy",
                                                  "stream": True,
                                                  "sampling_params": {**ENDLESS, "n": 2}}
                       ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")  # in the engine
        status, out = post(client, "/generate", {"input_ids": PROMPT, "rid": "busy-1"})
        assert status == 400 and "request id 'busy-1' is already used" in out["error"], out
        status, out = post(client, "/generate", {"prompt_token_ids": PROMPT,
                                                 "request_id": "busy", "sampling_params": {
                                                     "n": 2}})
        assert status == 400 and "request id 'busy-0' is already used" in out["error"], out
        assert post(client, "/abort_request", {"rid": "busy"})[1]["aborted"] == [
            "busy-0", "busy-1"]
        read_events(lines)
    # free again once it ended
    assert post(client, "/generate", {"input_ids": PROMPT, "rid": "busy-1",
                                      "sampling_params": {"max_new_tokens": 2}})[0] == 200
    status, out = post(client, "/generate", {"input_ids": [PROMPT, PROMPT], "rid": ["x", "x"]})
    assert status == 400, out


# ---- pause / continue / abort ------------------------------------------------------------------
def watch_waits(app: FastAPI) -> threading.Event:
    """Set once a request starts waiting for ``/continue_generation``."""
    resumed = app.state.sglang_resumed
    waiting = threading.Event()
    wait = resumed.wait

    async def watched() -> bool:
        waiting.set()
        return await wait()
    resumed.wait = watched
    return waiting


def test_pause_aborts_what_runs_and_holds_new_requests_until_continue(client,
                                                                      monkeypatch) -> None:
    # (the wait for stragglers is not waited out once every request is aborted)
    monkeypatch.setattr(sglang_api, "PAUSE_ABORT_WAIT_S", 10 * WAIT_S)
    with client.stream("POST", "/generate", json={"input_ids": PROMPT, "rid": "run",
                                                  "stream": True,
                                                  "sampling_params": {**ENDLESS, "n": 2}}
                       ) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        status, out = post(client, "/pause_generation", {})
        assert (status, out) == (200, {"success": True, "message": "generation paused; 2 "
                                       "requests in flight aborted", "num_aborted": 2})
        finals = [e for e in read_events(lines) if e != "[DONE]"
                  and e["meta_info"]["finish_reason"]]
    assert [f["meta_info"]["finish_reason"]["type"] for f in finals] == ["abort", "abort"]
    assert all(len(f["output_ids"]) < 200 for f in finals)
    waiting = watch_waits(client.app)  # type: ignore[arg-type]
    for body in ({"input_ids": PROMPT, "sampling_params": GREEDY},
                 {"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 3}},
                 {"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 3, "n": 2}}):
        waiting.clear()
        call = Background(lambda b=body: post(client, "/generate", b), WAIT_S)
        assert waiting.wait(WAIT_S)
        assert not call.finished.is_set()  # it waits
        assert post(client, "/continue_generation", None) == (
            200, {"success": True, "message": "generation continues"})
        assert call.result()[0] == 200  # type: ignore[index]
        assert post(client, "/pause_generation", None)[1]["num_aborted"] == 0
    assert post(client, "/continue_generation", {})[0] == 200
    status, out = post(client, "/pause_generation", {"mode": "sideways"})
    assert status == 400 and "mode" in out["error"], out


def test_abort_request_ends_a_groups_samples_by_its_id_or_everything(client) -> None:
    with client.stream("POST", "/generate", json={
            "input_ids": PROMPT, "rid": "grp", "stream": True,
            "sampling_params": {**ENDLESS, "n": 2}}) as r1, \
        client.stream("POST", "/generate", json={
            "input_ids": PROMPT, "rid": "grp-x-y", "stream": True,
            "sampling_params": ENDLESS}) as r2:
        l1, l2 = r1.iter_lines(), r2.iter_lines()
        assert next(l1).startswith("data: {") and next(l2).startswith("data: {")
        status, out = post(client, "/abort_request", {"rid": "grp"})
        assert (status, out) == (200, {"success": True, "message": "aborted 2 requests",
                                       "aborted": ["grp-0", "grp-1"]})
        read_events(l1)
        status, out = post(client, "/abort_request", {"abort_all": True})
        assert out["aborted"] == ["grp-x-y"], out
        read_events(l2)


# ---- model info, health, prefix cache -------------------------------------------------------
def test_model_info_and_health(client, aeng) -> None:
    eng = aeng.engine
    r = client.get("/get_model_info")
    assert r.status_code == 200 and r.json() == {
        "model_path": eng.config.model, "tokenizer_path": eng.config.model,
        "is_generation": True, "preferred_sampling_params": None,
        "weight_version": eng.weight_version, "draft_model_path": str(eng.config.draft),
        "max_model_len": eng.config.max_model_len}
    r = client.get("/health_generate")
    assert r.status_code == 200 and r.json() == {"status": "ok",
                                                  "weight_version": eng.weight_version}


def test_flush_cache_empties_the_prefix_cache(client) -> None:
    body = {"input_ids": LONG, "sampling_params": {"max_new_tokens": 2}}
    post(client, "/generate", body)
    assert post(client, "/generate", body)[1]["meta_info"]["cached_tokens"] == 32
    for flush in (lambda: client.post("/flush_cache"), lambda: client.get("/flush_cache")):
        r = flush()
        assert r.status_code == 200 and r.json() == {"success": True,
                                                     "message": "prefix cache flushed"}
        assert post(client, "/generate", body)[1]["meta_info"]["cached_tokens"] == 0


# ---- weights ---------------------------------------------------------------------------------
@pytest.fixture
def weights_aeng(aeng: AsyncSpecEngine) -> AsyncSpecEngine:
    """The engine the weight tests update (to the bundled weights: outputs unchanged)."""
    return aeng


@pytest.fixture
def wclient(weights_aeng: AsyncSpecEngine) -> Iterator[TestClient]:
    with TestClient(build_app(weights_aeng, default_k=3)) as c:
        yield c


def refusal(message: str) -> dict[str, Any]:
    return {"success": False, "message": message, "error": message}


def test_a_checkpoint_from_disk_is_loaded_with_the_learners_version(wclient, weights_aeng
                                                                    ) -> None:
    v = weights_aeng.engine.weight_version
    status, out = post(wclient, "/update_weights_from_disk", {"model_path": str(DEFAULT_TARGET)})
    assert (status, out) == (200, {"success": True, "message": f"loaded {DEFAULT_TARGET}: "
                                   f"weight version {v + 1}", "num_paused_requests": 0,
                                   "weight_version": v + 1})
    status, out = post(wclient, "/update_weights_from_disk", {
        "model_path": str(DEFAULT_TARGET), "weight_version": str(v + 10)})
    assert status == 200 and out["weight_version"] == v + 10 == weights_aeng.engine.weight_version
    status, out = post(wclient, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert status == 400 and out == refusal(out["message"]) and "/nonexistent" in out["message"]
    status, out = post(wclient, "/update_weights_from_disk", {
        "model_path": str(DEFAULT_TARGET), "weight_version": str(v + 10)})
    assert status == 400 and out == refusal(out["message"]) and "must increase" in out["message"]


def test_a_non_finite_checkpoint_is_a_400_naming_the_tensor(wclient, tmp_path: Path) -> None:
    sd = load_file(str(Path(DEFAULT_TARGET) / "model.safetensors"))
    sd[NORM] = sd[NORM].clone()
    sd[NORM][1] = float("inf")
    save_file(sd, str(tmp_path / "model.safetensors"))
    status, out = post(wclient, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert status == 400 and out == refusal(out["message"]) and NORM in out["message"], out


def test_keep_pause_and_abort_all_requests_around_a_disk_update(wclient, caplog) -> None:
    with wclient.stream("POST", "/generate", json={"input_ids": PROMPT, "stream": True,
                                                   "sampling_params": ENDLESS}) as r:
        lines = r.iter_lines()
        assert next(lines).startswith("data: {")
        with caplog.at_level(logging.INFO, logger="specengine.server.sglang_api"):
            status, out = post(wclient, "/update_weights_from_disk", {
                "model_path": str(DEFAULT_TARGET), "abort_all_requests": True,
                "keep_pause": True})
        assert status == 200, out
        assert "aborted 1 requests before a weight update" in [
            r.getMessage() for r in caplog.records if r.name == "specengine.server.sglang_api"]
        final = [e for e in read_events(lines) if e != "[DONE]"][-1]
    assert final["meta_info"]["finish_reason"]["type"] == "abort"  # ended before the update
    waiting = watch_waits(wclient.app)  # type: ignore[arg-type]
    call = Background(lambda: post(wclient, "/generate", {"input_ids": PROMPT}), WAIT_S)
    assert waiting.wait(WAIT_S) and not call.finished.is_set()  # paused, as asked
    assert post(wclient, "/continue_generation", {})[0] == 200
    assert call.result()[0] == 200  # type: ignore[index]
    # without keep_pause a disk update leaves generation running
    assert post(wclient, "/update_weights_from_disk", {"model_path": str(DEFAULT_TARGET)}
                )[0] == 200
    assert wclient.app.state.sglang_resumed.is_set()  # type: ignore[attr-defined]


class CountingLock:
    """The engine's weight lock, counting refused attempts (``refused`` is set at the first)."""

    def __init__(self, lock: Any) -> None:
        self.lock, self.refused, self.taken = lock, threading.Event(), threading.Event()

    def acquire(self, what: str, wait_s: float = 0.0) -> None:
        try:
            self.lock.acquire(what, wait_s)
        except RuntimeError:
            self.refused.set()
            raise
        self.taken.set()

    def release(self) -> None:
        self.lock.release()

    @property
    def holder(self) -> str:
        return self.lock.holder


def test_a_weight_operation_waits_for_the_one_in_progress(wclient, weights_aeng) -> None:
    eng = weights_aeng.engine
    lock = eng.weight_lock
    # (the engine makes its lock on first use and keeps it here)
    eng.__dict__["_weight_lock_obj"] = counting = CountingLock(lock)
    try:
        lock.acquire("a test's operation")
        call = Background(lambda: post(wclient, "/update_weights_from_disk", {
            "model_path": str(DEFAULT_TARGET)}), WAIT_S)
        assert counting.refused.wait(WAIT_S)  # it tried, and waits
        assert not call.finished.is_set()
        lock.release()
        status, out = call.result()  # type: ignore[misc]
        assert status == 200 and out["success"], out
    finally:
        eng.__dict__["_weight_lock_obj"] = lock


def test_a_weight_operation_that_waited_too_long_is_a_409(wclient, weights_aeng,
                                                          monkeypatch) -> None:
    monkeypatch.setattr(sglang_api, "LOCK_WAIT_S", 0.0)
    lock = weights_aeng.engine.weight_lock
    lock.acquire("a test's operation")
    try:
        status, out = post(wclient, "/update_weights_from_disk",
                           {"model_path": str(DEFAULT_TARGET)})
    finally:
        lock.release()
    message = ("another weight operation is in progress (a test's operation): load_weights is "
               "refused; retry once it has finished")
    assert (status, out) == (409, refusal(message))


def test_a_refusal_that_mentions_in_progress_is_not_retried(wclient, weights_aeng, tmp_path,
                                                          monkeypatch) -> None:
    """Only the weight lock's refusal is waited out: an update refused for its own content
    is answered at once, whatever its message says (a tensor named ``in progress``)."""
    monkeypatch.setattr(sglang_api, "LOCK_WAIT_S", 1.0)  # bounds a wrong retry
    save_file({"in progress": torch.tensor([float("nan")])}, str(tmp_path / "model.safetensors"))
    eng = weights_aeng.engine
    calls = []
    stage = eng.stage_weights
    monkeypatch.setattr(eng, "stage_weights", lambda *a, **k: calls.append(a) or stage(*a, **k))
    status, out = post(wclient, "/update_weights_from_disk", {"model_path": str(tmp_path)})
    assert status == 400 and "in progress" in out["message"], out
    assert len(calls) == 1


def test_weight_operations_are_logged_by_name(wclient, caplog) -> None:
    with caplog.at_level(logging.DEBUG, logger="specengine.server.sglang_api"):
        post(wclient, "/destroy_weights_update_group", {"group_name": "nobody"})
        post(wclient, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert [r.getMessage() for r in caplog.records
            if r.name == "specengine.server.sglang_api"] == [
        "weight operation destroy_weights_update_group off the step loop",
        "weight operation update_weights_from_disk off the step loop"]


def init_body(port: int, name: str, **over: Any) -> dict[str, Any]:
    return {"master_address": "127.0.0.1", "master_port": port, "rank_offset": 1,
            "world_size": 2, "group_name": name, "backend": "gloo", "timeout_s": JOIN_S,
            **over}


def init(client: TestClient, name: str) -> tuple[tuple[int, Any], Learner]:
    """Join a learner (on a thread: a refused join fails the test at once)."""
    port = free_port()
    learner = Background(lambda: Learner("127.0.0.1", port, name, JOIN_S), WAIT_S)
    answer = post(client, "/init_weights_update_group", init_body(port, name))
    assert answer[0] == 200, answer
    return answer, learner.result()  # type: ignore[return-value]


def update(client: TestClient, learner: Learner, body: dict[str, Any], sent: torch.Tensor
           ) -> tuple[int, Any]:
    """Post an update while the learner broadcasts ``sent`` (on a thread)."""
    call = Background(lambda: learner.send(sent), WAIT_S)
    answer = post(client, "/update_weights_from_distributed", body)
    assert answer[0] == 200, answer
    call.result()
    return answer


def test_a_learners_group_joined_updated_replaced_and_destroyed(wclient, weights_aeng) -> None:
    eng = weights_aeng.engine
    norm = load_file(str(Path(DEFAULT_TARGET) / "model.safetensors"))[NORM].float()
    answer, learner = init(wclient, "rl")
    assert answer == (200, {"success": True,
                            "message": "joined weight-update group 'rl' as rank 1 of 2"})
    groups = wclient.app.state.sglang_groups  # type: ignore[attr-defined]
    assert set(groups) == {"rl"}
    v = eng.weight_version
    body = {"names": [NORM], "dtypes": ["float32"], "shapes": [list(norm.shape)],
            "group_name": "rl", "weight_version": v + 3}
    assert update(wclient, learner, body, norm * 2) == (200, {
        "success": True, "message": f"updated 1 tensors to weight version {v + 3}",
        "weight_version": v + 3})
    got = dict(eng.model.named_parameters())[NORM].detach()
    torch.testing.assert_close(got, (norm * 2).to(got.dtype))
    assert update(wclient, learner, {**body, "weight_version": None}, norm)[1][
        "weight_version"] == v + 4
    # the same name again while its learner answers: refused at once
    status, out = post(wclient, "/init_weights_update_group", init_body(1, "rl"))
    assert status == 409 and "'rl' exists and its learner still answers" in out["error"], out
    old = groups["rl"]
    learner.leave()
    answer, learner = init(wclient, "rl")  # its learner gone: replaced
    assert answer[0] == 200, answer
    assert groups["rl"] is not old and old.pg is None  # the old one was closed
    status, out = post(wclient, "/destroy_weights_update_group", {"group_name": "rl"})
    assert (status, out) == (200, {"success": True, "message": "left weight-update group 'rl'"})
    assert groups == {}
    learner.leave()
    status, out = post(wclient, "/destroy_weights_update_group", {"group_name": "rl"})
    assert (status, out) == (400, refusal("no weight-update group 'rl'"))
    status, out = post(wclient, "/update_weights_from_distributed", body)
    assert (status, out) == (400, refusal("no weight-update group 'rl': "
                                          "/init_weights_update_group first"))


def test_a_join_that_fails_is_refused_and_leaves_no_group(wclient) -> None:
    port = free_port()
    status, out = post(wclient, "/init_weights_update_group", init_body(port, "lonely",
                                                                        timeout_s=0.2))
    assert status == 400 and out == refusal(out["message"]), out
    assert out["message"].startswith("joining weight-update group 'lonely' at 127.0.0.1:")
    assert wclient.app.state.sglang_groups == {}  # type: ignore[attr-defined]
    status, out = post(wclient, "/init_weights_update_group", {"group_name": "x"})
    assert status == 400 and "master_address" in out["error"], out


def test_our_update_body_goes_to_our_route(wclient) -> None:
    """A body without ``names`` is ours (no group of ours: 409); not an object: our 422."""
    status, out = post(wclient, "/update_weights_from_distributed", {})
    assert status == 409 and "no weight-update group" in out["error"], out
    status, out = post(wclient, "/update_weights_from_distributed", [1])
    assert status == 422, out
    status, out = post(wclient, "/abort", {"request_id": "nobody"})  # our other routes stay
    assert status == 404 and "no unfinished request with id 'nobody'" in out["error"], out


# ---- the app ---------------------------------------------------------------------------------
def test_malformed_json_is_a_400_naming_it(client) -> None:
    r = client.post("/pause_generation", content=b"{nope",
                    headers={"Content-Type": "application/json"})
    assert r.status_code == 400 and r.json()["error"].startswith("malformed JSON body: ")


def test_the_openapi_schema_documents_the_bodies_the_routes_read(client) -> None:
    jsonschema = pytest.importorskip("jsonschema")
    app: FastAPI = client.app  # type: ignore[assignment]
    spec = app.openapi()
    assert app.openapi() is spec  # made once
    components = spec["components"]["schemas"]

    def check(path: str, body: object, valid: bool) -> None:
        body_spec = spec["paths"][path]["post"]["requestBody"]
        assert body_spec["required"] is True
        schema = {**body_spec["content"]["application/json"]["schema"],
                  "components": {"schemas": components}}
        ok = jsonschema.Draft202012Validator(schema).is_valid(body)
        assert ok == valid, (path, body)

    check("/generate", {"text": "Q:", "sampling_params": {"max_new_tokens": 3}}, True)
    check("/generate", {"prompt_token_ids": [1, 2], "sampling_params": {"max_tokens": 3}}, True)
    check("/generate", {"text": 5}, False)
    check("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"],
                                               "shapes": [[2]]}, True)
    check("/update_weights_from_distributed", {"staging": "host"}, True)
    check("/init_weights_update_group", {"master_address": "h", "master_port": 5,
                                         "rank_offset": 1, "world_size": 2}, True)
    check("/init_weights_update_group", {"master_port": 5}, False)
    check("/destroy_weights_update_group", {"group_name": "g"}, True)
    check("/update_weights_from_disk", {"model_path": "/m"}, True)
    check("/update_weights_from_disk", {}, False)
    check("/abort_request", {"rid": "r"}, True)
    check("/pause_generation", {"mode": "abort"}, True)
    check("/pause_generation", {"mode": "sideways"}, False)
    check("/continue_generation", {}, True)


def test_mount_needs_the_apps_own_routes(aeng) -> None:
    app = FastAPI()
    app.state.server = build_app(aeng).state.server
    with pytest.raises(RuntimeError) as info:
        sglang_api.mount(app)
    assert str(info.value) == "mount needs the app's POST /generate route (build_app makes it)"


# ---- more of /generate ---------------------------------------------------------------------------
def test_a_streamed_chunk_holds_back_what_may_start_a_stop_string(client, aeng) -> None:
    """Each chunk's text is the decoded text so far less its last (longest stop string - 1)
    characters (never shrinking); without stop strings nothing is held back."""
    tok = aeng.engine.tokenizer.tokenizer  # type: ignore[union-attr]
    for stops, hold in (([], 0), (["@@@@", ";A"], 3), ("=9", 1)):
        sp = {"max_new_tokens": 40, "temperature": 0.0, "stop": stops}
        chunks = stream(client, {"text": "Q:385+472=", "sampling_params": sp})[:-1]
        answer = post(client, "/generate", {"text": "Q:385+472=", "sampling_params": sp})[1]
        assert chunks[-1]["text"] == answer["text"], stops
        shown = ""
        for c in chunks[:-1]:
            decoded = tok.decode(c["output_ids"], skip_special_tokens=True)
            if len(decoded) - hold > len(shown):
                shown = decoded[:len(decoded) - hold]
            assert c["text"] == shown, (stops, c)


def test_top_logprobs_num_is_passed_for_each_prompt(client, aeng) -> None:
    body = {"input_ids": [PROMPT, LONG[:6]], "return_logprob": True, "top_logprobs_num": [2, 0],
            "sampling_params": {"max_new_tokens": 4, "temperature": 0.0}}
    out = post(client, "/generate", body)[1]
    tops = out[0]["meta_info"]["output_top_logprobs"]
    assert len(tops) == 4 and all(len(t) == 2 for t in tops), tops
    assert "output_top_logprobs" not in out[1]["meta_info"]
    final = sorted((c for c in stream(client, body)[:-1] if c["meta_info"]["finish_reason"]),
                   key=lambda c: c["index"])
    assert [len(c["meta_info"].get("output_top_logprobs", [])) for c in final] == [4, 0]


def test_k_and_k_max_of_a_request_reach_the_engine(client) -> None:
    """k 0 (or ``"auto"`` with k_max 0) proposes no draft; the server's default k (3) does."""
    def drafts(body: dict[str, Any]) -> int:
        status, out = post(client, "/generate", body)
        assert status == 200, out
        outs = out["outputs"] if "outputs" in out else out if isinstance(out, list) else [out]
        return sum(o["meta_info"]["num_draft_tokens"] if "meta_info" in o
                   else o["num_draft_tokens"] for o in outs)
    sg = {"input_ids": PROMPT, "sampling_params": GREEDY}
    ours = {"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 12,
                                                            "temperature": 0.0, "n": 2}}
    for body in (sg, ours):
        assert drafts(body) > 0
        assert drafts({**body, "k": 0}) == 0
        assert drafts({**body, "k": "auto", "k_max": 0}) == 0
    assert drafts({**sg, "k": 2}) > 0


def test_a_stop_string_at_the_start_leaves_no_text(client, aeng) -> None:
    w = want(aeng, "Q:12+7=", temperature=0.0, max_tokens=40)[0]
    stop = w.text[:2]  # type: ignore[index]
    sp = {"max_new_tokens": 40, "temperature": 0.0, "skip_special_tokens": False, "stop": stop}
    out = post(client, "/generate", {"text": "Q:12+7=", "sampling_params": sp})[1]
    assert out["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    assert out["text"] == ""
    out = post(client, "/generate", {"text": "Q:12+7=", "sampling_params": {
        **sp, "no_stop_trim": True}})[1]
    assert out["text"] == stop


def test_a_refused_stream_frees_its_id_and_a_finished_one_too(client) -> None:
    r = client.post("/generate", json={"input_ids": [1, 99], "rid": "f", "stream": True})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"], r.text
    for _ in range(2):  # the id is free again, also once a stream ended
        assert stream(client, {"input_ids": [PROMPT, PROMPT], "rid": ["f", "g"],
                               "sampling_params": {"max_new_tokens": 2}})[-1] == "[DONE]"


def test_our_invalid_body_keeps_its_422_and_sglangs_is_a_400(client) -> None:
    status, out = post(client, "/generate", {"prompt_token_ids": "x"})
    assert status == 422, out
    status, out = post(client, "/generate", {"input_ids": "x"})
    assert status == 400, out


def metric(client: TestClient, name: str, **labels: str) -> float:
    from prometheus_client.parser import text_string_to_metric_families

    for family in text_string_to_metric_families(client.get("/metrics").text):
        for s in family.samples:
            if s.name == name and all(s.labels.get(k) == v for k, v in labels.items()):
                return s.value
    return 0.0


def test_a_draining_server_refuses_new_generations_and_is_unhealthy(client) -> None:
    state = client.app.state.server  # type: ignore[attr-defined]
    state.draining = True
    try:
        for body in ({"input_ids": PROMPT}, {"prompt_token_ids": PROMPT,
                                             "sampling_params": {"n": 2}}):
            status, out = post(client, "/generate", body)
            assert (status, out) == (503, {"error": "the server is shutting down: no new "
                                                    "requests"})
        r = client.get("/health_generate")
        assert r.status_code == 503 and "shutting down" in r.json()["error"]
    finally:
        state.draining = False


def test_waiting_requests_and_refusals_are_counted(client) -> None:
    before = metric(client, "specengine_http_errors_total", status_code="400")
    post(client, "/update_weights_from_disk", {"model_path": "/nonexistent"})
    assert metric(client, "specengine_http_errors_total", status_code="400") == before + 1
    assert post(client, "/pause_generation", {})[0] == 200
    waiting = watch_waits(client.app)  # type: ignore[arg-type]
    call = Background(lambda: post(client, "/generate", {"input_ids": PROMPT}), WAIT_S)
    assert waiting.wait(WAIT_S)
    assert metric(client, "specengine_num_requests_paused") == 1
    assert post(client, "/continue_generation", {})[0] == 200
    assert call.result()[0] == 200  # type: ignore[index]
    assert metric(client, "specengine_num_requests_paused") == 0
    assert metric(client, "specengine_client_disconnects_total") == 0  # it waited, not left


# ---- the answer's shape, from an output -------------------------------------------------------
def output(**over: Any) -> GenerationOutput:
    fields: dict[str, Any] = {
        "prompt_token_ids": (5, 6, 7), "token_ids": (9, 4), "logprobs": (-0.5, -1.25),
        "finish_reason": "length", "num_steps": 2, "num_draft_tokens": 3,
        "num_accepted_tokens": 1, "weight_version": 4, "text": "ab",
        "token_weight_versions": (3, 4), "num_cached_tokens": 2}
    return GenerationOutput(**{**fields, **over})


@pytest.mark.parametrize("over,reason", [
    ({"finish_reason": "stop", "stop_reason": "ab"}, {"type": "stop", "matched": "ab"}),
    ({"finish_reason": "stop", "stop_reason": 4}, {"type": "stop", "matched": 4}),
    ({"finish_reason": "stop", "token_ids": (9, 4, 2), "logprobs": (-1.0, -1.0, -1.0),
      "token_weight_versions": (4, 4, 4)}, {"type": "stop", "matched": 2}),
    ({"finish_reason": "stop", "token_ids": (), "logprobs": (), "token_weight_versions": ()},
     {"type": "stop", "matched": None}),
    ({}, {"type": "length", "length": 2}),
    ({"finish_reason": "policy_lag"},
     {"type": "abort", "message": "the request's policy lag exceeded its bound"}),
    ({"finish_reason": "abort"}, {"type": "abort", "message": "aborted"}),
    ({"finish_reason": "error", "error": "boom"}, {"type": "abort", "message": "boom"}),
])
def test_finish_reason_in_sglangs_shape(over: dict[str, Any], reason: dict[str, Any]) -> None:
    assert sglang_api.finish_reason(output(**over)) == reason


def test_result_and_meta_info_from_an_output() -> None:
    out = output(top_logprobs=({9: -0.5, 2: -0.25, 7: -3.0}, {4: -1.25, 1: -0.75}))
    assert sglang_api.sglang_result("r", out, False) == {
        "text": "ab", "output_ids": [9, 4], "meta_info": {
            "id": "r", "finish_reason": {"type": "length", "length": 2}, "prompt_tokens": 3,
            "completion_tokens": 2, "weight_version": 4, "cached_tokens": 2,
            "token_weight_versions": [3, 4], "num_draft_tokens": 3, "num_accepted_tokens": 1}}
    meta = sglang_api.sglang_result("r", out, True, 2, text="a<b>")
    assert meta["text"] == "a<b>"
    meta = meta["meta_info"]
    assert meta["output_token_logprobs"] == [[-0.5, 9, None], [-1.25, 4, None]]
    assert meta["output_top_logprobs"] == [[[-0.25, 2, None], [-0.5, 9, None]],
                                           [[-0.75, 1, None], [-1.25, 4, None]]]
    assert "output_top_logprobs" not in sglang_api.sglang_result("r", out, True)["meta_info"]
    assert "output_top_logprobs" not in sglang_api.meta_info("r", 3, [9, 4], [-0.5, -1.25], out,
                                                             4)  # no top_n: none
    # a chunk before the end: no output yet
    assert sglang_api.meta_info("r", None, [9], None, None, 7) == {
        "id": "r", "finish_reason": None, "prompt_tokens": None, "completion_tokens": 1,
        "weight_version": 7}


def test_json_response_and_events_are_pythons_json() -> None:
    r = sglang_api.json_response({"lp": float("-inf")}, 201)
    assert r.status_code == 201 and r.media_type == "application/json"
    assert r.body == b'{"lp": -Infinity}'
    assert sglang_api._event({"a": 1}) == b'data: {"a": 1}\n\n'
    assert sglang_api.output_dict("x", output()) == {"request_id": "x",
                                                     **dataclasses.asdict(output())}


def test_request_ids_are_claimed_once_and_released() -> None:
    state = types.SimpleNamespace(live={"busy"})
    job = sglang_api.Job("g", [1], SamplingParams(n=2), 0, 0)
    assert job.sample_ids == ["g-0", "g-1"]
    assert sglang_api.Job("s", [1], SamplingParams(), 0, 0).sample_ids == ["s"]
    with pytest.raises(ValueError) as info:
        sglang_api._claim(state, [sglang_api.Job("busy", [1], SamplingParams(), 0, 0)])
    assert str(info.value) == "request id 'busy' is already used by an unfinished request"
    with pytest.raises(ValueError) as info:  # twice in one call: the id given twice is named
        sglang_api._claim(state, [job, sglang_api.Job("g-1", [1], SamplingParams(), 0, 0)])
    assert str(info.value) == "request id 'g-1' is already used by an unfinished request"
    assert state.live == {"busy"}  # nothing claimed by a refused call
    sglang_api._claim(state, [job])
    assert state.live == {"busy", "g-0", "g-1"}
    sglang_api._release(state, [job])
    assert state.live == {"busy"}


def test_a_batch_whose_ids_collide_names_the_id_given_twice(client) -> None:
    """Prompt 0's group of two is ``g-0``, ``g-1``; prompt 1 asks for ``g-1`` itself."""
    status, out = post(client, "/generate", {
        "input_ids": [PROMPT, PROMPT], "rid": ["g", "g-1"],
        "sampling_params": [{"n": 2, "max_new_tokens": 2}, {"max_new_tokens": 2}]})
    assert status == 400 and "request id 'g-1' is already used" in out["error"], out


def test_pause_retries_the_abort_of_a_request_not_yet_in_the_engine(client, aeng,
                                                                    monkeypatch) -> None:
    """A request its handler has claimed but not yet handed to the engine (the engine does not
    know its id: ``abort`` raises ValueError) is aborted once it is there."""
    state = client.app.state.server  # type: ignore[attr-defined]
    attempts: list[str] = []

    async def abort(rid: str) -> None:
        attempts.append(rid)
        if len(attempts) == 1:
            raise ValueError(f"no request {rid!r}")  # not in the engine yet
        state.live.discard(rid)  # there now: aborted, and its handler releases it

    monkeypatch.setattr(aeng, "abort", abort)
    state.live.add("handed-over-late")
    status, out = post(client, "/pause_generation", {})
    assert (status, out["num_aborted"]) == (200, 1), out
    assert attempts == ["handed-over-late", "handed-over-late"]
    assert post(client, "/continue_generation", {})[0] == 200


def test_health_generate_is_a_503_when_generating_fails(client, aeng, monkeypatch) -> None:
    async def fails(*args: Any, **kwargs: Any) -> None:
        raise RuntimeError("the GPU fell off")

    monkeypatch.setattr(aeng, "generate", fails)
    r = client.get("/health_generate")
    assert r.status_code == 503
    assert r.json() == {"error": "generating one token failed: the GPU fell off"}


def test_a_client_leaving_a_stream_releases_it_and_is_counted(client) -> None:
    state = client.app.state.server  # type: ignore[attr-defined]
    for body in ({"input_ids": PROMPT, "rid": "gone", "sampling_params": {**ENDLESS, "n": 2}},
                 {"prompt_token_ids": PROMPT, "request_id": "gone", "sampling_params": {
                     "max_tokens": 200, "ignore_eos": True, "n": 2}}):
        before = metric(client, "specengine_client_disconnects_total")
        with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert next(r.iter_lines()).startswith("data: {")
        assert metric(client, "specengine_client_disconnects_total") == before + 1
        assert not state.live  # released


# ---- what the engine hands back, stood in for ---------------------------------------------------
def stand_in_stream(monkeypatch, aeng: AsyncSpecEngine, steps: list[Any]) -> None:
    """``aeng.generate_stream`` replaced by one that yields ``steps`` (``RequestOutput``
    factories taking the request id), or raises one that is an exception."""
    async def generate_stream(prompt: Any, params: Any = None, **kw: Any) -> Any:
        for step in steps:
            if isinstance(step, BaseException):
                raise step
            yield step(kw["request_id"])
    monkeypatch.setattr(aeng, "generate_stream", generate_stream)


def test_an_engine_refusal_keeps_its_status(client, aeng, monkeypatch) -> None:
    from specengine.async_loop import EngineOverloadedError

    stand_in_stream(monkeypatch, aeng, [EngineOverloadedError("the engine is full")])
    for body in ({"input_ids": PROMPT}, {"input_ids": PROMPT, "stream": True},
                 {"prompt_token_ids": PROMPT, "sampling_params": {"n": 2}}):
        status, out = post(client, "/generate", body)
        assert (status, out) == (503, {"error": "the engine is full"}), body


def test_a_request_that_failed_in_the_engine_is_a_500(client, aeng, monkeypatch) -> None:
    from specengine.outputs import RequestOutput

    failed = output(finish_reason="error", error="boom")
    stand_in_stream(monkeypatch, aeng, [
        lambda rid: RequestOutput(rid, (9,), False),
        lambda rid: RequestOutput(rid, (4,), True, output=failed)])
    errors = metric(client, "specengine_http_errors_total", status_code="500")
    status, out = post(client, "/generate", {"input_ids": PROMPT, "rid": "bad"})
    assert (status, out) == (500, {"error": "a request failed in the engine after 2 tokens: "
                                            "boom"})
    events = stream(client, {"input_ids": PROMPT, "rid": "bad"})
    assert events[-1] == {"error": "request 'bad' failed in the engine: boom",
                          "status_code": 500}
    assert len(events) == 2  # one chunk, then the error: no [DONE]
    assert metric(client, "specengine_http_errors_total", status_code="500") == errors + 2


def test_a_restarted_request_streams_from_its_prompt_again(client, aeng, monkeypatch) -> None:
    from specengine.outputs import RequestOutput

    final = output(token_ids=(7, 8), logprobs=(-1.0, -2.0), finish_reason="length")
    stand_in_stream(monkeypatch, aeng, [
        lambda rid: RequestOutput(rid, (9, 4), False),
        lambda rid: RequestOutput(rid, (7,), False, restarted=True),
        lambda rid: RequestOutput(rid, (8,), True, output=final)])
    chunks = stream(client, {"input_ids": PROMPT})[:-1]
    assert [c["output_ids"] for c in chunks] == [[9, 4], [7], [7, 8]]


@pytest.mark.parametrize("path,body,status,error", [
    ("/generate", {"input_ids": "x"}, 400, 'input_ids: Input should be a valid list (got "x")'),
    ("/generate", {"input_ids": [1], "sampling_params": [{"n": "q"}]}, 400,
     'sampling_params.0.n: Input should be a valid integer (got "q")'),
    ("/generate", {"prompt_token_ids": "x"}, 422,
     'prompt_token_ids: Input should be a valid list (got "x")'),
    ("/pause_generation", {"mode": "sideways"}, 400,
     "mode: Input should be 'abort', 'retract' or 'in_place' (got \"sideways\")"),
])
def test_a_body_that_does_not_fit_is_refused_naming_where_and_why(client, path, body, status,
                                                                  error) -> None:
    """Where: the field's path, without the one-or-list union's own tags; why: pydantic's."""
    assert post(client, path, body) == (status, {"error": error})


def test_a_refusal_names_the_weight_operation_in_progress(wclient, weights_aeng,
                                                         monkeypatch) -> None:
    """A join waiting for its learner holds the weight lock: a disk update meanwhile (that may
    not wait: LOCK_WAIT_S 0) is refused naming it."""
    monkeypatch.setattr(sglang_api, "LOCK_WAIT_S", 0.0)
    eng = weights_aeng.engine
    lock = eng.weight_lock
    eng.__dict__["_weight_lock_obj"] = counting = CountingLock(lock)
    try:
        port = free_port()
        call = Background(lambda: post(wclient, "/init_weights_update_group",
                                       init_body(port, "slow_learner")), WAIT_S)
        assert counting.taken.wait(WAIT_S)  # the join holds the lock while it waits
        status, out = post(wclient, "/update_weights_from_disk",
                           {"model_path": str(DEFAULT_TARGET)})
        assert (status, out) == (409, refusal(
            "another weight operation is in progress (init_weights_update_group): "
            "load_weights is refused; retry once it has finished"))
        learner = Learner("127.0.0.1", port, "slow_learner", JOIN_S)
        assert call.result()[0] == 200  # type: ignore[index]
        assert post(wclient, "/destroy_weights_update_group",
                    {"group_name": "slow_learner"})[0] == 200
        learner.leave()
    finally:
        eng.__dict__["_weight_lock_obj"] = lock


def test_a_stream_is_server_sent_events_not_cached(client) -> None:
    for body in ({"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 2}},
                 {"prompt_token_ids": PROMPT, "sampling_params": {"max_tokens": 2, "n": 2}}):
        with client.stream("POST", "/generate", json={**body, "stream": True}) as r:
            assert r.headers["content-type"].split(";")[0] == "text/event-stream"
            assert r.headers["cache-control"] == "no-cache"
            r.read()


def post_then_leave(app: FastAPI, body: dict[str, Any]) -> int:
    """POST ``body`` to ``/generate`` over ASGI from a client that disconnects once its body is
    sent; the status the app answered (to nobody)."""
    async def run() -> int:
        pending = [{"type": "http.request", "body": json.dumps(body).encode(),
                    "more_body": False}]
        sent: list[dict[str, Any]] = []

        async def receive() -> dict[str, Any]:
            return pending.pop(0) if pending else {"type": "http.disconnect"}

        async def send(message: dict[str, Any]) -> None:
            sent.append(message)
        scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1",
                 "method": "POST", "path": "/generate", "raw_path": b"/generate",
                 "query_string": b"", "root_path": "", "scheme": "http",
                 "headers": [(b"content-type", b"application/json")],
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 80)}
        await app(scope, receive, send)
        return sent[0]["status"]
    return asyncio.run(run())


def test_a_client_that_leaves_before_any_token_is_let_go(aeng, monkeypatch) -> None:
    """Its request is aborted and its ids released, the disconnect counted, and the answer
    (nobody reads it) is a 499: while it waits for its first step (streamed or not, one
    request or a group) and while generation is paused."""
    async def never(prompt: Any, params: Any = None, **kw: Any) -> Any:
        await asyncio.Event().wait()  # no step comes
        yield None
    monkeypatch.setattr(aeng, "generate_stream", never)
    app = build_app(aeng, default_k=3)
    state = app.state.server
    bodies = [{"input_ids": PROMPT, "rid": "left", "stream": True},
              {"input_ids": PROMPT, "rid": "left"},
              {"prompt_token_ids": PROMPT, "request_id": "left", "sampling_params": {"n": 2}},
              {"prompt_token_ids": PROMPT, "request_id": "left", "stream": True,
               "sampling_params": {"n": 2}}]
    for i, body in enumerate(bodies):
        assert post_then_leave(app, body) == 499, body
        assert not state.live, body
        assert state.metrics.disconnects._value.get() == i + 1
    app.state.sglang_resumed.clear()  # paused: it leaves while it waits
    assert post_then_leave(app, {"input_ids": PROMPT}) == 499
    assert state.metrics.disconnects._value.get() == len(bodies) + 1
    assert state.metrics.paused_waiting._value.get() == 0


def test_special_tokens_text_is_cut_where_the_engine_cut_after_min_tokens(client, aeng
                                                                          ) -> None:
    """A stop string that also occurs before ``min_new_tokens`` (not looked for there): the
    text with special tokens is cut at the match that ended the request, as the engine's."""
    sp = {"max_new_tokens": 40, "temperature": 0.0, "stop": ";", "min_new_tokens": 8}
    plain = post(client, "/generate", {"text": "Q:12+7=", "sampling_params": sp})[1]
    assert plain["meta_info"]["finish_reason"] == {"type": "stop", "matched": ";"}
    assert plain["text"].count(";") == 1  # the first ";" came before min_new_tokens
    out = post(client, "/generate", {"text": "Q:12+7=", "sampling_params": {
        **sp, "skip_special_tokens": False}})[1]
    assert out["text"] == plain["text"]
    out = post(client, "/generate", {"text": "Q:12+7=", "sampling_params": {
        **sp, "skip_special_tokens": False, "no_stop_trim": True}})[1]
    assert out["text"] == plain["text"] + ";"


def test_an_error_after_the_first_chunk_is_the_streams_last_event(client, aeng,
                                                                  monkeypatch) -> None:
    from specengine.async_loop import EngineOverloadedError
    from specengine.outputs import RequestOutput

    stand_in_stream(monkeypatch, aeng, [lambda rid: RequestOutput(rid, (9,), False),
                                        EngineOverloadedError("the engine is full")])
    errors = metric(client, "specengine_http_errors_total", status_code="503")
    events = stream(client, {"input_ids": PROMPT})
    assert events[-1] == {"error": "the engine is full", "status_code": 503}
    assert events[0]["output_ids"] == [9] and len(events) == 2
    assert metric(client, "specengine_http_errors_total", status_code="503") == errors + 1


def test_a_weight_operation_that_breaks_is_a_500_and_logged(wclient, weights_aeng, caplog,
                                                            monkeypatch) -> None:
    def breaks(*args: Any, **kwargs: Any) -> None:
        raise KeyError("boom")

    monkeypatch.setattr(weights_aeng.engine, "stage_weights", breaks)
    with caplog.at_level(logging.ERROR, logger="specengine.server.sglang_api"):
        status, out = post(wclient, "/update_weights_from_disk", {"model_path": "/m"})
    assert (status, out) == (500, refusal("'boom'"))
    logged = [r for r in caplog.records if r.name == "specengine.server.sglang_api"]
    assert [r.getMessage() for r in logged] == ["weight operation failed"]
    assert logged[0].exc_info is not None and logged[0].exc_info[1].args == ("boom",)


def test_a_streamed_batch_of_single_samples_is_indexed_by_prompt(client) -> None:
    body = {"input_ids": [PROMPT, LONG[:5]], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 3, "temperature": 0.0}}
    chunks = stream(client, body)[:-1]
    assert {c["index"] for c in chunks} == {0, 1}
    finals = [c for c in chunks if c["meta_info"]["finish_reason"]]
    assert all("output_top_logprobs" not in c["meta_info"] for c in finals)  # none asked


def test_a_streamed_text_with_special_tokens_is_cut_at_the_stop(client, aeng) -> None:
    sp = {"max_new_tokens": 40, "temperature": 0.0, "stop": ";", "min_new_tokens": 8,
          "skip_special_tokens": False}
    answer = post(client, "/generate", {"text": "Q:12+7=", "sampling_params": sp})[1]
    events = stream(client, {"text": "Q:12+7=", "sampling_params": sp})
    assert events[-1] == "[DONE]" and events[-2]["text"] == answer["text"]
    assert events[-2]["meta_info"]["finish_reason"] == {"type": "stop", "matched": ";"}
