"""Counts what one engine step costs the host: operator launches, blocking syncs, compute time.

Instruments, combined by :class:`StepProfiler` (a context manager):

* compute regions (``regions=True``): on CPU the device work runs inline on the host, so its
  time must be taken out of a step's wall time. A region is an outermost ``nn.Module`` call
  (the target, the drafter's head or LM, their LM heads: global forward hooks), a call of the
  rejection sampler (reference or Triton) and a Triton / ``_C`` kernel launch outside those.
  Tensor ops the engine issues outside any module count as host work: on a GPU each one is a
  launch the host pays for. (Timing each aten op under a dispatch mode was tried and rejected:
  an op called from inside a ``TorchDispatchMode`` handler takes 2-3x its eager time, so the
  subtracted "compute" exceeded the step's own wall time.)
* a ``TorchDispatchMode`` (``dispatch=True``) that counts every aten operator that launches a
  kernel on a GPU (views, allocations and metadata ops excluded; host<->device copies apart;
  on a CUDA machine, ops on host tensors only are host work, not launches);
* wrappers of the Triton launch (``JITFunction.run``, and the interpreter's
  ``InterpretedFunction.run`` under ``TRITON_INTERPRET=1``) and of the ``specengine._C`` kernel
  entry points (pybind functions the dispatch mode cannot see); aten ops issued *inside* a
  Triton launch (the interpreter's own work) are not counted;
* wrappers of the ``Tensor`` methods that block on a GPU until the device is done (``tolist``,
  ``item``, ``cpu``, ``numpy``, ``bool()``/``int()``/``float()``) and of explicit
  synchronisations, counted only when called from files under ``specengine/`` or ``kernels/``,
  plus ``aten._local_scalar_dense`` reached from those files without such a method. On CPU a
  tensor's device cannot tell whether the same call would block on a GPU, so every such call
  counts (an upper bound); on CUDA only calls on CUDA tensors count.

``LayerScope`` attributes launches to the target's decoder layers (forward hooks), for the
"launches per decoder layer" figure. Used by ``bench_host_overhead.py``.
"""

from __future__ import annotations

import functools
import sys
import time
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

import torch
from step_counts import Counts, LayerScope
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# Ops that never launch a device kernel: allocation, aliasing, metadata, scalar reads (the
# last one is a sync, counted as such).
_NO_KERNEL = {
    _aten.empty, _aten.empty_strided, _aten.empty_like, _aten.new_empty,
    _aten.new_empty_strided, _aten._unsafe_view, _aten.detach, _aten.lift_fresh, _aten.alias,
    _aten.set_, _aten.resize_, _aten.sym_size, _aten.sym_stride, _aten.sym_numel,
    _aten.sym_storage_offset, _aten.is_same_size, _aten._local_scalar_dense,
    _aten.record_stream, _aten._pin_memory, _aten.is_pinned,
}
_COPIES = {_aten.copy_, _aten._to_copy}
_SYNC_METHODS = ("tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__")
_C_KERNELS = ("reshape_and_cache_host", "reshape_and_cache_cuda", "compact_kv_host",
              "compact_kv_cuda")
# Device work called as plain functions (module, attribute): the fused rejection sampler.
_COMPUTE_FUNCS = (("specengine.kernels.reference", "rejection_sample"),
                  ("specengine.kernels.rejection_sampling", "rejection_sample"),
                  # A static pass (verify + sampling, a drafter's k-step loop): on CUDA it is
                  # one graph replay, so on the CPU its time is device work too.
                  ("specengine.core.graphs", "GraphRunner.run_graph"))
_HERE = str(Path(__file__).resolve())
_TORCH_DIR = str(Path(torch.__file__).resolve().parent)


def project_roots() -> tuple[str, ...]:
    """Folders whose calls count as the engine's own: ``specengine/`` and ``kernels/``."""
    import specengine
    import specengine.kernels

    dirs = {str(p) + "/" for m in (specengine, specengine.kernels)
            for p in (Path(m.__file__).parent, Path(m.__file__).resolve().parent)}
    return tuple(sorted(dirs))


def _devices(args: Iterable[Any], out: Any) -> set[torch.device]:
    devices = {a.device for a in args if isinstance(a, torch.Tensor)}
    outs = out if isinstance(out, (tuple, list)) else (out,)
    devices.update(o.device for o in outs if isinstance(o, torch.Tensor))
    return devices


