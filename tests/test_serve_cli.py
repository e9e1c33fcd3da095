"""``specengine serve`` as a real process: it answers /health and /generate (the engine's
outputs), and SIGTERM ends it cleanly (exit status 0) after aborting the request in flight,
whose stream still gets its last event and ``[DONE]``. Bad options exit with status 2."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from net_helpers import free_port
from server_helpers import bundled_engine

from specengine import SamplingParams
from specengine.cli import main
from specengine.client import ServerError, SpecEngineClient
from specengine.server import API_KEY_ENV

WAIT_S = 120.0


def test_serve_process_serves_then_exits_cleanly_on_sigterm() -> None:
    port = free_port()
    env = dict(os.environ, OMP_NUM_THREADS="1", **{API_KEY_ENV: "k3y"})
    proc = subprocess.Popen(
        [sys.executable, "-m", "specengine.cli", "serve", "--port", str(port), "--device",
         "cpu", "--kernel-backend", "torch", "--kv-cache-tokens", "4096",
         "--shutdown-timeout", "0"],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env)
    watchdog = threading.Timer(WAIT_S, proc.kill)  # a hung server fails the test, not CI
    watchdog.start()
    log: list[str] = []
    try:
        for raw in proc.stderr:  # uvicorn logs its address once it listens
            log.append(raw.decode())
            if "Uvicorn running on" in log[-1]:
                break
        else:
            raise AssertionError("server exited before listening:\n" + "".join(log))
        with pytest.raises(ServerError) as err:  # $SPECENGINE_API_KEY is in force
            SpecEngineClient(f"http://127.0.0.1:{port}").health()
        assert err.value.status == 401
        client = SpecEngineClient(f"http://127.0.0.1:{port}", api_key="k3y", timeout=WAIT_S)
        assert client.health()["status"] == "ok"
        greedy = SamplingParams(temperature=0.0, max_tokens=16)
        want = bundled_engine().generate(["Q:472*6="], k=3, sampling=greedy)[0]
        assert client.generate("Q:472*6=", greedy).token_ids == want.token_ids  # --k 3
        long = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
        stream = client.generate_stream("Q:385+472=", long)
        tokens = list(next(stream).new_token_ids)
        proc.send_signal(signal.SIGTERM)
        for out in stream:  # ends with the aborted output, then [DONE]
            tokens.extend(out.new_token_ids)
        assert out.finished and out.output.finish_reason == "abort"
        assert out.output.token_ids == tuple(tokens) and len(tokens) < 200
        rest = proc.stderr.read().decode()
        assert proc.wait(WAIT_S) == 0, "".join(log) + rest
        assert "aborted 1 requests" in rest
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()


def test_serve_refuses_bad_options(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["serve", "--model", str(tmp_path / "none")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert main(["serve", "--model", str(tmp_path), "--k", "3"]) == 2  # checked before loading
    err = capsys.readouterr().err
    assert "--k 3 needs --draft" in err and "--k 0" in err and "ngram|suffix|HEAD_DIR" in err
    with pytest.raises(SystemExit):
        main(["serve", "--port", "70000"])
    assert "--port" in capsys.readouterr().err


def test_serve_own_model_without_a_drafter_serves_plain_decoding(
        tiny_checkpoint: Path, monkeypatch: pytest.MonkeyPatch,
        capsys: pytest.CaptureFixture[str]) -> None:
    import specengine.server.serve as serve

    seen = []
    monkeypatch.setattr(serve, "serve_main", lambda args: seen.append(args) or 0)
    assert main(["serve", "--model", str(tiny_checkpoint)]) == 0
    (args,) = seen
    assert args.k == 0 and args.draft is None  # plain decoding is the requests' default
    note = capsys.readouterr().err.splitlines()
    assert len(note) == 1 and "plain decoding (k=0)" in note[0] and "--draft suffix" in note[0]
    assert main(["serve", "--model", str(tiny_checkpoint), "--draft", "suffix"]) == 0
    assert seen[1].k == 3 and seen[1].draft == "suffix"
    assert main(["serve"]) == 0  # the bundled pair drafts with its head, as before
    assert seen[2].k == 3 and seen[2].model is None
