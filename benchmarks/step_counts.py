"""What the host-overhead profiler records: per-region counts, launches per decoder layer.

Filled by ``step_profiler.StepProfiler``; read by ``bench_host_overhead.py``.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class Counts:
    """What one step (or any region) did: launches, blocking syncs, graph replays, time."""

    aten_kernels: int = 0
    copies: int = 0  # copy_ / _to_copy: host<->device transfers on a GPU, copy kernels on CPU
    triton: int = 0
    c_kernels: int = 0
    syncs: int = 0
    sync_s: float = 0.0  # time blocked in those syncs
    graph_replays: int = 0
    compute_s: float = 0.0  # time inside compute regions (see the module docstring)
    compute_cpu_s: float = 0.0  # this thread's CPU time inside them (immune to time slicing)
    ops: dict[str, int] = field(default_factory=dict)  # launches by name
    sync_sites: dict[str, int] = field(default_factory=dict)  # "dir/file.py:line what"

    @property
    def launches(self) -> int:
        """Kernel launches the host issued outside graph replays (copies included)."""
        return self.aten_kernels + self.copies + self.triton + self.c_kernels

    def add_op(self, name: str) -> None:
        self.ops[name] = self.ops.get(name, 0) + 1


class LayerScope:
    """Counts launches issued inside each of ``layers``' forward calls (eager mode only)."""

    def __init__(self) -> None:
        self.depth = 0
        self.calls = 0
        self.launches = 0
        self._handles: list[Any] = []

    def attach(self, layers: Iterable[torch.nn.Module]) -> None:
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._enter))
            self._handles.append(layer.register_forward_hook(self._leave))

    def detach(self) -> None:
        for h in self._handles:
            h.remove()
        self._handles.clear()

    def _enter(self, *_: Any) -> None:
        self.depth += 1
        self.calls += 1

    def _leave(self, *_: Any) -> None:
        self.depth -= 1

    def on_launch(self) -> None:
        if self.depth > 0:
            self.launches += 1

    def per_layer(self) -> float | None:
        """Mean launches per decoder-layer call, None if no layer ran."""
        return self.launches / self.calls if self.calls else None
