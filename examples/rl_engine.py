"""The engine side of ``rl_loop.py``: the worker that runs in the spawned engine process (rank 1)
and the learner's client for it, or (``--workers N``) a client for a ``RolloutPool`` of N Ray
workers (ranks 1..N) with the same methods; ``start_engine`` picks one.

The process worker and its client talk over a ``multiprocessing`` Pipe in ``(command,
argument)`` / ``(tag, payload)`` pairs of plain Python values; the weights themselves travel
over the process group instead. The worker is a module-level function of a sibling module
because spawn re-imports it by name in the child, which gets the parent's ``sys.path`` (and so
this directory).
"""

from __future__ import annotations

import socket
import time
import traceback
from multiprocessing.connection import Connection

import torch
import torch.multiprocessing as mp
from rl_config import LoopConfig

MASTER_ADDRESS = "127.0.0.1"
LEARNER_RANK, ENGINE_RANK, WORLD_SIZE = 0, 1, 2


def free_port() -> int:
    """A TCP port on ``MASTER_ADDRESS`` that was free a moment ago, for the rendezvous."""
    with socket.socket() as s:
        s.bind((MASTER_ADDRESS, 0))
        return s.getsockname()[1]


def engine_kwargs(cfg: LoopConfig, device: str) -> dict[str, object]:
    """``SpecEngine`` keywords of every engine of the run. float32 on every device: the
    logprob check compares with the float32 learner. ``adapt_draft_every`` turns on the
    EAGLE-3 head's online adaptation (a rollout buffer of 4 steps' tokens, 2048 per
    optimiser step: small enough to cost about a rollout's time on a CPU)."""
    kwargs: dict[str, object] = {"device": device, "dtype": "float32", "seed": cfg.seed,
                                 "max_model_len": min(256, 32 + cfg.max_tokens)}
    if cfg.adapt_draft_every:
        rollout_tokens = cfg.num_prompts * cfg.group_size * (cfg.max_tokens + 16)
        kwargs["draft_options"] = {"adapt_every": cfg.adapt_draft_every,
                                   "adapt_steps": cfg.adapt_draft_steps,
                                   "adapt_lr": cfg.adapt_draft_lr,
                                   "adapt_buffer_tokens": 4 * rollout_tokens,
                                   "adapt_batch_tokens": 2048}
    return kwargs


def rollouts(outs: list, stats: object, gen_s: float) -> dict[str, object]:
    """What a ``generate`` command answers: plain lists, one entry per rollout, and the
    call's mean accepted length and acceptance per draft (``EngineStats``)."""
    return {"token_ids": [list(o.token_ids) for o in outs],
            "logprobs": [list(o.logprobs) for o in outs],
            "versions": [o.weight_version for o in outs],
            "accepted_length": stats.mean_accepted_length,  # type: ignore[attr-defined]
            "acceptance": (stats.num_accepted_tokens  # type: ignore[attr-defined]
                           / max(stats.num_draft_tokens, 1)),  # type: ignore[attr-defined]
            "gen_s": gen_s}


def sampling(cfg: LoopConfig, seeds: list[int]) -> list:
    from specengine import SamplingParams

    return [SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens, seed=s)
            for s in seeds]


def engine_worker(cfg: LoopConfig, draft: str, port: int, conn: Connection) -> None:
    """Rank 1: build the engine, join the weight group, then serve commands from the Pipe until
    ``stop``. Any failure is sent back as a traceback so the learner raises instead of hanging."""
    from specengine import SpecEngine
    from specengine.model.loader import hf_named_tensors

    torch.set_num_threads(1)  # the two processes take turns; the CPU is small
    try:
        device = "cpu" if cfg.device == "cpu" else f"cuda:{min(1, torch.cuda.device_count() - 1)}"
        if device != "cpu":
            torch.cuda.set_device(device)  # NCCL's group uses the current device
        engine = SpecEngine(cfg.model, draft=draft, **engine_kwargs(cfg, device))
        conn.send(("built", None))
        engine.init_weight_update_group(MASTER_ADDRESS, port, ENGINE_RANK, WORLD_SIZE,
                                        backend=cfg.dist_backend, timeout_s=cfg.timeout_s)
        while True:
            cmd, arg = conn.recv()
            if cmd == "generate":
                prompts, seeds = arg
                t0 = time.perf_counter()
                outs = engine.generate(prompts, k=cfg.k, sampling=sampling(cfg, seeds))
                conn.send(("rollouts", rollouts(outs, engine.stats,
                                                time.perf_counter() - t0)))
            elif cmd == "sync":
                conn.send(("synced", engine.update_weights_from_distributed(
                    which="policy", src_rank=LEARNER_RANK)))
            elif cmd == "params":
                # By checkpoint (HF) name: merged projections as their HF parts.
                conn.send(("params", {n: p.detach().cpu().clone()
                                      for n, p in hf_named_tensors(engine.model).items()}))
            elif cmd == "stop":
                break
            else:
                raise ValueError(f"unknown command {cmd!r}")
        engine.close_weight_update_group()
    except BaseException:
        conn.send(("error", traceback.format_exc()))
        raise


