"""The engine side of ``rl_loop.py``: the worker that runs in the spawned engine process (rank 1)
and the learner's client for it.

They talk over a ``multiprocessing`` Pipe in ``(command, argument)`` / ``(tag, payload)`` pairs
of plain Python values; the weights themselves travel over the process group instead. The worker
is a module-level function of a sibling module because spawn re-imports it by name in the child,
which gets the parent's ``sys.path`` (and so this directory).
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


def engine_worker(cfg: LoopConfig, draft: str, port: int, conn: Connection) -> None:
    """Rank 1: build the engine, join the weight group, then serve commands from the Pipe until
    ``stop``. Any failure is sent back as a traceback so the learner raises instead of hanging."""
    from specengine import SamplingParams, SpecEngine
    from specengine.model.loader import hf_named_tensors

    torch.set_num_threads(1)  # the two processes take turns; the CPU is small
    try:
        device = "cpu" if cfg.device == "cpu" else f"cuda:{min(1, torch.cuda.device_count() - 1)}"
        if device != "cpu":
            torch.cuda.set_device(device)  # NCCL's group uses the current device
        # float32 on every device: the logprob check compares with the float32 learner
        engine = SpecEngine(cfg.model, draft=draft, device=device, dtype="float32", seed=cfg.seed,
                            max_model_len=min(256, 32 + cfg.max_tokens))
        conn.send(("built", None))
        engine.init_weight_update_group(MASTER_ADDRESS, port, ENGINE_RANK, WORLD_SIZE,
                                        backend=cfg.dist_backend, timeout_s=cfg.timeout_s)
        while True:
            cmd, arg = conn.recv()
            if cmd == "generate":
                prompts, seeds = arg
                params = [SamplingParams(temperature=cfg.temperature, max_tokens=cfg.max_tokens,
                                         seed=s) for s in seeds]
                t0 = time.perf_counter()
                outs = engine.generate(prompts, k=cfg.k, sampling=params)
                gen_s = time.perf_counter() - t0
                conn.send(("rollouts", {
                    "token_ids": [list(o.token_ids) for o in outs],
                    "logprobs": [list(o.logprobs) for o in outs],
                    "versions": [o.weight_version for o in outs],
                    "accepted_length": engine.stats.mean_accepted_length,
                    "gen_s": gen_s,
                }))
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


class EngineClient:
    """The learner's end of the Pipe: waits for answers, raising if the engine failed or died."""

    def __init__(self, conn: Connection, proc: mp.process.BaseProcess, timeout_s: float) -> None:
        self.conn, self.proc, self.timeout_s = conn, proc, timeout_s

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
