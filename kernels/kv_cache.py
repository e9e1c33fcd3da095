"""KV-cache writes and accepted-path compaction: launchers over the ``specengine._C`` kernels.

The element routines live once in ``csrc/kv_ops.h`` and are shared by a host loop (tested on
CPU) and a CUDA kernel (compiled for sm_90a / sm_100a). These launchers check every tensor and
pass raw addresses, sizes and strides, so ``_C`` itself needs no torch headers.
Specifications: ``kernels/reference.py`` (``reshape_and_cache``, ``compact_kv``).
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

_SLOT_DTYPES = (torch.int32, torch.int64)


def _check_cache(name: str, cache: Tensor) -> None:
    if cache.dim() != 4:
        raise ValueError(
            f"{name} must be [num_blocks, block_size, Hkv, D], got {tuple(cache.shape)}"
        )
    if not cache.is_contiguous():
        raise ValueError(f"{name} must be contiguous (the kernels index it as flat slots)")


def _check_slots(name: str, slots: Tensor, n: int, device: torch.device) -> None:
    if slots.dtype not in _SLOT_DTYPES:
        raise TypeError(f"{name} must be int32 or int64, got {slots.dtype}")
    if slots.shape != (n,):
        raise ValueError(f"{name} must have shape ({n},), got {tuple(slots.shape)}")
    if slots.device != device:
        raise ValueError(f"{name} is on {slots.device} but the cache is on {device}")


def reshape_and_cache(
    key: Tensor,  # [T, Hkv, D]
    value: Tensor,  # [T, Hkv, D]
    k_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: Tensor,  # [T] int32/int64; negative = skip (padding)
) -> None:
    """Scatter new K/V into their cache slots, in place (``reference.reshape_and_cache``)."""
    from specengine import _C

    _check_cache("k_cache", k_cache)
    _check_cache("v_cache", v_cache)
    if k_cache.shape != v_cache.shape or k_cache.dtype != v_cache.dtype:
        raise ValueError("k_cache and v_cache must have the same shape and dtype")
    _, _, num_heads, head_dim = k_cache.shape
    for name, t in (("key", key), ("value", value)):
        if t.dim() != 3 or t.shape[1:] != (num_heads, head_dim):
            raise ValueError(f"{name} must be [T, {num_heads}, {head_dim}], got {tuple(t.shape)}")
        if t.dtype != k_cache.dtype:
            raise TypeError(f"{name} dtype {t.dtype} differs from the cache's {k_cache.dtype}")
        if t.stride(2) != 1:
            raise ValueError(f"{name} must be contiguous along head_dim")
        if t.device != k_cache.device:
            raise ValueError(f"{name} is on {t.device} but the cache is on {k_cache.device}")
    num_tokens = key.shape[0]
    if value.shape[0] != num_tokens:
        raise ValueError(f"key has {num_tokens} tokens but value has {value.shape[0]}")
    _check_slots("slot_mapping", slot_mapping, num_tokens, k_cache.device)
    if num_tokens == 0:
        return
    slot_mapping = slot_mapping.contiguous()
    args = (
        key.data_ptr(), value.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
        slot_mapping.data_ptr(), slot_mapping.dtype == torch.int64, num_tokens, num_heads,
        head_dim, key.element_size(), key.stride(0), key.stride(1), value.stride(0),
        value.stride(1), k_cache.shape[0] * k_cache.shape[1],
    )
    if k_cache.is_cuda:
        _C.reshape_and_cache_cuda(*args, torch.cuda.current_stream(k_cache.device).cuda_stream)
    else:
        try:
            _C.reshape_and_cache_host(*args)
        except IndexError as e:  # std::out_of_range: nothing was written
            raise IndexError(f"reshape_and_cache: {e}") from None


# Device copies of the per-layer base-pointer tables, keyed by the pointers themselves: the
# cache tensors live for the engine's lifetime, so the table is built once per cache.
_PTR_TABLES: dict[tuple[int, ...], Tensor] = {}
# What compact_kv_cache needs of a whole cache, by (address, shape, dtype): per-layer K / V
# addresses, their device table on CUDA, and (Hkv, D, element size, slots per layer).
_CACHES: dict[tuple, tuple[list[int], Tensor | None, tuple[int, int, int, int]]] = {}


def compact_kv(
    k_caches: list[Tensor],  # per layer [num_blocks, block_size, Hkv, D]
    v_caches: list[Tensor],
    src_slots: Tensor,  # [N] int: slots holding the accepted path's entries
    dst_slots: Tensor,  # [N] int: where they go (context_len .. context_len + accepted)
) -> None:
    """Move accepted tree nodes to contiguous slots in every layer with one launch.

    Pairs must be *ordered* (no pair reads a slot an earlier pair writes): accepted paths listed
    sequence by sequence in path order always are, since within a path ``dst <= src`` and both
    increase. Destinations must be distinct. The host version checks both and raises.
    """
    caches = [*k_caches, *v_caches]
    if not caches or len(k_caches) != len(v_caches):
        raise ValueError("compact_kv needs as many K caches as V caches, at least one each")
    first = caches[0]
    for i, c in enumerate(caches):
        _check_cache(f"caches[{i}]", c)
        if c.shape != first.shape or c.dtype != first.dtype or c.device != first.device:
            raise ValueError("every cache must have the same shape, dtype and device")
    _launch_compact([c.data_ptr() for c in caches], first, src_slots, dst_slots)


def compact_kv_cache(
    kv: Tensor,  # [2, num_layers, num_blocks, block_size, Hkv, D]: a whole paged cache
    slots: np.ndarray | Tensor,  # [2, N] int64: row 0 the source slots, row 1 destinations
) -> None:
    """:func:`compact_kv` over every layer (K and V) of one contiguous paged cache. What the
    launch needs of ``kv`` (checks, per-layer addresses) is made once per cache, so the
    launcher's host cost does not grow with the number of layers. ``slots`` is a tensor on
    ``kv``'s device (the verify pass computes them there: no host data, capturable; pairs
    with a negative slot are skipped) or a host array (on CUDA one non-blocking copy; on the
    CPU the host kernel reads it in place)."""
    key = (kv.data_ptr(), kv.shape, kv.dtype)
    cache = _CACHES.get(key)
    if cache is None:
        if kv.dim() != 6 or kv.shape[0] != 2:
            raise ValueError(f"kv must be [2, num_layers, num_blocks, block_size, Hkv, D], "
                             f"got {tuple(kv.shape)}")
        if not kv.is_contiguous():
            raise ValueError("kv must be contiguous (the kernels index it as flat slots)")
        step = kv[0, 0].numel() * kv.element_size()
        ptrs = [kv.data_ptr() + i * step for i in range(2 * kv.shape[1])]
        table = (torch.tensor(ptrs, dtype=torch.int64, device=kv.device) if kv.is_cuda
                 else None)
        cache = _CACHES[key] = (ptrs, table, (kv.shape[4], kv.shape[5], kv.element_size(),
                                              kv.shape[2] * kv.shape[3]))
    on_device = isinstance(slots, Tensor)
    if (slots.dtype != (torch.int64 if on_device else np.int64) or slots.ndim != 2
            or slots.shape[0] != 2 or (on_device and slots.device != kv.device)):
        raise ValueError("slots must be [2, N] int64 (sources, destinations), a tensor on the "
                         f"cache's device or a host array, got {slots.dtype} "
                         f"{tuple(slots.shape)} on {getattr(slots, 'device', 'the host')}")
    n = slots.shape[1]
    if n == 0:
        return
    from specengine import _C

    ptrs, table, (num_heads, head_dim, elem, num_slots) = cache
    if on_device:
        dev = slots.contiguous()
    elif table is not None:
        # Host slots are checked here, where reading them costs no sync (bounds, distinct
        # destinations, ordered moves: a bad pair raises with nothing written, as on the
        # CPU); then to the device without blocking (page-locked staging).
        slots = np.ascontiguousarray(slots)
        try:
            _C.check_compact_kv(slots.ctypes.data, slots.ctypes.data + 8 * n, True, n,
                                num_slots)
        except (IndexError, ValueError) as e:
            raise type(e)(f"compact_kv: {e}") from None
        dev = torch.from_numpy(slots).pin_memory().to(kv.device, non_blocking=True)
    else:
        dev = None
        slots = np.ascontiguousarray(slots)
    if table is not None:
        src = dev.data_ptr()  # type: ignore[union-attr]
        _C.compact_kv_cuda(ptrs, table.data_ptr(), src, src + 8 * n, True, n, num_heads,
                           head_dim, elem, num_slots,
                           torch.cuda.current_stream(kv.device).cuda_stream)
    else:
        src = dev.data_ptr() if dev is not None else slots.ctypes.data  # type: ignore
        try:
            _C.compact_kv_host(ptrs, src, src + 8 * n, True, n, num_heads, head_dim, elem,
                               num_slots)
        except (IndexError, ValueError) as e:
            raise type(e)(f"compact_kv: {e}") from None


def _launch_compact(ptrs: list[int], first: Tensor, src_slots: Tensor,
                    dst_slots: Tensor) -> None:
    """The shared launch of :func:`compact_kv` / :func:`compact_kv_cache`: ``ptrs`` address
    caches shaped like ``first`` ``[num_blocks, block_size, Hkv, D]``."""
    from specengine import _C

    n = src_slots.shape[0] if src_slots.dim() == 1 else -1
    _check_slots("src_slots", src_slots, n, first.device)
    _check_slots("dst_slots", dst_slots, n, first.device)
    if src_slots.dtype != dst_slots.dtype:
        raise TypeError("src_slots and dst_slots must have the same dtype")
    if n == 0:
        return
    src_slots = src_slots.contiguous()
    dst_slots = dst_slots.contiguous()
    _, _, num_heads, head_dim = first.shape
    num_slots = first.shape[0] * first.shape[1]
    common = (src_slots.data_ptr(), dst_slots.data_ptr(), src_slots.dtype == torch.int64, n,
              num_heads, head_dim, first.element_size(), num_slots)
    if first.is_cuda:
        key = tuple(ptrs)
        table = _PTR_TABLES.get(key)
        if table is None:
            table = torch.tensor(ptrs, dtype=torch.int64, device=first.device)
            _PTR_TABLES[key] = table
        _C.compact_kv_cuda(ptrs, table.data_ptr(), *common,
                           torch.cuda.current_stream(first.device).cuda_stream)
    else:
        try:
            _C.compact_kv_host(ptrs, *common)
        except (IndexError, ValueError) as e:
            raise type(e)(f"compact_kv: {e}") from None
