"""Our kernels next to FlashInfer's on the same inputs, both graph-timed the same way (GPU only).

Both sides are timed by ``graph_timing.time_rotated``: captured in a CUDA graph with inputs
rotated over >= 4x L2, median per call over replays (a side whose capture fails falls back to
its eager time, and the row says so). Outputs are compared on the same inputs before timing.
Rows (8B shapes: 32 q / 8 kv heads, head_dim 128, NHD pages of 16, bf16; V = 151,936):

* ``paged decode``: ``paged_attention`` (q_len 1) vs ``BatchDecodeWithPagedKVCacheWrapper``;
  max |difference| of the outputs.
* ``tree attention``: our packed tree mask (16 nodes, whole context visible) vs
  ``BatchPrefillWithPagedKVCacheWrapper`` with the same mask as a custom mask; max |diff|.
  Each wrapper's ``plan`` runs once, outside the timing (once per step for all layers).
* ``chain spec sampling`` (k = 3, draft probabilities given): our fused sampler from logits vs
  ``chain_speculative_sampling``, which takes probabilities: their time includes the softmax
  of the target logits (``theirs_no_softmax_us`` without). Compared on peaked rows where the
  output is determined (p = q, so every draft is accepted, then the bonus token's peak).
* ``top-p renorm`` (top_p 0.9): our kept-set cut (``keep_threshold``: the threshold, reading
  logits) vs ``top_p_renorm_probs`` (reads and writes probabilities; not the same work, see
  the note); compared: kept tokens per row.
* ``sampling from logits``: one token per row, no filter: our sampler (no drafts) vs
  ``sampling_from_logits``; compared on peaked rows.
* ``top-k/top-p from logits`` (top_k 50, top_p 0.9): ours vs
  ``top_k_top_p_sampling_from_logits``; compared on peaked rows.

Sampling rows use float32 logits on both sides (every FlashInfer sampling entry takes them).
FlashInfer's random streams differ from ours, so sampled outputs agree only where the
distribution leaves one choice; that is what the peaked comparison checks.

``--warmup-only``: one call of each FlashInfer entry at tiny shapes, which JIT-compiles its
modules (minutes) and caches them under ``FLASHINFER_WORKSPACE_BASE``; run it in the background
while other work uses the GPU (``scripts/device_kernels.sh``), then the timed run finds them
built. Without CUDA or FlashInfer it writes why and exits 0 with no rows. Writes
``OUT/peers_flashinfer.json`` (rows as they finish) and prints a table.

Usage::

    python benchmarks/peers_flashinfer.py --out OUT [--budget-s 120]
    python benchmarks/peers_flashinfer.py --warmup-only --out OUT
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import graph_timing as gt
import torch

VOCAB = 151936  # Qwen3
HEADS = (32, 8, 128)  # q heads, kv heads, head_dim: Llama-3.1-8B / Qwen3-8B
PAGE = 16
ATTN_TOL = 0.05  # bf16 attention outputs of two kernels: |diff| well under this when right


@dataclass
class Peer:
    """One row's two sides over the same copies of the inputs."""

    make: Callable[[int], Any]  # copy i
    ours: Callable[[Any], object]
    theirs: Callable[[Any], object]
    nbytes: int  # bytes one call touches (sizes the rotation)
    compare: Callable[[], dict[str, Any]]  # outputs side by side (on their own inputs)
    note: str = ""
    same_work: bool = True  # False: the target "ours <= theirs" does not apply (note says why)
    theirs_extra: dict[str, Callable[[Any], object]] | None = None  # further timed variants


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means no peer to compare
        return f"flashinfer not importable ({type(e).__name__}: {e})"
    return None


# ---------------------------------------------------------------------------------------------
# attention


def _attn_copies(batch: int, ctx: int, q_len: int, mode: str):
    """Copy ``i`` of the attention inputs, every copy on copy 0's block table (so both sides
    read the same pages from each copy's caches)."""
    from bench_attention import Case

    first: dict[str, Any] = {}

    def make(i: int):
        c = Case(batch, ctx, q_len, mode, PAGE, torch.bfloat16, "cuda", seed=0)
        if i == 0:
            first["c"] = c
        else:
            c.block_tables = first["c"].block_tables
        return c
    return make


