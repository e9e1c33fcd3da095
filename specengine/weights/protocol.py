"""Plain-data pieces of the weight-sync protocol (docs/design.md §4), shared by sender and receiver.

The update travels as one byte stream: every tensor's bytes at an offset aligned to
:data:`ALIGN`, cut into chunks of ``bucket_bytes`` (a multiple of :data:`ALIGN`). Since every
offset and chunk edge is a multiple of 64 and no element is wider than 16 bytes, each piece of
a tensor inside a chunk is a whole number of elements, so a receiver can cast it on its own.
The manifest (version, which, full, bucket size, and per tensor its name, dtype and shape) is
JSON: nothing received over the network is ever unpickled.
"""

from __future__ import annotations

import bisect
import json
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass

import torch

ALIGN = 64
#: longest wait of a weight-sync group (``datetime.timedelta`` and the stores' C++ timeouts
#: overflow on huge ones; longer than a day is a hung peer, not a slow one)
MAX_TIMEOUT_S = 86400.0
#: weight versions are stamped on tokens as int64
MAX_VERSION = (1 << 63) - 1
MAX_WORLD_SIZE = (1 << 31) - 1  # ranks are int32 in torch.distributed
MIN_BUCKET_BYTES = 1 << 10
MAX_MANIFEST_BYTES = 256 << 20
WHICH = ("policy", "draft")
# Dtypes a manifest may name (no pickled dtype objects cross the wire).
DTYPES: dict[str, torch.dtype] = {
    str(d).removeprefix("torch."): d
    for d in (torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.float8_e4m3fn,
              torch.float8_e5m2, torch.int64, torch.int32, torch.int16, torch.int8, torch.uint8,
              torch.bool, torch.complex64)
}


class WeightSyncError(RuntimeError):
    """A weight update was refused or failed; the message names the first bad entries."""


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


@dataclass(frozen=True)
class ManifestEntry:
    """One tensor of an update and where its bytes sit in the stream."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        numel = 1
        for s in self.shape:
            numel *= s
        return numel * self.dtype.itemsize


@dataclass(frozen=True)
class Manifest:
    """What an update holds. ``full``: the update claims to be every parameter, so a receiver
    refuses it if one is missing (a partial update, ``full=False``, may be any subset).
    ``version`` None: each receiver's current version + 1."""

    version: int | None
    which: str
    full: bool
    bucket_bytes: int
    entries: tuple[ManifestEntry, ...]

    def __post_init__(self) -> None:
        if self.version is not None and (
                isinstance(self.version, bool) or not isinstance(self.version, int)
                or not 0 <= self.version <= MAX_VERSION):
            raise WeightSyncError(f"manifest version must be an int in [0, {MAX_VERSION}] or "
                                  f"None (the receiver's next), got {self.version!r}")
        if self.which not in WHICH:
            raise WeightSyncError(f"manifest which must be one of {WHICH}, got {self.which!r}")
        if isinstance(self.bucket_bytes, bool) or not isinstance(self.bucket_bytes, int) or \
                self.bucket_bytes < MIN_BUCKET_BYTES or self.bucket_bytes % ALIGN:
            raise WeightSyncError(f"bucket_bytes must be an int, a multiple of {ALIGN} and >= "
                                  f"{MIN_BUCKET_BYTES}, got {self.bucket_bytes}")

    @classmethod
    def build(cls, meta: Iterable[tuple[str, torch.dtype, tuple[int, ...]]], version: int | None,
              which: str, full: bool, bucket_bytes: int) -> Manifest:
        """Lay out ``(name, dtype, shape)`` triples in stream order; ``bucket_bytes`` is
        rounded down to a multiple of :data:`ALIGN`."""
        entries, offset = [], 0
        for name, dtype, shape in meta:
            if dtype not in DTYPES.values():
                raise WeightSyncError(f"{name}: dtype {dtype} cannot be sent")
            if any(s < 0 for s in shape):
                raise WeightSyncError(f"{name}: negative dimension in shape {shape}")
            entry = ManifestEntry(name, dtype, tuple(int(s) for s in shape), offset)
            entries.append(entry)
            offset = _align(offset + entry.nbytes)
        if isinstance(bucket_bytes, int):  # anything else is refused by __post_init__
            bucket_bytes = bucket_bytes // ALIGN * ALIGN
        return cls(version, which, bool(full), bucket_bytes, tuple(entries))

    @property
    def total_bytes(self) -> int:
        return self.entries[-1].offset + self.entries[-1].nbytes if self.entries else 0

    def chunks(self) -> list[tuple[int, int]]:
        """Byte ranges ``[lo, hi)`` of the stream, one per bucket, in order."""
        total, step = self.total_bytes, self.bucket_bytes
        return [(lo, min(lo + step, total)) for lo in range(0, total, step)]

    def pieces(self, lo: int, hi: int) -> Iterator[tuple[int, ManifestEntry, int, int]]:
        """``(index, entry, start, end)``: byte ranges (relative to the entry) of the tensors
        that overlap ``[lo, hi)``."""
        ends = [e.offset + e.nbytes for e in self.entries]
        i = bisect.bisect_right(ends, lo)
        while i < len(self.entries) and self.entries[i].offset < hi:
            e = self.entries[i]
            start, end = max(lo, e.offset), min(hi, e.offset + e.nbytes)
            if end > start:
                yield i, e, start - e.offset, end - e.offset
            i += 1

    def sole_piece(self, lo: int, hi: int) -> tuple[int, ManifestEntry, int, int] | None:
        """The piece, when ``[lo, hi)`` lies inside one tensor: both ends can then use that
        tensor's bytes directly instead of a bucket buffer (no pack, no scatter copy)."""
        pieces = self.pieces(lo, hi)
        first = next(pieces, None)
        if first is None or next(pieces, None) is not None or first[3] - first[2] != hi - lo:
            return None
        return first

    def to_json(self) -> bytes:
        return json.dumps({
            "version": self.version, "which": self.which, "full": self.full,
            "bucket_bytes": self.bucket_bytes,
            "entries": [[e.name, str(e.dtype).removeprefix("torch."), list(e.shape)]
                        for e in self.entries],
        }).encode()

    @classmethod
    def from_json(cls, payload: bytes) -> Manifest:
        """Parse and check a manifest; offsets are recomputed here, never trusted."""
        try:
            obj = json.loads(payload.decode())
            meta = []
            for name, dtype, shape in obj["entries"]:
                if not isinstance(name, str) or dtype not in DTYPES or not all(
                        isinstance(s, int) and not isinstance(s, bool) for s in shape):
                    raise WeightSyncError(f"malformed manifest entry {[name, dtype, shape]!r}")
                meta.append((name, DTYPES[dtype], tuple(shape)))
            return cls.build(meta, obj["version"], obj["which"], obj["full"], obj["bucket_bytes"])
        except (ValueError, KeyError, TypeError, UnicodeDecodeError) as e:
            raise WeightSyncError(f"malformed manifest ({e})") from e


