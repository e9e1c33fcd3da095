"""Weight sync from a learner to an engine: seconds and GB/s for Llama-3-8B-shaped weights.

The learner (this process, ``WeightSender``) pushes a bf16 state dict with Llama-3-8B shapes
(vocab 128256, hidden 4096, MLP 14336, 32 heads / 8 KV heads; ``--num-layers`` of the 32
decoder layers, embeddings and ``lm_head`` always) to an engine in a second process, a real
``SpecEngine`` built with ``load_format="dummy"`` from the same shapes, once per bucket size
(``--buckets``, MiB). Time is the learner's wall clock from the start of ``send`` until the
engine applied the update (distributed: ``send`` returns then; shared: the engine's ack).

Modes (``--mode``):

* ``gloo``: CPU tensors over TCP loopback (runs anywhere). Floor: the bytes over the raw
  TCP loopback bandwidth measured here between two processes (``socket`` ``sendall``); the raw
  ``memcpy`` bandwidth is printed too (the receiver's staging and copy-in are memcpys).
* ``shared``: colocated CUDA-IPC path between two processes on one GPU (learner packs into
  shared buckets, engine copies). Floor: bytes over the measured device-to-device copy rate.
* ``nccl``: two GPUs, learner on ``cuda:0`` and engine on ``cuda:1``. Floor: bytes over the
  measured ``cuda:0 -> cuda:1`` copy rate.
* ``auto``: ``nccl`` with two GPUs, ``shared`` with one, else ``gloo``.

The GPU modes were written without a GPU and are UNMEASURED until someone runs them.
Outputs: the table, ``OUT/weight_sync.json`` and ``OUT/weight_sync.png`` (``--out``, default
``benchmarks/out``).

Usage::

    python benchmarks/bench_weight_sync.py --mode gloo --num-layers 2
    python benchmarks/bench_weight_sync.py --mode shared --num-layers 32     # one GPU
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import tempfile
import time
from pathlib import Path

import benchlib
import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from specengine.weight_sync import WeightSender  # noqa: E402

LLAMA3_8B = dict(
    architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=128256,
    hidden_size=4096, intermediate_size=14336, num_attention_heads=32, num_key_value_heads=8,
    head_dim=128, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=8192,
    tie_word_embeddings=False, torch_dtype="bfloat16",
)
WAIT_S = 300.0  # rendezvous (engine start-up included) and each transfer step


def llama3_8b_shapes(num_layers: int) -> dict[str, tuple[int, ...]]:
    """HF parameter names and shapes of Llama-3-8B with ``num_layers`` decoder layers."""
    h, f, v, kv = 4096, 14336, 128256, 8 * 128
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (v, h)}
    for i in range(num_layers):
        p = f"model.layers.{i}."
        shapes.update({
            p + "input_layernorm.weight": (h,), p + "post_attention_layernorm.weight": (h,),
            p + "self_attn.q_proj.weight": (h, h), p + "self_attn.k_proj.weight": (kv, h),
            p + "self_attn.v_proj.weight": (kv, h), p + "self_attn.o_proj.weight": (h, h),
            p + "mlp.gate_proj.weight": (f, h), p + "mlp.up_proj.weight": (f, h),
            p + "mlp.down_proj.weight": (h, f),
        })
    shapes.update({"model.norm.weight": (h,), "lm_head.weight": (v, h)})
    return shapes


def _engine(config_dir: str, mode: str, port: int, num_updates: int, staging: str,
            queue: object, acks: object) -> None:
    from specengine import SpecEngine

    device = "cuda:1" if mode == "nccl" else ("cuda" if mode == "shared" else "cpu")
    if device.startswith("cuda"):
        torch.cuda.set_device(torch.device(device))
    engine = SpecEngine(config_dir, device=device, dtype="bfloat16", load_format="dummy",
                        kv_cache_tokens=256, max_model_len=128, max_batch_size=1)
    if mode == "shared":
        acks.put("ready")  # type: ignore[attr-defined]
        for _ in range(num_updates):
            handles = queue.get(timeout=WAIT_S)  # type: ignore[attr-defined]
            engine.update_weights_from_shared(handles)
            torch.cuda.synchronize()
            del handles
            acks.put("copied")  # type: ignore[attr-defined]
        return
    engine.init_weight_update_group("127.0.0.1", port, 1, 2, backend=mode, timeout_s=WAIT_S)
    for _ in range(num_updates):
        engine.update_weights_from_distributed(staging=staging)
    engine.close_weight_update_group()


def _socket_sink(port: int, nbytes: int) -> None:
    with socket.create_connection(("127.0.0.1", port)) as s:
        buf, got = bytearray(64 << 20), 0
        view = memoryview(buf)
        while got < nbytes:
            got += s.recv_into(view)
        s.sendall(b"k")


def loopback_gbps(nbytes: int = 1 << 30) -> float:
    """Raw TCP loopback bandwidth between two processes (the gloo floor)."""
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen(1)
        proc = mp.get_context("spawn").Process(target=_socket_sink,
                                               args=(server.getsockname()[1], nbytes))
        proc.start()
        conn, _ = server.accept()
        chunk = memoryview(bytearray(64 << 20))
        start = time.perf_counter()
        for _ in range(nbytes // len(chunk)):
            conn.sendall(chunk)
        conn.recv(1)
        secs = time.perf_counter() - start
        conn.close()
        proc.join(60)
    return nbytes / secs / 1e9


def copy_gbps(src: str, dst: str, nbytes: int = 1 << 30) -> float:
    """Best of 3 plain copies of ``nbytes`` from device ``src`` to ``dst`` (GB/s)."""
    a = torch.ones(nbytes, dtype=torch.uint8, device=src)
    b = torch.empty(nbytes, dtype=torch.uint8, device=dst)
    best = float("inf")
    for _ in range(3):
        for d in {a.device, b.device}:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        start = time.perf_counter()
        b.copy_(a)
        for d in {a.device, b.device}:
            if d.type == "cuda":
                torch.cuda.synchronize(d)
        best = min(best, time.perf_counter() - start)
    return nbytes / best / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mode", choices=["auto", "gloo", "shared", "nccl"], default="auto")
    ap.add_argument("--num-layers", type=int, default=2,
                    help="decoder layers of the 32 (the full 16 GB twice does not fit a "
                         "24 GiB CPU box)")
    ap.add_argument("--buckets", type=int, nargs="+", default=[64, 128, 256, 512, 1024],
                    help="bucket sizes in MiB")
    ap.add_argument("--staging", default="auto", choices=["auto", "device", "host", "none"])
    ap.add_argument("--out", type=Path, default=Path("benchmarks/out"))
    args = ap.parse_args()
    if not 1 <= args.num_layers <= 32:
        ap.error("--num-layers must be in 1..32")
    mode = args.mode
    if mode == "auto":
        n = torch.cuda.device_count()
        mode = "nccl" if n >= 2 else ("shared" if n == 1 else "gloo")
    device = "cpu" if mode == "gloo" else "cuda:0"
    shapes = llama3_8b_shapes(args.num_layers)
    gen = torch.Generator(device=device).manual_seed(0)
    sd = {n: torch.empty(s, dtype=torch.bfloat16, device=device).normal_(0, 0.02, generator=gen)
          for n, s in shapes.items()}
    nbytes = sum(t.nbytes for t in sd.values())
    if mode == "gloo":
        floor_gbps = loopback_gbps()
        floor_what = "TCP loopback between two processes"
        memcpy = copy_gbps("cpu", "cpu")
    else:
        floor_gbps = copy_gbps("cuda:0", "cuda:1" if mode == "nccl" else "cuda:0")
        floor_what = "cuda:0 -> cuda:1 copy" if mode == "nccl" else "device-to-device copy"
        memcpy = floor_gbps
    print(f"{mode}: {len(sd)} tensors, {nbytes / 1e9:.2f} GB bf16 ({args.num_layers} of 32 "
          f"layers); floor {floor_gbps:.2f} GB/s ({floor_what}); memcpy {memcpy:.2f} GB/s; "
          f"device {benchlib.device_name()}")

    with tempfile.TemporaryDirectory() as tmp:
        (Path(tmp) / "config.json").write_text(json.dumps(
            dict(LLAMA3_8B, num_hidden_layers=args.num_layers)))
        ctx = mp.get_context("spawn")
        queue, acks = ctx.Queue(), ctx.Queue()
        port = _free_port()
        num = len(args.buckets) + 1  # + one warm-up (first-touch of every buffer)
        proc = ctx.Process(target=_engine, args=(tmp, mode, port, num, args.staging, queue,
                                                 acks))
        proc.start()
        if mode == "shared":
            sender = WeightSender(transport="shared")
            acks.get(timeout=WAIT_S)
        else:
            sender = WeightSender("127.0.0.1", port, 2, backend=mode, timeout_s=WAIT_S)
        rows = []
        for version, mib in enumerate([args.buckets[-1], *args.buckets], start=1):
            start = time.perf_counter()
            handles = sender.send(sd, version, bucket_bytes=mib << 20)
            if handles is not None:
                queue.put(handles)
                acks.get(timeout=WAIT_S)
                sender.release(version)
            secs = time.perf_counter() - start
            if version > 1:
                rows.append({"bucket_mib": mib, "seconds": secs, "gbps": nbytes / secs / 1e9,
                             "floor_s": nbytes / floor_gbps / 1e9})
        sender.close()
        proc.join(WAIT_S)

    print(f"{'bucket MiB':>10} {'seconds':>8} {'GB/s':>7} {'floor s':>8} {'x floor':>8}")
    for r in rows:
        print(f"{r['bucket_mib']:>10} {r['seconds']:>8.2f} {r['gbps']:>7.2f} "
              f"{r['floor_s']:>8.2f} {r['seconds'] / r['floor_s']:>8.2f}")
    result = {"mode": mode, "device": benchlib.device_name(), "num_layers": args.num_layers,
              "num_bytes": nbytes, "staging": args.staging, "floor_gbps": floor_gbps,
              "floor": floor_what, "memcpy_gbps": memcpy, "rows": rows,
              "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())}
    benchlib.write_json(result, args.out, "weight_sync")
    plt = benchlib.pyplot()
    if plt is not None:
        fig, ax = plt.subplots(figsize=(6, 4))
        ax.plot([r["bucket_mib"] for r in rows], [r["gbps"] for r in rows], "o-", label=mode)
        ax.axhline(floor_gbps, ls="--", color="gray", label=f"floor: {floor_what}")
        ax.set_xscale("log", base=2)
        ax.set_xlabel("bucket (MiB)")
        ax.set_ylabel("GB/s (learner wall clock)")
        ax.set_title(f"weight sync, Llama-3-8B shapes, {nbytes / 1e9:.1f} GB bf16")
        ax.legend()
        benchlib.save_figure(fig, args.out, "weight_sync")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


if __name__ == "__main__":
    main()
