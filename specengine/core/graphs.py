"""Static passes (the verify pass, drafters' k-step loops) per batch-size bucket, captured as
CUDA graphs on CUDA.

With ``cuda_graphs=True`` a batch of ``B`` rows runs as the smallest bucket ``>= B`` (padded
rows are inactive: no KV write, ignored outputs). On CUDA the first pass of each shape runs
eagerly (it compiles the kernels and serves that step), then is captured; every later pass of
that shape is one graph replay. On the CPU the very same padded, static-buffer pass runs
without capture, so the CPU tests prove the graph path's inputs and outputs. Batches above the
largest bucket run eagerly, unpadded. Graphs read only static buffers (batch state, draft
buffers, KV cache, weights), so in-place weight updates keep them valid.

Capture up front (``capture="startup"``, the default on CUDA): :meth:`GraphRunner.capture_startup`
captures the declared buckets x k set at engine start, largest bucket first (the shared pool
then grows once and smaller graphs reuse its blocks), with the garbage collector frozen and off
(a collection inside a capture costs seconds on a large heap and may free tensors mid-capture)
and without emptying the caching allocator between captures: ``torch.cuda.graph`` calls
``torch.cuda.empty_cache()`` on every ``__enter__`` (torch 2.13 included), which hands the
blocks the previous capture freed back to the driver only for the next one to ``cudaMalloc``
them again, so :class:`CudaGraph` calls ``CUDAGraph.capture_begin`` / ``capture_end`` on its own
side stream instead (what ``torch.cuda.graph`` does, minus the empties). Each shape runs
through the very function a step runs (``run_graph``'s capture), on the batch state's neutral
rows: every row is a padded row then (inactive, no KV write). Shapes outside the declared set
(trees, other k, wider small-LM catch-ups) are still captured lazily at their first use.

A graph budget (:class:`GraphBudget`: ``max_graphs``, ``max_graph_bytes``) bounds the
captures. A shape whose capture would pass it is refused for good: its pass runs eagerly on
the static buffers, exactly the CPU's uncaptured static pass (same outputs), one warning per
shape, counted in :attr:`GraphRunner.graph_stats`. A capture's bytes are not known before it
runs, so it is taken to cost what the previous capture of its kind did (startup captures run
largest first, so that over- rather than under-estimates). Startup capture stops at the first
refusal; the shapes after it are captured at first use if they fit then. It keeps the largest
buckets: a rollout with requests queued runs most of its steps at the full batch, and the pool
grows once. A drafter's catch-up reads its verify pass's outputs, so it is captured only over
a captured verify pass (``verify.producer_key``).

``SPECENGINE_GRAPH_DEBUG=1`` (or ``GraphRunner.debug``) checks every replay against its
capture, as vLLM's CUDA-graph wrapper does: the Python values and tensor addresses the pass's
closure hands it (a replay reads the captured addresses and values, whatever the step passes
now) and the addresses of the outputs it returns; a mismatch raises :class:`GraphInputMismatch`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import itertools
import logging
import os
import time
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from specengine.config import MAX_K, EngineConfig
from specengine.core.batch import BatchState
from specengine.core.memory_plan import max_graph_bytes, verify_k_max
from specengine.core.model_runner import ModelRunner
from specengine.core.sampler import Sampler
from specengine.core.step_types import VerifyOutput, VerifyShape
from specengine.core.verify import StaticVerifier, producer_key
from specengine.tree import MAX_TREE_NODES

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)
#: the k captured at start when ``capture_ks`` is None and the engine has a drafter: every k
#: a ``k="auto"`` request picks with the default ``k_max`` (``core.auto_k.DEFAULT_K_MAX``,
#: checked by a test), which covers the usual fixed k too. Without a drafter only k = 0 runs.
DEFAULT_CAPTURE_KS = tuple(range(9))
#: env var that turns on :attr:`GraphRunner.debug` (replays checked against their capture)
GRAPH_DEBUG_ENV = "SPECENGINE_GRAPH_DEBUG"

Pass = tuple[tuple, Callable[[], Any]]  # a run_graph key and the pass it captures


class GraphInputMismatch(RuntimeError):
    """A replay was handed other inputs (or holds other outputs) than its graph captured."""


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the two calls the runner makes; every graph of a runner
    shares one memory pool (their outputs stay referenced, so none reuses another's)."""

    _stream: Any = None  # the capture stream (one per process, like torch.cuda.graph's)

    def __init__(self, pool: tuple[int, int] | None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Record ``fn`` (nothing runs); returns the outputs each replay writes.

        ``capture_begin`` / ``capture_end`` directly rather than ``torch.cuda.graph``: that
        context manager empties the caching allocator (``torch.cuda.empty_cache()``) on every
        entry, so a run of captures would give each one's freed blocks back to the driver and
        ``cudaMalloc`` them again for the next (module docstring)."""
        if CudaGraph._stream is None:
            CudaGraph._stream = torch.cuda.Stream()
        stream = CudaGraph._stream
        torch.cuda.synchronize()  # the warm-up's work is done before the capture reads it
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            # thread_local: weight updates are received and checked on other threads (server
            # endpoints stage off the step loop); their device work must not invalidate a
            # capture running here, and only this thread's unsafe calls may fail it.
            self.graph.capture_begin(pool=self.pool, capture_error_mode="thread_local")
            try:
                out = fn()
            finally:
                self.graph.capture_end()
        torch.cuda.current_stream().wait_stream(stream)
        self.pool = self.graph.pool()
        return out

    def replay(self) -> None:
        self.graph.replay()


class StartupPasses(Protocol):
    """What a static drafter gives :meth:`GraphRunner.capture_startup` (``StaticDrafts``)."""

    samples: bool  # its chain drafts carry distributions (the verify pass reads probs)

    def startup_draft(self, rows: int, k: int) -> list[Pass]:
        """Its draft passes of a ``rows`` x ``k`` step (k >= 1)."""

    def startup_observe(self, shape: VerifyShape, out: VerifyOutput) -> list[Pass]:
        """Its catch-up passes after the verify pass of ``shape`` (outputs ``out``)."""


@dataclass(frozen=True)
class GraphBudget:
    """Most graphs a runner captures and most bytes their captures may reserve (None: no
    limit); ``EngineConfig.max_graphs`` / ``max_graph_bytes``, the bytes defaulting on CUDA to
    the memory plan's (``memory_plan.max_graph_bytes``)."""

    max_graphs: int | None = None
    max_bytes: int | None = None

    def __post_init__(self) -> None:
        for name in ("max_graphs", "max_bytes"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)
                                      or value < 0):
                raise ValueError(f"GraphBudget.{name} must be None or an int >= 0, got "
                                 f"{value!r}")

    def refuses(self, num_graphs: int, used_bytes: int, next_bytes: int) -> str | None:
        """Why one more capture is refused when ``num_graphs`` graphs reserved ``used_bytes``
        and it would take about ``next_bytes``; None when it fits. Bytes reached count as
        spent: a capture's estimate may be 0 (the first, or one that fitted in the pool)."""
        if self.max_graphs is not None and num_graphs + 1 > self.max_graphs:
            return f"max_graphs={self.max_graphs} graphs are captured"
        if self.max_bytes is not None and (used_bytes >= self.max_bytes
                                           or used_bytes + next_bytes > self.max_bytes):
            return (f"max_graph_bytes={self.max_bytes}: the graphs reserved {used_bytes} B, "
                    f"this one would take about {next_bytes} B more")
        return None


