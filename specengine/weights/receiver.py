"""Engine side of weight updates: in process, over a weight-sync group, or from shared storage.

Every path checks the whole update first with the one set of rules of
:func:`specengine.model.loader.check_entries` (names known, shapes equal, dtypes castable),
writes into the existing parameters with ``param.data.copy_`` (addresses never change), and
bumps ``engine.weight_version`` only once the last byte is in.

Atomicity over the network, where the sender may die mid-transfer (``staging``):

- ``"device"`` / ``"host"``: buckets are cast into a staged copy of the updated parameters
  (on the engine's device, or in pinned host memory, kept for the next update until the
  group is closed) and copied into the parameters only after the group agreed that every
  receiver holds the complete update; on failure the old weights stay, whole.
- ``"auto"`` (default): the device when it has room for the copy (plus a margin), else host.
  A full 8B model in bf16 is a second 16 GB, which rarely fits next to the KV cache.
- ``"none"``: no second copy; buckets are written in place and, if the transfer fails, the
  engine fails closed: ``generate`` raises until an update covering every tensor of the
  failed one is applied.

Finite values (``check_finite``, default on; ``specengine.weights.finite``): an update holding
a NaN or Inf is refused with :class:`WeightSyncError` naming the first bad tensor. In process
and from shared buckets the values are checked as given, before any write; over the network
the staged copy is checked (after the cast) before the commit point, so every member of the
group refuses it and nothing changes. With ``staging="none"`` the values are already in
place when they can be checked: the update then fails closed like a broken transfer (the
tensors stay torn, ``generate`` raises until a complete update arrives).

Off the engine thread (docs/design.md §4): a staged network update splits into
:meth:`WeightReceiver.stage` (manifest, checks, transfer into the staging copy, finite check,
the commit-point agreement: it only reads the engine's parameter shapes and version, so it
may run beside ``engine.step()``) and :meth:`WeightReceiver.commit` (the copy into the
parameters and the version bump, between two steps). ``staging="none"`` writes the
parameters as bytes arrive, so its whole receive must run between two steps.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from specengine.core.inflight import after_update
from specengine.core.sleep import WeightsAsleepError
from specengine.model.config import CheckpointError
from specengine.model.loader import (
    check_entries,
    format_errors,
    full_shape,
    hf_named_tensors,
    iter_checkpoint,
    tied_names,
)
from specengine.weights.finite import FiniteCheck, check_finite_tensors, non_finite_message
from specengine.weights.group import MAX_ERROR_BYTES, WeightGroup
from specengine.weights.protocol import (
    MAX_MANIFEST_BYTES,
    MAX_VERSION,
    Manifest,
    WeightSyncError,
    bucket_buffer,
)
from specengine.weights.sender import MAGIC, SharedWeights

if TYPE_CHECKING:
    from specengine.engine import SpecEngine

logger = logging.getLogger(__name__)

STAGING = ("auto", "device", "host", "none")
DEVICE_STAGING_MARGIN_BYTES = 1 << 30


def update_target(engine: SpecEngine, which: str) -> tuple[nn.Module, dict[str, str]]:
    """The module an update of ``which`` writes into, and its tied (aliased) names."""
    if which == "policy":
        return engine.model, tied_names(engine.model)
    if which != "draft":
        raise ValueError(f"which must be 'policy' or 'draft', got {which!r}")
    module = getattr(engine.drafter, "module", None)
    if not isinstance(module, nn.Module):
        raise ValueError(f"the engine's drafter ({type(engine.drafter).__name__}) has no "
                         "weights to update")
    return module, tied_names(module)


def check_allowed(engine: SpecEngine, version: int | None) -> None:
    """Refuse an update whose version is not an int64 or would not increase. Requests may be
    running: an update lands between two steps (``specengine.core.inflight``)."""
    if version is not None and (isinstance(version, bool) or not isinstance(version, int)
                                or not 0 <= version <= MAX_VERSION):
        # Every later token is stamped with it in an int64 array.
        raise ValueError(f"weight version must be an int in [0, {MAX_VERSION}] (or None: the "
                         f"current one + 1), got {version!r}")
    asleep = getattr(engine, "weights_asleep", None)  # (a TP worker has no sleep state)
    if asleep:
        raise WeightsAsleepError(f"the engine's weights are released by sleep() ({asleep}): "
                                 "wake_up(tags=['weights']) before updating them")
    if version is not None and version <= engine.weight_version:
        raise ValueError(f"weight version must increase: got {version}, engine is at "
                         f"{engine.weight_version}")


def commit(engine: SpecEngine, which: str, names: Iterable[str], version: int | None) -> int:
    """Bump the version; tensors now whole again are no longer torn. Then the running
    requests follow the engine's in-flight policy (``kv_on_update``, ``max_policy_lag``),
    only after a complete update: a refused one changes nothing."""
    engine.torn_weights.difference_update((which, n) for n in names)
    engine.weight_version = version if version is not None else engine.weight_version + 1
    if engine.core is not None:  # None on a tensor-parallel worker (no requests there)
        after_update(engine.core, which, engine.weight_version)
    return engine.weight_version


def read_update(named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]
                | str | Path, check_finite: bool) -> list[tuple[str, torch.Tensor]]:
    """The update's ``(name, tensor)`` pairs (a safetensors dir is read into host tensors),
    refused with :class:`WeightSyncError` if ``check_finite`` and a tensor holds a NaN or an
    Inf. Touches no engine state, so it may run off the engine thread."""
    if isinstance(named_tensors, (str, Path)):
        items = list(iter_checkpoint(named_tensors))
    elif isinstance(named_tensors, Mapping):  # iterating it would give the names alone
        items = list(named_tensors.items())
    else:
        items = list(named_tensors)
    if check_finite:  # malformed entries are left for the entry checks to name
        # a pair may be a list (``[name, tensor]``, e.g. from JSON-like code): the loaders
        # take it, so the check must too (a tuple-only test let its NaNs through)
        check_finite_tensors(p for p in items if isinstance(p, (tuple, list)) and len(p) == 2
                             and isinstance(p[1], torch.Tensor))
    return items


def load_in_process(engine: SpecEngine, named_tensors: Iterable[tuple[str, torch.Tensor]]
                    | Mapping[str, torch.Tensor] | str | Path, which: str,
                    version: int | None, check_finite: bool = True) -> int:
    """``engine.load_weights``: named tensors (pairs or a mapping such as a state dict, as
    the sender takes) or a safetensors dir, all or nothing."""
    update_target(engine, which)
    check_allowed(engine, version)
    tp = getattr(engine, "tp", None)
    if which == "policy" and tp is not None:  # every rank checks, then copies its slice
        def mark_torn_tp(names: list[str]) -> None:  # commit clears them once all are in
            engine.torn_weights.update((which, n) for n in names)

        if isinstance(named_tensors, Mapping):
            named_tensors = named_tensors.items()
        names = tp.load_policy(engine.model, named_tensors, mark_torn_tp, check_finite)
        return commit(engine, which, names, version)
    items = read_update(named_tensors, check_finite)
    if which == "policy":
        from specengine.model.loader import load_named_tensors

        def mark_torn(names: list[str]) -> None:  # commit clears them once all are in
            engine.torn_weights.update((which, n) for n in names)

        names = load_named_tensors(engine.model, items, strict=False,
                                   tied=tied_names(engine.model), before_write=mark_torn)
    else:
        try:
            names = engine.drafter.load_weights(items)  # type: ignore[union-attr]
        except CheckpointError:
            raise  # refused before any write
        except Exception:
            # Which draft tensors were written before the failure is the drafter's business:
            # all are torn until a complete draft update.
            module, _ = update_target(engine, which)
            engine.torn_weights.update((which, n) for n in hf_named_tensors(module))
            raise
    return commit(engine, which, names, version)


@dataclass
class _Plan:
    """A checked update: where each accepted tensor's bytes go."""

    manifest: Manifest
    which: str
    params: dict[str, torch.Tensor]
    accepted: set[str]
    staged: dict[str, torch.Tensor] | None
    shards: dict[str, Any] = field(default_factory=dict)  # tensor-parallel slices (whole staged)
    receive_s: float = 0.0  # transfer + checks, for the log
    check_s: float = 0.0  # the finite check alone

    def first_non_finite(self) -> str | None:
        """The first accepted tensor (in the manifest's order) holding a NaN or an Inf, where
        the update now sits (the staging copy, or the parameters with ``staging="none"``):
        one reduction per tensor, one host read."""
        check = FiniteCheck()
        where = self.staged if self.staged is not None else self.params
        for e in self.manifest.entries:
            if e.name in self.accepted:
                check.add(e.name, where[e.name])
        return check.first_bad()

    def scatter(self, buf: torch.Tensor, lo: int, hi: int) -> None:
        """Cast stream bytes ``[lo, hi)`` (in ``buf[:hi-lo]``) into their destinations."""
        for _, entry, start, end in self.manifest.pieces(lo, hi):
            if entry.name not in self.accepted:
                continue  # a tied alias or an ignored key: its twin carries the data
            dst = (self.staged or self.params)[entry.name]
            item = entry.dtype.itemsize
            at = entry.offset + start - lo
            src = buf[at: at + end - start].view(entry.dtype)
            with torch.no_grad():
                dst.view(-1)[start // item: end // item].copy_(src)

    def direct(self, lo: int, hi: int, device: torch.device) -> torch.Tensor | None:
        """The destination's own bytes for chunk ``[lo, hi)`` when the chunk lies inside one
        accepted tensor that needs no cast and lives where the group receives."""
        sole = self.manifest.sole_piece(lo, hi)
        if sole is None or sole[1].name not in self.accepted:
            return None
        _, entry, start, end = sole
        dst = (self.staged or self.params)[entry.name]
        if dst.dtype != entry.dtype or dst.device != device or not dst.is_contiguous():
            return None
        return dst.view(-1).view(torch.uint8)[start:end]

    def apply_staged(self) -> None:
        if self.staged is not None:
            with torch.no_grad():
                for name, t in self.staged.items():
                    spec = self.shards.get(name)
                    if spec is None:
                        self.params[name].copy_(t)
                    else:  # the whole tensor was staged: this rank keeps its slice
                        spec.copy_into(self.params[name], t)
            self.staged = None


def plan_update(engine: SpecEngine, which: str, manifest: Manifest, staging: str,
                host_cache: dict[tuple[str, str], torch.Tensor] | None = None) -> _Plan:
    """Check ``manifest`` against the engine (raises naming the first bad entries) and
    allocate the staging copy. Host staging buffers are taken from / kept in ``host_cache``
    (allocating, and on CUDA pinning, 16 GB of host memory per update would cost seconds);
    device staging is allocated per update and given back, as device memory is dear."""
    if manifest.which != which:
        raise ValueError(f"the sender sends {manifest.which!r} weights but this receiver "
                         f"expects {which!r}")
    if which == "draft" and getattr(engine, "is_tp_worker", False):
        # The drafter lives on rank 0: this rank joins the transfer and keeps nothing.
        return _Plan(manifest, which, {}, set(), None)
    check_allowed(engine, manifest.version)  # first: sleeping weights have no views to make
    module, tied = update_target(engine, which)
    accepted, errors = check_entries(
        module, ((e.name, e.shape, e.dtype) for e in manifest.entries),
        strict=manifest.full, tied=tied)
    if errors:
        raise CheckpointError(format_errors(errors))
    # By HF name; a merged projection's parts are views of its storage, written in place.
    params = {n: t.detach() for n, t in hf_named_tensors(module, remove_duplicate=False).items()}
    staged = None
    shards = getattr(module, "tp_shards", {})
    where = _staging_device(engine.device, sum(params[n].nbytes for n in accepted), staging)
    if where is None and any(n in shards for n in accepted):
        where = torch.device("cpu")  # a slice is cut from the whole tensor: stage it whole
    if where is not None:
        staged = {}
        pin = where.type == "cpu" and engine.device.type == "cuda"
        for n in accepted:
            buf = host_cache.get((which, n)) if host_cache is not None else None
            shape = full_shape(module, n, params[n])
            if buf is None or buf.device != where or tuple(buf.shape) != shape or \
                    buf.dtype != params[n].dtype:
                buf = torch.empty(shape, dtype=params[n].dtype, device=where, pin_memory=pin)
                if host_cache is not None and where.type == "cpu":
                    host_cache[(which, n)] = buf
            staged[n] = buf
    return _Plan(manifest, which, params, set(accepted), staged,
                 {n: s for n, s in shards.items() if n in accepted})


def _staging_device(device: torch.device, nbytes: int, staging: str) -> torch.device | None:
    if staging == "none":
        return None
    if staging == "host" or device.type == "cpu":
        return torch.device("cpu")
    if staging == "device":
        return device
    free, _ = torch.cuda.mem_get_info(device)
    return device if nbytes + DEVICE_STAGING_MARGIN_BYTES < free else torch.device("cpu")


class WeightReceiver:
    """An engine's membership (rank 1..world_size-1) in a weight-sync group."""

    def __init__(self, master_address: str, master_port: int, rank: int, world_size: int,
                 backend: str, timeout_s: float, device: torch.device) -> None:
        if rank == 0:
            raise ValueError("rank 0 is the sender (WeightSender); engines take ranks 1..")
        self.group = WeightGroup(master_address, master_port, rank, world_size, backend,
                                 timeout_s, device if device.type == "cuda" else None)
        self._host_staging: dict[tuple[str, str], torch.Tensor] = {}  # kept until close

    def learner_gone(self) -> str:
        """Why the learner is gone ("" while its store answers)."""
        return self.group.learner_gone()

    def receive(self, engine: SpecEngine, which: str, src_rank: int, staging: str,
                check_finite: bool = True) -> int:
        """One update from ``src_rank`` (see ``engine.update_weights_from_distributed``),
        staged and committed on this thread."""
        return self.commit(engine, self.stage(engine, which, src_rank, staging, check_finite))

    def stage(self, engine: SpecEngine, which: str, src_rank: int, staging: str,
              check_finite: bool = True) -> _Plan:
        """Everything up to the commit point: the manifest and its checks, the transfer, the
        finite check and the group's agreement that every receiver holds the whole update.
        With a staging copy this writes nothing the engine reads, so it may run beside
        ``engine.step()``; :meth:`commit` then copies it in. With ``staging="none"`` the
        parameters are written here (run it between two steps).

        Every refusal of this receiver's own (bad ``staging`` or ``which``, no drafter, a
        version that does not increase, a manifest that does not fit, non-finite values) is
        raised only after a handshake, so that the sender and the other receivers, which
        wait in it, raise too."""
        g = self.group
        if isinstance(src_rank, bool) or not isinstance(src_rank, int) or \
                not 0 <= src_rank < g.world_size or src_rank == g.rank:
            # No collective can be joined with it: refuse here, leaving the group usable (a
            # collective with a bad root would break it) so a call with the right one works.
            raise ValueError(f"src_rank must be the sender's rank (0 for a WeightSender), "
                             f"got {src_rank!r}")
        header = torch.zeros(2, dtype=torch.int64, device=g.device)
        g.broadcast(header, src_rank)
        t0 = time.perf_counter()
        magic, size = header.tolist()
        if magic == MAGIC and -MAX_ERROR_BYTES <= size < 0:  # the sender refused its input
            message = torch.empty(-size, dtype=torch.uint8, device=g.device)
            g.broadcast(message, src_rank)
            raise WeightSyncError("the sender refused its own update, nothing changed: "
                                  + message.cpu().numpy().tobytes().decode(errors="replace"))
        if magic != MAGIC or not 0 < size <= MAX_MANIFEST_BYTES:
            g.broken = True  # out of step with the sender: nothing after this can be trusted
            raise WeightSyncError(f"bad weight-sync header {header.tolist()}: is rank "
                                  f"{src_rank} a WeightSender?")
        payload = torch.empty(size, dtype=torch.uint8, device=g.device)
        g.broadcast(payload, src_rank)
        plan, error = None, None
        try:  # any local failure must reach the handshake, or the others wait in vain
            if staging not in STAGING:
                raise ValueError(f"staging must be one of {STAGING}, got {staging!r}")
            manifest = Manifest.from_json(payload.cpu().numpy().tobytes())
            plan = plan_update(engine, which, manifest, staging, self._host_staging)
            buf = bucket_buffer(manifest, g.device)
        except Exception as e:  # noqa: BLE001 - incl. WeightSyncError, out of memory
            plan, error = None, _describe(e)
        errors = g.agree(error)
        if errors or plan is None:
            raise WeightSyncError("weight update refused, nothing changed: " + " | ".join(errors))
        chunks = plan.manifest.chunks()
        if chunks and plan.staged is None:  # in place from the first byte on: torn until done
            engine.torn_weights.update((which, n) for n in plan.accepted)
        for lo, hi in chunks:
            direct = plan.direct(lo, hi, g.device) if error is None else None
            g.broadcast(buf[: hi - lo] if direct is None else direct, src_rank)
            if error is None and direct is None:  # after a local failure keep receiving, to
                try:                              # stay in step with the group
                    plan.scatter(buf, lo, hi)
                except Exception as e:  # noqa: BLE001 - reported at the commit point
                    error = f"copy failed: {_describe(e)}"
        t_check = time.perf_counter()
        if error is None and check_finite:
            # Before the commit point, so that every member (and the sender) refuses it. The
            # staged copy is checked after the cast (a value too large for the parameter's
            # dtype is an Inf there); with staging="none" the parameters themselves, which
            # then stay torn (fail closed).
            bad = plan.first_non_finite()
            if bad is not None:
                error = non_finite_message(bad)
        plan.check_s = time.perf_counter() - t_check
        errors = g.agree(error)  # the commit point: every receiver holds the whole update
        plan.receive_s = time.perf_counter() - t0
        if errors:
            raise WeightSyncError(f"weight update v{plan.manifest.version} failed: "
                                  + " | ".join(errors))
        return plan

    def commit(self, engine: SpecEngine, plan: _Plan) -> int:
        """Copy a staged update into the parameters and bump the version (between two steps;
        the staged copy is complete and checked)."""
        t0 = time.perf_counter()
        which = plan.which
        # Torn while the staged copy is written in (commit clears it): should a copy fail
        # midway, generate refuses instead of running on a mix.
        engine.torn_weights.update((which, n) for n in plan.accepted)
        plan.apply_staged()
        version = commit(engine, which, plan.accepted, plan.manifest.version)
        logger.info("applied weight update v%d (%s): %d tensors; received and checked in "
                    "%.3f s (finite check %.3f s), copied in %.3f s", version, which,
                    len(plan.accepted), plan.receive_s, plan.check_s, time.perf_counter() - t0)
        return version

    def close(self) -> None:
        self._host_staging.clear()
        self.group.close()


def apply_shared(engine: SpecEngine, handles: SharedWeights, which: str,
                 check_finite: bool = True) -> int:
    """``engine.update_weights_from_shared``: every bucket is present before the first write,
    so the copy (and the finite check, on the buckets as sent) is all or nothing without
    staging."""
    if not isinstance(handles, SharedWeights):
        raise TypeError(f"handles must be SharedWeights (from WeightSender.send with "
                        f"transport='shared'), got {type(handles).__name__}")
    if getattr(engine, "tp", None) is not None:
        raise ValueError("update_weights_from_shared does not serve a tensor-parallel engine "
                         "(each rank copies its slice of the whole tensors): use load_weights "
                         "or a weight-sync group")
    manifest = Manifest.from_json(handles.manifest)
    chunks = manifest.chunks()
    sizes = [b.numel() for b in handles.buckets]
    if sizes != [hi - lo for lo, hi in chunks]:
        raise WeightSyncError(f"shared buckets of {sizes} bytes do not match the manifest's "
                              f"{[hi - lo for lo, hi in chunks]}")
    plan = plan_update(engine, which, manifest, "none")
    if check_finite:
        check = FiniteCheck()
        for (lo, hi), bucket in zip(chunks, handles.buckets):
            for _, entry, start, end in manifest.pieces(lo, hi):
                if entry.name in plan.accepted:
                    at = entry.offset + start - lo
                    check.add(entry.name, bucket[at: at + end - start].view(entry.dtype))
        check.raise_if_bad()
    # Torn until the last bucket is in (commit clears it): a copy that fails midway (storage
    # the sender freed, a device error) leaves generate refusing, not running on a mix.
    engine.torn_weights.update((which, n) for n in plan.accepted)
    for (lo, hi), bucket in zip(chunks, handles.buckets):
        plan.scatter(bucket, lo, hi)
    for device in {b.device for b in handles.buckets if b.device.type == "cuda"}:
        # The copies are queued on this process's stream: finish them before returning, as
        # the caller then tells the sender, which frees and reuses the shared buckets.
        torch.cuda.current_stream(device).synchronize()
    return commit(engine, which, plan.accepted, manifest.version)


def _describe(e: BaseException) -> str:
    """Never empty (an empty error would read as "fine" in the handshake)."""
    return f"{type(e).__name__}: {e}"
