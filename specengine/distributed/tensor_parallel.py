"""Tensor parallelism inside one engine: ``SpecEngine(..., tensor_parallel_size=N)``
(docs/design.md §19).

Rank 0 is the engine's own process; :class:`TensorParallel` spawns ranks ``1 .. N-1``
(``tp_worker``), each loading its shard of the same checkpoint (``tp_layers``). The engine
runs as before on rank 0 (scheduler, drafter, sampler, static verify path): its model is
rank 0's shard, whose forward, embedding and LM head first broadcast their inputs so that the
workers run the same call in lockstep (``tp_group``); the hidden states come back whole on
every rank and the logits are gathered. The drafter runs on rank 0 only (unsharded); its
proposals reach the workers as the verify pass's inputs. The KV cache is sharded by head with
the same block layout on every rank (one allocator, on rank 0), and every KV operation outside
a forward is mirrored (:class:`ShardedKVCache`).
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import weakref
from typing import Any

import torch

from specengine.config import EngineConfig
from specengine.core.kv_cache import KVCache
from specengine.distributed.tp_group import TensorParallelError, TPGroup
from specengine.distributed.tp_worker import worker_main
from specengine.model.config import ModelConfig
from specengine.model.llama import CausalLM
from specengine.model.tp_layers import check_tensor_parallel

logger = logging.getLogger(__name__)

#: every collective, the start-up rendezvous and each process join wait at most this long
DEFAULT_TIMEOUT_S = 120.0
JOIN_TIMEOUT_S = 10.0


def _stop(procs: list[Any], store_dir: str) -> None:
    """Stop the worker processes (join, then terminate, then kill) and drop the store."""
    for p in procs:
        p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.terminate()
            p.join(JOIN_TIMEOUT_S)
        if p.is_alive():
            p.kill()
            p.join(JOIN_TIMEOUT_S)
    shutil.rmtree(store_dir, ignore_errors=True)


class TensorParallel:
    """Rank 0's handle on the tensor-parallel ranks of one engine."""

    def __init__(self, cfg: EngineConfig, model_config: ModelConfig, load_format: str,
                 num_threads: int | None = None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        n = cfg.tensor_parallel_size
        check_tensor_parallel(model_config, n)  # before any process starts
        if n > 1 and torch.device(cfg.device).type == "cuda":
            base = torch.device(cfg.device).index or 0
            if base + n > torch.cuda.device_count():
                raise ValueError(f"tensor_parallel_size {n} needs CUDA devices {base}.."
                                 f"{base + n - 1} (one per rank); {torch.cuda.device_count()} "
                                 "visible")
        self.world_size = n
        self.closed = False
        self._dir = tempfile.mkdtemp(prefix="specengine-tp-")
        # Workers fork from a fork server that imported torch and the model code once per
        # engine process (a plain fork would copy this process's threads and CUDA state).
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([worker_main.__module__, "specengine.model.loader"])
        self.procs = [ctx.Process(target=worker_main, name=f"specengine-tp-rank{r}",
                                  args=(r, n, self._dir, cfg, load_format, os.getpid(),
                                        timeout_s, num_threads),
                                  # (a daemonic process may have no children; the watchdog and
                                  # the finalizer below stop them then)
                                  daemon=not mp.current_process().daemon)
                      for r in range(1, n)]
        for p in self.procs:
            p.start()
        # Stops the workers should this object be dropped without close() (or at exit).
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._dir)
        device = torch.device(cfg.device)
        try:
            self.group = TPGroup(self._dir, 0, n, device, timeout_s,
                                 lambda: [p.exitcode for p in self.procs])
        except BaseException as e:
            self._finalizer()
            raise TensorParallelError(f"the tensor-parallel ranks did not come up: {e}") from e
        failure: BaseException | None = None
        self.model: CausalLM | None = None
        try:
            from specengine.model.loader import build_model

            self.model = build_model(cfg.model, cfg.torch_dtype, device, load_format, self.group)
        except Exception as e:  # noqa: BLE001 - raised after the workers heard of it
            failure = e
        replies = self.group.exchange(None if failure is None else str(failure))
        if failure is not None or any(replies):
            self.closed = True  # the workers leave on their own after a failed start
            self.group.close()
            self._finalizer()
            if failure is not None:
                raise failure
            bad = "; ".join(f"rank {r}: {e}" for r, e in enumerate(replies) if e)
            raise TensorParallelError(f"tensor-parallel ranks failed to load: {bad}")
        logger.info("tensor parallel: %d ranks up", n)

    def kv_cache(self, num_blocks: int, block_size: int, num_layers: int, num_kv_heads: int,
                 head_dim: int, dtype: torch.dtype, device: torch.device | str,
                 **kwargs: Any) -> ShardedKVCache:
        """``KVCache``'s constructor for rank 0: its own heads (``num_kv_heads`` is the
        model's), and the same block layout allocated on every worker."""
        attn = self.model.model.layers[0].self_attn  # type: ignore[union-attr]
        self.check_replies(self.group.call("init_kv", num_blocks, block_size,
                                            reply=("ok", None)))
        return ShardedKVCache(self, num_blocks, block_size, num_layers, attn.num_kv_heads,
                              head_dim, dtype, device, **kwargs)

    def load_policy(self, model: CausalLM, named_tensors: Any,
                    mark_torn: Any, check_finite: bool) -> list[str]:
        """``load_weights`` on a tensor-parallel engine: every rank checks, then copies its
        slice (``tp_weights.load_policy``); the weight receiver calls this without importing
        the distributed package."""
        from specengine.distributed.tp_weights import load_policy

        return load_policy(self, model, named_tensors, mark_torn, check_finite)

    def check_replies(self, replies: list[tuple[str, Any]]) -> list[Any]:
        """The workers' reply values; raises naming every rank that failed."""
        bad = [f"rank {r}: {v}" for r, (s, v) in enumerate(replies) if s == "error"]
        if bad:
            raise TensorParallelError("; ".join(bad))
        return [v for _, v in replies]

    def alive(self) -> list[bool]:
        """Whether each worker process (ranks 1..N-1) runs."""
        return [p.is_alive() for p in self.procs]

    def close(self) -> None:
        """Tell the workers to exit and wait for them (terminated after a timeout);
        idempotent."""
        if self.closed:
            return
        self.closed = True
        try:
            if not self.group.broken:
                self.group.send_command("shutdown")
        except TensorParallelError as e:  # a worker already gone: stopped below regardless
            logger.debug("tensor-parallel shutdown: %s", e)
        self.group.close()
        self._finalizer()


class ShardedKVCache(KVCache):
    """Rank 0's KV cache (its heads) whose operations outside a forward are mirrored on every
    worker's cache, so the caches stay one cache sharded by head."""

    def __init__(self, tp: TensorParallel, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.tp = tp

    def copy_blocks(self, src: list[int], dst: list[int]) -> None:
        self.tp.group.send_command("copy_blocks", list(src), list(dst))
        super().copy_blocks(src, dst)  # type: ignore[misc]

    def mirror_compact(self, src: list[int], dst: list[int]) -> None:
        """Rank 0 moved K/V from slots ``src`` to ``dst`` (the accepted tree path): the
        workers do the same."""
        self.tp.group.send_command("compact", list(src), list(dst))


__all__ = ["DEFAULT_TIMEOUT_S", "ShardedKVCache", "TensorParallel"]
