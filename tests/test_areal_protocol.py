"""AReaL 1.0.4's SGLang protocol, replayed from what its own client sent.

``tests/data/areal_1.0.4_bodies.json`` was recorded by ``scripts/record_areal.py``: AReaL's
``RemoteSGLangEngine`` (its RLVR rollouts' ``agenerate``, ``pause_generation`` /
``continue_generation`` of its asynchronous mode, its distributed and disk weight updates in
the order its FSDP engine runs them) against ``specengine serve`` on the bundled model,
through a proxy that logged every request. AReaL itself is no dependency: these tests send
its bodies verbatim (a temporary path and a free port substituted) to a live server and check
the answers as AReaL parses them. The learner side joins as SGLang's
``init_custom_process_group`` does (gloo, AReaL's backend on a CPU platform).
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from net_helpers import Background, free_port
from safetensors.torch import load_file, save_file
from server_helpers import WAIT_S, bundled_engine, families, post_json
from sglang_helpers import init_custom_process_group, serve_process

from specengine import SamplingParams, SpecEngine
from specengine.assets import DEFAULT_TARGET

RECORD = json.loads((Path(__file__).parent / "data" / "areal_1.0.4_bodies.json").read_text())


def recorded(path: str) -> list[dict[str, Any]]:
    """The bodies AReaL sent to ``path``, in order."""
    return [r["body"] for r in RECORD["requests"] if r["path"] == path]


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    sd = load_file(str(Path(DEFAULT_TARGET) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen) if ".mlp." in n else t
            for n, t in sd.items()}


def parse(out: dict[str, Any]) -> tuple[list[int], list[float], str]:
    """What AReaL's ``parse_generation_response`` reads: tokens and logprobs from
    ``output_token_logprobs``, the stop reason from ``finish_reason.type``."""
    meta = out["meta_info"]
    triples = meta["output_token_logprobs"]
    return [t for _, t, _ in triples], [lp for lp, _, _ in triples], \
        meta["finish_reason"]["type"]


def greedy(engine: SpecEngine, prompt: list[int], n: int) -> tuple[list[int], list[float]]:
    out = engine.generate([prompt], k=3, sampling=SamplingParams(
        temperature=0.0, max_tokens=n, ignore_eos=True))[0]
    return list(out.token_ids), list(out.logprobs)


@pytest.fixture(scope="module")
def reference() -> SpecEngine:
    return bundled_engine()


@pytest.fixture(scope="module")
def shared() -> Iterator[int]:
    """One server for the tests that change no weights."""
    with serve_process() as (_, port, _log):
        yield port


@pytest.fixture
def port() -> Iterator[int]:
    """A ``specengine serve`` process of its own (these tests change its weights; and the
    learner's group, made in this process, must not share its name registry)."""
    with serve_process() as (_, port, _log):
        yield port


def unfinished(port: int) -> int:
    return int(_get(port, "/health")["num_unfinished"])


def idle(port: int) -> None:
    wait_until(lambda: unfinished(port) == 0, "the server to be idle")


def paused_waiting(port: int) -> float:
    status_and_text = _get_text(port, "/metrics")
    return families(status_and_text)["specengine_num_requests_paused"][()]


def _get_text(port: int, path: str) -> str:
    import http.client
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        conn.request("GET", path)
        return conn.getresponse().read().decode()
    finally:
        conn.close()


def _get(port: int, path: str) -> dict[str, Any]:
    return json.loads(_get_text(port, path))


def wait_until(pred: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_S
    while not pred():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)


def test_recording_is_areals_whole_sequence() -> None:
    """The recording holds what the issue lists, in AReaL's order, each answered 200."""
    paths = [r["path"] for r in RECORD["requests"]]
    assert RECORD["areal"] == "1.0.4"
    assert all(r["status"] == 200 for r in RECORD["requests"]), RECORD["requests"]
    assert paths[0] == "/health"
    i = paths.index("/init_weights_update_group")
    assert paths[i + 1:i + 4] == ["/pause_generation", "/update_weights_from_distributed",
                                  "/continue_generation"]
    assert paths[-3:] == ["/pause_generation", "/update_weights_from_disk",
                          "/continue_generation"]
    body = recorded("/generate")[0]
    assert "image_data" in body and "skip_special_tokens" in body["sampling_params"]
    assert isinstance(recorded("/init_weights_update_group")[0]["master_port"], str)
    assert recorded("/update_weights_from_disk")[0]["abort_all_requests"] is True
    # AReaL's own record of the interrupted rollout: every token kept, those before the
    # pause of version 0, after it of version 1.
    got = RECORD["results"]["interrupted"]
    versions = got["output_versions"]
    assert len(got["output_tokens"]) == 200 and 0 < versions.count(0) < 200
    assert versions == sorted(versions) and set(versions) == {0, 1}


def test_rollout_bodies_as_areal_sends_them(shared, reference) -> None:
    port = shared
    for body in recorded("/generate")[:3]:
        status, out = post_json(port, "/generate", body)
        assert status == 200, out
        ids, lps, reason = parse(out)
        sp = body["sampling_params"]
        assert ids == out["output_ids"] and len(ids) == sp["max_new_tokens"]
        assert reason == "length"
        if sp["temperature"] == 0.0:
            want_ids, want_lps = greedy(reference, body["input_ids"], sp["max_new_tokens"])
            assert ids == want_ids
            assert lps == pytest.approx(want_lps, abs=1e-4)


REFUSED = [  # (field, value): known to SGLang, asking for what this engine cannot do
    ({"image_data": ["img.png"]}, "image_data is not supported"),
    ({"lora_path": "adapter-v1"}, "lora_path is not supported"),
    ({"return_hidden_states": True}, "return_hidden_states is not supported"),
    ({"sampling_params": {"regex": "[0-9]+"}}, "sampling_params.regex is not supported"),
    ({"sampling_params": {"spaces_between_special_tokens": False}},
     "sampling_params.spaces_between_special_tokens is not supported"),
    ({"input_ids": [[5, 6], [5, 7]], "image_data": [None, "img.png"]},
     "image_data is not supported"),
]


def test_sglang_fields_at_their_default_pass_and_others_are_refused_by_name(shared
                                                                            ) -> None:
    port = shared
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 4}}
    status, out = post_json(port, "/generate", {
        **body, "image_data": None, "lora_path": None, "return_hidden_states": False,
        "log_metrics": False, "custom_labels": {"job": "x"}, "return_logprob": None,
        "sampling_params": {"max_new_tokens": 4, "regex": None, "stream_interval": 3,
                            "spaces_between_special_tokens": True, "top_k": None}})
    assert status == 200 and len(out["output_ids"]) == 4, out
    for extra, words in REFUSED:
        status, answer = post_json(port, "/generate", {**body, **extra})
        assert status == 400 and words in answer["error"], (extra, answer)
    idle(port)
    # retract / in_place keep requests halted inside the engine: refused by name
    status, answer = post_json(port, "/pause_generation", {"mode": "in_place"})
    assert status == 400 and "mode 'in_place' is not supported" in answer["error"], answer


