"""Weight operations split around the step loop (docs/design.md §4, "off the step loop").

What may wait (a rendezvous with a learner that is not up yet, a transfer over the network,
reading and checking a checkpoint) runs in a *stage* on any thread, beside ``engine.step()``:
it only reads the engine's parameter shapes, version and group, and writes into buffers of
its own. What changes the engine (the in-place copy of a checked update, the version bump,
attaching a joined group) is the *commit*, which must run on the thread that steps the engine,
between two steps (``AsyncSpecEngine.run_in_engine``)::

    staged = engine.stage_weights_from_distributed()        # any thread
    version = await aeng.run_in_engine(lambda e: e.commit_staged(staged))

Where no stage can be taken apart from the commit, the stage only takes the lock and the
whole operation runs in the commit: ``staging="none"`` (the transfer writes the parameters)
and a tensor-parallel engine (its ranks follow rank 0's commands over the channel the step
loop uses).

One weight operation at a time: a stage takes the engine's weight lock and holds it until
its commit or :meth:`StagedUpdate.discard`; any other weight operation meanwhile (stage or
synchronous method, incl. closing the group) is refused with a ``RuntimeError`` (the
server's 409) rather than queued, since a caller queued behind a transfer that times out
would wait twice its timeout. So neither the version nor the group can change between a
stage and its commit.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from collections.abc import Iterator

    from specengine.engine import SpecEngine

logger = logging.getLogger(__name__)


class WeightLock:
    """The engine's one-weight-operation-at-a-time lock; never waited on by default (the
    engine thread must not block behind a transfer)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self.holder = ""  # what holds it, for the refusal's message

    def acquire(self, what: str, wait_s: float = 0.0) -> None:
        """Take it for ``what``, or raise ``RuntimeError`` naming the operation in progress
        (after waiting up to ``wait_s``)."""
        ok = self._lock.acquire(timeout=wait_s) if wait_s > 0 else \
            self._lock.acquire(blocking=False)
        if not ok:
            raise RuntimeError(f"another weight operation is in progress ({self.holder}): "
                               f"{what} is refused; retry once it has finished")
        self.holder = what

    def release(self) -> None:
        self.holder = ""
        self._lock.release()

    @contextmanager
    def held(self, what: str) -> Iterator[None]:
        self.acquire(what)
        try:
            yield
        finally:
            self.release()


class StagedUpdate:
    """A weight operation whose waiting part is done: commit it with
    ``engine.commit_staged`` between two steps, or :meth:`discard` it. It holds the engine's
    weight lock until then."""

    def __init__(self, what: str, lock: WeightLock, apply: Callable[[SpecEngine], Any],
                 drop: Callable[[], None] | None = None) -> None:
        self.what = what
        self._lock = lock
        self._apply: Callable[[SpecEngine], Any] | None = apply
        self._drop = drop

    @property
    def pending(self) -> bool:
        """Neither committed nor discarded yet."""
        return self._apply is not None

    def commit(self, engine: SpecEngine) -> Any:
        """Run the commit (``engine.commit_staged``); the lock is released however it ends,
        and a commit that raises drops what was staged (a joined group is left)."""
        apply = self._apply
        if apply is None:
            raise RuntimeError(f"this staged {self.what} was already committed or discarded")
        self._apply = None
        try:
            result = apply(engine)
        except BaseException:
            self._run_drop()
            raise
        finally:
            self._lock.release()
        self._drop = None
        return result

    def discard(self) -> None:
        """Drop what was staged (leave a joined group, free a staged copy) and release the
        lock; idempotent, a no-op after a commit."""
        if self._apply is None:
            return
        self._apply = None
        try:
            self._run_drop()
        finally:
            self._lock.release()

    def _run_drop(self) -> None:
        drop, self._drop = self._drop, None
        if drop is not None:
            try:
                drop()
            except Exception:  # noqa: BLE001 - clean-up of an update that failed anyway
                logger.exception("dropping a staged %s failed", self.what)


def staged(engine: SpecEngine, what: str, stage: Callable[[], tuple[
        Callable[[SpecEngine], Any], Callable[[], None] | None]]) -> StagedUpdate:
    """Take the engine's weight lock for ``what``, run ``stage()`` (which returns the commit
    and the clean-up) and wrap the result; the lock is released if the stage raises."""
    lock: WeightLock = engine.weight_lock
    lock.acquire(what)
    try:
        apply, drop = stage()
    except BaseException:
        lock.release()
        raise
    return StagedUpdate(what, lock, apply, drop)


__all__ = ["StagedUpdate", "WeightLock", "staged"]
