"""Learner side of weight sync (docs/design.md §3–4): :class:`WeightSender`.

Two transports:

- ``"distributed"`` (default): a gloo or NCCL group of its own (:class:`WeightGroup`), the
  sender is rank 0 and every engine (data-parallel rollout workers) a receiver, ranks
  ``1 .. world_size-1``. ``send`` broadcasts the manifest, the receivers check it and the
  group agrees (both sides raise on a mismatch, nothing changed), then the tensors travel in
  flat byte buckets and the receivers confirm they hold all of it (the commit point;
  each then copies it in and bumps its version).
- ``"shared"``: learner and engine on one host (one GPU, where NCCL refuses two ranks).
  ``send`` packs the update into buckets whose storage ``torch.multiprocessing`` shares (CUDA
  IPC on GPU, shared memory on CPU) and returns a :class:`SharedWeights` to pass to the engine
  through a local ``torch.multiprocessing`` queue or pipe; the engine copies with
  ``engine.update_weights_from_shared(handles)``. The sender keeps the buckets alive until
  :meth:`WeightSender.release` (call it once the engine acknowledged) or :meth:`close`.

Example (learner, rank 0)::

    sender = WeightSender("127.0.0.1", port, world_size=2, backend="gloo")
    sender.send(model.state_dict(), version=1)   # returns once every engine has it all
    sender.close()
"""

from __future__ import annotations

import logging
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import torch

from specengine.weights.group import MAX_ERROR_BYTES, WeightGroup
from specengine.weights.protocol import (
    WHICH,
    Manifest,
    WeightSyncError,
    bucket_buffer,
    byte_view,
    manifest_for,
    pack,
)

logger = logging.getLogger(__name__)

MAGIC = 0x5745_4947  # "WEIG": the first word of every update header
DEFAULT_BUCKET_BYTES = 512 << 20
TRANSPORTS = ("distributed", "shared")

NamedTensors = Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor]


@dataclass(frozen=True)
class SharedWeights:
    """A colocated update: the manifest (JSON bytes) and the stream buckets, whose storage is
    shared when this object goes through a ``torch.multiprocessing`` queue. Meant for
    processes of one host only (pickled through a local pipe, never over a network)."""

    manifest: bytes
    buckets: tuple[torch.Tensor, ...]

    def __post_init__(self) -> None:
        if not isinstance(self.manifest, bytes):
            raise TypeError("SharedWeights.manifest must be bytes")
        if not all(isinstance(b, torch.Tensor) and b.dtype == torch.uint8 and b.dim() == 1
                   and b.is_contiguous() for b in self.buckets):
            raise TypeError("SharedWeights.buckets must be flat contiguous uint8 tensors")


