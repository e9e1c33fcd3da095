"""Run AReaL 1.0.4's own SGLang client against a live ``specengine serve`` and record every
request it sends (``tests/data/areal_1.0.4_bodies.json``, replayed by
``tests/test_areal_protocol.py``).

AReaL is no dependency of this project: install it apart, e.g.
``pip install --no-deps --target /tmp/areal areal==1.0.4`` plus the few modules its client
imports (aiohttp, uvloop, torchdata, hydra-core, omegaconf, colorlog, tenacity, lark, numba,
einops, aiofiles, pybase64), then, with the server running on the bundled model
(``specengine serve --port 30000 --device cpu --kernel-backend torch --k 3``)::

    PYTHONPATH=/tmp/areal:/tmp/areal_deps:. python scripts/record_areal.py --port 30000

A recording proxy sits between AReaL and the server. What runs, through AReaL's
``RemoteSGLangEngine`` (``areal.engine.sglang_remote``) and in the order its FSDP engine runs
it (``areal/engine/fsdp_engine.py``):

1. rollouts: ``agenerate`` (what AReaL's RLVR workflow calls) of a few prompts;
2. an asynchronous-mode interruption: a long ``agenerate`` in flight, then
   ``pause_generation`` (its in-flight request is aborted; AReaL keeps the tokens so far and
   resubmits prompt + tokens once it resumes), ``set_version(1)``, ``continue_generation``;
   the finished response must hold every token, those before the pause stamped version 0;
3. distributed weight update: ``init_weights_update_group`` while this process joins as the
   learner (AReaL's own ``init_custom_process_group``, gloo, as on its CPU platform), then
   ``pause_generation``, ``update_weights_from_distributed`` with the tensors broadcast from
   rank 0, ``continue_generation``;
4. disk weight update: ``pause_generation``, ``update_weights_from_disk`` (after the
   checkpoint's name is published, as the FSDP engine does), ``continue_generation``.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import logging
import tempfile
import threading
import time
from concurrent.futures import Future
from datetime import timedelta
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from safetensors.torch import load_file, save_file

from specengine.assets import DEFAULT_TARGET

logger = logging.getLogger("record_areal")
OUT = Path(__file__).resolve().parents[1] / "tests" / "data" / "areal_1.0.4_bodies.json"


def recording_proxy(upstream_port: int, log: list[dict[str, Any]]) -> ThreadingHTTPServer:
    """A proxy on a free port of 127.0.0.1 that forwards every request to the server and
    appends ``{"method", "path", "body", "status"}`` to ``log``."""
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, *args: object) -> None:  # quiet
            pass

        def _forward(self) -> None:
            n = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(n) if n else b""
            conn = http.client.HTTPConnection("127.0.0.1", upstream_port, timeout=600)
            conn.request(self.command, self.path, body=raw or None,
                         headers={"Content-Type": "application/json"} if raw else {})
            resp = conn.getresponse()
            data = resp.read()
            conn.close()
            with lock:
                log.append({"method": self.command, "path": self.path,
                            "body": json.loads(raw) if raw else None,
                            "status": resp.status})
            self.send_response(resp.status)
            self.send_header("Content-Type", resp.getheader("Content-Type") or
                             "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        do_GET = do_POST = _forward

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server


def perturbed(seed: int) -> dict[str, torch.Tensor]:
    sd = load_file(str(Path(DEFAULT_TARGET) / "model.safetensors"))
    gen = torch.Generator().manual_seed(seed)
    return {n: t + 0.05 * torch.randn(t.shape, generator=gen) if ".mlp." in n else t
            for n, t in sd.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--port", type=int, required=True, help="the specengine server's port")
    ap.add_argument("--out", type=Path, default=OUT)
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO)

    from areal.api import ModelRequest, ParamSpec, WeightUpdateMeta
    from areal.api.alloc_mode import ModelAllocation
    from areal.api.cli_args import (
        GenerationHyperparameters,
        InferenceEngineConfig,
        NameResolveConfig,
    )
    from areal.engine.core.distributed import init_custom_process_group
    from areal.engine.sglang_remote import RemoteSGLangEngine
    from areal.utils import name_resolve, names

    log: list[dict[str, Any]] = []
    proxy = recording_proxy(args.port, log)
    addr = f"127.0.0.1:{proxy.server_address[1]}"
    ckpt_root = Path(tempfile.mkdtemp(prefix="areal-rec-"))
    cfg = InferenceEngineConfig(experiment_name="specengine-rec", trial_name="t0",
                                backend="sglang:d1", max_concurrent_rollouts=4,
                                request_timeout=600, pause_grace_period=0.0,
                                setup_timeout=60)
    name_resolve.reconfigure(NameResolveConfig(
        type="nfs", nfs_record_root=str(ckpt_root / "names")))
    engine = RemoteSGLangEngine(cfg)
    engine.initialize(addr=addr, train_data_parallel_size=1)
    results: dict[str, Any] = {}

    # 1. rollouts, as the RLVR workflow's agenerate makes them
    async def rollouts() -> list[Any]:
        reqs = [ModelRequest(input_ids=[5, 6, 7, 8 + i], gconfig=GenerationHyperparameters(
            max_new_tokens=12, greedy=i % 2 == 0, temperature=1.0)) for i in range(3)]
        return await asyncio.gather(*(engine.agenerate(r) for r in reqs))
    outs = asyncio.run(rollouts())
    results["rollouts"] = [{"output_tokens": o.output_tokens,
                            "output_versions": o.output_versions,
                            "stop_reason": o.stop_reason} for o in outs]
    logger.info("rollouts: %s", results["rollouts"])

    # 2. pause while a long request runs (AReaL's asynchronous mode)
    fut: Future[Any] = Future()

    def long_rollout() -> None:
        req = ModelRequest(input_ids=[5, 6, 7], gconfig=GenerationHyperparameters(
            max_new_tokens=200, greedy=True, ignore_eos=True))
        try:
            fut.set_result(asyncio.run(engine.agenerate(req)))
        except BaseException as e:  # noqa: BLE001
            fut.set_exception(e)
    threading.Thread(target=long_rollout, daemon=True).start()
    deadline = time.monotonic() + 60
    while _unfinished(args.port) == 0:  # the server runs it now
        if time.monotonic() > deadline or fut.done():
            raise SystemExit("the long request did not start (or ended) before the pause")
        time.sleep(0.005)
    engine.pause()  # the workflow executor holds resubmissions (as rollout_batch's caller)
    engine.pause_generation()
    engine.set_version(1)
    engine.continue_generation()
    engine.resume()
    long = fut.result(timeout=600)
    results["interrupted"] = {"output_tokens": long.output_tokens,
                              "output_versions": long.output_versions,
                              "stop_reason": long.stop_reason}
    logger.info("interrupted rollout: %d tokens, versions %s", len(long.output_tokens),
                sorted(set(long.output_versions)))

    # 3. distributed (xccl) update, FSDP engine order
    port = _free_port()
    meta = WeightUpdateMeta(type="xccl", gen_allocation=ModelAllocation.from_str(
        "sglang:d1", name="rollout"), nccl_master_address="127.0.0.1",
        nccl_master_port=port, nccl_group_name="update_weight_group")
    fut_init = engine.init_weights_update_group(meta)
    pg = init_custom_process_group(backend="gloo", world_size=2,
                                   init_method=f"tcp://127.0.0.1:{port}", rank=0,
                                   group_name="update_weight_group",
                                   timeout=timedelta(seconds=120))
    fut_init.result()
    new = perturbed(1)
    engine.pause_generation()
    specs = [ParamSpec(name=n, shape=tuple(t.shape), dtype=str(t.dtype).split("torch.")[1])
             for n, t in new.items()]
    fut_upd = engine.update_weights_from_distributed(meta, specs)
    for t in new.values():
        dist.broadcast(t.contiguous(), src=0, group=pg)
    fut_upd.result()
    engine.continue_generation()
    engine.set_version(2)

    # 4. disk update, FSDP engine order
    path = ckpt_root / "weight_update_v3"
    path.mkdir()
    disk_meta = WeightUpdateMeta(type="disk", path=str(path), clear_checkpoint_after_load=False)
    engine.pause_generation()
    fut_disk = engine.update_weights_from_disk(disk_meta)
    save_file(perturbed(2), str(path / "model.safetensors"))
    name_resolve.add(names.update_weights_from_disk(cfg.experiment_name, cfg.trial_name,
                                                    engine.get_version()),
                     str(time.time()), keepalive_ttl=120)
    fut_disk.result()
    engine.continue_generation()
    engine.destroy()
    proxy.shutdown()

    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"areal": "1.0.4", "model": "bundled target (arith)",
                                    "requests": log, "results": results}, indent=1) + "\n")
    logger.info("%d requests recorded in %s", len(log), args.out)


def _unfinished(port: int) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    conn.request("GET", "/health")
    n = json.loads(conn.getresponse().read())["num_unfinished"]
    conn.close()
    return n


def _free_port() -> int:
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
