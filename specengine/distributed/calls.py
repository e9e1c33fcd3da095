"""Waiting on the pool's Ray calls: every wait bounded, every failure named by its worker."""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

import ray
from ray.exceptions import GetTimeoutError, RayActorError, RayTaskError

RESTART_HINT = " (restart_worker(i) brings worker i back)"


class WorkerDiedError(RuntimeError):
    """A rollout worker's actor died (killed, crashed, its node lost). The message names the
    worker and its actor; ``RolloutPool.restart_worker(index)`` brings it back."""

    def __init__(self, message: str, indices: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.indices = tuple(indices)


class DonorDiedError(RuntimeError):
    """The live worker whose weights a restarted worker was copying died meanwhile."""


def unwrap(error: RayTaskError) -> BaseException:
    """The exception a worker's method raised (``ValueError``, ``WeightSyncError`` ...), not
    Ray's wrapper: callers catch what the engine itself raises."""
    cause = getattr(error, "cause", None)
    return cause if isinstance(cause, Exception) else error


class PoolCall:
    """Calls on several workers that run concurrently. :meth:`result` waits for all of them
    (so no worker is left busy behind an error), then raises a :class:`WorkerDiedError` naming
    every worker that died, else the first worker's own error, else returns
    ``combine(results)`` (results in worker order)."""

    def __init__(self, refs: Sequence[tuple[int, ray.ObjectRef]], what: str,
                 describe: Callable[[int], str], on_died: Callable[[int, str], None],
                 combine: Callable[[list[Any]], Any] = list,
                 timeout_s: float | None = None, hint: str = RESTART_HINT) -> None:
        self.refs, self.what, self.timeout_s, self.hint = list(refs), what, timeout_s, hint
        self._describe, self._on_died, self._combine = describe, on_died, combine
        self._done = False

    def result(self, timeout_s: float | None = None) -> Any:
        """Wait (at most ``timeout_s``, default the pool's) and return the combined result;
        a call that does not finish in time raises ``TimeoutError`` naming the workers."""
        if self._done:
            raise RuntimeError(f"the result of {self.what} was already taken")
        self._done = True
        limit = self.timeout_s if timeout_s is None else timeout_s
        deadline = None if limit is None else time.monotonic() + limit
        results, died, reasons, errors, late = [], [], [], [], []
        for index, ref in self.refs:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                results.append(ray.get(ref, timeout=left))
            except GetTimeoutError:
                late.append(index)
            except RayActorError as e:
                reason = _first_line(e)
                reasons.append(f"{self._describe(index)} died: {reason}")
                died.append(index)
                self._on_died(index, reason)
            except RayTaskError as e:
                errors.append(unwrap(e))
        if died:
            raise WorkerDiedError(f"{self.what}: " + "; ".join(reasons) + self.hint, died)
        if late:
            names = ", ".join(self._describe(i) for i in late)
            raise TimeoutError(f"{self.what}: no answer from {names} within {limit:g} s (still "
                               "running there; later calls to it wait behind it)")
        if errors:
            raise errors[0]
        return self._combine(results)


def _first_line(error: RayActorError) -> str:
    """Ray's message without its stack of actor details: the reason it gives last."""
    lines = [ln.strip() for ln in str(error).splitlines() if ln.strip()]
    return lines[-1] if lines else type(error).__name__


__all__ = ["DonorDiedError", "PoolCall", "WorkerDiedError", "unwrap"]
