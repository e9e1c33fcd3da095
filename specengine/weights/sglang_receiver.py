"""Engine side of SGLang's weight-update protocol: a named group and one broadcast per tensor.

What RL frameworks that drive SGLang (slime, AReaL, verl, OpenRLHF, SkyRL) do, learner side:

1. ``POST /init_weights_update_group`` (``master_address``, ``master_port``, ``rank_offset``,
   ``world_size``, ``group_name``, ``backend``) and, at the same time, make a process group
   as SGLang's ``init_custom_process_group`` does: rendezvous at
   ``tcp://master_address:master_port`` as rank 0 (which hosts the ``TCPStore``), the store
   prefixed by ``group_name``, and torch's group constructor under that name;
2. per update, ``POST /update_weights_from_distributed`` (``names``, ``dtypes``, ``shapes``,
   ``group_name``) and, at the same time, ``torch.distributed.broadcast(tensor, src=0,
   group=group)`` of each named tensor, in order.

:class:`NamedGroup` joins such a group as rank ``rank_offset`` the same way (torch's own
constructor, so the store keys are whatever torch uses, equal on both sides for the same
torch). Over NCCL the engine must be on CUDA in a torch with NCCL (refused before the
rendezvous otherwise), tensors are received on the engine's device, the communicator is made
lazily by the first broadcast (as SGLang's), and a dead learner aborts the communicator without
taking the server down (``group.nccl_errors_not_fatal``).

:func:`stage_broadcast_update` receives one update off the step loop, all or nothing:

- the names, dtypes and shapes are checked against the model (``check_entries``, the rules of
  every other update path) before any byte arrives;
- a refused update still receives every broadcast it announced, into a scratch buffer that is
  dropped (a *drain*), so the learner's broadcasts return and the group stays in step for the
  next update;
- an accepted one is received into fresh tensors (the staging copy), checked for NaN / Inf,
  and copied into the parameters by the commit, between two steps (``load_in_process``:
  in place, version bumped; tensor parallelism included).

An update whose tensor sizes cannot be known (a dtype torch does not have, a negative or
absurd dimension, lists of different lengths) cannot be drained: it is refused and the group
is marked out of step (destroy it and init a new one); the learner's broadcasts then fail on
its own timeout.
"""

from __future__ import annotations

import inspect
import logging
import math
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d

from specengine.model.config import CheckpointError
from specengine.model.loader import check_entries, format_errors
from specengine.model.weight_names import hf_named_tensors
from specengine.weights.finite import check_finite_tensors
from specengine.weights.group import nccl_errors_not_fatal, store_gone
from specengine.weights.protocol import MAX_TIMEOUT_S, MAX_WORLD_SIZE, WeightSyncError
from specengine.weights.receiver import check_allowed, load_in_process, update_target

if TYPE_CHECKING:
    from specengine.engine import SpecEngine

logger = logging.getLogger(__name__)

BACKENDS = ("gloo", "nccl")
#: a refused tensor is drained into a scratch buffer; one larger than this many times the
#: model's largest parameter (and 1 GiB) is no weight of a related model: not drained
DRAIN_FACTOR = 4
MIN_DRAIN_BYTES = 1 << 30


def parse_dtype(name: object) -> torch.dtype | None:
    """``"bfloat16"`` or ``"torch.bfloat16"`` (how learners write ``str(tensor.dtype)``) as a
    torch dtype; None for anything else."""
    if not isinstance(name, str):
        return None
    dtype = getattr(torch, name.removeprefix("torch."), None)
    return dtype if isinstance(dtype, torch.dtype) else None