def _paged_layout(c) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """FlashInfer's (indptr, indices, last_page_len) for ``c``'s block table."""
    kv_len = c.ctx + c.q_len
    pages = -(-kv_len // PAGE)
    indptr = torch.arange(0, (c.batch + 1) * pages, pages, dtype=torch.int32, device="cuda")
    indices = c.block_tables[:, :pages].reshape(-1).contiguous()
    last = torch.full((c.batch,), kv_len - (pages - 1) * PAGE, dtype=torch.int32,
                      device="cuda")
    return indptr, indices, last


def _ours_attention(c):
    from specengine.kernels.attention import paged_attention

    return paged_attention(c.q, c.k_cache, c.v_cache, c.block_tables, c.context_lens,
                           c.qo_indptr, c.tree_mask, c.scale, max_q_len=c.q_len)


def decode_peer(batch: int, ctx: int) -> Peer:
    import flashinfer

    hq, hkv, d = HEADS
    make = _attn_copies(batch, ctx, 1, "decode")
    c0 = make(0)
    wrapper = flashinfer.BatchDecodeWithPagedKVCacheWrapper(
        torch.zeros(128 * 2**20, dtype=torch.uint8, device="cuda"), "NHD")
    indptr, indices, last = _paged_layout(c0)
    wrapper.plan(indptr, indices, last, hq, hkv, d, PAGE, pos_encoding_mode="NONE",
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16, sm_scale=c0.scale)

    def theirs(c):
        return wrapper.run(c.q, (c.k_cache, c.v_cache))

    def compare() -> dict[str, Any]:
        diff = float((_ours_attention(c0).float() - theirs(c0).float()).abs().max())
        return dict(max_diff=diff, agree=diff < ATTN_TOL)

    made = {0: c0}
    return Peer(lambda i: made.pop(i) if i in made else make(i), _ours_attention, theirs,
                c0.bytes_moved(), compare)


def tree_peer(batch: int, ctx: int, nodes: int = 16) -> Peer:
    import flashinfer

    hq, hkv, d = HEADS
    make = _attn_copies(batch, ctx, nodes, "tree")
    c0 = make(0)
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.zeros(256 * 2**20, dtype=torch.uint8, device="cuda"), "NHD")
    indptr, indices, last = _paged_layout(c0)
    mask = c0.full_mask.reshape(-1).repeat(batch)  # per request [q_len, kv_len], flattened
    wrapper.plan(c0.qo_indptr, indptr, indices, last, hq, hkv, d, PAGE, custom_mask=mask,
                 causal=False, sm_scale=c0.scale, q_data_type=torch.bfloat16,
                 kv_data_type=torch.bfloat16)

    def theirs(c):
        return wrapper.run(c.q, (c.k_cache, c.v_cache))

    def compare() -> dict[str, Any]:
        diff = float((_ours_attention(c0).float() - theirs(c0).float()).abs().max())
        return dict(max_diff=diff, agree=diff < ATTN_TOL)

    made = {0: c0}
    return Peer(lambda i: made.pop(i) if i in made else make(i), _ours_attention, theirs,
                c0.bytes_moved(), compare)


# ---------------------------------------------------------------------------------------------
# sampling


def _vectors(batch: int, top_k: int, top_p: float) -> dict[str, torch.Tensor]:
    dev = "cuda"
    return dict(ones=torch.ones(batch, device=dev),
                top_k=torch.full((batch,), top_k, dtype=torch.int32, device=dev),
                top_p=torch.full((batch,), top_p, device=dev),
                seeds=torch.arange(batch, dtype=torch.int64, device=dev),
                offsets=torch.zeros(batch, dtype=torch.int64, device=dev))