def test_skip_special_tokens_false_keeps_them_in_the_text(shared, reference) -> None:
    port = shared
    tok = reference.tokenizer
    body = {"input_ids": [5, 6, 7], "sampling_params": {"max_new_tokens": 30,
                                                         "temperature": 0.0}}
    status, plain = post_json(port, "/generate", body)
    assert status == 200
    body["sampling_params"]["skip_special_tokens"] = False
    status, kept = post_json(port, "/generate", body)
    assert status == 200 and kept["output_ids"] == plain["output_ids"]
    ids = kept["output_ids"]
    assert kept["text"] == tok.tokenizer.decode(ids, skip_special_tokens=False)
    assert plain["text"] == tok.tokenizer.decode(ids, skip_special_tokens=True)


def test_pause_aborts_in_flight_holds_new_and_an_update_lands_between(port, reference,
                                                                      tmp_path) -> None:
    """AReaL's asynchronous mode: pause (the long rollout ends with ``abort`` and its tokens
    so far), AReaL resubmits prompt + tokens (held while paused), a disk update lands, then
    continue: the resubmission runs wholly on the new weights, and the tokens concatenated
    are the old policy's then the new one's, none lost."""
    long_body = recorded("/generate")[3]
    assert long_body["sampling_params"]["max_new_tokens"] == 200
    first = Background(lambda: post_json(port, "/generate", long_body))
    wait_until(lambda: unfinished(port) == 1, "the long rollout to start")
    status, answer = post_json(port, "/pause_generation", recorded("/pause_generation")[0])
    assert status == 200 and answer["success"], answer
    status, out = first.result()  # type: ignore[misc]
    assert status == 200, out
    ids0, lps0, reason = parse(out)
    assert reason == "abort" and 0 < len(ids0) < 200
    assert out["meta_info"]["token_weight_versions"] == [0] * len(ids0)
    want_ids, want_lps = greedy(reference, long_body["input_ids"], len(ids0))
    assert ids0 == want_ids and lps0 == pytest.approx(want_lps, abs=1e-4)

    # AReaL's resubmission: prompt + tokens so far, max_new_tokens less what it got
    again = json.loads(json.dumps(long_body))
    again["input_ids"] = long_body["input_ids"] + ids0
    again["sampling_params"]["max_new_tokens"] = 200 - len(ids0)
    second = Background(lambda: post_json(port, "/generate", again))
    wait_until(lambda: paused_waiting(port) == 1, "the resubmission to wait for continue")

    new = new_weights(seed=11)
    save_file(new, str(tmp_path / "model.safetensors"))
    disk = {**recorded("/update_weights_from_disk")[0], "model_path": str(tmp_path)}
    status, answer = post_json(port, "/update_weights_from_disk", disk)
    assert status == 200 and answer["success"] and answer["weight_version"] == 1, answer
    assert not second.finished.is_set()
    status, answer = post_json(port, "/continue_generation", {})
    assert status == 200 and answer["success"]
    status, out = second.result()  # type: ignore[misc]
    assert status == 200, out
    ids1, lps1, reason = parse(out)
    assert reason == "length" and len(ids0) + len(ids1) == 200
    assert out["meta_info"]["token_weight_versions"] == [1] * len(ids1)
    reference.load_weights(new)
    try:
        want_ids, want_lps = greedy(reference, again["input_ids"], len(ids1))
    finally:
        reference.load_weights(load_file(str(Path(DEFAULT_TARGET) / "model.safetensors")))
    assert ids1 == want_ids and lps1 == pytest.approx(want_lps, abs=1e-4)
    assert paused_waiting(port) == 0
    idle(port)


