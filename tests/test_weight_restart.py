"""A trainer restarted against a running server (our weight-sync protocol over HTTP): while
the first learner lives a second join is refused at once (409, naming why); once it is gone
the new group replaces it; ``send()`` without a version is each engine's next version, which
``/health``, ``/get_model_info`` and ``SpecEngineClient.weight_version`` report."""

from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from net_helpers import Background, free_port
from safetensors.torch import load_file
from server_helpers import WAIT_S, bundled_engine, running_server

from specengine import AsyncSpecEngine, SamplingParams
from specengine.assets import DEFAULT_TARGET
from specengine.client import ServerError
from specengine.weights import WeightSender

FIRST_LEARNER = """
import sys
from specengine.weights import WeightSender
sender = WeightSender("127.0.0.1", {port}, 2, backend="gloo", timeout_s=60)
print("joined", flush=True)
sys.stdin.readline()
import torch
from safetensors.torch import load_file
sd = load_file({ckpt!r})
sender.send({{n: t + 0.01 for n, t in sd.items() if ".mlp." in n}}, version=3)
print("sent", flush=True)
sys.stdin.read()  # until the test closes it: then this learner is gone
"""


def mlp_update(seed: int) -> dict[str, torch.Tensor]:
    sd = load_file(str(Path(DEFAULT_TARGET) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen) for n, t in sd.items()
            if ".mlp." in n}


def test_restarted_trainer_rejoins_and_sends_the_next_version(
        caplog: pytest.LogCaptureFixture) -> None:
    # the sender's INFO line formats a versionless update too (it once raised on None)
    caplog.set_level(logging.INFO, logger="specengine.weights.sender")
    eng = AsyncSpecEngine(bundled_engine())
    try:
        with running_server(eng, default_k=3) as (srv, client):
            port = free_port()
            first = subprocess.Popen(
                [sys.executable, "-c", FIRST_LEARNER.format(
                    port=port, ckpt=str(Path(DEFAULT_TARGET) / "model.safetensors"))],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
            try:
                client.init_weight_update_group("127.0.0.1", port, 1, 2, backend="gloo",
                                                timeout_s=WAIT_S)
                assert first.stdout.readline().strip() == "joined"  # type: ignore[union-attr]
                got = Background(lambda: client.update_weights_from_distributed())
                first.stdin.write("go\n")  # type: ignore[union-attr]
                first.stdin.flush()  # type: ignore[union-attr]
                assert got.result() == 3
                assert first.stdout.readline().strip() == "sent"  # type: ignore[union-attr]
                assert client.weight_version() == 3 == client.health()["weight_version"]

                # the first learner still answers: refused now, naming why
                t0 = time.monotonic()
                with pytest.raises(ServerError) as err:
                    client.init_weight_update_group("127.0.0.1", free_port(), 1, 2,
                                                    backend="gloo", timeout_s=WAIT_S)
                assert err.value.status == 409 and "still answers" in err.value.message
                assert time.monotonic() - t0 < WAIT_S / 2
            finally:
                first.stdin.close()  # type: ignore[union-attr]
                assert first.wait(WAIT_S) == 0

            # the restarted trainer: a new group replaces the one whose learner is gone
            port2 = free_port()
            joining = Background(lambda: WeightSender("127.0.0.1", port2, 2, backend="gloo",
                                                      timeout_s=WAIT_S))
            client.init_weight_update_group("127.0.0.1", port2, 1, 2, backend="gloo",
                                            timeout_s=WAIT_S)
            sender = joining.result()
            new = mlp_update(seed=31)
            got = Background(lambda: client.update_weights_from_distributed())
            sender.send(new)  # type: ignore[attr-defined]  # no version: the engine's next
            assert got.result() == 4
            assert "sent weight update the next version" in caplog.text
            assert client.weight_version() == 4
            out = client.generate([5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8))
            assert out.weight_version == 4
            ref = bundled_engine()
            ref.load_weights(new)
            want = ref.generate([[5, 6, 7]], k=3, sampling=SamplingParams(
                temperature=0.0, max_tokens=8))[0]
            assert list(out.token_ids) == list(want.token_ids)
            sender.close()  # type: ignore[attr-defined]
    finally:
        asyncio.run(eng.close())
