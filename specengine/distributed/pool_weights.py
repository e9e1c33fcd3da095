"""The weight side of ``RolloutPool``: the learner's group, updates, restarting a worker.

The workers join the learner's weight-sync group (``specengine.weights``) as ranks
``1 .. num_workers`` of ``1 + num_workers``; the learner's ``WeightSender`` is rank 0 and one
``send`` broadcasts to all of them (the protocol's broadcasts and agreements span every rank).
A restarted worker gets the current weights from a live worker, exactly (docs/design.md
§12).
"""

from __future__ import annotations

import logging
from typing import Any

import ray
import torch

from specengine.distributed.calls import DonorDiedError, PoolCall

logger = logging.getLogger(__name__)


class PoolWeights:
    """Mixed into ``RolloutPool``, whose state it shares: the fields below and those set in
    :meth:`_init_weights`, and the pool's ``_call``, ``_check_open``, ``_start``,
    ``_mark_dead`` and ``describe``."""

    num_workers: int
    _workers: list[Any]
    _dead: dict[int, str]
    _resources: dict[str, Any]
    _kwargs: dict[str, Any]  # the workers' engine_kwargs

    def _init_weights(self) -> None:
        self._version = 0
        self._updated: set[str] = set()  # which ("policy", "draft") updates changed
        self._group: tuple[str, int, str, float] | None = None
        self._group_stale: set[int] = set()  # restarted workers that are not in the group

    @property
    def weight_version(self) -> int:
        """The version the last update through the pool gave every worker (a worker restarted
        with ``fresh=True`` holds 0 until the next update: :meth:`worker_weight_versions`)."""
        return self._version

    def worker_weight_versions(self) -> list[int]:
        """Each worker's own ``engine.weight_version``, asked now."""
        return self._call("weight_version", range(self.num_workers), "weight_version").result()

    @property
    def weight_group_world_size(self) -> int:
        """The learner's ``WeightSender`` world size: itself (rank 0) + one rank per worker,
        or per tensor-parallel rank of each worker (``engine_kwargs["tensor_parallel_size"]``:
        every rank receives the broadcast itself)."""
        return 1 + self.num_workers * self._tensor_parallel_size

    @property
    def _tensor_parallel_size(self) -> int:
        return int(self._kwargs.get("tensor_parallel_size", 1))

    def init_weight_update_group(self, master_address: str, master_port: int,
                                 backend: str | None = None, *, timeout_s: float = 120.0,
                                 wait: bool = True) -> PoolCall | None:
        """Join every worker to the learner's weight-sync group: worker ``i`` is rank ``1 + i``
        of ``1 + num_workers`` (the learner's ``WeightSender`` is rank 0); with tensor
        parallelism of size N, ranks ``1 + i*N .. i*N + N`` of ``1 + num_workers * N``. The
        rendezvous needs the learner at the same time: from another thread or process, or pass
        ``wait=False``, create the sender, then call ``.result()`` on what this returns.
        ``backend`` None: NCCL when the workers have GPUs, else gloo."""
        if backend is None:
            backend = "nccl" if self._resources.get("num_gpus") else "gloo"
        world = self.weight_group_world_size
        self._group = None  # until every worker joined

        def joined(_: list[None]) -> None:
            self._group = (master_address, master_port, backend, timeout_s)
            self._group_stale.clear()

        call = self._call("init_weight_update_group", range(self.num_workers),
                          "init_weight_update_group", per_worker=[
                              (master_address, master_port, 1 + i * self._tensor_parallel_size,
                               world, backend, timeout_s)
                              for i in range(self.num_workers)], combine=joined)
        return call.result() if wait else call

    def update_weights_from_distributed(self, which: str = "policy", *, staging: str = "auto",
                                        wait: bool = True) -> int | PoolCall:
        """Every worker receives the learner's next ``send`` at once; returns the new version
        (the same on all). Run it while the learner sends (another thread or process), or pass
        ``wait=False``, call ``sender.send(...)``, then ``.result()`` on what this returns.
        A refused update raises the engines' ``WeightSyncError`` and changes nothing."""
        if self._group is None:
            raise RuntimeError("no weight-update group: call init_weight_update_group first")
        if self._group_stale:
            names = ", ".join(self.describe(i) for i in sorted(self._group_stale))
            raise RuntimeError(f"{names} restarted after the weight-update group was made, so "
                               "the group lost a rank: make a new WeightSender and call "
                               "init_weight_update_group again")

        def combine(versions: list[int]) -> int:
            if len(set(versions)) != 1:
                raise RuntimeError(f"workers disagree on the new version: {versions}")
            self._version = versions[0]
            self._updated.add(which)
            return versions[0]

        call = self._call("update_weights_from_distributed", range(self.num_workers),
                          "update_weights_from_distributed", which, staging, combine=combine)
        return call.result() if wait else call

    def get_weights(self, which: str = "policy", index: int = 0) -> dict[str, torch.Tensor]:
        """Worker ``index``'s weights of ``which`` by HF name, as CPU tensors (e.g. to check
        that the workers hold exactly what the learner sent)."""
        return self._call("get_weights", [index], "named_weights", which).result()[0]

    def restart_worker(self, index: int, *, fresh: bool = False) -> None:
        """Replace worker ``index`` (dead or alive) by a new actor holding the pool's current
        weights and version: a live worker's copy of every tensor the updates changed goes to
        it through the Ray object store, exactly. ``fresh=True`` starts it from the checkpoint
        (version 0) instead, e.g. when no worker is left alive; the learner then sends a full
        update. The weight-sync group lost a rank either way: make a new ``WeightSender`` and
        call :meth:`init_weight_update_group` again before the next update."""
        if isinstance(index, bool) or not isinstance(index, int) or \
                not 0 <= index < self.num_workers:
            raise ValueError(f"index must be a worker index in [0, {self.num_workers}), got "
                             f"{index!r}")
        self._check_open("restart_worker")
        donors = [i for i in range(self.num_workers) if i != index and i not in self._dead]
        need = sorted(self._updated) if self._version > 0 and not fresh else []
        if need and not donors:
            raise RuntimeError(f"no live worker holds the current weights (v{self._version}) to "
                               f"restart {self.describe(index)} with: restart_worker(i, "
                               "fresh=True) starts every worker from the checkpoint, then the "
                               "learner sends a full update")
        old = self._workers[index]
        if old is not None:
            ray.kill(old)  # a live one is replaced; killing a dead one is a no-op
        self._workers[index] = self._start(index)
        self._dead.pop(index, None)
        if self._group is not None:
            self._group_stale.add(index)
        try:
            self._call("restart", [index], "info").result()
            while need:
                # The donor's tensors travel as object refs that the new actor fetches itself,
                # never through this process.
                donor = donors.pop(0)
                refs = {w: self._workers[donor].named_weights.remote(w) for w in need}
                try:
                    self._call("restart", [index], "restore", refs, self._version).result()
                    break
                except DonorDiedError as e:
                    self._mark_dead(donor, str(e))
                    if not donors:
                        raise
        except BaseException:
            self._dead.setdefault(index, "failed to restart")
            raise
        logger.info("%s restarted at weight version %d", self.describe(index),
                    self._version if need else 0)


__all__ = ["PoolWeights"]