def _peaked(batch: int, rows: int, vocab: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits ``[B, rows, V]`` whose every row has one token 40 nats above the rest (the
    sampled token is then determined, whatever the random stream), and those tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    logits = torch.randn(batch, rows, vocab, device="cuda", generator=g)
    peak = torch.randint(0, vocab, (batch, rows), device="cuda", generator=g)
    logits.scatter_(-1, peak[..., None], 40.0)
    return logits, peak


def chain_peer(batch: int, k: int = 3, vocab: int = VOCAB) -> Peer:
    from flashinfer import sampling as fs

    from specengine.kernels.rejection_sampling import rejection_sample

    v = _vectors(batch, -1, 1.0)
    nd = torch.full((batch,), k, dtype=torch.int32, device="cuda")

    def make(i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(i)
        logits = torch.randn(batch, k + 1, vocab, device="cuda", generator=g) * 3
        q = torch.softmax(logits[:, :-1] + 0.5, -1)
        drafts = q.argmax(-1)
        return dict(logits=logits, q=q, drafts=drafts, drafts32=drafts.int(),
                    p=torch.softmax(logits, -1))

    def ours(x):
        return rejection_sample(x["logits"], x["drafts"], nd, x["q"], v["ones"], v["top_k"],
                                v["top_p"], v["seeds"], v["offsets"], None, check_values=False)

    def theirs(x):
        return fs.chain_speculative_sampling(x["q"], x["drafts32"], torch.softmax(x["logits"], -1),
                                             seed=v["seeds"], offset=v["offsets"])

    def theirs_no_softmax(x):
        return fs.chain_speculative_sampling(x["q"], x["drafts32"], x["p"], seed=v["seeds"],
                                             offset=v["offsets"])

    def compare() -> dict[str, Any]:
        logits, peak = _peaked(batch, k + 1, vocab, 7)
        q = torch.softmax(logits[:, :-1], -1)  # p = q: every draft accepted
        x = dict(logits=logits, q=q, drafts=peak[:, :-1], drafts32=peak[:, :-1].int(),
                 p=torch.softmax(logits, -1))
        ours_ids = ours(x)[0]
        theirs_ids = theirs(x)
        theirs_ids = theirs_ids[0] if isinstance(theirs_ids, tuple) else theirs_ids
        want = peak.long()
        return dict(ours_exact=bool(torch.equal(ours_ids, want)),
                    theirs_exact=bool(torch.equal(theirs_ids.long(), want)),
                    agree=bool(torch.equal(ours_ids, theirs_ids.long())))

    nbytes = batch * (2 * k + 1) * vocab * 4
    return Peer(make, ours, theirs, nbytes, compare,
                "theirs = softmax of the target logits + chain_speculative_sampling (theirs "
                "takes probabilities)", {"theirs_no_softmax": theirs_no_softmax})


def renorm_peer(batch: int, vocab: int = VOCAB, top_p: float = 0.9) -> Peer:
    from flashinfer import sampling as fs

    from specengine.kernels.keep_threshold import keep_threshold

    v = _vectors(batch, -1, top_p)

    def make(i: int) -> dict[str, torch.Tensor]:
        g = torch.Generator(device="cuda").manual_seed(i)
        logits = torch.randn(batch, vocab, device="cuda", generator=g) * 3
        return dict(logits=logits, probs=torch.softmax(logits, -1))

    def ours(x):
        return keep_threshold(x["logits"], v["ones"], v["top_k"], v["top_p"])

    def theirs(x):
        return fs.top_p_renorm_probs(x["probs"], v["top_p"])

    def compare() -> dict[str, Any]:
        x = make(123)
        tau = ours(x)[0]
        ours_kept = (x["logits"] >= tau[:, None]).sum(-1)
        theirs_kept = (theirs(x) > 0).sum(-1)
        return dict(kept_equal_rows=float((ours_kept == theirs_kept).float().mean()),
                    ours_kept_mean=float(ours_kept.float().mean()),
                    theirs_kept_mean=float(theirs_kept.float().mean()),
                    agree=bool((ours_kept - theirs_kept).abs().max() <= 1))

    return Peer(make, ours, theirs, batch * vocab * 4, compare,
                "not the same work: ours finds the cut reading logits (3 floats out per row); "
                "theirs reads probabilities and writes renormalised ones (2x the bytes)",
                same_work=False)


def logits_sampling_peer(batch: int, top_k: int, top_p: float, vocab: int = VOCAB) -> Peer:
    from flashinfer import sampling as fs

    from specengine.kernels.rejection_sampling import rejection_sample

    v = _vectors(batch, top_k, top_p)
    empty = torch.zeros(batch, 0, dtype=torch.int64, device="cuda")
    zeros = torch.zeros(batch, dtype=torch.int32, device="cuda")
    filtered = top_k > 0 or top_p < 1.0

    def make(i: int) -> torch.Tensor:
        g = torch.Generator(device="cuda").manual_seed(i)
        return torch.randn(batch, 1, vocab, device="cuda", generator=g) * 3

    def ours(logits):
        return rejection_sample(logits, empty, zeros, None, v["ones"], v["top_k"], v["top_p"],
                                v["seeds"], v["offsets"], None, check_values=False)

    def theirs(logits):
        if filtered:
            return fs.top_k_top_p_sampling_from_logits(logits[:, 0], v["top_k"], v["top_p"],
                                                       seed=v["seeds"], offset=v["offsets"])
        return fs.sampling_from_logits(logits[:, 0], seed=v["seeds"], offset=v["offsets"])

    def compare() -> dict[str, Any]:
        logits, peak = _peaked(batch, 1, vocab, 11)
        ours_ids = ours(logits)[0][:, 0]
        theirs_ids = theirs(logits).long()
        want = peak[:, 0].long()
        return dict(ours_exact=bool(torch.equal(ours_ids, want)),
                    theirs_exact=bool(torch.equal(theirs_ids, want)),
                    agree=bool(torch.equal(ours_ids, theirs_ids)))

    return Peer(make, ours, theirs, batch * vocab * 4, compare)


# ---------------------------------------------------------------------------------------------
# the run


def peer_list(batches_attn: list[int], batches_sampling: list[int],
              ctx: int) -> list[tuple[str, int, Callable[[], Peer]]]:
    """(check, batch, builder) in the order they run: the likeliest wins and losses first."""
    out: list[tuple[str, int, Callable[[], Peer]]] = []
    # The middle batch of each list first (the engine's usual case), then the others.
    for b in sorted(batches_attn, key=lambda b: b != batches_attn[len(batches_attn) // 2]):
        out.append(("paged decode", b, lambda b=b: decode_peer(b, ctx)))
        out.append(("tree attention", b, lambda b=b: tree_peer(b, ctx)))
    for b in sorted(batches_sampling,
                    key=lambda b: b != batches_sampling[len(batches_sampling) // 2]):
        out.append(("chain spec sampling", b, lambda b=b: chain_peer(b)))
        out.append(("top-k/top-p from logits", b, lambda b=b: logits_sampling_peer(b, 50, 0.9)))
        out.append(("sampling from logits", b, lambda b=b: logits_sampling_peer(b, -1, 1.0)))
        out.append(("top-p renorm", b, lambda b=b: renorm_peer(b)))
    return out


def run_peer(check: str, batch: int, build: Callable[[], Peer], args: argparse.Namespace,
             l2: int) -> dict[str, Any]:
    row: dict[str, Any] = dict(check=check, batch=batch)
    peer = build()
    if peer.note:
        row["note"] = peer.note
    row.update(peer.compare())
    n = gt.num_copies(peer.nbytes, peer.nbytes, l2=l2, max_copies=32, mem_cap_bytes=3 << 30)
    copies = [peer.make(i) for i in range(n)]
    sides = {"ours": peer.ours, "theirs": peer.theirs, **(peer.theirs_extra or {})}
    for side, fn in sides.items():
        t = gt.time_rotated(fn, copies, replays=args.replays, eager_runs=args.eager_runs,
                            graphs=True)
        row[f"{side}_us"] = t.best_us
        row[f"{side}_eager_us"] = t.eager_us
        if t.graph_error:
            row[f"{side}_graph_error"] = t.graph_error
    row.update(copies=n, ours_ms=row["ours_us"] / 1e3, theirs_ms=row["theirs_us"] / 1e3,
               ratio=row["ours_us"] / row["theirs_us"])
    # Issue 35's target: ours <= theirs wherever both do the same work.
    row["verdict"] = ("PASS" if row["ratio"] <= 1.0 else "MISS") if peer.same_work else "n/a"
    return row


WARMUP_STEPS = ("decode", "tree", "sampling")  # one FlashInfer JIT module family each


def warmup(out: Path, steps: list[str]) -> int:
    """One call of the FlashInfer entries of ``steps`` at tiny shapes: the JIT builds their
    modules (decode; prefill with a custom mask and the mask packing; sampling). Steps are
    independent: ``scripts/device_kernels.sh`` runs one process per step, in parallel."""
    result: dict[str, Any] = dict(steps={})
    t_all = time.monotonic()
    builds = {"decode": lambda: decode_peer(2, 64), "tree": lambda: tree_peer(2, 64),
              "sampling": lambda: chain_peer(2, vocab=4096)}
    for step in steps:
        t0 = time.monotonic()
        try:
            peer = builds[step]()
            peer.theirs(peer.make(0))
            if step == "sampling":  # the same module holds every sampling entry
                logits_sampling_peer(2, 50, 0.9, 4096).theirs(torch.randn(2, 1, 4096,
                                                                          device="cuda"))
            torch.cuda.synchronize()
            result["steps"][step] = dict(seconds=round(time.monotonic() - t0, 1))
        except Exception as e:  # noqa: BLE001 - reported; the timed run reports it again
            result["steps"][step] = dict(seconds=round(time.monotonic() - t0, 1),
                                         error=f"{type(e).__name__}: {e}"[:500])
        print(f"warm-up {step}: {result['steps'][step]}", flush=True)
    result["seconds"] = round(time.monotonic() - t_all, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / f"flashinfer_warmup_{'_'.join(steps)}.json").write_text(json.dumps(result, indent=1))
    return 0


def _write(result: dict, out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "peers_flashinfer.json").write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--attn-batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--sampling-batches", type=int, nargs="+", default=[1, 64, 256])
    p.add_argument("--context", type=int, default=4096)
    p.add_argument("--replays", type=int, default=30)
    p.add_argument("--eager-runs", type=int, default=5)
    p.add_argument("--budget-s", type=float, default=240.0,
                   help="stop starting rows whose estimated time does not fit")
    p.add_argument("--warmup-only", action="store_true",
                   help="JIT-compile FlashInfer's modules (one tiny call each), then exit")
    p.add_argument("--warmup-steps", default=",".join(WARMUP_STEPS),
                   help=f"with --warmup-only: comma-separated among {', '.join(WARMUP_STEPS)}")
    p.add_argument("--out", type=Path, default=Path(__file__).resolve().parent / "out")
    args = p.parse_args(argv)
    steps = [x for x in args.warmup_steps.split(",") if x]
    if not steps or any(x not in WARMUP_STEPS for x in steps):
        p.error(f"--warmup-steps takes names among {WARMUP_STEPS}, got {args.warmup_steps!r}")
    reason = _skip_reason()
    result: dict[str, Any] = dict(device=torch.cuda.get_device_name() if reason is None
                                  else "cpu", torch=torch.__version__, rows=[])
    if reason is not None:
        print(f"peers_flashinfer: skipped: {reason}")
        result["skipped"] = reason
        _write(result, args.out)
        return 0
    if args.warmup_only:
        return warmup(args.out, steps)
    import flashinfer

    t_start = time.monotonic()
    result["flashinfer"] = getattr(flashinfer, "__version__", "?")
    gbps, _ = gt.copy_bandwidth(1 << 30)
    result.update(copy_gbps=gbps, timing="graph replays, inputs rotated over >= 4x L2, median "
                  "per call (graph_timing.py); eager beside")
    l2 = gt.l2_bytes()
    spent: list[float] = []
    skipped = []
    for check, batch, build in peer_list(args.attn_batches, args.sampling_batches,
                                         args.context):
        estimate = 1.5 * max(spent) if spent else 10.0
        if time.monotonic() - t_start + estimate > args.budget_s:
            skipped.append(f"{check} B={batch}")
            continue
        t0 = time.monotonic()
        try:
            row = run_peer(check, batch, build, args, l2)
        except Exception as e:  # noqa: BLE001 - one failing peer call is a row
            row = dict(check=check, batch=batch, error=f"{type(e).__name__}: {e}"[:400])
        row["seconds"] = round(time.monotonic() - t0, 1)
        spent.append(row["seconds"])
        result["rows"].append(row)
        _write(result, args.out)
        print(f"{check:26} B={batch:<4} " + (f"error: {row['error'][:120]}" if "error" in row
              else f"ours {row['ours_us']:9.1f} us  theirs {row['theirs_us']:9.1f} us  "
                   f"x{row['ratio']:.2f}  agree={row.get('agree')}"), flush=True)
        torch.cuda.empty_cache()
    result["skipped_rows"] = skipped
    _write(result, args.out)
    print(markdown(result))
    return 0


def markdown(result: dict) -> str:
    lines = [f"FlashInfer {result.get('flashinfer')} on {result['device']} (graph-timed, "
             "same inputs)", "", "| check | B | ours us | theirs us | ours / theirs | "
             "outputs | ours <= theirs | note |", "|---|---|---|---|---|---|---|---|"]
    if result.get("skipped"):
        lines = [f"FlashInfer peers skipped: {result['skipped']}"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"| {r['check']} | {r['batch']} | | | | | | error: "
                         f"{r['error'][:100]} |")
            continue
        fallback = " (eager)" if any(k.endswith("_graph_error") for k in r) else ""
        lines.append(f"| {r['check']} | {r['batch']} | {r['ours_us']:.1f} | "
                     f"{r['theirs_us']:.1f}{fallback} | {r['ratio']:.2f} | "
                     f"{'agree' if r.get('agree') else 'DIFFER'} | {r.get('verdict', '')} | "
                     f"{r.get('note', '')} |")
    if result.get("skipped_rows"):
        lines += ["", "Not run (budget): " + ", ".join(result["skipped_rows"])]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
