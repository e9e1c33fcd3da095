"""Engine side of vLLM's packed weight transfer (``/update_weights`` of vLLM's server with
``packed``): the learner broadcasts its tensors from rank 0 as uint8 chunks, each the bytes of
consecutive tensors (announced ``names``, ``dtype_names``, ``shapes``, in order) laid end to
end with no padding; a chunk is closed once its size exceeds ``packed_buffer_size_bytes``
(the tensor that crosses the limit is its last), so both sides know every chunk's size from
the announcement alone. Unpacked (``packed`` false): one broadcast per tensor, of its dtype
and shape. Double buffering on the learner (``packed_num_buffers``) does not change what
arrives.

:func:`receive` gets one announced update into host tensors over a
:class:`~specengine.weights.group.WeightGroup` (this engine's rank in the learner's group); the
caller commits them as any other update (``SpecEngine.stage_weights``: names, shapes, dtypes
and finite values checked, all or nothing, one version).
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from specengine.weights.group import WeightGroup

#: vLLM's default ``packed_buffer_size_bytes``
DEFAULT_PACKED_BUFFER_BYTES = 1 << 30


def chunks(sizes: Sequence[int], buffer_bytes: int) -> list[list[int]]:
    """The indices of the tensors of each packed chunk: consecutive, a chunk closed once its
    bytes exceed ``buffer_bytes``."""
    out: list[list[int]] = []
    cur: list[int] = []
    total = 0
    for i, n in enumerate(sizes):
        cur.append(i)
        total += n
        if total > buffer_bytes:
            out.append(cur)
            cur, total = [], 0
    if cur:
        out.append(cur)
    return out


def receive(group: WeightGroup, meta: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
            packed: bool, buffer_bytes: int = DEFAULT_PACKED_BUFFER_BYTES
            ) -> list[tuple[str, torch.Tensor]]:
    """Receive the announced tensors from rank 0 (``meta``: name, dtype, shape, in stream
    order), packed or one broadcast each. Host tensors of their own."""
    if buffer_bytes < 1:
        raise ValueError(f"packed_buffer_size_bytes must be >= 1, got {buffer_bytes}")
    sizes = [math.prod(shape) * dtype.itemsize for _, dtype, shape in meta]
    out: list[tuple[str, torch.Tensor]] = []
    if not packed:
        for name, dtype, shape in meta:
            t = torch.empty(shape, dtype=dtype, device=group.device)
            group.broadcast(t, 0)
            out.append((name, t.cpu()))
        return out
    for idx in chunks(sizes, buffer_bytes):
        buf = torch.empty(sum(sizes[i] for i in idx), dtype=torch.uint8, device=group.device)
        group.broadcast(buf, 0)
        buf = buf.cpu()
        at = 0
        for i in idx:
            name, dtype, shape = meta[i]
            # a copy: a piece at an odd offset cannot be viewed as a wider dtype in place
            piece = buf[at:at + sizes[i]].clone()
            out.append((name, piece.view(dtype).reshape(shape)))
            at += sizes[i]
    return out


__all__ = ["DEFAULT_PACKED_BUFFER_BYTES", "chunks", "receive"]
