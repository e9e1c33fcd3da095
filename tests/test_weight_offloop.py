"""Weight operations do not block the step loop (docs/design.md §4, "off the step loop"): a
server's rendezvous with a learner that is not there, and the transfer of an update from a
learner that pauses mid-stream, wait in a worker thread while requests keep generating; only
the commit runs between two steps. Every wait honours its ``timeout_s``; a second weight
operation while one is in progress is refused (409). Real gloo groups and a real server on
loopback; the learner runs on a thread of this process and synchronises through events."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from net_helpers import Background, free_port
from safetensors.torch import load_file
from server_helpers import bundled_engine, in_engine, post_json, running_server

from specengine import AsyncSpecEngine, SamplingParams
from specengine.assets import DEFAULT_TARGET
from specengine.client import SpecEngineClient
from specengine.weights import WeightSender
from specengine.weights.group import WeightGroup
from specengine.weights.protocol import bucket_buffer, manifest_for, pack
from specengine.weights.sender import MAGIC

WAIT_S = 60.0
PAUSE_S = 20.0  # how long the learner holds its transfer at most (the test releases it)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def new_weights(seed: int) -> dict[str, torch.Tensor]:
    sd = load_file(str(Path(DEFAULT_TARGET) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen) if ".mlp." in n else t
            for n, t in sd.items()}


@pytest.fixture
def served() -> Iterator[tuple[AsyncSpecEngine, int, SpecEngineClient]]:
    aeng = AsyncSpecEngine(bundled_engine())
    try:
        with running_server(aeng, default_k=3) as (server, client):
            yield aeng, server.port, client
    finally:
        asyncio.run(aeng.close())


def test_rendezvous_with_nobody_does_not_block_generation(served) -> None:
    aeng, port, client = served
    long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    stream = client.generate_stream([1, 2, 3], long)
    tokens = list(next(stream).new_token_ids)  # the request runs
    start = time.monotonic()
    joining = Background(lambda: post_json(port, "/init_weight_update_group", {
        "master_address": "127.0.0.1", "master_port": free_port(), "rank": 1,
        "world_size": 2, "backend": "gloo", "timeout_s": 3.0}))
    for out in stream:
        tokens.extend(out.new_token_ids)
    assert len(tokens) == 40
    # The stream ran to its end while the rendezvous still waited for its learner.
    assert not joining.finished.is_set()
    # Meanwhile another weight operation is refused, not queued behind it.
    status, body = post_json(port, "/load_weights", {"path": str(DEFAULT_TARGET)})
    assert status == 409 and "in progress (init_weight_update_group)" in body["error"]
    status, body = joining.result()  # type: ignore[misc]
    elapsed = time.monotonic() - start
    assert status == 400 and "rendezvous" in body["error"], body
    assert elapsed < 3.0 + 1.0, elapsed  # its own timeout_s, within a second
    # Nothing was left behind: the engine is in no group and takes a weight load again.
    assert in_engine(aeng, lambda e: e._weight_receiver) is None
    status, body = post_json(port, "/load_weights", {"path": str(DEFAULT_TARGET)})
    assert status == 200 and body == {"weight_version": 1}


def paused_send(group: WeightGroup, sd: dict[str, torch.Tensor], version: int,
                mid: threading.Event, resume: threading.Event) -> bool:
    """``WeightSender.send``'s protocol, stopping after half of the buckets until ``resume``
    (at most :data:`PAUSE_S`); returns whether it was resumed (rather than timed out)."""
    manifest, tensors = manifest_for(sd, version, "policy", False, 64 << 10)
    payload = manifest.to_json()
    group.broadcast(torch.tensor([MAGIC, len(payload)], dtype=torch.int64), 0)
    group.broadcast(torch.frombuffer(bytearray(payload), dtype=torch.uint8), 0)
    assert group.agree(None) == []
    buf = bucket_buffer(manifest, group.device)
    chunks = manifest.chunks()
    resumed = False
    for i, (lo, hi) in enumerate(chunks):
        if i == len(chunks) // 2:
            mid.set()
            resumed = resume.wait(PAUSE_S)
        pack(manifest, tensors, lo, hi, buf)
        group.broadcast(buf[: hi - lo], 0)
    assert group.agree(None) == []
    return resumed


def test_generation_continues_while_an_update_is_received(served) -> None:
    aeng, port, client = served
    before = client.generate([5, 6, 7], GREEDY)
    group_port = free_port()
    joining = Background(lambda: WeightSender("127.0.0.1", group_port, world_size=2,
                                              backend="gloo", timeout_s=WAIT_S))
    client.init_weight_update_group("127.0.0.1", group_port, rank=1, world_size=2,
                                    backend="gloo", timeout_s=WAIT_S)
    sender = joining.result()
    assert isinstance(sender, WeightSender) and sender.group is not None
    new = new_weights(seed=4)
    mid, resume = threading.Event(), threading.Event()
    try:
        learner = Background(lambda: paused_send(sender.group, new, 7, mid,  # type: ignore
                                                 resume))
        updating = Background(lambda: post_json(port, "/update_weights_from_distributed", {}))
        assert mid.wait(WAIT_S), "the learner did not start its transfer"
        # The transfer is half done and the learner holds it: requests still run.
        during = client.generate([5, 6, 7], GREEDY)
        assert during.token_ids == before.token_ids and during.weight_version == 0
        assert not updating.finished.is_set()
        for path, body in (("/close_weight_update_group", {}),
                           ("/load_weights", {"path": str(DEFAULT_TARGET)})):
            status, answer = post_json(port, path, body)
            assert status == 409 and "in progress" in answer["error"], (path, answer)
        resume.set()
        assert learner.result() is True  # released by the test, not by its own timeout
        status, body = updating.result()  # type: ignore[misc]
        assert status == 200 and body == {"weight_version": 7}
        after = client.generate([5, 6, 7], GREEDY)
        fresh = bundled_engine()
        fresh.load_weights(new)
        want = fresh.generate([[5, 6, 7]], k=3, sampling=GREEDY)[0]
        assert after.token_ids == want.token_ids and after.weight_version == 7
    finally:
        resume.set()
        client.close_weight_update_group()
        sender.close()
