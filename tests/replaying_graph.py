"""A stand-in for ``torch.cuda.CUDAGraph`` on the CPU, for ``GraphRunner(graph_factory=...)``.

A CUDA graph's replay reruns the captured kernels and writes the *captured* output tensors in
place. This does the same with Python: ``capture`` runs the pass once and keeps its outputs,
``replay`` runs it again and copies the fresh results into those kept tensors. It lets the CPU
tests drive the runner's capture / replay path (warm-up, capture, replay, outputs consumers
keep across steps) that only a GPU runs for real; a consumer that held on to anything but the
captured outputs would read stale values and the outputs would differ from the eager path.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any

import torch


def copy_into(dst: Any, src: Any) -> None:
    """Copy ``src`` into ``dst`` in place: tensors, and lists / tuples / dataclasses of them."""
    if isinstance(dst, torch.Tensor):
        dst.copy_(src)
    elif isinstance(dst, (list, tuple)):
        assert len(dst) == len(src)
        for a, b in zip(dst, src):
            copy_into(a, b)
    elif dataclasses.is_dataclass(dst):
        for f in dataclasses.fields(dst):
            copy_into(getattr(dst, f.name), getattr(src, f.name))
    else:
        assert dst is None and src is None, (dst, src)


class ReplayingGraph:
    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.fn: Callable[[], Any] | None = None
        self.out: Any = None
        self.replays = 0

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        self.out = fn()
        return self.out

    def replay(self) -> None:
        with torch.inference_mode():  # the passes make inference tensors, as on a GPU
            copy_into(self.out, self.fn())  # type: ignore[misc]
        self.replays += 1
