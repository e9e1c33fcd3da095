"""specengine next to transformers' own batched ``model.generate`` on the bundled pair.

The protocol of issue 27: the same held-out prompts, greedy, fp32, the same number of new
tokens, one batch for everyone; transformers' ``generate`` (left-padded batch, attention mask,
its KV cache) against specengine at k=0, the n-gram drafter at k=3 and the bundled EAGLE-3
head at k=3. Rounds are interleaved (every configuration once per round, in turn) so machine
load hits all rows alike; the figure of a row is the median over rounds of tokens/s, where
tokens are the completions' tokens up to and including ``<eos>`` (what each side returns to a
caller), over the wall time of the whole ``generate`` call. Greedy outputs are compared token
by token with transformers' as the reference: any difference is reported (prompt, position)
and makes the row's ``identical`` false.

Imported by ``bench_generate.py`` (``--peer hf``) and parsed for ``gpu_check.py`` by
``gpu_check_rows.parse_hf_peer``.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

# (row name, drafter passed to SpecEngine ("eagle3": the bundled head), k)
CONFIGS: tuple[tuple[str, str, int], ...] = (
    ("specengine k=0", "eagle3", 0),
    ("specengine ngram k=3", "ngram", 3),
    ("specengine EAGLE-3 k=3", "eagle3", 3),
)
HF_ROW = "transformers generate"


@dataclass(frozen=True)
class Mismatch:
    """Where ``got`` first leaves the reference ``ref`` for one prompt."""

    prompt: int
    position: int
    ref: tuple[int, ...]
    got: tuple[int, ...]


def completion(ids: Sequence[int], eos_id: int) -> tuple[int, ...]:
    """``ids`` up to and including the first ``eos_id`` (transformers pads after it)."""
    ids = tuple(int(t) for t in ids)
    return ids[: ids.index(eos_id) + 1] if eos_id in ids else ids


def compare(ref: Sequence[Sequence[int]], got: Sequence[Sequence[int]]) -> list[Mismatch]:
    """Every prompt whose completion in ``got`` differs from ``ref`` (first differing
    position; a shorter or longer completion differs at the end of the shorter one)."""
    if len(ref) != len(got):
        raise ValueError(f"{len(got)} completions to compare with {len(ref)} references")
    out = []
    for i, (a, b) in enumerate(zip(ref, got)):
        a, b = tuple(a), tuple(b)
        if a != b:
            pos = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            out.append(Mismatch(i, pos, a, b))
    return out


def describe(mismatches: Sequence[Mismatch], num_prompts: int) -> str:
    """One line for a table: ``identical`` or how many differ and the first difference."""
    if not mismatches:
        return "identical"
    m = mismatches[0]
    return (f"{len(mismatches)} of {num_prompts} differ (first: prompt {m.prompt} at token "
            f"{m.position}: {m.ref[m.position:m.position + 4]} vs "
            f"{m.got[m.position:m.position + 4]})")


class HFGenerate:
    """transformers' batched greedy ``generate`` over token-id prompts, left-padded."""

    def __init__(self, path: str, device: str, pad_id: int, eos_id: int) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).to(device)
        self.model.eval()
        self.device, self.pad_id, self.eos_id = device, pad_id, eos_id

    @torch.inference_mode()
    def __call__(self, prompts: Sequence[Sequence[int]], max_new_tokens: int
                 ) -> list[tuple[int, ...]]:
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), self.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):  # left padding: every prompt ends at the last column
            ids[i, width - len(p):] = torch.tensor(p)
            mask[i, width - len(p):] = 1
        out = self.model.generate(ids.to(self.device), attention_mask=mask.to(self.device),
                                  max_new_tokens=max_new_tokens, do_sample=False,
                                  pad_token_id=self.pad_id, eos_token_id=self.eos_id)
        return [completion(row[width:].tolist(), self.eos_id) for row in out.cpu()]


def run_peer(*, device: str | None, batch: int, max_tokens: int, rounds: int,
             target: str, draft: str, prompts: Sequence[Sequence[int]],
             eos_id: int, pad_id: int, progress: Callable[[str], None] | None = None
             ) -> list[dict]:
    """The interleaved comparison; one dict per row (transformers' first)."""
    from specengine import SamplingParams, SpecEngine

    dev = device or ("cuda" if torch.cuda.is_available() else "cpu")
    prompts = [list(p) for p in prompts[:batch]]
    hf = HFGenerate(target, dev, pad_id, eos_id)
    engines = {"eagle3": SpecEngine(target, draft=draft, device=dev, dtype="float32",
                                    max_batch_size=batch),
               "ngram": SpecEngine(target, draft="ngram", device=dev, dtype="float32",
                                   max_batch_size=batch)}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, seed=0)

    def ours(name: str, drafter: str, k: int) -> Callable[[], tuple[list, float]]:
        def go() -> tuple[list, float]:
            outs = engines[drafter].generate(prompts, k=k, sampling=params)
            steps = sum(o.num_steps for o in outs)
            return [completion(o.token_ids, eos_id) for o in outs], steps
        return go

    runners = {HF_ROW: lambda: (hf(prompts, max_tokens), 0),
               **{name: ours(name, d, k) for name, d, k in CONFIGS}}
    for run in runners.values():  # warm-up: allocator, caches, graphs
        run()
    times: dict[str, list[float]] = {name: [] for name in runners}
    outputs: dict[str, list] = {}
    steps: dict[str, int] = {}
    for r in range(rounds):
        for name, run in runners.items():
            if dev == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            outs, num_steps = run()
            if dev == "cuda":
                torch.cuda.synchronize()
            times[name].append(time.perf_counter() - t0)
            outputs[name], steps[name] = outs, num_steps
        if progress is not None:
            progress(f"round {r + 1}/{rounds}")
    return peer_rows(times, outputs, steps)


def peer_rows(times: dict[str, list[float]], outputs: dict[str, list],
              steps: dict[str, int]) -> list[dict]:
    """Rows from the measured times and outputs: tokens/s (median over rounds), the ratio to
    transformers, tokens per target step, and the greedy comparison against transformers."""
    ref = outputs[HF_ROW]
    num_tokens = {name: sum(len(c) for c in outs) for name, outs in outputs.items()}
    hf_tps = num_tokens[HF_ROW] / statistics.median(times[HF_ROW])
    rows = []
    for name, ts in times.items():
        mism = compare(ref, outputs[name])
        tps = num_tokens[name] / statistics.median(ts)
        # tokens per target forward per sequence (steps summed over sequences, prefill incl.)
        per_step = num_tokens[name] / steps[name] if steps.get(name) else None
        rows.append(dict(mode="peer-hf", config=name, batch=len(ref), rounds=len(ts),
                         tokens=num_tokens[name], median_s=statistics.median(ts),
                         tokens_per_s=tps, vs_transformers=tps / hf_tps,
                         tokens_per_step=per_step, identical=not mism,
                         outputs=describe(mism, len(ref)),
                         mismatches=[[m.prompt, m.position] for m in mism]))
    return rows
