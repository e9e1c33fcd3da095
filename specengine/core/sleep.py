"""Sleep and wake for colocated training (issue 36; docs/design.md "Sleep and wake").

An idle engine gives its device memory back while a trainer on the same GPU runs, then takes
it again: vLLM's ``sleep(level)`` / ``wake_up(tags)``, SGLang's
``release_memory_occupation`` / ``resume_memory_occupation``. Two parts sleep apart
(``tags``): ``"weights"`` (the policy's parameters) and ``"kv_cache"`` (the target's and the
drafter's paged KV caches).

- **How memory is freed.** Each part's tensors keep their storage *objects*; the storage is
  resized to 0 bytes (``untyped_storage().resize_(0)``, as FSDP frees parameters), then
  ``torch.cuda.empty_cache()`` hands the blocks back to the driver. Every tensor and view
  that refers to the storage (parameters, tied weights, the EAGLE-3 head's view of the
  target's embeddings, per-layer KV views) stays valid Python-side, and waking resizes the
  same storages back to their size: no object anywhere needs rebinding.
- **Level 1** keeps a host copy of the weights (pinned on CUDA) and copies it back into the
  same storages on wake; the host buffers are kept for the next level-1 sleep (pinning, not
  copying, is most of the first sleep's time). **Level 2** keeps nothing: on wake the
  storages are reallocated and zeroed and every policy tensor is marked torn
  (``engine.torn_weights``), so a request is refused, naming why, until a weight update has
  written every one of them.
- **KV cache.** Released whatever the level (it holds nothing an idle engine needs): the
  prefix caches are emptied first, and on wake the cache is reallocated at the same
  number of blocks, every block free.
- **CUDA graphs** captured the old device addresses, and reallocation does not promise the
  same ones (the caching allocator may hand back other blocks; only a virtual-memory
  allocator that unmaps and remaps physical pages under a fixed address range could). So
  sleeping drops every captured graph and its memory pool (freeing that memory too), and
  waking recaptures: at once when the engine captures at startup (``capture="startup"``,
  the CUDA default), else each shape at its first use, as after start-up.
- The drafter's own weights stay resident (a head is a few percent of the policy, and the
  learner does not push it).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable
from dataclasses import dataclass, field

import torch

logger = logging.getLogger(__name__)

PARTS = ("weights", "kv_cache")
LEVELS = (1, 2)

__all__ = ["LEVELS", "PARTS", "EngineAsleepError", "Released", "SleepState", "WeightsAsleepError",
           "check_tags", "release_storages", "restore_storages", "unique_storages"]


class EngineAsleepError(RuntimeError):
    """A request (or weight update) reached an engine whose memory :meth:`SpecEngine.sleep`
    released, or whose weights ``sleep(level=2)`` dropped and no update has refilled yet
    (the server answers 503 with the message)."""


class WeightsAsleepError(EngineAsleepError, ValueError):
    """A weight update reached an engine whose weights sleep. Also a ``ValueError``: the
    update paths treat it as a refusal of the update's own (checked after the handshake and
    drained, so the learner raises too instead of waiting)."""


def check_tags(tags: Iterable[str] | None) -> tuple[str, ...]:
    """The parts named by ``tags`` (None: both), checked."""
    if tags is None:
        return PARTS
    if isinstance(tags, str):
        tags = [tags]
    tags = tuple(tags)
    bad = [t for t in tags if t not in PARTS]
    if bad or not tags:
        raise ValueError(f"tags must be a non-empty subset of {list(PARTS)}, got {list(tags)}")
    return tuple(t for t in PARTS if t in tags)


def unique_storages(tensors: Iterable[torch.Tensor]) -> list[torch.Tensor]:
    """One whole-storage byte view per distinct storage among ``tensors`` (tied and merged
    weights share one), in first-seen order."""
    out: list[torch.Tensor] = []
    seen: set[int] = set()
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == 0 or storage.data_ptr() in seen:
            continue
        seen.add(storage.data_ptr())
        out.append(torch.empty(0, dtype=torch.uint8, device=t.device).set_(storage))
    return out


@dataclass
class Released:
    """One sleeping part: the byte views of its storages, their sizes, and (weights at level
    1) their host copies."""

    views: list[torch.Tensor]
    sizes: list[int]
    host: list[torch.Tensor] = field(default_factory=list)
    level: int = 1

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)


def release_storages(views: list[torch.Tensor], keep_host_copy: bool, level: int = 1,
                     reuse: list[torch.Tensor] | None = None) -> Released:
    """Copy ``views`` to host memory when ``keep_host_copy`` (pinned when they are on CUDA;
    into ``reuse``, the buffers of an earlier sleep, when they have the same sizes: pinning is
    the slow part), then resize their storages to 0 bytes."""
    sizes = [v.untyped_storage().nbytes() for v in views]
    host = []
    if keep_host_copy:
        if reuse is None or [h.numel() for h in reuse] != [v.numel() for v in views]:
            reuse = [torch.empty(v.numel(), dtype=torch.uint8, pin_memory=v.is_cuda)
                     for v in views]
        for v, h in zip(views, reuse):
            h.copy_(v, non_blocking=v.is_cuda)
            host.append(h)
        if any(v.is_cuda for v in views):
            torch.cuda.synchronize()  # the copies are done before the storage goes
    for v in views:
        v.untyped_storage().resize_(0)
    return Released(views, sizes, host, level)


def restore_storages(part: Released) -> None:
    """Resize every storage back to its size and fill it: the host copy, else zeros."""
    for i, (v, size) in enumerate(zip(part.views, part.sizes)):
        storage = v.untyped_storage()
        storage.resize_(size)
        v.set_(storage)  # the view's size follows its storage again
        if part.host:
            v.copy_(part.host[i], non_blocking=v.is_cuda)
        else:
            v.zero_()
    if part.host and any(v.is_cuda for v in part.views):
        torch.cuda.synchronize()  # the host copies may be reused once the device holds them


@dataclass
class SleepState:
    """Which parts sleep (``weights`` at which level), and what they released."""

    parts: dict[str, Released] = field(default_factory=dict)
    #: the host (pinned on CUDA) buffers of the last level-1 sleep of the weights, kept after
    #: waking so the next one only copies (``.clear()`` frees them; a level-2 sleep does)
    host_buffers: list[torch.Tensor] = field(default_factory=list)

    @property
    def is_sleeping(self) -> bool:
        return bool(self.parts)

    def describe(self) -> str:
        return ", ".join(f"weights (level {p.level})" if name == "weights" else name
                         for name, p in self.parts.items())
