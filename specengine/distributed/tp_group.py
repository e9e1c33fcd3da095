"""The process groups of one tensor-parallel engine and its lockstep command channel.

Every rank is a process of the same host, rendezvoused through a ``FileStore`` in a private
temporary directory (no port to pick, nothing reachable from outside), as two groups of their
own (neither touches the process's default ``torch.distributed`` group, as the weight-sync group
does not): a gloo *control* group over which rank 0 broadcasts each command (pickled: both ends
are this engine's own processes) and the ranks' replies travel, and a *compute* group (gloo on
CPU, NCCL on CUDA) for the layers' all-reduces and gathers.

Lockstep: rank 0 runs the engine; when it enters a sharded call on its own (the model's forward,
the embedding, the LM head; :meth:`TPGroup.entry`) it first broadcasts ``(op, args)``, and the
workers, which wait in :meth:`TPGroup.recv_command`, run the same call, so the collectives
inside match. Nested calls (the embedding inside the forward) send nothing.
"""

from __future__ import annotations

import logging
import pickle
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import fields, is_dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

MAGIC = 0x7E45
#: a worker waits this long for rank 0's next command (an idle engine); rank 0's death is
#: noticed sooner, by the worker's parent watchdog or the closed connection
IDLE_TIMEOUT = timedelta(days=7)
UP_POLL_S = 0.5


class TensorParallelError(RuntimeError):
    """A tensor-parallel rank failed, or a collective timed out: the engine cannot go on."""


def to_cpu(obj: Any) -> Any:
    """``obj`` with every tensor on the CPU (commands are pickled); dataclasses become
    ``(type, fields)`` pairs rebuilt by :func:`to_device`."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(x) for x in obj)
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if is_dataclass(obj) and not isinstance(obj, type):
        return ("__dataclass__", type(obj), {f.name: to_cpu(getattr(obj, f.name))
                                             for f in fields(obj)})
    return obj


def to_device(obj: Any, device: torch.device) -> Any:
    """Undo :func:`to_cpu` on ``device``."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple) and len(obj) == 3 and obj[0] == "__dataclass__":
        return obj[1](**{k: to_device(v, device) for k, v in obj[2].items()})
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(x, device) for x in obj)
    if isinstance(obj, dict):
        return {k: to_device(v, device) for k, v in obj.items()}
    return obj


