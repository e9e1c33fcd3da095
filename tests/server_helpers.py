"""Helpers of the rollout-server tests: a real uvicorn server on 127.0.0.1 in a background
thread, raw HTTP calls for bodies the client would never send, and event-driven waits."""

from __future__ import annotations

import asyncio
import http.client
import json
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import pytest

# The server extra is optional: without it every module importing these helpers is skipped
# at collection, with the reason, instead of failing to collect.
pytest.importorskip("fastapi")
pytest.importorskip("uvicorn")
pytest.importorskip("prometheus_client")

from prometheus_client.parser import text_string_to_metric_families

from specengine import AsyncSpecEngine, SamplingParams, SpecEngine
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET
from specengine.client import SpecEngineClient
from specengine.outputs import GenerationOutput
from specengine.server.serve import RolloutServer, make_server

T = TypeVar("T")
WAIT_S = 60.0  # bound on every wait (server start, a request leaving)
GREEDY = SamplingParams(temperature=0.0, max_tokens=12)


def bundled_engine() -> SpecEngine:
    return SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, device="cpu", kernel_backend="torch",
                      max_batch_size=64, kv_cache_tokens=16 * 1024)


class WatchedSet(set):
    """A set that notifies ``cond`` on every change (the server's in-flight ids), so a test
    waits for a request to start or leave without polling."""

    def __init__(self) -> None:
        super().__init__()
        self.cond = threading.Condition()

    def add(self, item: object) -> None:
        with self.cond:
            super().add(item)
            self.cond.notify_all()

    def discard(self, item: object) -> None:
        with self.cond:
            super().discard(item)
            self.cond.notify_all()

    def wait_for(self, pred: Callable[[set], bool], what: str) -> None:
        with self.cond:
            if not self.cond.wait_for(lambda: pred(self), timeout=WAIT_S):
                raise AssertionError(f"timed out waiting for {what}; in flight: {set(self)}")


@contextmanager
def running_server(aeng: AsyncSpecEngine, **options: Any
                   ) -> Iterator[tuple[RolloutServer, SpecEngineClient]]:
    """A live server over ``aeng`` on a free port of 127.0.0.1 (uvicorn in a thread), its
    in-flight set watched; stopped (gracefully, as on SIGTERM) on exit. ``aeng`` stays open."""
    options.setdefault("log_level", "warning")
    server = make_server(aeng, port=0, **options)
    server.state.live = WatchedSet()
    errors: list[BaseException] = []

    def run() -> None:
        try:
            server.run()
        except BaseException as exc:  # surfaced below instead of dying silently
            errors.append(exc)
            server.ready.set()

    thread = threading.Thread(target=run, name="test-uvicorn", daemon=True)
    thread.start()
    assert server.ready.wait(WAIT_S), "server did not start"
    assert not errors, errors
    client = SpecEngineClient(f"http://127.0.0.1:{server.port}", api_key=options.get("api_key"),
                              timeout=WAIT_S)
    try:
        yield server, client
    finally:
        server.should_exit = True
        thread.join(WAIT_S)
        assert not thread.is_alive(), "server did not stop"
        assert not errors, errors


def in_engine(aeng: AsyncSpecEngine, fn: Callable[[SpecEngine], T]) -> T:
    """``fn(engine)`` on the engine thread between steps, from the test thread."""
    return asyncio.run(aeng.run_in_engine(fn))


def assert_idle_and_free(engine: SpecEngine) -> None:
    """Run through :func:`in_engine`: nothing unfinished, every KV block free."""
    assert not engine.has_unfinished()
    assert engine.kv_cache.num_free_blocks == engine.kv_cache.num_blocks
    assert engine.drafter.kv_cache.num_free_blocks == engine.drafter.kv_cache.num_blocks


def raw_request(port: int, method: str, path: str, body: bytes | None = None,
                headers: dict[str, str] | None = None) -> tuple[int, dict[str, Any]]:
    """One request over ``http.client`` (any bytes as the body); returns the status and the
    JSON answer."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=WAIT_S)
    try:
        hdrs = {"Content-Type": "application/json", **(headers or {})}
        conn.request(method, path, body=body, headers=hdrs)
        resp = conn.getresponse()
        raw = resp.read()
        assert resp.getheader("Content-Type", "").startswith("application/json"), raw
        return resp.status, json.loads(raw)
    finally:
        conn.close()


def post_json(port: int, path: str, obj: object, headers: dict[str, str] | None = None
              ) -> tuple[int, dict[str, Any]]:
    return raw_request(port, "POST", path, json.dumps(obj).encode(), headers)


def mixed_params(n: int) -> list[SamplingParams]:
    """Greedy and seeded sampling, 8..16 tokens."""
    return [SamplingParams(temperature=0.0 if i % 2 else 1.0, max_tokens=8 + i % 9,
                           seed=2000 + i) for i in range(n)]


def assert_same(got: GenerationOutput, want: GenerationOutput) -> None:
    assert got.token_ids == want.token_ids
    assert got.prompt_token_ids == want.prompt_token_ids
    assert got.finish_reason == want.finish_reason
    assert got.text == want.text
    assert got.token_weight_versions == want.token_weight_versions
    assert got.weight_version == want.weight_version
    assert got.logprobs == pytest.approx(want.logprobs, abs=1e-4)


def families(text: str) -> dict[str, dict[tuple, float]]:
    """Prometheus text -> {sample name: {sorted labels: value}} (parsing fails on bad text)."""
    out: dict[str, dict[tuple, float]] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out.setdefault(s.name, {})[tuple(sorted(s.labels.items()))] = s.value
    return out