@dataclass(frozen=True)
class CaptureRecord:
    """One captured shape: its key, the seconds its warm-up + capture + first replay took, and
    the device memory they reserved (0 off CUDA)."""

    key: tuple
    seconds: float
    bytes: int
    startup: bool

    def __post_init__(self) -> None:
        if self.seconds < 0 or self.bytes < 0:
            raise ValueError(f"a capture takes seconds >= 0 and bytes >= 0, got {self}")


@dataclass(frozen=True)
class GraphStats:
    """Every capture of a :class:`GraphRunner` (``engine.graphs.graph_stats``) and the
    shapes its budget refused (they run eagerly)."""

    captures: tuple[CaptureRecord, ...]
    refused: tuple[tuple, ...] = ()

    def __post_init__(self) -> None:
        keys = {c.key for c in self.captures}
        if len(keys) != len(self.captures):
            raise ValueError("a shape is captured once")
        if len(set(self.refused)) != len(self.refused) or keys & set(self.refused):
            raise ValueError("a shape is refused once, and then never captured")

    @property
    def num_refused(self) -> int:
        return len(self.refused)

    @property
    def num_startup(self) -> int:
        return sum(c.startup for c in self.captures)

    @property
    def num_lazy(self) -> int:
        return len(self.captures) - self.num_startup

    @property
    def startup_s(self) -> float:
        return sum(c.seconds for c in self.captures if c.startup)

    @property
    def graph_bytes(self) -> int:
        return sum(c.bytes for c in self.captures)


