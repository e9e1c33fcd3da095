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


class ThreadLearner:
    """A gloo ``WeightSender`` (rank 0 of ``world_size``) on a thread of this process: the
    constructor joins the group in the background (the engine joins meanwhile), ``send``
    broadcasts an update in the background, ``join`` waits for the last call and returns its
    error (None when it went through). ``send_kwargs`` go to every ``send``."""

    def __init__(self, port: int, world_size: int, timeout_s: float = WAIT_S,
                 **send_kwargs: object) -> None:
        from specengine.weights import WeightSender

        self.sender = None
        self.timeout_s = timeout_s
        self._send_kwargs = send_kwargs
        self._call = Background(lambda: setattr(self, "sender", WeightSender(
            "127.0.0.1", port, world_size=world_size, backend="gloo", timeout_s=timeout_s)),
            timeout_s)

    def send(self, named_tensors: object, version: int) -> None:
        self._call = Background(lambda: self.sender.send(  # type: ignore[union-attr]
            named_tensors, version, **self._send_kwargs), self.timeout_s)

    def join(self) -> BaseException | None:
        try:
            self._call.result()
        except AssertionError:
            raise
        except BaseException as e:  # noqa: BLE001 - the caller checks it
            return e
        return None