def manifest_for(named_tensors: Iterable[tuple[str, torch.Tensor]] | Mapping[str, torch.Tensor],
                 version: int | None, which: str, full: bool, bucket_bytes: int
                 ) -> tuple[Manifest, list[torch.Tensor]]:
    """Check a sender's input (unique names, sendable dtypes) and lay it out."""
    items = list(named_tensors.items()) if isinstance(named_tensors, Mapping) else \
        list(named_tensors)
    bad = [n for n, t in items if not isinstance(n, str) or not isinstance(t, torch.Tensor)]
    if bad:
        raise ValueError(f"named_tensors must be (str, Tensor) pairs; bad entries: {bad[:5]}")
    names = [n for n, _ in items]
    if len(set(names)) != len(names):
        raise ValueError(f"tensor names must be unique; repeated: "
                         f"{sorted({n for n in names if names.count(n) > 1})[:5]}")
    manifest = Manifest.build(((n, t.dtype, tuple(t.shape)) for n, t in items), version,
                              which, full, bucket_bytes)
    return manifest, [t.detach() for _, t in items]


def byte_view(tensor: torch.Tensor) -> torch.Tensor:
    """A tensor's bytes as a flat uint8 tensor (copied only when not contiguous)."""
    return tensor.contiguous().reshape(-1).view(torch.uint8)


def bucket_buffer(manifest: Manifest, device: torch.device) -> torch.Tensor:
    """The buffer one side packs or receives each chunk in (the largest chunk's size). Both
    sides allocate it before the handshake, where a failure (out of memory) is reported to
    every rank instead of leaving them waiting in a broadcast."""
    sizes = [hi - lo for lo, hi in manifest.chunks()]
    return torch.empty(max(sizes, default=0), dtype=torch.uint8, device=device)


def pack(manifest: Manifest, tensors: list[torch.Tensor], lo: int, hi: int,
         out: torch.Tensor) -> None:
    """Fill ``out[:hi-lo]`` with stream bytes ``[lo, hi)`` (padding left as is)."""
    for i, entry, start, end in manifest.pieces(lo, hi):
        src = byte_view(tensors[i])[start:end]
        at = entry.offset + start - lo
        out[at: at + end - start].copy_(src)