class StepClock:
    """Times a decode step's phases (draft, verify, bookkeeping) into a ``StepTimes``.

    Off CUDA: the engine thread's CPU time, ``time.thread_time`` (verify ends once the sampled
    tokens are on the host). On an idle machine that is the step's wall time (the thread runs
    the step throughout; with several torch threads it is one of the team working the whole
    parallel region), and on a shared one it leaves out the time slices other jobs took: wall
    time there is mostly waiting (10x the step's CPU time at load 12 on 2 cores), which would
    make the ``k="auto"`` fit noise. On CUDA
    (``events``: a factory of timing events) an event is recorded on the stream at each phase
    boundary, because the host only launches the passes: without a device clock the drafter's
    device time lands in verify (the host waits for it at the sync) and the ``k="auto"`` cost
    fit is skewed. No event is waited for: draft and verify are read right after the step's
    one sync (their events are done by then); bookkeeping ends with the drafter's catch-up
    pass, launched after that sync, so it is read at the next step's sync, or when the run's
    stats are read (``StepTimes.settle``)."""

    def __init__(self, events: Callable[[], Any] | None = None) -> None:
        self.events = events
        self._t = [0.0, 0.0, 0.0]
        # Two sets of [start, drafted, verified, end]: a step records one while the previous
        # step's (end not read yet) is still pending.
        self._sets = [[events() for _ in range(4)] for _ in range(2)] if events else []
        self._cur: list[Any] = []
        self._flip = 0
        self._last: Any = None  # the StepTimes whose bookkeeping is pending

    def start(self) -> None:
        if self.events is None:
            self._t[0] = time.thread_time()
            return
        self._flip ^= 1
        self._cur = self._sets[self._flip]
        self._cur[0].record()

    def drafted(self) -> None:
        if self.events is None:
            self._t[1] = time.thread_time()
        else:
            self._cur[1].record()

    def verified(self) -> None:
        """The verify pass is launched (before the sync)."""
        if self.events is not None:
            self._cur[2].record()

    def synced(self, times: Any) -> None:
        """Right after the step's one device→host read."""
        if self.events is None:
            self._t[2] = time.thread_time()
            times.draft += self._t[1] - self._t[0]
            times.verify += self._t[2] - self._t[1]
            return
        e = self._cur
        times.draft += e[0].elapsed_time(e[1]) / 1e3  # milliseconds
        times.verify += e[1].elapsed_time(e[2]) / 1e3
        if self._last is not None:  # the previous step's end is before this sync
            self._last.settle(wait=False)
            self._last = None

    def end(self, times: Any) -> None:
        if self.events is None:
            times.bookkeeping += time.thread_time() - self._t[2]
            return
        self._cur[3].record()
        times.pending = (self._cur[2], self._cur[3])
        self._last = times


