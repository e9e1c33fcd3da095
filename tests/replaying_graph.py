"""A stand-in for ``torch.cuda.CUDAGraph`` on the CPU, for ``GraphRunner(graph_factory=...)``.

A CUDA graph's replay reruns the captured kernels and writes the *captured* output tensors in
place. This does the same with Python: ``capture`` runs the pass once and keeps its outputs,
``replay`` runs it again and copies the fresh results into those kept tensors. It lets the CPU
tests drive the runner's capture / replay path (warm-up, capture, replay, outputs consumers
keep across steps) that only a GPU runs for real; a consumer that held on to anything but the
captured outputs would read stale values and the outputs would differ from the eager path.

It is strict about what a real graph would silently ignore. A replayed CUDA graph launches
the captured kernels with the captured arguments: the addresses of the tensors the pass read
and every Python value that reached a kernel (a slice bound, a scalar operand, a shape). A
pass whose Python code would now compute something else (it reads an attribute that was
replaced by a new tensor, an int that changed, a host value read back inside the pass) gives
a stale result on a GPU and a correct one in a plain re-run. So ``capture`` records the pass's
trace, every torch call it makes (a ``TorchFunctionMode``) with its arguments reduced to what a
launch bakes in: tensors made earlier in the pass by their position in the trace, tensors from
outside it by address and layout, Python values by value; each ``replay`` traces the re-run
and raises :class:`StaleCapture` at the first call that differs.

The attention backend's methods are kernels (one launch each on a GPU, reading lengths on the
device): they are recorded as one call each with their arguments, and what the PyTorch
reference does inside them (it reads lengths back to size its padding) is not traced.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

from specengine.model.attention import AttentionBackend


class StaleCapture(AssertionError):
    """A replay's pass differs from its capture in what a CUDA graph bakes in."""


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


class _Trace(TorchFunctionMode):
    """Every torch call of a pass, reduced to what a captured launch depends on."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: list[tuple[str, Any]] = []
        self._made: dict[int, int] = {}  # id of a tensor made in the pass -> call index
        self._keep: list[Any] = []  # the pass's tensors stay alive: their ids stay unique
        self._opaque = 0  # inside a kernel (an attention backend method)
        self._patched: list[tuple[type, str, Any]] = []

    def __enter__(self) -> _Trace:
        classes, todo = [], [AttentionBackend]
        while todo:
            cls = todo.pop()
            classes.append(cls)
            todo.extend(cls.__subclasses__())
        names = [n for n, v in vars(AttentionBackend).items()
                 if callable(v) and not n.startswith("_")]
        for cls in classes:
            for name in names:
                if name in vars(cls):
                    self._patched.append((cls, name, vars(cls)[name]))
                    setattr(cls, name, self._kernel(vars(cls)[name]))
        return super().__enter__()  # type: ignore[return-value]

    def __exit__(self, *exc: object) -> None:
        super().__exit__(*exc)
        for cls, name, fn in reversed(self._patched):
            setattr(cls, name, fn)

    def _kernel(self, fn: Callable) -> Callable:
        @functools.wraps(fn)
        def kernel(backend: Any, *args: Any, **kwargs: Any) -> Any:
            if self._opaque:
                return fn(backend, *args, **kwargs)
            self.calls.append((f"kernel {fn.__qualname__}", (self._arg(args), self._arg(
                kwargs))))
            self._opaque += 1
            try:
                out = fn(backend, *args, **kwargs)
            finally:
                self._opaque -= 1
            ins = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
            self._note(out, ins, len(self.calls) - 1)
            return out
        return kernel

    def _arg(self, x: Any, depth: int = 0) -> Any:
        if isinstance(x, torch.Tensor):
            made = self._made.get(id(x))
            if made is not None:
                return ("made", made)
            return ("outside", x.data_ptr(), tuple(x.shape), tuple(x.stride()), x.dtype)
        if x is None or isinstance(x, (bool, int, float, complex, str, torch.dtype,
                                       torch.device, torch.Size)):
            return x
        if isinstance(x, slice):
            return ("slice", self._arg(x.start), self._arg(x.stop), self._arg(x.step))
        if isinstance(x, (list, tuple)) and depth < 3:
            return tuple(self._arg(v, depth + 1) for v in x)
        if isinstance(x, dict) and depth < 3:
            return tuple(sorted((k, self._arg(v, depth + 1)) for k, v in x.items()))
        if dataclasses.is_dataclass(x) and not isinstance(x, type) and depth < 3:
            return (type(x).__name__, tuple(self._arg(getattr(x, f.name), depth + 1)
                                            for f in dataclasses.fields(x)))
        return ("object", type(x).__name__)

    def _note(self, out: Any, inputs: set[int], index: int, depth: int = 0) -> None:
        if isinstance(out, torch.Tensor):
            # An in-place op returns its input: it stays what it was (outside or made).
            if id(out) not in inputs and id(out) not in self._made:
                self._made[id(out)] = index
                self._keep.append(out)
        elif isinstance(out, (list, tuple)) and depth < 2:
            for o in out:
                self._note(o, inputs, index, depth + 1)

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if self._opaque:
            return func(*args, **kwargs)
        name = getattr(func, "__qualname__", None) or repr(func)
        self.calls.append((name, (self._arg(args), self._arg(kwargs))))
        out = func(*args, **kwargs)
        inputs = {id(a) for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        self._note(out, inputs, len(self.calls) - 1)
        if name.rsplit(".", 1)[-1] in _VALUE_READS:
            # A value read back from a tensor in the pass (``item``, ``bool``): a graph keeps
            # the one seen at capture; later calls that use it show the difference.
            self.calls.append(("result", out))
        return out


# Reads of a tensor's values into Python (a host sync on a GPU; a capture would fail or keep
# the captured value)
_VALUE_READS = ("item", "tolist", "__int__", "__bool__", "__float__", "__index__")


def _describe(calls: list, at: int) -> str:
    return repr(calls[at]) if at < len(calls) else "<the pass ended>"


class ReplayingGraph:
    def __init__(self, pool: Any) -> None:
        self.pool = pool
        self.fn: Callable[[], Any] | None = None
        self.out: Any = None
        self.replays = 0
        self.trace: list[tuple[str, Any]] = []

    def capture(self, fn: Callable[[], Any]) -> Any:
        self.fn = fn
        self.out, self.trace = self._traced()
        return self.out

    def _traced(self) -> tuple[Any, list]:
        with torch.inference_mode():  # the passes make inference tensors, as on a GPU
            with _Trace() as trace:
                out = self.fn()  # type: ignore[misc]
        return out, trace.calls

    def replay(self) -> None:
        fresh, calls = self._traced()
        if calls != self.trace:
            at = next((i for i, (a, b) in enumerate(zip(calls, self.trace)) if a != b),
                      min(len(calls), len(self.trace)))
            raise StaleCapture(
                f"a replay's pass differs from its capture at torch call {at} of "
                f"{len(self.trace)} (a CUDA graph would replay the captured one):\n"
                f"  captured: {_describe(self.trace, at)}\n  now:      {_describe(calls, at)}\n"
                f"  after: {_describe(calls, at - 1) if at else None}")
        with torch.inference_mode():
            copy_into(self.out, fresh)
        self.replays += 1
