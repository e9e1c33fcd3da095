"""Small helpers of the tests that use sockets and threads: a free loopback port, and a call
run in a background thread whose result (or error) is collected later."""

from __future__ import annotations

import socket
import threading
from collections.abc import Callable

WAIT_S = 60.0


def free_port() -> int:
    """A TCP port of 127.0.0.1 that nothing listens on (free when this returns)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class Background:
    """Run ``fn`` in a thread; ``finished`` is set once it returned or raised, and
    ``result()`` waits for it and returns (or raises) what it did."""

    def __init__(self, fn: Callable[[], object], timeout_s: float = 2 * WAIT_S) -> None:
        self.finished = threading.Event()
        self.timeout_s = timeout_s
        self._out: list[object] = []
        self._err: list[BaseException] = []

        def run() -> None:
            try:
                self._out.append(fn())
            except BaseException as exc:  # noqa: BLE001 - re-raised by result()
                self._err.append(exc)
            finally:
                self.finished.set()

        threading.Thread(target=run, daemon=True).start()

    def result(self) -> object:
        assert self.finished.wait(self.timeout_s), "background call did not return"
        if self._err:
            raise self._err[0]
        return self._out[0]