def test_abort_all_requests_on_a_distributed_update(port) -> None:
    """``abort_all_requests`` (AReaL sets it): the requests in flight end with finish reason
    abort before the update, their tokens so far returned."""
    master = free_port()
    init_body = {**recorded("/init_weights_update_group")[0], "master_port": str(master)}
    init = Background(lambda: post_json(port, "/init_weights_update_group", init_body))
    pg = init_custom_process_group(f"tcp://127.0.0.1:{master}", 2, 0,
                                   init_body["group_name"], timedelta(seconds=WAIT_S))
    try:
        status, answer = init.result()  # type: ignore[misc]
        assert status == 200 and answer["success"], answer
        running = Background(lambda: post_json(port, "/generate", recorded("/generate")[3]))
        wait_until(lambda: unfinished(port) == 1, "a rollout to start")
        upd_body = recorded("/update_weights_from_distributed")[0]
        assert upd_body["abort_all_requests"] is True
        new = new_weights(seed=12)
        assert upd_body["names"] == list(new)
        call = Background(lambda: post_json(port, "/update_weights_from_distributed",
                                            upd_body))
        status, out = running.result()  # type: ignore[misc]
        assert status == 200 and parse(out)[2] == "abort", out
        for name in upd_body["names"]:
            dist.broadcast(new[name].contiguous(), src=0, group=pg)
        status, answer = call.result()  # type: ignore[misc]
        assert status == 200 and answer["weight_version"] == 1, answer
        assert _get(port, "/health")["weight_version"] == 1
        assert _get(port, "/get_model_info")["weight_version"] == 1
    finally:
        dist.destroy_process_group(pg)
    idle(port)


LEARNER = """
import sys, time
from datetime import timedelta
sys.path.insert(0, {tests!r})
from sglang_helpers import init_custom_process_group
pg = init_custom_process_group("tcp://127.0.0.1:{port}", 2, 0, {name!r},
                               timedelta(seconds=60))
print("joined", flush=True)
sys.stdin.read()  # until the test closes it: then this learner is gone
"""


def test_a_restarted_trainer_replaces_the_group_of_a_learner_that_is_gone(port
                                                                         ) -> None:
    """AReaL restarted: the same ``/init_weights_update_group`` again. While the first
    learner lives it is refused at once (409, why); once it is gone the new group replaces
    it, and the update goes through. Never a rendezvous hang."""
    name = recorded("/init_weights_update_group")[0]["group_name"]
    master = free_port()
    learner = subprocess.Popen(
        [sys.executable, "-c", LEARNER.format(tests=str(Path(__file__).parent), port=master,
                                              name=name)],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        status, answer = post_json(port, "/init_weights_update_group", {
            **recorded("/init_weights_update_group")[0], "master_port": str(master)})
        assert status == 200 and answer["success"], answer
        assert learner.stdout.readline().strip() == "joined"  # type: ignore[union-attr]
        # the first learner still answers: a second init is refused now, naming why
        master2 = free_port()
        body2 = {**recorded("/init_weights_update_group")[0], "master_port": str(master2)}
        t0 = time.monotonic()
        status, answer = post_json(port, "/init_weights_update_group", body2)
        assert status == 409 and "still answers" in answer["error"], answer
        assert time.monotonic() - t0 < WAIT_S / 2
    finally:
        learner.stdin.close()  # type: ignore[union-attr]
        assert learner.wait(WAIT_S) == 0
    init = Background(lambda: post_json(port, "/init_weights_update_group", body2))
    pg = init_custom_process_group(f"tcp://127.0.0.1:{master2}", 2, 0, name,
                                   timedelta(seconds=WAIT_S))
    try:
        status, answer = init.result()  # type: ignore[misc]
        assert status == 200 and answer["success"], answer
        upd_body = recorded("/update_weights_from_distributed")[0]
        new = new_weights(seed=13)
        call = Background(lambda: post_json(port, "/update_weights_from_distributed",
                                            upd_body))
        for n in upd_body["names"]:
            dist.broadcast(new[n].contiguous(), src=0, group=pg)
        status, answer = call.result()  # type: ignore[misc]
        assert status == 200 and answer["weight_version"] == 1, answer
    finally:
        dist.destroy_process_group(pg)
    idle(port)
