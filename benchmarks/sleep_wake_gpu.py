"""Sleep and wake on a GPU (issue 36): device memory given back, time to sleep and to wake,
outputs after waking, graphs recaptured.

1. The bundled pair with CUDA graphs captured at startup: greedy and seeded outputs before
   ``sleep(1)`` / ``wake_up()`` and after (and after ``sleep(2)``, ``wake_up()``, a reload of
   the checkpoint) must be equal; reports whether parameter and KV addresses survived and how
   many graphs were recaptured.
2. Llama-8B shapes with dummy bf16 weights: memory free on the device before, asleep and
   awake (``torch.cuda.mem_get_info``), the seconds of ``sleep`` and ``wake_up`` at level 1
   (twice: the second reuses the pinned host buffers), then level 2 (wake's graph recapture
   reported apart).

    python benchmarks/sleep_wake_gpu.py --out OUT_DIR

Writes ``OUT_DIR/sleep_wake.json`` and prints a table for RESULTS.md.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from specengine import SamplingParams, SpecEngine
from specengine.assets import DEFAULT_DRAFT, DEFAULT_TARGET

LLAMA_8B = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                num_key_value_heads=8, vocab_size=128256, rms_norm_eps=1e-5,
                rope_theta=500000.0, max_position_embeddings=8192, tie_word_embeddings=False)
GIB = 2**30


def free_gib() -> float:
    torch.cuda.synchronize()
    return torch.cuda.mem_get_info()[0] / GIB


def timed(fn: Any) -> tuple[Any, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = fn()
    torch.cuda.synchronize()
    return out, time.perf_counter() - t0


def captures_s(engine: SpecEngine) -> float:
    """Seconds of the captures since the last sleep (sleep resets the graph stats)."""
    return sum(c.seconds for c in engine.graphs.graph_stats.captures)


def bundled() -> dict[str, Any]:
    prompts = ["Q:472+385=", "Q:12*7=", [17, 16, 5, 10]] * 4
    params = [SamplingParams(temperature=0.0 if i % 3 == 0 else 1.0, seed=i, max_tokens=32)
              for i in range(len(prompts))]
    engine = SpecEngine(DEFAULT_TARGET, draft=DEFAULT_DRAFT, gpu_memory_utilization=0.2,
                        capture_ks=(0, 3))

    def run() -> list[tuple[Any, ...]]:
        return [o.token_ids for o in engine.generate(prompts, k=3, sampling=params)]

    want = run()
    ptrs = [p.data_ptr() for p in engine.model.parameters()] + [engine.kv_cache.kv.data_ptr()]
    graphs = engine.graphs.num_graphs
    c0 = engine.graphs.num_captures
    engine.sleep(1)
    asleep_graphs = engine.graphs.num_graphs
    _, wake_s = timed(engine.wake_up)
    got1 = run()
    same_ptrs = ptrs == [p.data_ptr() for p in engine.model.parameters()] + [
        engine.kv_cache.kv.data_ptr()]
    engine.sleep(2)
    engine.wake_up()
    refused = ""
    try:
        engine.generate(prompts[:1])
    except RuntimeError as exc:
        refused = str(exc)[:80]
    engine.load_weights(DEFAULT_TARGET)
    got2 = run()
    return {"graphs_at_start": graphs, "graphs_asleep": asleep_graphs,
            "graphs_after_wake": engine.graphs.num_graphs,
            "recaptured": engine.graphs.num_captures - c0,
            "wake_s": round(wake_s, 3), "addresses_kept": same_ptrs,
            "level1_equal": got1 == want, "level2_reload_equal": got2 == want,
            "level2_refusal": refused, "accepted": engine.stats.mean_accepted_length}


def big(shape: dict[str, Any], util: float) -> dict[str, Any]:
    ckpt = Path(tempfile.mkdtemp())
    (ckpt / "config.json").write_text(json.dumps(shape))
    before = free_gib()
    engine = SpecEngine(ckpt, dtype="bfloat16", load_format="dummy", max_model_len=4096,
                        gpu_memory_utilization=util, max_batch_size=64)
    prompt = [[11, 12, 13, 14, 15, 16, 17, 18]] * 8
    greedy = SamplingParams(temperature=0.0, max_tokens=16, ignore_eos=True)
    want = [o.token_ids for o in engine.generate(prompt, sampling=greedy)]
    weights = sum(p.untyped_storage().nbytes() for p in engine.model.parameters()) / GIB
    kv = engine.kv_cache.kv.untyped_storage().nbytes() / GIB
    rows: dict[str, Any] = {"free_before_engine_gib": round(before, 2),
                            "weights_gib": round(weights, 2), "kv_gib": round(kv, 2),
                            "graphs": engine.graphs.num_graphs}
    for level in (1, "1 again", 2):  # the second level-1 sleep reuses the pinned buffers
        awake = free_gib()
        released, sleep_s = timed(lambda lv=int(str(level)[0]): engine.sleep(lv))
        asleep = free_gib()
        _, wake_s = timed(engine.wake_up)
        rows[f"level{level}"] = {
            "released_gib": round(released / GIB, 2), "free_awake_gib": round(awake, 2),
            "free_asleep_gib": round(asleep, 2), "freed_gib": round(asleep - awake, 2),
            "sleep_s": round(sleep_s, 3), "wake_s": round(wake_s, 3),
            "recapture_s": round(captures_s(engine), 3),
            "free_after_wake_gib": round(free_gib(), 2)}
        if level == 1:
            rows["level1"]["equal_after_wake"] = [
                o.token_ids for o in engine.generate(prompt, sampling=greedy)] == want
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--util", type=float, default=0.5)
    args = ap.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    result: dict[str, Any] = {"device": torch.cuda.get_device_name(),
                              "torch": torch.__version__}
    for name, fn in (("bundled", bundled), ("llama8b_dummy", lambda: big(LLAMA_8B, args.util))):
        try:
            result[name] = fn()
        except Exception as exc:  # noqa: BLE001 - reported, the other part still runs
            import traceback

            result[name] = {"error": f"{type(exc).__name__}: {exc}",
                            "trace": traceback.format_exc()[-2000:]}
        print(name, json.dumps(result[name], indent=1), flush=True)
        torch.cuda.empty_cache()
    (args.out / "sleep_wake.json").write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