class _Recorder(TorchDispatchMode):
    def __init__(self, prof: StepProfiler) -> None:
        super().__init__()
        self.prof = prof

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        prof = self.prof
        if prof._inside_launch or prof._inside_sync:
            return func(*args, **kwargs)
        packet = func.overloadpacket
        if packet is _aten._local_scalar_dense:
            site = prof._project_caller(skip_torch=True)
            t0 = time.perf_counter()
            out = func(*args, **kwargs)
            if site is not None:
                prof._count_sync(site, "_local_scalar_dense", time.perf_counter() - t0)
            return out
        if func.is_view or packet in _NO_KERNEL:
            return func(*args, **kwargs)
        out = func(*args, **kwargs)
        c = prof.counts
        devices = _devices((*args, *kwargs.values()), out)
        if prof.cuda and all(d.type == "cpu" for d in devices):
            return out  # host work on a GPU machine (staging arrays): no launch
        if packet in _COPIES and len(devices) > 1:
            c.copies += 1
        else:
            c.aten_kernels += 1
        c.add_op(str(packet))
        prof.layers.on_launch()
        return out


@functools.cache
def _short(filename: str) -> str:
    """``dir/file.py`` of a source file (cached: the profiler's own cost counts as host time
    at every sync site it wraps)."""
    p = Path(filename)
    return f"{p.parent.name}/{p.name}"


