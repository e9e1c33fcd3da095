"""A tensor-parallel worker: rank ``1 .. N-1`` of an engine, one process each.

It loads its shard from the same checkpoint, then serves rank 0's commands in a loop: the
sharded calls (``forward``, ``embed``, ``lm_head``) on its own KV cache, every KV operation
the engine does outside a forward (tree-path compaction, block copies), and the weight paths
(``distributed.tp_weights``). It exits on ``shutdown``, when a collective fails (rank 0 died
or a peer broke the lockstep), or when its parent process is gone (a watchdog thread: rank 0
may die without closing anything).
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import torch

from specengine.config import EngineConfig

logger = logging.getLogger(__name__)

PARENT_POLL_S = 0.5


def rank_device(device: torch.device, rank: int) -> torch.device:
    """Rank ``r``'s device: the engine's CUDA device index + r, or the CPU."""
    if device.type != "cuda":
        return torch.device("cpu")
    base = device.index if device.index is not None else 0
    return torch.device("cuda", base + rank)


def process_alive(pid: int) -> bool:
    """Whether ``pid`` runs (a zombie, dead but not yet reaped, does not)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except FileNotFoundError:
        return False
    except OSError:  # no procfs: whether the pid exists at all
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True


def _watch_engine(engine_pid: int) -> None:
    """Exit this process once the engine's process (rank 0) is gone: it may die without
    closing anything (the workers are the fork server's children, not its own)."""
    while process_alive(engine_pid):
        time.sleep(PARENT_POLL_S)
    os._exit(3)


class WorkerState:
    """What a worker holds; also the ``engine`` the weight receiver updates (``model``,
    ``weight_version``, ``torn_weights``; no drafter and no scheduler: ``core`` None)."""

    is_tp_worker = True

    def __init__(self, cfg: EngineConfig, model: torch.nn.Module, group: Any,
                 device: torch.device) -> None:
        from specengine.model.attention import make_attention_backend

        self.config, self.model, self.group, self.device = cfg, model, group, device
        self.backend = make_attention_backend(cfg.kernel_backend)
        self.kv: torch.Tensor | None = None
        self.drafter = None
        self.core = None
        self.weight_version = 0
        self.torn_weights: set[tuple[str, str]] = set()
        self.receiver: Any = None
        self.staged_load: Any = None


def _init_kv(st: WorkerState, num_blocks: int, block_size: int) -> None:
    attn = st.model.model.layers[0].self_attn
    st.kv = torch.zeros(2, len(st.model.model.layers), num_blocks, block_size,
                        attn.num_kv_heads, attn.head_dim, dtype=st.config.torch_dtype,
                        device=st.device)


def _forward(st: WorkerState, ids: torch.Tensor, positions: torch.Tensor, meta: Any,
             aux_layers: tuple[int, ...]) -> None:
    st.model(ids, positions, st.kv, meta, st.backend, aux_layers)


def _compact(st: WorkerState, src: list[int], dst: list[int]) -> None:
    from specengine.kernels.kv_cache import compact_kv_cache

    assert st.kv is not None
    compact_kv_cache(st.kv, np.array([src, dst], dtype=np.int64))


def _copy_blocks(st: WorkerState, src: list[int], dst: list[int]) -> None:
    assert st.kv is not None
    s = torch.as_tensor(src, dtype=torch.int64, device=st.device)
    d = torch.as_tensor(dst, dtype=torch.int64, device=st.device)
    st.kv.index_copy_(2, d, st.kv.index_select(2, s))


def _handlers() -> dict[str, tuple[Callable[..., Any], bool]]:
    """op -> (handler, whether it replies through ``exchange``)."""
    import specengine.distributed.tp_weights as w

    return {
        "init_kv": (_init_kv, True),
        "forward": (_forward, False),
        "embed": (lambda st, ids: st.model.model.embed_tokens(ids), False),
        "lm_head": (lambda st, hidden: st.model.lm_head(hidden), False),
        "compact": (_compact, False),
        "copy_blocks": (_copy_blocks, False),
        "load_check": (w.worker_load_check, True),
        "load_apply": (w.worker_load_apply, True),
        "load_drop": (w.worker_load_drop, False),
        "join": (w.worker_join, True),
        "recv": (w.worker_receive, True),
        "leave": (w.worker_leave, False),
        "shards": (w.worker_shards, True),
    }


def worker_main(rank: int, world_size: int, store_dir: str, cfg: EngineConfig,
                load_format: str, engine_pid: int, timeout_s: float, num_threads: int | None
                ) -> None:
    """The worker process (``multiprocessing`` target); ends the process when done."""
    threading.Thread(target=_watch_engine, args=(engine_pid,), daemon=True).start()
    try:
        _serve(rank, world_size, store_dir, cfg, load_format, timeout_s, num_threads)
    finally:
        logging.shutdown()
        # Skip the interpreter's teardown (seconds of module and thread clean-up): this
        # process holds nothing else that needs it.
        os._exit(0)


def _serve(rank: int, world_size: int, store_dir: str, cfg: EngineConfig, load_format: str,
           timeout_s: float, num_threads: int | None) -> None:
    from specengine.distributed.tp_group import TPGroup
    from specengine.model.loader import build_model
    from specengine.threads import apply_thread_policy

    device = rank_device(torch.device(cfg.device), rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    apply_thread_policy(num_threads, device)
    if cfg.kernel_backend != "torch" and device.type == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    group = TPGroup(store_dir, rank, world_size, device, timeout_s)
    error = None
    try:
        model = build_model(cfg.model, cfg.torch_dtype, device, load_format, group)
    except Exception as e:  # noqa: BLE001 - reported to rank 0, which raises it
        error = f"{type(e).__name__}: {e}"
    if any(group.exchange(error)):
        group.close()
        return
    st = WorkerState(cfg, model, group, device)
    handlers = _handlers()
    try:
        with torch.inference_mode():
            while True:
                op, args = group.recv_command()
                if op == "shutdown":
                    break
                fn, replies = handlers[op]
                if not replies:
                    fn(st, *args)
                    continue
                try:
                    reply: tuple[str, Any] = ("ok", fn(st, *args))
                except Exception as e:  # noqa: BLE001 - the reply carries it to rank 0
                    reply = ("error", f"{type(e).__name__}: {e}")
                group.exchange(reply)
    except Exception:  # a failed collective or a bad command: the lockstep is lost
        logger.exception("tensor-parallel rank %d stops", rank)
    finally:
        if st.receiver is not None:
            st.receiver.close()
        group.close()


__all__ = ["WorkerState", "rank_device", "worker_main"]
