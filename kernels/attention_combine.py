"""Split-KV (flash-decoding) helpers for ``kernels/attention.py``.

When a batch has few sequences and few query tiles, one program per (sequence, tile, kv head)
leaves most SMs idle while each program walks a long context. Splitting the KV range across
``num_splits`` programs fills the machine; every split writes its normalised partial output and
its log-sum-exp (base 2), and the last split to finish merges them exactly in the same launch:
``o = sum_s 2^(lse_s - M) o_s / sum_s 2^(lse_s - M)`` with ``M = max_s lse_s``. "Last" is
counted per (tile, kv head) in an int32 counter from :func:`split_counters`, which the last
split sets back to 0, so the counters are zero before and after every launch.
"""

from __future__ import annotations

import functools

import torch
import triton
from torch import Tensor

#: Counter buffers per (device, stream): launches on one stream run one after another, so they
#: can share counters; launches on two streams may overlap, so they get separate ones. Every
#: buffer ever made stays referenced: a CUDA graph captured with it keeps its address.
_COUNTERS: dict[tuple[str, int | None, int], list[Tensor]] = {}


def split_counters(device: torch.device, needed: int) -> Tensor:
    """Zeroed int32 counters (at least ``needed``) for the split-KV launches of the current
    stream. Made once per stream and size (a zero-fill launch then, inside a capture part of
    the graph); the kernel leaves them zero after each launch, so reuse needs no reset."""
    stream = torch.cuda.current_stream(device).cuda_stream if device.type == "cuda" else 0
    buffers = _COUNTERS.setdefault((device.type, device.index, stream), [])
    if not buffers or buffers[-1].numel() < needed:
        buffers.append(torch.zeros(max(needed, 1024), dtype=torch.int32, device=device))
    return buffers[-1]


@functools.cache
def _num_sms(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def default_num_splits(device: torch.device, num_programs: int, max_kv_tiles: int) -> int:
    """How many KV splits to use, from shapes only (no device->host sync, CUDA-graph stable).

    ``num_programs`` = sequences x query tiles x kv heads; ``max_kv_tiles`` is an upper bound on
    the KV tiles of any sequence (from the block table width). Off CUDA the interpreter gains
    nothing from splitting, so 1.
    """
    if device.type != "cuda" or num_programs == 0:
        return 1
    sms = _num_sms(device.index if device.index is not None else torch.cuda.current_device())
    if num_programs >= sms:
        return 1  # one wave is already full: splitting only adds the combine pass
    # Aim for about two waves, but keep >= 4 KV tiles per split so the partial write and the
    # combine stay small next to the KV read; 32 splits is plenty for 32k contexts.
    want = triton.cdiv(2 * sms, num_programs)
    return max(1, min(want, max_kv_tiles // 4, 32))