class StepProfiler:
    """``with StepProfiler(dispatch=True) as p: ...; p.counts`` (see the module docstring).

    ``dispatch=False`` installs only the cheap wrappers (syncs, Triton and ``_C`` launches,
    graph replays), for runs whose wall time is measured; ``syncs=False`` leaves the blocking
    methods alone too (a CPU timing run: its host time needs no sync times, and a wrapper that
    walks frames at each read would count as host time).
    """

    def __init__(self, *, dispatch: bool = True, regions: bool = True, syncs: bool = True,
                 roots: tuple[str, ...] | None = None) -> None:
        self.dispatch = dispatch
        self.regions = regions
        self.syncs = syncs  # wrap the blocking Tensor methods (count and time the syncs)
        self.cuda = torch.cuda.is_available()
        self._region_depth = 0
        self._region_t0 = self._region_c0 = 0.0
        self.roots = roots if roots is not None else project_roots()
        self.counts = Counts()
        self.layers = LayerScope()
        self._inside_launch = False
        self._inside_sync = 0
        self._undo: list[Callable[[], None]] = []
        self._mode: _Recorder | None = None

    def reset(self) -> Counts:
        """Starts a new region; returns the finished one's counts."""
        done, self.counts = self.counts, Counts()
        return done

    # -- compute regions ---------------------------------------------------------------------
    def _enter_region(self, *_: Any) -> None:
        if self._region_depth == 0:
            self._region_t0 = time.perf_counter()
            self._region_c0 = time.thread_time()
        self._region_depth += 1

    def _leave_region(self, *_: Any) -> None:
        self._region_depth -= 1
        if self._region_depth == 0:
            self.counts.compute_s += time.perf_counter() - self._region_t0
            self.counts.compute_cpu_s += time.thread_time() - self._region_c0

    def _region_wrapper(self, orig: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self._enter_region()
            try:
                return orig(*args, **kwargs)
            finally:
                self._leave_region()
        return wrapper

    # -- frames ------------------------------------------------------------------------------
    def _project_caller(self, *, skip_torch: bool) -> str | None:
        """``file:line`` of the innermost frame outside this file (and torch, with
        ``skip_torch``) when that frame is in a project root, else None."""
        frame = sys._getframe(1)
        while frame is not None:
            name = frame.f_code.co_filename
            if name != _HERE and not (skip_torch and name.startswith(_TORCH_DIR)):
                if not name.startswith(self.roots):
                    return None
                return f"{_short(name)}:{frame.f_lineno}"
            frame = frame.f_back
        return None

    def _count_sync(self, site: str, what: str, seconds: float) -> None:
        c = self.counts
        c.syncs += 1
        c.sync_s += seconds
        key = f"{site} {what}"
        c.sync_sites[key] = c.sync_sites.get(key, 0) + 1

    # -- patching ----------------------------------------------------------------------------
    def _patch(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        had = name in vars(owner)
        orig = getattr(owner, name)
        setattr(owner, name, make(orig))
        self._undo.append(lambda: setattr(owner, name, orig) if had else delattr(owner, name))

    def _launch_wrapper(self, kind: str, name: str) -> Callable[[Any], Any]:
        def make(orig: Any) -> Any:
            def wrapper(*args: Any, **kwargs: Any) -> Any:
                if self._inside_launch or kwargs.get("warmup", False):
                    return orig(*args, **kwargs)
                self._inside_launch = True
                self._enter_region()
                try:
                    return orig(*args, **kwargs)
                finally:
                    self._inside_launch = False
                    self._leave_region()
                    c = self.counts
                    setattr(c, kind, getattr(c, kind) + 1)
                    fn = getattr(args[0], "fn", None) if args else None
                    c.add_op(name if kind == "c_kernels" else getattr(fn, "__name__", name))
                    self.layers.on_launch()
            return wrapper
        return make

    def _sync_wrapper(self, what: str) -> Callable[[Any], Any]:
        def make(orig: Any) -> Any:
            def wrapper(t: Any, *args: Any, **kwargs: Any) -> Any:
                site = None
                if not torch.cuda.is_available() or getattr(t, "is_cuda", True):
                    site = self._project_caller(skip_torch=False)
                self._inside_sync += 1
                t0 = time.perf_counter()
                try:
                    return orig(t, *args, **kwargs)
                finally:
                    self._inside_sync -= 1
                    if site is not None:
                        self._count_sync(site, what, time.perf_counter() - t0)
            return wrapper
        return make

    def _replay_wrapper(self, orig: Any) -> Any:
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            self.counts.graph_replays += 1
            return orig(*args, **kwargs)
        return wrapper

    def __enter__(self) -> StepProfiler:
        from triton.runtime.jit import JITFunction

        from specengine import _C

        self._patch(JITFunction, "run", self._launch_wrapper("triton", "triton"))
        try:
            from triton.runtime.interpreter import InterpretedFunction
        except ImportError:  # a Triton without the interpreter
            InterpretedFunction = None  # noqa: N806
        if InterpretedFunction is not None and "run" in vars(InterpretedFunction):
            self._patch(InterpretedFunction, "run", self._launch_wrapper("triton", "triton"))
        for name in _C_KERNELS:
            if hasattr(_C, name):
                self._patch(_C, name, self._launch_wrapper("c_kernels", name))
        for name in _SYNC_METHODS if self.syncs else ():
            self._patch(torch.Tensor, name, self._sync_wrapper(name))
        if torch.cuda.is_available() and self.syncs:
            for owner, label in ((torch.cuda, "cuda.synchronize"),
                                 (torch.cuda.Event, "Event.synchronize"),
                                 (torch.cuda.Stream, "Stream.synchronize")):
                self._patch(owner, "synchronize", lambda o, lb=label: self._sync_any(o, lb))
            self._patch(torch.cuda.CUDAGraph, "replay", self._replay_wrapper)
        if self.regions:
            import importlib

            from torch.nn.modules import module as nn_module

            for mod_name, attr in _COMPUTE_FUNCS:
                try:
                    mod = importlib.import_module(mod_name)
                except ImportError:
                    continue
                owner_name, _, attr = attr.rpartition(".")
                owner = getattr(mod, owner_name, None) if owner_name else mod
                if owner is not None and hasattr(owner, attr):
                    self._patch(owner, attr, self._region_wrapper)
            handles = (nn_module.register_module_forward_pre_hook(self._enter_region),
                       nn_module.register_module_forward_hook(self._leave_region,
                                                              always_call=True))
            self._undo.extend(h.remove for h in handles)
        if self.dispatch:
            self._mode = _Recorder(self)
            self._mode.__enter__()
        return self

    def _sync_any(self, orig: Any, label: str) -> Any:
        # Not a tensor method: a None placeholder takes the tensor's place (always counted);
        # an Event's or Stream's ``self`` stays in ``a``.
        inner = self._sync_wrapper(label)(lambda _t, *a, **k: orig(*a, **k))
        return lambda *a, **k: inner(None, *a, **k)

    def __exit__(self, *exc: object) -> None:
        if self._mode is not None:
            self._mode.__exit__(*exc)
            self._mode = None
        self.layers.detach()
        while self._undo:
            self._undo.pop()()