class TPGroup:
    """Rank ``rank`` of ``world_size`` (0: the engine's process)."""

    def __init__(self, store_dir: str | Path, rank: int, world_size: int,
                 device: torch.device, timeout_s: float,
                 exit_codes: Callable[[], list[int | None]] | None = None) -> None:
        """``exit_codes`` (rank 0): the workers' exit codes (None while running), polled
        while they come up, so a worker that fails to start is reported at once."""
        self.rank, self.world_size, self.device = rank, world_size, device
        self.timeout = timedelta(seconds=timeout_s)
        self.in_lockstep = rank != 0  # a worker only ever runs calls rank 0 started
        self.broken = False
        self._store = dist.FileStore(str(Path(store_dir) / "store"), world_size)
        self._store.set_timeout(self.timeout)
        if rank:
            self._store.set(f"up/{rank}", "1")
        elif exit_codes is not None:
            self._wait_up(exit_codes, timeout_s)
        self._ctl = dist.ProcessGroupGloo(dist.PrefixStore("ctl", self._store), rank,
                                          world_size, self.timeout)
        compute_store = dist.PrefixStore("compute", self._store)
        if device.type == "cuda":
            from specengine.weights.group import nccl_group

            opts = dist.ProcessGroupNCCL.Options()
            opts._timeout = self.timeout
            self._pg = nccl_group(compute_store, rank, world_size, opts)
        else:
            self._pg = dist.ProcessGroupGloo(compute_store, rank, world_size, self.timeout)

    def _wait_up(self, exit_codes: Callable[[], list[int | None]], timeout_s: float) -> None:
        keys = [f"up/{r}" for r in range(1, self.world_size)]
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                self._store.wait(keys, timedelta(seconds=UP_POLL_S))
                return
            except (RuntimeError, dist.DistError):
                pass
            dead = [(r + 1, c) for r, c in enumerate(exit_codes()) if c is not None]
            if dead:
                raise TensorParallelError(f"tensor-parallel ranks exited while starting (rank, "
                                          f"exit code): {dead}")
            if time.monotonic() > deadline:
                raise TensorParallelError(f"tensor-parallel ranks did not start within "
                                          f"{timeout_s:g} s")

    # ---- collectives -----------------------------------------------------------------
    def _wait(self, what: str, work: dist.Work, timeout: timedelta | None = None) -> None:
        if self.broken:
            raise TensorParallelError("a tensor-parallel collective failed earlier: close the "
                                      "engine and make a new one")
        try:
            work.wait(timeout or self.timeout)
        except (RuntimeError, dist.DistError) as e:
            self.broken = True
            raise TensorParallelError(f"tensor-parallel {what} failed on rank {self.rank} (a "
                                      f"rank died or the {self.timeout.total_seconds():g} s "
                                      f"timeout passed): {e}") from e

    def all_reduce(self, t: torch.Tensor) -> None:
        """Sum ``t`` over ranks, in place."""
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._wait("all-reduce", self._pg.allreduce([t], opts))

    def all_gather_last(self, t: torch.Tensor) -> torch.Tensor:
        """Every rank's ``t`` concatenated along the last dim, in rank order."""
        t = t.contiguous()
        outs = [torch.empty_like(t) for _ in range(self.world_size)]
        self._wait("all-gather", self._pg.allgather([outs], [t]))
        return torch.cat(outs, dim=-1)

    def _ctl_broadcast(self, t: torch.Tensor, timeout: timedelta | None = None) -> None:
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor = 0, 0
        opts.timeout = timeout or self.timeout
        self._wait("command broadcast", self._ctl.broadcast([t], opts), opts.timeout)

    # ---- commands ----------------------------------------------------------------------
    def send_command(self, op: str, *args: Any) -> None:
        """Rank 0: tell every worker to run ``op(*args)``."""
        if self._ctl is None:
            raise TensorParallelError("the tensor-parallel ranks were shut down (engine.close())")
        raw = pickle.dumps((op, to_cpu(args)), protocol=pickle.HIGHEST_PROTOCOL)
        self._ctl_broadcast(torch.tensor([MAGIC, len(raw)], dtype=torch.int64))
        self._ctl_broadcast(torch.frombuffer(bytearray(raw), dtype=torch.uint8))

    def recv_command(self) -> tuple[str, tuple[Any, ...]]:
        """A worker: the next command (waits as long as the engine idles)."""
        header = torch.zeros(2, dtype=torch.int64)
        self._ctl_broadcast(header, IDLE_TIMEOUT)
        magic, size = header.tolist()
        if magic != MAGIC or size <= 0:
            raise TensorParallelError(f"bad tensor-parallel command header {header.tolist()}")
        payload = torch.empty(size, dtype=torch.uint8)
        self._ctl_broadcast(payload)
        op, args = pickle.loads(payload.numpy().tobytes())
        return op, to_device(args, self.device)

    def exchange(self, reply: Any) -> list[Any]:
        """Every rank passes a (picklable) reply; rank 0 gets them all, in rank order
        (workers get them too). Two all-reduces: the sizes, then a byte matrix in which each
        rank fills its own row."""
        raw = pickle.dumps(reply, protocol=pickle.HIGHEST_PROTOCOL)
        sizes = torch.zeros(self.world_size, dtype=torch.int64)
        sizes[self.rank] = len(raw)
        opts = dist.AllreduceOptions()
        opts.reduceOp = dist.ReduceOp.SUM
        self._wait("reply exchange", self._ctl.allreduce([sizes], opts))
        rows = torch.zeros(self.world_size, int(sizes.max()), dtype=torch.uint8)
        rows[self.rank, : len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        self._wait("reply exchange", self._ctl.allreduce([rows], opts))
        return [pickle.loads(rows[r, : int(sizes[r])].numpy().tobytes())
                for r in range(self.world_size)]

    def call(self, op: str, *args: Any, reply: Any = None) -> list[Any]:
        """Rank 0: run ``op`` on every worker and collect the replies (``reply`` is rank 0's
        own, first in the list)."""
        self.send_command(op, *args)
        return self.exchange(reply)

    @contextmanager
    def entry(self, op: str, *args: Any) -> Iterator[None]:
        """Around a sharded call: on rank 0 outside lockstep, broadcast ``(op, args)`` first so
        the workers run the same call; elsewhere nothing."""
        if self.in_lockstep:
            yield
            return
        self.send_command(op, *args)
        self.in_lockstep = True
        try:
            yield
        except BaseException:
            # The workers may now wait in a collective rank 0 never reaches.
            self.broken = True
            raise
        finally:
            self.in_lockstep = False

    def close(self) -> None:
        for name in ("_pg", "_ctl"):
            pg = getattr(self, name, None)
            if pg is not None:
                try:
                    pg.shutdown()
                except (RuntimeError, AttributeError) as e:
                    logger.debug("tensor-parallel group shutdown: %s", e)
            setattr(self, name, None)
        self._store = None


__all__ = ["TPGroup", "TensorParallelError", "to_cpu", "to_device"]