def start_engine(cfg: LoopConfig, draft: str, port: int) -> EngineClient | PoolClient:
    """Start the rollout side: one spawned engine process, or a pool of ``cfg.workers``."""
    if cfg.workers:
        return PoolClient(cfg, draft, port)
    parent, child = mp.get_context("spawn").Pipe()
    proc = mp.get_context("spawn").Process(target=engine_worker, args=(cfg, draft, port, child),
                                           daemon=True)
    proc.start()
    return EngineClient(parent, proc, cfg.timeout_s)


class EngineClient:
    """The learner's end of the Pipe: waits for answers, raising if the engine failed or died."""

    world_size = WORLD_SIZE

    def __init__(self, conn: Connection, proc: mp.process.BaseProcess, timeout_s: float) -> None:
        self.conn, self.proc, self.timeout_s = conn, proc, timeout_s

    def join_begin(self) -> None:
        """Before the learner's ``WeightSender``: the engine is built and joins on its own."""
        self.recv("built")

    def join_end(self) -> None:
        """After the learner's ``WeightSender``: nothing left to wait for."""

    def sync_begin(self) -> None:
        """Start receiving the learner's next send."""
        self.conn.send(("sync", None))

    def sync_end(self) -> int:
        """The version the send gave the engine."""
        return self.recv("synced")  # type: ignore[return-value]

    def stop(self) -> None:
        """Ask the engine process to leave the group and exit; wait for it."""
        self.conn.send(("stop", None))
        self.proc.join(self.timeout_s)

    def close(self) -> None:
        """Kill the engine process if it is still there (after an error, or a slow stop)."""
        if self.proc.is_alive():
            self.proc.terminate()
            self.proc.join()

    def recv(self, expect: str) -> object:
        """The payload of the next answer, which must be tagged ``expect``."""
        deadline = time.monotonic() + self.timeout_s
        while not self.conn.poll(0.1):
            if not self.proc.is_alive():
                raise RuntimeError(f"engine process exited (code {self.proc.exitcode})")
            if time.monotonic() > deadline:
                raise TimeoutError(f"engine gave no {expect!r} within {self.timeout_s} s")
        tag, payload = self.conn.recv()
        if tag == "error":
            raise RuntimeError(f"engine process failed:\n{payload}")
        if tag != expect:
            raise RuntimeError(f"engine answered {tag!r}, expected {expect!r}")
        return payload

    def call(self, cmd: str, arg: object = None) -> object:
        """Send ``cmd`` and wait for its answer."""
        self.conn.send((cmd, arg))
        return self.recv({"generate": "rollouts", "sync": "synced", "params": "params"}[cmd])


class PoolClient:
    """``--workers N``: the same commands on a ``RolloutPool`` of N Ray workers (a local Ray
    cluster that it starts and stops), ranks 1..N of the learner's weight-sync group."""

    def __init__(self, cfg: LoopConfig, draft: str, port: int) -> None:
        from specengine.distributed import RolloutPool

        self.cfg, self.port = cfg, port
        device = "cuda" if cfg.device == "cuda" else "cpu"  # on CUDA: the GPU Ray gives it
        self.pool = RolloutPool(cfg.workers, cfg.model, draft,
                                engine_kwargs=engine_kwargs(cfg, device), timeout_s=cfg.timeout_s)
        self.world_size = self.pool.weight_group_world_size
        self._pending = None

    def join_begin(self) -> None:
        self._pending = self.pool.init_weight_update_group(
            MASTER_ADDRESS, self.port, self.cfg.dist_backend, timeout_s=self.cfg.timeout_s,
            wait=False)

    def join_end(self) -> None:
        self._pending.result()

    def sync_begin(self) -> None:
        self._pending = self.pool.update_weights_from_distributed("policy", wait=False)

    def sync_end(self) -> int:
        return self._pending.result()

    def call(self, cmd: str, arg: object = None) -> object:
        if cmd == "generate":
            prompts, seeds = arg
            t0 = time.perf_counter()
            outs = self.pool.generate(prompts, k=self.cfg.k, sampling=sampling(self.cfg, seeds))
            return rollouts(outs, self.pool.stats, time.perf_counter() - t0)
        if cmd == "params":  # every worker must hold the same weights: check, return one
            held = [self.pool.get_weights("policy", i) for i in range(self.cfg.workers)]
            if any(any(not torch.equal(h[n], held[0][n]) for n in held[0]) for h in held[1:]):
                raise RuntimeError("the rollout workers hold different weights")
            return held[0]
        raise ValueError(f"unknown command {cmd!r}")

    def stop(self) -> None:
        self.pool.shutdown()

    def close(self) -> None:
        self.pool.shutdown()  # idempotent