def fingerprint(value: Any, depth: int = 0) -> Any:
    """What a captured pass bakes in of ``value``: a tensor's address and layout, a Python
    scalar's value, containers and dataclasses item by item; other objects by identity."""
    if isinstance(value, torch.Tensor):
        return ("tensor", value.data_ptr(), tuple(value.shape), value.stride(), value.dtype)
    if value is None or isinstance(value, (bool, int, float, str, bytes, torch.dtype)):
        return (type(value).__name__, value)
    if depth > 4:
        return ("obj", type(value).__name__, id(value))
    if isinstance(value, (tuple, list)):
        return (type(value).__name__, tuple(fingerprint(v, depth + 1) for v in value))
    if isinstance(value, np.ndarray):
        return ("ndarray", value.dtype.str, value.shape, value.tobytes())
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return (type(value).__name__, tuple(fingerprint(getattr(value, f.name), depth + 1)
                                            for f in dataclasses.fields(value)))
    return ("obj", type(value).__name__, id(value))


def closure_fingerprint(fn: Callable[[], Any]) -> Any:
    """:func:`fingerprint` of what ``fn`` (a lambda over a pass) hands the pass: its code and
    the values of its closure cells."""
    code = getattr(fn, "__code__", None)
    cells = tuple(c.cell_contents for c in getattr(fn, "__closure__", None) or ())
    return (id(code), fingerprint(cells))


def _first_difference(a: Any, b: Any, path: str = "") -> str:
    if type(a) is not type(b) or not isinstance(a, tuple) or len(a) != len(b):
        return f"{path or 'value'}: captured {a!r}, now {b!r}"
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return _first_difference(x, y, f"{path}[{i}]")
    return f"{path}: equal"


@contextlib.contextmanager
def no_gc(freeze: bool) -> Iterator[None]:
    """The garbage collector off; with ``freeze`` also (after one collection) every object
    moved out of its reach: a collection that starts inside a capture walks the whole heap
    (seconds on a large one) while the stream is capturing, and may free tensors the capture
    still reads. A process that froze objects itself keeps them frozen (nothing is
    unfrozen that this did not freeze)."""
    enabled = gc.isenabled()
    freeze = freeze and gc.get_freeze_count() == 0
    if freeze:
        gc.collect()  # what is garbage now is not frozen with the rest
        gc.freeze()
    gc.disable()
    try:
        yield
    finally:
        if freeze:
            gc.unfreeze()
        if enabled:
            gc.enable()


