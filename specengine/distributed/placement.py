"""Where a ``RolloutPool``'s workers run: the Ray cluster and each worker's resources."""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import ray

logger = logging.getLogger(__name__)

RESOURCE_KEYS = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type")


def connect(address: str | None) -> bool:
    """Join the Ray cluster at ``address``, or start a local one (``address`` None), unless
    this process is connected already. Returns whether the pool started (so owns) it."""
    if ray.is_initialized():
        return False
    ray.init(address=address, include_dashboard=False, logging_level=logging.WARNING)
    return address is None


def worker_resources(resources: Mapping[str, Any] | None, num_workers: int,
                     owns_cluster: bool) -> dict[str, Any]:
    """Each worker's Ray actor resources. Default: one GPU (and one CPU) when the cluster has
    GPUs, else one CPU. Workers that cannot all fit in a cluster the pool started would wait
    forever, so that is refused; a cluster joined by address may autoscale, so it is only
    logged there."""
    bad = sorted(set(resources or {}) - set(RESOURCE_KEYS))
    if bad:
        raise ValueError(f"resources_per_worker: unknown keys {bad}; use {RESOURCE_KEYS}")
    total = ray.cluster_resources()
    if resources is None:
        resources = {"num_cpus": 1, "num_gpus": 1} if total.get("GPU", 0) > 0 else \
            {"num_cpus": 1}
    out = dict(resources)
    for key, name in (("num_cpus", "CPU"), ("num_gpus", "GPU")):
        need = num_workers * float(out.get(key, 0) or 0)
        have = float(total.get(name, 0))
        if need > have:
            message = (f"{num_workers} rollout workers x {key}={out[key]} need {need:g} {name}s "
                       f"but the Ray cluster has {have:g}: lower resources_per_worker"
                       f"[{key!r}] or use fewer workers")
            if owns_cluster:
                raise ValueError(message)
            logger.warning("%s (waiting for the cluster to grow)", message)
    return out


__all__ = ["RESOURCE_KEYS", "connect", "worker_resources"]