class NamedGroup:
    """Rank ``rank`` of ``world_size`` in the group named ``group_name`` whose rank 0 (the
    learner) hosts the rendezvous at ``master_address:master_port``. Blocks until every rank
    joined; :class:`WeightSyncError` once ``timeout_s`` has passed (also the limit of every
    later broadcast). Registered in this process's ``torch.distributed`` state under its name
    (as SGLang's group is); :meth:`close` unregisters it."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 group_name: str, backend: str, timeout_s: float,
                 device: torch.device) -> None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
        if not 2 <= world_size <= MAX_WORLD_SIZE:
            raise ValueError(f"world_size must be in [2, {MAX_WORLD_SIZE}] (the learner and "
                             f"the engines), got {world_size}")
        if not 1 <= rank < world_size:
            raise ValueError(f"rank_offset must be in [1, world_size={world_size}) (rank 0 is "
                             f"the learner), got {rank}")
        if not group_name:
            raise ValueError("group_name must be a non-empty string")
        if not 0 < timeout_s <= MAX_TIMEOUT_S:
            raise ValueError(f"timeout_s must be in (0, {MAX_TIMEOUT_S:g}], got {timeout_s!r}")
        if backend == "nccl":
            # Checked before the rendezvous: a group that cannot be made must not leave the
            # learner waiting in its own half of it (nor leave a name or store behind here).
            why = [w for bad, w in (
                (device.type != "cuda", f"the engine runs on {device.type}, and NCCL moves "
                                        "CUDA tensors"),
                (not dist.is_nccl_available(), "this torch was built without NCCL")) if bad]
            if why:
                raise ValueError(f"backend='nccl' cannot be used here: {'; '.join(why)}; use "
                                 "backend='gloo'")
        self.rank, self.world_size, self.name, self.backend = rank, world_size, group_name, backend
        self.timeout = timedelta(seconds=timeout_s)
        self.device = device if backend == "nccl" else torch.device("cpu")
        self.out_of_step = ""  # why the group cannot be used any more ("" while it can)
        if group_name in c10d._world.pg_names.values():
            raise ValueError(f"a process group named {group_name!r} already exists in this "
                             "process: destroy it first or use another group_name")
        host = f"[{master_address}]" if ":" in master_address else master_address
        try:
            store, rank, world_size = next(c10d.rendezvous(
                f"tcp://{host}:{master_port}", rank, world_size, timeout=self.timeout))
            store.set_timeout(self.timeout)
            self._store = store  # the learner's: probed by learner_gone
            store = dist.PrefixStore(group_name, store)
            # torch renamed pg_options to backend_options (2.6); pass whichever it takes.
            params = inspect.signature(c10d._new_process_group_helper).parameters
            options = "backend_options" if "backend_options" in params else "pg_options"
            # No device_id (as SGLang's group): with one, NCCL would connect eagerly, here,
            # and this call would wait for the learner's side of ncclCommInitRank, which a
            # learner that awaits this endpoint's answer first only reaches at its first
            # broadcast. Without it the communicator is made by the first broadcast, on the
            # device of the tensor it receives (``device``, the engine's).
            with nccl_errors_not_fatal():  # a dead learner is this group's error, not ours
                self.pg, _ = c10d._new_process_group_helper(
                    world_size, rank, [], dist.Backend(backend), store, group_name=group_name,
                    timeout=self.timeout, **{options: None})
            c10d._world.pg_group_ranks[self.pg] = {i: i for i in range(world_size)}
        except (RuntimeError, dist.DistError, TimeoutError, ValueError) as e:
            raise WeightSyncError(
                f"joining weight-update group {group_name!r} at {master_address}:{master_port} "
                f"as rank {rank} of {world_size} ({backend}) failed within {timeout_s:g} s: "
                f"{e}") from e
        logger.info("joined weight-update group %r as rank %d of %d (%s)", group_name, rank,
                    world_size, backend)

    def broadcast(self, tensor: torch.Tensor) -> None:
        """Receive ``tensor`` (on :attr:`device`) from rank 0; a failure (a dead learner, the
        timeout) leaves the group out of step."""
        if self.out_of_step:
            raise WeightSyncError(f"weight-update group {self.name!r} is out of step "
                                  f"({self.out_of_step}): destroy it and init a new one")
        try:
            work = dist.broadcast(tensor, src=0, group=self.pg, async_op=True)
            work.wait(self.timeout)
        except (RuntimeError, dist.DistError) as e:
            self.out_of_step = f"a broadcast failed: {e}"
            raise WeightSyncError(f"receiving from the learner over group {self.name!r} "
                                  f"failed (a dead learner, or the "
                                  f"{self.timeout.total_seconds():g} s timeout): {e}") from e

    def learner_gone(self) -> str:
        """Why the learner (rank 0, which hosts the store) is gone; "" while it answers."""
        return store_gone(getattr(self, "_store", None), self.timeout)

    def close(self) -> None:
        """Leave and unregister the group (idempotent)."""
        pg, self.pg = getattr(self, "pg", None), None
        if pg is None:
            return
        try:
            dist.destroy_process_group(pg)
        except (RuntimeError, ValueError, KeyError) as e:  # torn down by a failure already
            logger.debug("destroying weight-update group %r: %s", self.name, e)


def _numel(shape: Sequence[int]) -> int:
    return math.prod(shape)


def drain_limit(engine: SpecEngine) -> int:
    largest = getattr(engine, "largest_weight_bytes", None)  # (known while weights sleep)
    if largest is None:
        module, _ = update_target(engine, "policy")
        largest = max((t.nbytes for t in hf_named_tensors(module).values()), default=0)
    return max(DRAIN_FACTOR * largest, MIN_DRAIN_BYTES)


def stage_broadcast_update(engine: SpecEngine, group: NamedGroup, names: Sequence[str],
                           dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
                           version: int | None, check_finite: bool = True
                           ) -> Callable[[SpecEngine], int]:
    """Receive one update (the learner broadcasts ``names[i]`` as a tensor of ``dtypes[i]``
    and ``shapes[i]``, in order) and return its commit (``commit(engine)`` copies it in and
    returns the new version; run it between two steps). Reads only the engine's parameter
    shapes, dtypes and version, so it may run beside ``engine.step()`` (under the engine's
    weight lock). Raises ``ValueError`` / ``CheckpointError`` / :class:`WeightSyncError`
    naming what is wrong, with every announced broadcast received (drained) where the sizes
    are known; nothing of the engine is changed."""
    if group.out_of_step:
        raise WeightSyncError(f"weight-update group {group.name!r} is out of step "
                              f"({group.out_of_step}): destroy it and init a new one")
    meta, why = announced_sizes(names, dtypes, shapes, drain_limit(engine))
    if why:  # nothing can be drained: the learner's next broadcast lands nowhere
        group.out_of_step = f"an update that could not be drained was refused: {why}"
        raise ValueError(f"update refused and not drained, the group {group.name!r} is now "
                         f"out of step (destroy it and init a new one): {why}")
    refusal: Exception | None = None
    try:
        check_allowed(engine, version)
        module, tied = update_target(engine, "policy")
        _, errors = check_entries(module, ((n, s, d) for n, d, s in meta), strict=False,
                                  tied=tied)
        if errors:
            raise CheckpointError(format_errors(errors))
    except (ValueError, CheckpointError) as e:
        refusal = e
    if refusal is not None:
        _drain(group, meta)
        logger.warning("refused a weight update over group %r (its %d broadcasts drained): %s",
                       group.name, len(meta), refusal)
        raise refusal
    received = []
    for name, dtype, shape in meta:
        t = torch.empty(shape, dtype=dtype, device=group.device)
        group.broadcast(t)
        received.append((name, t))
    if check_finite:
        check_finite_tensors(received)  # WeightSyncError naming the first bad tensor
    return lambda e: load_in_process(e, received, "policy", version, check_finite=False)


def announced_sizes(names: Sequence[str], dtypes: Sequence[str], shapes: Sequence[Sequence[int]],
           limit: int) -> tuple[list[tuple[str, torch.dtype, tuple[int, ...]]], str]:
    """``(name, dtype, shape)`` of each announced tensor, or why their sizes are unknown."""
    if not len(names) == len(dtypes) == len(shapes):
        return [], (f"names, dtypes and shapes must have the same length, got {len(names)}, "
                    f"{len(dtypes)} and {len(shapes)}")
    meta = []
    for name, dtype_name, shape in zip(names, dtypes, shapes):
        dtype = parse_dtype(dtype_name)
        if dtype is None:
            return [], f"{name}: {dtype_name!r} is not a torch dtype"
        shape = tuple(shape)
        if any(s < 0 for s in shape):
            return [], f"{name}: negative dimension in shape {list(shape)}"
        nbytes = _numel(shape) * dtype.itemsize
        if nbytes > limit:
            return [], (f"{name}: {nbytes} bytes, more than {limit} (no weight of this "
                        "model's size)")
        meta.append((name, dtype, shape))
    return meta, ""


def _drain(group: NamedGroup, meta: list[tuple[str, torch.dtype, tuple[int, ...]]]) -> None:
    """Receive every announced tensor into one reused scratch buffer and drop it."""
    sizes = [_numel(s) * d.itemsize for _, d, s in meta]
    scratch = torch.empty(max(sizes, default=0), dtype=torch.uint8, device=group.device)
    for (_, dtype, shape), nbytes in zip(meta, sizes):
        # A fresh allocation is aligned for every dtype; the view has the learner's layout.
        group.broadcast(scratch[:nbytes].view(dtype).view(shape))


__all__ = ["NamedGroup", "parse_dtype", "stage_broadcast_update"]
