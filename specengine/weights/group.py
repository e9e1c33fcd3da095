"""A process group of its own for weight sync, made from a TCP rendezvous.

Built directly on a ``TCPStore`` (as vLLM's stateless process group is), so neither the
learner's nor the engine's ``torch.distributed`` default group is created, required or
touched. Only tensor collectives are used (no ``*_object`` calls, which pickle); the errors
of a refused update are exchanged as UTF-8 bytes in a uint8 tensor.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from datetime import timedelta

import torch
import torch.distributed as dist

from specengine.weights.protocol import MAX_TIMEOUT_S, MAX_WORLD_SIZE, WeightSyncError

logger = logging.getLogger(__name__)

MAX_ERROR_BYTES = 1024
BACKENDS = ("gloo", "nccl")


class WeightGroup:
    """``world_size`` ranks (0: the learner, 1..: receivers) joined at ``master_address:
    master_port`` (rank 0 hosts the store). Blocks until every rank joined, or raises
    :class:`WeightSyncError` once ``timeout_s`` has passed (the store's rendezvous, the
    group's set-up and its first collective share that one deadline); every later
    collective has the same limit.
    After a transport failure the group is broken: close it and make a new one. ``device``:
    where NCCL buffers live (default: the current CUDA device); gloo uses the CPU."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 backend: str, timeout_s: float, device: torch.device | None = None) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if isinstance(world_size, bool) or not isinstance(world_size, int) or \
                not 2 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be an int in [2, {MAX_WORLD_SIZE}] (a sender "
                             f"and receivers), got {world_size!r}")
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < world_size:
            raise ValueError(f"rank must be an int in [0, {world_size}), got {rank!r}")
        if isinstance(master_port, bool) or not isinstance(master_port, int) or \
                not 0 <= master_port <= 65535:
            raise ValueError(f"master_port must be an int in [0, 65535], got {master_port!r}")
        if isinstance(timeout_s, bool) or not isinstance(timeout_s, (int, float)) or \
                not 0 < timeout_s <= MAX_TIMEOUT_S:  # (NaN fails the comparison too)
            raise ValueError(f"timeout_s must be a number of seconds in (0, {MAX_TIMEOUT_S:g}], "
                             f"got {timeout_s!r}")
        if backend == "nccl" and not torch.cuda.is_available():
            raise ValueError("backend='nccl' needs CUDA; use backend='gloo' on CPU")
        self.rank, self.world_size, self.backend = rank, world_size, backend
        self.timeout = timedelta(seconds=timeout_s)
        if backend == "gloo":
            self.device = torch.device("cpu")
        else:  # NCCL moves CUDA tensors: the engine's device, or the current one
            self.device = device or torch.device("cuda", torch.cuda.current_device())
        self.broken = False
        deadline = time.monotonic() + timeout_s
        try:
            if rank != 0:
                # A TCPStore client given timeout T retries its connect with a back-off and
                # takes about 2T to give up on a master that is not there yet (8 s asked:
                # 11-16 s taken), so wait for the port to listen against our own deadline
                # first: then its connect succeeds at once.
                _wait_listening(master_address, master_port, deadline)
            self._store = dist.TCPStore(master_address, master_port, world_size,
                                        is_master=rank == 0, timeout=_left(deadline),
                                        wait_for_workers=True)
            store = dist.PrefixStore("specengine/weight_sync", self._store)
            if backend == "gloo":
                # The set-up waits for the peers' addresses within what is left; later
                # collectives pass their own (full) timeout.
                self._pg = dist.ProcessGroupGloo(store, rank, world_size, _left(deadline))
            else:
                opts = dist.ProcessGroupNCCL.Options()
                opts._timeout = self.timeout
                self._pg = nccl_group(store, rank, world_size, opts)
            # One collective so that every rank has joined when the constructor returns.
            self.allreduce(torch.zeros(1, dtype=torch.int32, device=self.device),
                           timeout=_left(deadline))
        except (RuntimeError, dist.DistError, TimeoutError) as e:  # store errors, refused
            self.close()  # a store that came up would hold its port until collected
            raise WeightSyncError(f"weight-sync rendezvous at {master_address}:{master_port} "
                                  f"(rank {rank} of {world_size}, {backend}) failed within "
                                  f"{timeout_s:g} s: {e}") from e
        logger.info("weight-sync group up: rank %d of %d (%s)", rank, world_size, backend)

    def _run(self, what: str, work_fn: Callable[[], dist.Work],
             timeout: timedelta | None = None) -> None:
        if self.broken:
            raise WeightSyncError("the weight-sync group failed earlier: close it and create a "
                                  "new one")
        try:
            work_fn().wait(timeout or self.timeout)
        except (RuntimeError, dist.DistError) as e:
            self.broken = True
            raise WeightSyncError(f"weight-sync {what} failed (a peer died or the "
                                  f"{self.timeout.total_seconds():g} s timeout passed): {e}"
                                  ) from e

    def broadcast(self, tensor: torch.Tensor, src: int) -> None:
        """In place, from rank ``src``; ``tensor`` lives on :attr:`device`."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = src, 0, self.timeout
        self._run("broadcast", lambda: self._pg.broadcast([tensor], opts))

    def allreduce(self, tensor: torch.Tensor, timeout: timedelta | None = None) -> None:
        """Sum in place across ranks (within ``timeout``, default the group's)."""
        opts = dist.AllreduceOptions()
        opts.reduceOp, opts.timeout = dist.ReduceOp.SUM, timeout or self.timeout
        self._run("all-reduce", lambda: self._pg.allreduce([tensor], opts), timeout)

    def agree(self, error: str | None) -> list[str]:
        """Every rank passes its error (None: fine); every rank gets all of them, as
        ``"rank r: message"``. One all-reduce of a ``[world_size, MAX_ERROR_BYTES]`` byte
        matrix in which each rank fills only its own row: it is the group's ok flag and
        carries the reasons."""
        rows = torch.zeros(self.world_size, MAX_ERROR_BYTES, dtype=torch.uint8)
        if error:
            raw = error.encode()[: MAX_ERROR_BYTES - 1] or b"?"
            rows[self.rank, : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        rows = rows.to(self.device)
        self.allreduce(rows)
        out = []
        for r, row in enumerate(rows.cpu()):
            raw = bytes(row.tolist()).rstrip(b"\0")
            if raw:
                out.append(f"rank {r}: {raw.decode(errors='replace')}")
        return out

    def learner_gone(self) -> str:
        """Why rank 0 (the learner) is gone, "" while it answers (see :func:`store_gone`);
        for a receiver."""
        return store_gone(self._store, self.timeout)

    def close(self) -> None:
        """Tear the group down (idempotent)."""
        pg = getattr(self, "_pg", None)
        if pg is not None:
            try:
                pg.shutdown()
            except (RuntimeError, AttributeError) as e:  # already torn down by a failure
                logger.debug("weight-sync group shutdown: %s", e)
        self._pg = None
        self._store = None


#: how long a liveness probe of the learner's store may take (a live store answers in micro-
#: seconds; a dead one's connection fails at once)
PROBE_TIMEOUT = timedelta(seconds=5)


def store_gone(store: dist.Store | None, timeout: timedelta) -> str:
    """Why the learner that hosts ``store`` (a ``TCPStore`` client joined to it) is gone, or
    "" while it answers. The probe goes over the connection made at the join, not a new one:
    a restarted learner may listen on the same port, and only the old connection tells that
    the old learner died (its reads fail at once). ``timeout``: the store's own, restored."""
    if store is None:
        return "the group is closed"
    store.set_timeout(PROBE_TIMEOUT)
    try:
        store.num_keys()
    except (RuntimeError, dist.DistError) as e:
        return str(e).splitlines()[0] if str(e) else type(e).__name__
    finally:
        store.set_timeout(timeout)
    return ""


def _left(deadline: float) -> timedelta:
    """The time left until ``deadline`` (a few ms at least: a zero timeout means "none" to
    some of torch's waits)."""
    return timedelta(seconds=max(deadline - time.monotonic(), 0.01))


def _wait_listening(address: str, port: int, deadline: float) -> None:
    """Return once ``address:port`` accepts a TCP connection; ``TimeoutError`` at
    ``deadline``. The probe connection is closed at once (the store's server drops a client
    that never speaks)."""
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"nobody listens at {address}:{port} (is the learner's "
                               "WeightSender up?)")
        try:
            with socket.create_connection((address, port), timeout=min(left, 1.0)):
                return
        except OSError:
            time.sleep(min(0.05, max(deadline - time.monotonic(), 0)))


def nccl_group(store: dist.Store, rank: int, world_size: int,
                opts: dist.ProcessGroupNCCL.Options) -> dist.ProcessGroup:
    """A ``ProcessGroupNCCL`` made under :func:`nccl_errors_not_fatal`."""
    with nccl_errors_not_fatal():
        return dist.ProcessGroupNCCL(store, rank, world_size, opts)


@contextmanager
def nccl_errors_not_fatal() -> Iterator[None]:
    """Around the construction of a ``ProcessGroupNCCL``: its watchdog, on a timed-out or
    failed collective, aborts the communicator but does not take the process down (its
    default, 3, does): the dead peer must surface as this group's error in ``wait``, with
    the engine still serving on its old weights. The mode is read in the constructor, so it
    is set for that group only."""
    key = "TORCH_NCCL_ASYNC_ERROR_HANDLING"
    prev = os.environ.get(key)
    os.environ[key] = "2"  # CleanUpOnly
    try:
        yield
    finally:
        if prev is None:
            del os.environ[key]
        else:
            os.environ[key] = prev
