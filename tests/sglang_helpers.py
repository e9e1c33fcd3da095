"""Helpers of the SGLang-protocol tests: a learner's named group made as SGLang's
``init_custom_process_group`` makes it, JSON calls over ``urllib``, and a real
``specengine serve`` process."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Iterator
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from net_helpers import free_port

WAIT_S = 120.0


def init_custom_process_group(init_method: str, world_size: int, rank: int, group_name: str,
                              timeout: timedelta) -> dist.ProcessGroup:
    """A learner's named group, as SGLang's ``init_custom_process_group`` makes it."""
    from torch.distributed.distributed_c10d import (
        _new_process_group_helper,
        _world,
        rendezvous,
    )

    store, rank, world_size = next(rendezvous(init_method, rank, world_size, timeout=timeout))
    store.set_timeout(timeout)
    store = dist.PrefixStore(group_name, store)
    pg, _ = _new_process_group_helper(world_size, rank, [], dist.Backend("gloo"), store,
                                      group_name=group_name, timeout=timeout,
                                      backend_options=None)
    _world.pg_group_ranks[pg] = {i: i for i in range(world_size)}
    return pg


def post(port: int, path: str, body: object) -> tuple[int, dict[str, Any]]:
    req = urllib.request.Request(f"http://127.0.0.1:{port}{path}", json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=WAIT_S) as resp:
            return resp.status, json.loads(resp.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read())


def get(port: int, path: str) -> dict[str, Any]:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}{path}", timeout=WAIT_S) as resp:
        return json.loads(resp.read())


@contextmanager
def serve_process(*extra: str) -> Iterator[tuple[subprocess.Popen, int, list[str]]]:
    """``specengine serve`` (the bundled pair, --k 3, then the ``extra`` flags) on a free
    port; its log is collected by a thread (so the pipe never fills)."""
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "specengine.cli", "serve", "--port", str(port), "--device",
         "cpu", "--kernel-backend", "torch", "--kv-cache-tokens", "4096", "--k", "3",
         "--shutdown-timeout", "0", *extra],
        stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        env=dict(os.environ, OMP_NUM_THREADS="1"))
    watchdog = threading.Timer(4 * WAIT_S, proc.kill)  # a hung server fails, not hangs CI
    watchdog.start()
    log: list[str] = []
    try:
        for raw in proc.stderr:  # type: ignore[union-attr]
            log.append(raw.decode())
            if "Uvicorn running on" in log[-1]:
                break
        else:
            raise AssertionError("server exited before listening:\n" + "".join(log))
        reader = threading.Thread(target=lambda: log.extend(
            raw.decode() for raw in proc.stderr), daemon=True)  # type: ignore[union-attr]
        reader.start()
        yield proc, port, log
    finally:
        watchdog.cancel()
        if proc.poll() is None:
            proc.kill()
            proc.wait()