class WeightSender:
    """Pushes weights from the learner to one or more engines.

    Args:
        master_address, master_port: where rank 0 (this process) hosts the rendezvous store
            (``"distributed"`` only).
        world_size: 1 sender + the number of receivers (``"distributed"`` only).
        backend: ``"nccl"`` (CUDA) or ``"gloo"`` (CPU tensors; also works from CUDA tensors
            through host copies).
        timeout_s: limit on the rendezvous and on every transfer step.
        transport: ``"distributed"`` or ``"shared"`` (see the module docstring).
    """

    def __init__(self, master_address: str | None = None, master_port: int | None = None,
                 world_size: int | None = None, *, backend: str = "nccl",
                 timeout_s: float = 120.0, transport: str = "distributed") -> None:
        if transport not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {transport!r}")
        self.transport = transport
        self.group: WeightGroup | None = None
        self._shared: dict[int, SharedWeights] = {}
        if transport == "distributed":
            if master_address is None or master_port is None or world_size is None:
                raise ValueError("the distributed transport needs master_address, master_port "
                                 "and world_size")
            self.group = WeightGroup(master_address, master_port, 0, world_size, backend,
                                     timeout_s)

    def send(self, named_tensors: NamedTensors, version: int | None = None,
             which: str = "policy",
             bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, full: bool = False
             ) -> SharedWeights | None:
        """Send an update (HF checkpoint names; a tied ``lm_head.weight`` may be sent or left
        out). ``version`` must exceed every receiver's current version; None (the default):
        each receiver's current version + 1, so a restarted learner need not know where the
        engines are (they report it: ``/health``, ``SpecEngineClient.weight_version``); the
        shared transport needs an int (it holds updates by version). ``full=True`` says
        the update is every parameter, so a receiver missing one refuses it.

        Distributed: returns None once every receiver holds the whole update (each then
        copies it in, a local step that can only fail closed); raises
        :class:`WeightSyncError` (naming the receivers' first bad entries) when any refused
        it or the transfer failed. Shared: returns the :class:`SharedWeights` to hand over.
        """
        if self.transport == "distributed" and self.group is None:
            raise WeightSyncError("the sender is closed")
        try:
            if which not in WHICH:
                raise ValueError(f"which must be one of {WHICH}, got {which!r}")
            if version is None and self.transport == "shared":
                raise ValueError("the shared transport needs an int version (it holds each "
                                 "update by version until release)")
            manifest, tensors = manifest_for(named_tensors, version, which, full, bucket_bytes)
        except (ValueError, WeightSyncError) as e:
            if self.group is not None:  # tell the receivers, so that they raise too
                raw = f"{type(e).__name__}: {e}".encode()[:MAX_ERROR_BYTES]
                self.group.broadcast(torch.tensor([MAGIC, -len(raw)], dtype=torch.int64,
                                                  device=self.group.device), 0)
                self.group.broadcast(_bytes_tensor(raw, self.group.device), 0)
            raise
        if self.transport == "shared":
            return self._send_shared(manifest, tensors)
        self._send_distributed(self.group, manifest, tensors)  # type: ignore[arg-type]
        return None

    def _send_distributed(self, group: WeightGroup, manifest: Manifest,
                          tensors: list[torch.Tensor]) -> None:
        payload = manifest.to_json()
        header = torch.tensor([MAGIC, len(payload)], dtype=torch.int64, device=group.device)
        group.broadcast(header, 0)
        group.broadcast(_bytes_tensor(payload, group.device), 0)
        error = None
        try:
            buf = bucket_buffer(manifest, group.device)
        except Exception as e:  # noqa: BLE001 - e.g. out of memory: refused in the handshake
            error = f"sender: {type(e).__name__}: {e}"
        errors = group.agree(error)
        if errors:
            raise WeightSyncError(f"weight update v{manifest.version} ({manifest.which}) "
                                  f"refused: " + " | ".join(errors))
        chunks = manifest.chunks()
        for lo, hi in chunks:
            sole = manifest.sole_piece(lo, hi)
            src = tensors[sole[0]] if sole is not None else None
            if error is None and src is not None and src.is_contiguous() and \
                    src.device == group.device:
                group.broadcast(byte_view(src)[sole[2]: sole[3]], 0)  # type: ignore
                continue
            if error is None:  # after a local failure keep sending (whatever buf holds) to
                try:           # stay in step; the commit point tells the receivers
                    pack(manifest, tensors, lo, hi, buf)
                except Exception as e:  # noqa: BLE001 - reported at the commit point
                    error = f"sender copy failed: {type(e).__name__}: {e}"
            group.broadcast(buf[: hi - lo], 0)
        errors = group.agree(error)
        if errors:
            raise WeightSyncError(f"weight update v{manifest.version} failed: "
                                  + " | ".join(errors))
        # version None: the receivers number it (the engine's next version)
        logger.info("sent weight update %s (%s): %d tensors, %.3f GB in %d buckets",
                    "the next version" if manifest.version is None else f"v{manifest.version}",
                    manifest.which, len(manifest.entries),
                    manifest.total_bytes / 1e9, len(chunks))

    def _send_shared(self, manifest: Manifest, tensors: list[torch.Tensor]) -> SharedWeights:
        if manifest.version in self._shared:
            raise ValueError(f"version {manifest.version} is still held: release it first")
        device = tensors[0].device if tensors else torch.device("cpu")
        buckets = []
        for lo, hi in manifest.chunks():
            buf = torch.zeros(hi - lo, dtype=torch.uint8, device=device)
            if device.type == "cpu":
                buf.share_memory_()  # the consumer maps it instead of copying through the pipe
            pack(manifest, tensors, lo, hi, buf)
            buckets.append(buf)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()  # packed before the handle leaves
        handles = SharedWeights(manifest.to_json(), tuple(buckets))
        self._shared[manifest.version] = handles
        return handles

    def release(self, version: int | None = None) -> None:
        """Free the shared buckets of ``version`` (all when None) once the engine copied."""
        if version is None:
            self._shared.clear()
        else:
            self._shared.pop(version, None)

    def close(self) -> None:
        """Tear the group down and free shared buckets (idempotent)."""
        self._shared.clear()
        if self.group is not None:
            self.group.close()
            self.group = None

    def __enter__(self) -> WeightSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _bytes_tensor(raw: bytes, device: torch.device) -> torch.Tensor:
    return torch.frombuffer(bytearray(raw), dtype=torch.uint8).to(device)


__all__ = ["DEFAULT_BUCKET_BYTES", "SharedWeights", "WeightSender", "WeightSyncError"]