class GraphRunner:
    """Pads to buckets when ``static``; captures and replays CUDA graphs when also on CUDA."""

    def __init__(self, verifier: StaticVerifier, buckets: tuple[int, ...], static: bool,
                 device: torch.device, graph_factory: Callable[[Any], Any] | None = None,
                 budget: GraphBudget | None = None) -> None:
        """``graph_factory(pool)`` makes a graph object (``capture(fn)``, ``replay()``);
        default: :class:`CudaGraph`, and capture only on CUDA. ``budget``: none by default."""
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"graph buckets must be a non-empty tuple of ints >= 1: {buckets}")
        self.verifier = verifier
        self.buckets = tuple(sorted(set(buckets)))
        self.static = static
        self.device = device
        self.capture = static and (device.type == "cuda" or graph_factory is not None)
        self.graph_factory = graph_factory or CudaGraph
        # key -> (graph, captured outputs, closure fingerprint, outputs fingerprint)
        self._graphs: dict[tuple, tuple[Any, Any, Any, Any]] = {}
        self._pool: Any = None
        self.num_replays = 0
        self.num_captures = 0
        self._padded: dict[int, int] = {}  # padded_rows answers
        #: static passes run, by kind (``verify``, ``draft``, ``observe``, ``lm-draft``)
        self.num_runs: Counter[str] = Counter()
        #: check every replay's inputs and outputs against its capture (module docstring)
        self.debug = os.environ.get(GRAPH_DEBUG_ENV, "") not in ("", "0")
        #: static drafters' passes for :meth:`capture_startup` (they register themselves)
        self.static_drafts: list[StartupPasses] = []
        self._captures: list[CaptureRecord] = []
        self._startup = False  # inside capture_startup
        self.budget = budget or GraphBudget()
        self._refused: dict[tuple, str] = {}  # key -> why (its pass runs eagerly for good)
        self._graph_bytes = 0  # what the captures reserved, all of them
        self._last_bytes: dict[str, int] = {}  # pass kind -> its latest capture's bytes
        #: the step's phase timer: CUDA events on CUDA
        self.clock = StepClock(
            (lambda: torch.cuda.Event(enable_timing=True)) if device.type == "cuda" else None)

    @property
    def graph_stats(self) -> GraphStats:
        return GraphStats(tuple(self._captures), tuple(self._refused))

    @property
    def num_graphs(self) -> int:
        """Graphs captured and held now."""
        return len(self._graphs)

    def release_graphs(self) -> int:
        """Drop every captured graph and their memory pool: the weights or KV cache they
        read are about to be reallocated (``SpecEngine.sleep``), which need not give back
        the addresses they captured. Later shapes are captured afresh (at first use, or by
        :meth:`capture_startup`), within a fresh budget; :attr:`graph_stats` then describes
        the graphs captured since (``num_captures`` keeps counting). Returns how many were
        dropped."""
        n = len(self._graphs)
        self._graphs.clear()
        self._captures.clear()
        self._pool = None
        self._refused.clear()
        self._graph_bytes = 0
        self._last_bytes.clear()
        return n

    def padded_rows(self, num_rows: int) -> int:
        """Rows a batch of ``num_rows`` runs as: its bucket, or itself (eager / too large)."""
        rows = self._padded.get(num_rows)
        if rows is None:
            rows = next((b for b in self.buckets if b >= num_rows), num_rows) if self.static \
                else num_rows
            self._padded[num_rows] = rows
        return rows

    def verify_pass(self, shape: VerifyShape) -> Pass:
        """The verify pass of ``shape``, as :meth:`run_graph` takes it."""
        return shape.graph_keys["verify"], lambda: self.verifier.run(shape)

    def run(self, shape: VerifyShape) -> VerifyOutput:
        """The verify pass of ``shape``."""
        key, fn = self.verify_pass(shape)
        return self.run_graph(key, shape.num_rows, fn)

    def run_graph(self, key: tuple, num_rows: int, fn: Callable[[], Any]) -> Any:
        """``fn()``, a pass that reads and writes only static buffers; on CUDA replayed from
        the graph captured for ``key`` (``num_rows`` a bucket), else run as is. Outputs of a
        replay are the captured pass's tensors: valid until the next replay of ``key``.

        The first call of a key runs ``fn`` eagerly (it compiles the kernels), captures it and
        replays it: the pass is a function of static buffers, so the replay rewrites the same
        values, and the caller gets the captured outputs from the start. A later pass that
        reads them (the drafter's catch-up reads the verify pass's) then reads the tensors
        every replay writes, never the warm-up's.

        A key the budget refuses (:meth:`_admits`) runs ``fn`` eagerly, now and every later
        time: the static buffers and outputs the CPU path runs on, without capture."""
        self.num_runs[key[0]] += 1
        if not self.capture or num_rows not in self.buckets:
            return fn()
        entry = self._graphs.get(key)
        if entry is None:
            if key in self._refused or not self._admits(key):
                return fn()
            return self._capture_new(key, fn)
        graph, out, inputs, outputs = entry
        if self.debug:
            self._check_replay(key, fn, inputs, out, outputs)
        graph.replay()
        self.num_replays += 1
        return out

    def _check_replay(self, key: tuple, fn: Callable[[], Any], inputs: Any, out: Any,
                      outputs: Any) -> None:
        now = closure_fingerprint(fn)
        if now != inputs:
            raise GraphInputMismatch(
                f"graph {key[:4]}: a replay is handed other inputs than its capture read (the "
                f"graph would silently use the captured ones): "
                f"{_first_difference(inputs, now)}")
        now_out = fingerprint(out)
        if now_out != outputs:
            raise GraphInputMismatch(
                f"graph {key[:4]}: its captured outputs moved or changed shape since capture "
                f"(replays write the captured addresses): {_first_difference(outputs, now_out)}")

    def _admits(self, key: tuple) -> bool:
        """Whether ``key`` (not captured yet) may be captured now; a refusal is recorded and
        warned of once (the key is never asked about again)."""
        producer = producer_key(key)
        if producer is not None and producer not in self._graphs:
            why: str | None = f"it reads the outputs of {producer[:4]}, which runs eagerly"
        else:
            last = self._captures[-1].bytes if self._captures else 0
            why = self.budget.refuses(len(self._graphs), self._graph_bytes,
                                      self._last_bytes.get(key[0], last))
        if why is None:
            return True
        self._refused[key] = why
        logger.warning("graph budget: %s runs eagerly, not captured (%s)", key[:4], why)
        return False

    def _capture_new(self, key: tuple, fn: Callable[[], Any]) -> Any:
        """Warm-up, capture and first replay of ``key`` (see :meth:`run_graph`)."""
        t0 = time.perf_counter()
        before = _reserved(self.device)
        with no_gc(freeze=False):  # (capture_startup freezes for all of its captures)
            fn()  # warm-up: compiles the kernels, creates the handles capture may not create
            graph = self.graph_factory(self._pool)
            static_out = graph.capture(fn)
        self._pool = graph.pool
        self._graphs[key] = (graph, static_out, closure_fingerprint(fn), fingerprint(static_out))
        self.num_captures += 1
        graph.replay()
        self.num_replays += 1
        record = CaptureRecord(key, time.perf_counter() - t0,
                               max(0, _reserved(self.device) - before), self._startup)
        self._captures.append(record)
        self._graph_bytes += record.bytes
        self._last_bytes[key[0]] = record.bytes
        if not self._startup:
            logger.info("captured a graph for %s in %.1f ms (%.1f MiB)", key[:4],
                        1e3 * record.seconds, record.bytes / 2**20)
        return static_out

    def _ensure(self, key: tuple, fn: Callable[[], Any]) -> tuple[bool, Any]:
        """``(True, outputs)`` of ``key``'s graph, captured now if need be; ``(False, None)``
        when the budget refuses it (its pass is not run: nothing needs it at startup)."""
        entry = self._graphs.get(key)
        if entry is not None:
            return True, entry[1]
        if key in self._refused or not self._admits(key):
            return False, None
        return True, self._capture_new(key, fn)

    def capture_startup(self, ks: Sequence[int] | None, drafting: bool) -> int:
        """Capture every bucket (up to the batch capacity) x k of ``ks`` (None:
        :data:`DEFAULT_CAPTURE_KS`; k = 0 only when not ``drafting``), largest bucket first:
        the verify pass, and the static drafters' draft and catch-up passes, each through the
        same capture a step makes, on the batch state's neutral rows. Stops at the first
        pass the budget refuses (module docstring). Returns the number of graphs captured (0
        when this runner does not capture)."""
        if not self.capture:
            logger.info("capture='startup': nothing to capture (no CUDA graphs here)")
            return 0
        state = self.verifier.state
        if state.num_rows:
            raise RuntimeError("capture_startup needs an empty batch (it runs padded rows)")
        ks = sorted({0} if not drafting else set(DEFAULT_CAPTURE_KS if ks is None else ks),
                    reverse=True)
        if any(k < 0 or k > MAX_K for k in ks):
            raise ValueError(f"capture ks must be in 0..{MAX_K}, got {ks}")
        buckets = [b for b in reversed(self.buckets) if b <= state.capacity]
        state.stage(np.zeros(0, dtype=np.int64))  # every row neutral on the device
        probs = any(d.samples for d in self.static_drafts)
        t0, n0 = time.perf_counter(), self.num_captures
        self._startup = True
        try:
            with no_gc(freeze=True):
                for rows, k in itertools.product(buckets, ks):
                    if not self._capture_shape(rows, k, probs and k > 0):
                        logger.warning("graph budget reached at startup (bucket %d x k %d): "
                                       "the shapes from there on are captured at first use "
                                       "if they fit then, else run eagerly", rows, k)
                        break
        finally:
            self._startup = False
        new = self._captures[len(self._captures) - (self.num_captures - n0):]
        logger.info("captured %d graphs at startup (buckets %s x k %s) in %.2f s, %.1f MiB",
                    len(new), buckets, ks, time.perf_counter() - t0,
                    sum(c.bytes for c in new) / 2**20)
        return len(new)

    def _capture_shape(self, rows: int, k: int, probs: bool) -> bool:
        """One step's passes at ``rows`` x ``k``, in the order a step runs them; False when
        the budget refused one (the rest of the shape is left alone)."""
        if k > 0:
            for d in self.static_drafts:
                for key, fn in d.startup_draft(rows, k):
                    if not self._ensure(key, fn)[0]:
                        return False
        shape = VerifyShape(rows, k + 1, None, probs)
        ok, out = self._ensure(*self.verify_pass(shape))
        if not ok:
            return False
        for d in self.static_drafts:
            for key, fn in d.startup_observe(shape, out):
                if not self._ensure(key, fn)[0]:
                    return False
        return True


