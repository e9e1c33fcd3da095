"""Static passes (the verify pass, drafters' k-step loops) per batch-size bucket, captured as
CUDA graphs on CUDA.

With ``cuda_graphs=True`` a batch of ``B`` rows runs as the smallest bucket ``>= B`` (padded
rows are inactive: no KV write, ignored outputs). On CUDA the first pass of each shape runs
eagerly (it compiles the kernels and serves that step), then is captured; every later pass of
that shape is one graph replay. On the CPU the very same padded, static-buffer pass runs
without capture, so the CPU tests prove the graph path's inputs and outputs. Batches above the
largest bucket run eagerly, unpadded. Graphs read only static buffers (batch state, draft
buffers, KV cache, weights), so in-place weight updates keep them valid.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Callable
from typing import Any

import torch

from specengine.config import MAX_K, EngineConfig
from specengine.core.batch import BatchState
from specengine.core.verify import StaticVerifier, VerifyOutput, VerifyShape
from specengine.model_runner import ModelRunner
from specengine.sampler import Sampler
from specengine.tree import MAX_TREE_NODES

logger = logging.getLogger(__name__)

DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256)


class CudaGraph:
    """``torch.cuda.CUDAGraph`` behind the two calls the runner makes; every graph of a runner
    shares one memory pool (their outputs stay referenced, so none reuses another's)."""

    def __init__(self, pool: tuple[int, int] | None) -> None:
        self.graph = torch.cuda.CUDAGraph()
        self.pool = pool

    def capture(self, fn: Callable[[], Any]) -> Any:
        """Record ``fn`` (nothing runs); returns the outputs each replay writes."""
        torch.cuda.synchronize()
        # thread_local: weight updates are received and checked on other threads (server
        # endpoints stage off the step loop); their device work must not invalidate a capture
        # running here, and only this thread's unsafe calls may fail it.
        with torch.cuda.graph(self.graph, pool=self.pool, capture_error_mode="thread_local"):
            out = fn()
        self.pool = self.graph.pool()
        return out

    def replay(self) -> None:
        self.graph.replay()


class GraphRunner:
    """Pads to buckets when ``static``; captures and replays CUDA graphs when also on CUDA."""

    def __init__(self, verifier: StaticVerifier, buckets: tuple[int, ...], static: bool,
                 device: torch.device, graph_factory: Callable[[Any], Any] | None = None
                 ) -> None:
        """``graph_factory(pool)`` makes a graph object (``capture(fn)``, ``replay()``);
        default: :class:`CudaGraph`, and capture only on CUDA."""
        if not buckets or any(b < 1 for b in buckets):
            raise ValueError(f"graph buckets must be a non-empty tuple of ints >= 1: {buckets}")
        self.verifier = verifier
        self.buckets = tuple(sorted(set(buckets)))
        self.static = static
        self.capture = static and (device.type == "cuda" or graph_factory is not None)
        self.graph_factory = graph_factory or CudaGraph
        self._graphs: dict[tuple, tuple[Any, Any]] = {}
        self._pool: Any = None
        self.num_replays = 0
        self.num_captures = 0
        self._padded: dict[int, int] = {}  # padded_rows answers
        #: static passes run, by kind (``verify``, ``draft``, ``observe``, ``lm-draft``)
        self.num_runs: Counter[str] = Counter()

    def padded_rows(self, num_rows: int) -> int:
        """Rows a batch of ``num_rows`` runs as: its bucket, or itself (eager / too large)."""
        rows = self._padded.get(num_rows)
        if rows is None:
            rows = next((b for b in self.buckets if b >= num_rows), num_rows) if self.static \
                else num_rows
            self._padded[num_rows] = rows
        return rows

    def run(self, shape: VerifyShape) -> VerifyOutput:
        """The verify pass of ``shape``."""
        return self.run_graph(shape.graph_keys["verify"], shape.num_rows,
                              lambda: self.verifier.run(shape))

    def run_graph(self, key: tuple, num_rows: int, fn: Callable[[], Any]) -> Any:
        """``fn()``, a pass that reads and writes only static buffers; on CUDA replayed from
        the graph captured for ``key`` (``num_rows`` a bucket), else run as is. Outputs of a
        replay are the captured pass's tensors: valid until the next replay of ``key``.

        The first call of a key runs ``fn`` eagerly (it compiles the kernels), captures it and
        replays it: the pass is a function of static buffers, so the replay rewrites the same
        values, and the caller gets the captured outputs from the start. A later pass that
        reads them (the drafter's catch-up reads the verify pass's) then reads the tensors
        every replay writes, never the warm-up's."""
        self.num_runs[key[0]] += 1
        if not self.capture or num_rows not in self.buckets:
            return fn()
        entry = self._graphs.get(key)
        if entry is not None:
            graph, out = entry
            graph.replay()
            self.num_replays += 1
            return out
        fn()  # warm-up: compiles the kernels, creates the handles capture may not create
        graph = self.graph_factory(self._pool)
        static_out = graph.capture(fn)
        self._pool = graph.pool
        self._graphs[key] = (graph, static_out)
        self.num_captures += 1
        logger.info("captured a graph for %s", key[:3])
        graph.replay()
        self.num_replays += 1
        return static_out


def build_graph_runner(cfg: EngineConfig, runner: ModelRunner, sampler: Sampler,
                       vocab_size: int) -> GraphRunner:
    """The decode step's persistent batch, static verify pass and per-bucket graphs.

    Rows: enough for ``max_batch_size`` padded to its bucket. Block-table columns: a sequence
    of ``max_model_len`` tokens plus the largest lookahead (a 64-node tree)."""
    device = torch.device(cfg.device)
    larger = [b for b in cfg.graph_buckets if b >= cfg.max_batch_size]
    capacity = min(larger) if larger else cfg.max_batch_size
    max_blocks = -(-(cfg.max_model_len + MAX_TREE_NODES) // cfg.block_size)
    state = BatchState(capacity, max_blocks, device)
    verifier = StaticVerifier(runner, sampler, state, cfg.block_size, vocab_size,
                              max(MAX_K + 1, MAX_TREE_NODES))
    static = cfg.cuda_graphs
    if static and device.type == "cuda" and cfg.kernel_backend == "torch":
        # The PyTorch reference attention reads lengths back to the host: it cannot be captured.
        logger.warning("cuda_graphs needs kernel_backend triton/cuda on CUDA; running eagerly")
        static = False
    return GraphRunner(verifier, cfg.graph_buckets, static, device)
