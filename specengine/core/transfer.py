"""Host↔device copies of the decode step.

The step copies host data to the device only through :func:`to_device` (pinned staging and a
non-blocking copy on CUDA: the host never waits for it) and reads device data back only
through :func:`to_host` (one blocking copy per decode step). Keeping both in one place is what
lets the tests count them.
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor


def to_device(array: np.ndarray | list[int] | list[float], device: torch.device,
              dtype: torch.dtype | None = None) -> Tensor:
    """A device copy of host data that does not block the host.

    On CUDA the data is staged in page-locked memory (PyTorch's caching host allocator keeps
    the staging block alive until the copy has run, so the host may reuse its own array at
    once) and copied with ``non_blocking=True``. On the CPU it is a plain copy."""
    host = torch.from_numpy(np.ascontiguousarray(array))
    if dtype is not None:
        host = host.to(dtype)
    if device.type == "cuda":
        return host.pin_memory().to(device, non_blocking=True)
    return host.clone()  # never alias a host array the caller may change


def to_host(tensor: Tensor) -> np.ndarray:
    """The step's device→host copy (blocks until the device has produced ``tensor``)."""
    if tensor.device.type == "cpu":  # no copy happens: take one, it may be a static buffer
        return tensor.numpy(force=True).copy()
    return tensor.detach().cpu().numpy()