def _reserved(device: torch.device) -> int:
    """Device memory the caching allocator holds (0 off CUDA)."""
    return torch.cuda.memory_reserved(device) if device.type == "cuda" else 0


def build_graph_runner(cfg: EngineConfig, runner: ModelRunner, sampler: Sampler,
                       vocab_size: int) -> GraphRunner:
    """The decode step's persistent batch, static verify pass and per-bucket graphs.

    Rows: enough for ``max_batch_size`` padded to its bucket. Block-table columns: a sequence
    of ``max_model_len`` tokens plus the largest lookahead (a 64-node tree). The shared
    draft-probability buffer is as wide as the largest k the engine verifies
    (``memory_plan.verify_k_max``: the plan counts the same), and so are the verify outputs
    every graph shares (``StaticVerifier.output_views``); the budget from ``max_graphs``
    and ``max_graph_bytes`` (on CUDA by default the plan's, ``memory_plan.max_graph_bytes``)."""
    device = torch.device(cfg.device)
    larger = [b for b in cfg.graph_buckets if b >= cfg.max_batch_size]
    capacity = min(larger) if larger else cfg.max_batch_size
    max_blocks = -(-(cfg.max_model_len + MAX_TREE_NODES) // cfg.block_size)
    state = BatchState(capacity, max_blocks, device)
    verifier = StaticVerifier(runner, sampler, state, cfg.block_size, vocab_size,
                              max(MAX_K + 1, MAX_TREE_NODES), max_prob_drafts=verify_k_max(cfg))
    static = cfg.cuda_graphs
    if static and device.type == "cuda" and cfg.kernel_backend == "torch":
        # The PyTorch reference attention reads lengths back to the host: it cannot be captured.
        logger.warning("cuda_graphs needs kernel_backend triton/cuda on CUDA; running eagerly")
        static = False
    # (the plan is read only for a runner that may capture)
    verifier.share_outputs = static  # captured graphs' outputs: views of one allocation
    # A captured pass may not branch on data: the sampler's CPU fast paths (chosen from the
    # rows' values) are for eager passes only.
    sampler.cpu_fast_paths = not static
    budget = GraphBudget(cfg.max_graphs, max_graph_bytes(cfg, runner.model.config, device)
                         if static else cfg.max_graph_bytes)
    return GraphRunner(verifier, cfg.graph_buckets, static, device, budget=budget)
