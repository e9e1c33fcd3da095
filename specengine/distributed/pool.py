"""``RolloutPool``: data-parallel rollout workers on Ray that one learner updates together.

Each worker is a Ray actor owning a ``SpecEngine`` (``worker.RolloutWorker``). ``generate``
shards a batch across them (``sharding``: a GRPO group stays on one worker, LPT on
``max_tokens``) and returns outputs in prompt order, equal to one engine's (see
:meth:`RolloutPool.generate`). The workers join the learner's weight-sync group as ranks
``1 .. num_workers``, so one ``WeightSender.send`` updates all of them (docs/design.md
§12).
"""

from __future__ import annotations

import dataclasses
import logging
import random
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import ray

from specengine.core.requests import RequestBatch
from specengine.core.run_stats import merge_stats
from specengine.distributed.calls import (
    RESTART_HINT,
    PoolCall,
    WorkerDiedError,
)
from specengine.distributed.placement import connect, worker_resources
from specengine.distributed.pool_weights import PoolWeights
from specengine.distributed.sharding import assign
from specengine.distributed.worker import RolloutWorker
from specengine.outputs import EngineStats, GenerationOutput
from specengine.sampling import SamplingParams
from specengine.tree import TreeArg

logger = logging.getLogger(__name__)


class RolloutPool(PoolWeights):
    """``num_workers`` engines on ``model`` (+ ``draft``), one per Ray actor.

    Args:
        num_workers: data-parallel workers (>= 1).
        model, draft, engine_kwargs: what each worker passes to ``SpecEngine(model, draft,
            **engine_kwargs)``; paths must exist on the workers' nodes. ``engine_kwargs["seed"]``
            (default 0) also seeds the pool's draw of per-request seeds.
        resources_per_worker: Ray actor resources, e.g. ``{"num_cpus": 1, "num_gpus": 1}``.
            Default: one GPU each when the cluster has GPUs, else one CPU each.
        address: a Ray cluster to connect to; None starts a local one (``ray.init()``) unless
            this process is already connected. A cluster the pool started is shut down with it.
        timeout_s: bound on every wait for the workers (start-up, rollouts, updates); None:
            no bound.
    """

    def __init__(self, num_workers: int, model: str | Path, draft: str | Path | None = None, *,
                 engine_kwargs: Mapping[str, Any] | None = None,
                 resources_per_worker: Mapping[str, Any] | None = None,
                 address: str | None = None, timeout_s: float | None = None) -> None:
        if isinstance(num_workers, bool) or not isinstance(num_workers, int) or num_workers < 1:
            raise ValueError(f"num_workers must be an int >= 1, got {num_workers!r}")
        if timeout_s is not None and not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0 or None, got {timeout_s!r}")
        kwargs = dict(engine_kwargs or {})
        if not all(isinstance(key, str) for key in kwargs):
            raise ValueError("engine_kwargs keys must be SpecEngine keyword names")
        self.num_workers, self.timeout_s = num_workers, timeout_s
        self._model, self._kwargs = str(model), kwargs
        self._draft = None if draft is None else str(draft)
        self._workers: list[Any] = [None] * num_workers
        self._owns_ray = connect(address)
        try:
            self._resources = worker_resources(resources_per_worker, num_workers,
                                               self._owns_ray)
        except ValueError:
            self.shutdown()
            raise
        self._actor_cls = ray.remote(RolloutWorker)
        # Per-request seeds are drawn here, in prompt order, by the engine's own rule (a
        # random.Random(seed), 62 bits per request that gives none), so sharding changes no
        # sample: each worker only ever sees explicit seeds.
        self._rng = random.Random(kwargs.get("seed", 0))
        self._dead: dict[int, str] = {}
        self._init_weights()
        self._stats = EngineStats()
        self._worker_stats: tuple[EngineStats | None, ...] = (None,) * num_workers
        self.last_assignment: tuple[tuple[int, ...], ...] = ((),) * num_workers
        try:
            for i in range(num_workers):
                self._workers[i] = self._start(i)
            self._call("starting the pool", range(num_workers), "info", hint="").result()
        except BaseException:
            self.shutdown()
            raise
        logger.info("rollout pool up: %d workers (%s each)", num_workers, self._resources)

    # ---- workers ------------------------------------------------------------------------------
    @property
    def workers(self) -> tuple[Any, ...]:
        """The workers' Ray actor handles, by index."""
        return tuple(self._workers)

    def describe(self, index: int) -> str:
        """``"rollout worker i (actor <id>)"``: how errors name a worker."""
        actor = self._workers[index]
        actor_id = actor._actor_id.hex() if actor is not None else "none"
        return f"rollout worker {index} (actor {actor_id})"

    def _start(self, index: int) -> Any:
        return self._actor_cls.options(**self._resources).remote(
            index, self._model, self._draft, self._kwargs)

    def _mark_dead(self, index: int, reason: str) -> None:
        self._dead[index] = reason
        logger.error("%s died: %s", self.describe(index), reason)

    def _call(self, what: str, indices: Sequence[int] | range, method: str, *args: Any,
              per_worker: Sequence[tuple[Any, ...]] | None = None,
              combine: Any = list, hint: str = RESTART_HINT) -> PoolCall:
        """Start ``method`` on every worker of ``indices`` at once (``per_worker`` args each,
        else ``args``); refuses at once if one of them is known dead."""
        indices = list(indices)
        self._check_alive(what, indices)
        refs = []
        for n, i in enumerate(indices):
            call_args = per_worker[n] if per_worker is not None else args
            refs.append((i, getattr(self._workers[i], method).remote(*call_args)))
        return PoolCall(refs, what, self.describe, self._mark_dead, combine, self.timeout_s,
                        hint)

    def _check_open(self, what: str) -> None:
        if all(w is None for w in self._workers):
            raise RuntimeError(f"{what}: the rollout pool is shut down")

    def _check_alive(self, what: str, indices: Sequence[int] | range) -> None:
        self._check_open(what)
        dead = [i for i in indices if i in self._dead]
        if dead:
            raise WorkerDiedError(
                f"{what}: " + "; ".join(f"{self.describe(i)} died earlier: {self._dead[i]}"
                                        for i in dead)
                + f" (restart_worker({dead[0]}) brings it back)", dead)

    # ---- rollouts -----------------------------------------------------------------------------
    def generate(self, batch: Sequence[list[int] | str], k: int = 0,
                 sampling: SamplingParams | Sequence[SamplingParams] | None = None,
                 tree: TreeArg = None
                 ) -> list[GenerationOutput]:
        """``SpecEngine.generate`` across the workers: same arguments, outputs in prompt order.

        The call is checked first by a worker's engine (bad input raises its ``ValueError``,
        naming the prompt by its index in ``batch``, and nothing runs). Requests without a
        seed get one drawn here in prompt order, as one engine would draw them, so greedy
        tokens and seeded or unseeded samples equal those of one engine built with the same
        ``engine_kwargs`` that ran the same calls (logprobs to float rounding, which depends
        on which requests share a batch). :attr:`last_assignment` says which worker ran what.
        A dead worker raises :class:`WorkerDiedError` naming it (the others finish first)."""
        t0 = time.perf_counter()
        # A known-dead worker fails the call before anything runs or any seed is drawn.
        self._check_alive("generate", range(self.num_workers))
        req: RequestBatch = self._call("generate", [0], "validate", batch, k, sampling,
                                       tree).result()[0]
        params = [sp if sp.seed is not None else
                  dataclasses.replace(sp, seed=self._rng.getrandbits(62)) for sp in req.params]
        shards = assign(req.prompts, [sp.max_tokens for sp in params], self.num_workers)
        busy = [i for i, s in enumerate(shards) if s]
        self.last_assignment = shards
        call = self._call("generate", busy, "generate", per_worker=[
            ([req.prompts[j] for j in shards[i]], req.k, [params[j] for j in shards[i]],
             req.tree) for i in busy])
        results = call.result()
        outs: list[GenerationOutput | None] = [None] * len(params)
        worker_stats: list[EngineStats | None] = [None] * self.num_workers
        for i, (shard_outs, stats) in zip(busy, results):
            worker_stats[i] = stats
            for j, out in zip(shards[i], shard_outs):
                outs[j] = out
        self._worker_stats = tuple(worker_stats)
        # Counters and worker-seconds summed; the wall time is this call's, so that
        # tokens_per_second is the pool's throughput.
        merged = merge_stats([s for s in worker_stats if s is not None])
        self._stats = dataclasses.replace(merged, wall_time_s=time.perf_counter() - t0)
        return outs  # type: ignore[return-value]

    @property
    def stats(self) -> EngineStats:
        """The last ``generate``'s stats over all workers: counters, per-position lists and
        worker time summed; ``wall_time_s`` that of the whole call."""
        return self._stats

    @property
    def worker_stats(self) -> tuple[EngineStats | None, ...]:
        """Each worker's stats of the last ``generate`` (None: it got no request)."""
        return self._worker_stats

    # ---- lifetime -----------------------------------------------------------------------------
    def shutdown(self) -> None:
        """Stop every worker (and the local Ray cluster the pool started). Idempotent."""
        for i, actor in enumerate(self._workers):
            if actor is not None:
                ray.kill(actor)
                self._workers[i] = None
        if self._owns_ray and ray.is_initialized():
            ray.shutdown()
        self._owns_ray = False

    def __enter__(self) -> RolloutPool:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()


__all__ = ["RolloutPool", "WorkerDiedError"]
