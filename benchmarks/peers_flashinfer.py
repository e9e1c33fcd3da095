"""Our kernels next to FlashInfer's, same process, same inputs, 8B shapes (GPU only).

Rows (each: our ms, theirs ms, ours / theirs; below 1 means ours is faster):

* ``tree attention``: our paged attention with a packed tree mask vs FlashInfer's
  ``BatchPrefillWithPagedKVCacheWrapper`` with a custom mask (the same random tree, whole
  context visible), NHD pages of 16 tokens, 32 q heads / 8 KV heads / head_dim 128, bf16.
  FlashInfer's ``plan`` runs once outside the timing (as it would once per step for all
  layers); its output is checked against ours.
* ``chain spec sampling``: our fused rejection sampler (chains, draft probabilities given,
  from logits) vs ``flashinfer.sampling.chain_speculative_sampling`` fed probabilities; their
  time is reported with and without the softmax that turns the target logits into them.
* ``top-k/top-p sampling``: one token per row (k = 0) at top_k 50, top_p 0.9: ours vs
  ``flashinfer.sampling.top_k_top_p_sampling_from_logits``.

Timing: ``benchlib.time_ms`` (median of single calls between CUDA events, L2 flushed).
Without FlashInfer (``pip install -e '.[gpu]'``) or CUDA it prints why and exits 0 with no
rows, so a GPU check can run it unconditionally. Writes ``OUT/peers_flashinfer.json``.

Usage::

    python benchmarks/peers_flashinfer.py [--batches 1 32 128] [--contexts 4096]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import benchlib
import torch

VOCAB = 151936  # Qwen3-8B


def _skip_reason() -> str | None:
    if not torch.cuda.is_available():
        return "no CUDA device"
    try:
        import flashinfer  # noqa: F401
    except Exception as e:  # noqa: BLE001 - any import failure means no peer to compare
        return f"flashinfer not importable ({type(e).__name__}: {e})"
    return None


def tree_attention_row(batch: int, ctx: int, nodes: int, kw: dict) -> dict:
    import flashinfer
    from bench_attention import HEAD_DIM, HKV, HQ, Case, run_triton

    c = Case(batch, ctx, nodes, "tree", 16, torch.bfloat16, "cuda")
    bs = c.k_cache.shape[1]
    kv_len = ctx + nodes
    pages = -(-kv_len // bs)
    indptr = torch.arange(0, (batch + 1) * pages, pages, dtype=torch.int32, device="cuda")
    indices = c.block_tables[:, :pages].reshape(-1).contiguous()
    last = torch.full((batch,), kv_len - (pages - 1) * bs, dtype=torch.int32, device="cuda")
    mask = c.full_mask.reshape(-1).repeat(batch)  # per request [q_len, kv_len], flattened
    wrapper = flashinfer.BatchPrefillWithPagedKVCacheWrapper(
        torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda"), "NHD")
    wrapper.plan(c.qo_indptr, indptr, indices, last, HQ, HKV, HEAD_DIM, bs, custom_mask=mask,
                 q_data_type=torch.bfloat16, kv_data_type=torch.bfloat16)
    ours = run_triton(c, None)

    def theirs():
        return wrapper.run(c.q, (c.k_cache, c.v_cache))

    diff = float((ours().float() - theirs().float()).abs().max())
    row = dict(check="tree attention", batch=batch, context=ctx, nodes=nodes, max_diff=diff,
               ours_ms=benchlib.time_ms(ours, **kw), theirs_ms=benchlib.time_ms(theirs, **kw))
    return row


def sampling_rows(batch: int, k: int, kw: dict) -> list[dict]:
    from flashinfer import sampling as fs

    from specengine.kernels.rejection_sampling import rejection_sample

    dev = "cuda"
    g = torch.Generator(device=dev).manual_seed(0)
    logits = torch.randn(batch, k + 1, VOCAB, device=dev, generator=g) * 3
    q = torch.softmax(logits[:, :-1] + 0.5, -1)
    drafts = q.argmax(-1)
    ones = torch.ones(batch, device=dev)
    seeds = torch.arange(batch, dtype=torch.int64, device=dev)
    offs = torch.zeros(batch, dtype=torch.int64, device=dev)
    nd = torch.full((batch,), k, dtype=torch.int32, device=dev)
    no_k = torch.full((batch,), -1, dtype=torch.int32, device=dev)
    rows = []

    def ours_chain():
        return rejection_sample(logits, drafts, nd, q, ones, no_k, ones, seeds, offs, None,
                                check_values=False)

    p = torch.softmax(logits, -1)

    def theirs_chain():
        return fs.chain_speculative_sampling(q, drafts.int(), p)

    def theirs_chain_softmax():
        return fs.chain_speculative_sampling(q, drafts.int(), torch.softmax(logits, -1))

    ours = benchlib.time_ms(ours_chain, **kw)
    rows.append(dict(check="chain spec sampling", batch=batch, k=k, vocab=VOCAB, ours_ms=ours,
                     theirs_ms=benchlib.time_ms(theirs_chain_softmax, **kw),
                     theirs_no_softmax_ms=benchlib.time_ms(theirs_chain, **kw)))

    one = logits[:, :1].contiguous()
    top_k = torch.full((batch,), 50, dtype=torch.int32, device=dev)
    top_p = torch.full((batch,), 0.9, device=dev)
    empty = torch.zeros(batch, 0, dtype=torch.int64, device=dev)
    zeros = torch.zeros(batch, dtype=torch.int32, device=dev)

    def ours_topk():
        return rejection_sample(one, empty, zeros, None, ones, top_k, top_p, seeds, offs, None,
                                check_values=False)

    flat = one[:, 0]

    def theirs_topk():
        return fs.top_k_top_p_sampling_from_logits(flat, top_k, top_p)

    rows.append(dict(check="top-k/top-p sampling", batch=batch, vocab=VOCAB,
                     ours_ms=benchlib.time_ms(ours_topk, **kw),
                     theirs_ms=benchlib.time_ms(theirs_topk, **kw)))
    return rows


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128])
    p.add_argument("--contexts", type=int, nargs="+", default=[4096])
    p.add_argument("--tree-nodes", type=int, default=16)
    p.add_argument("--ks", type=int, nargs="+", default=[3])
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--out", type=Path, default=benchlib.DEFAULT_OUT)
    args = p.parse_args(argv)
    reason = _skip_reason()
    result: dict = dict(device=benchlib.device_name(), torch=torch.__version__, rows=[])
    if reason is not None:
        print(f"peers_flashinfer: skipped: {reason}")
        result["skipped"] = reason
        benchlib.write_json(result, args.out, "peers_flashinfer")
        return 0
    import flashinfer

    result["flashinfer"] = getattr(flashinfer, "__version__", "?")
    kw = dict(warmup=args.warmup, iters=args.iters)
    rows = result["rows"]
    for batch in args.batches:
        for ctx in args.contexts:
            try:
                rows.append(tree_attention_row(batch, ctx, args.tree_nodes, kw))
            except Exception as e:  # noqa: BLE001 - one failing peer call is reported
                rows.append(dict(check="tree attention", batch=batch, context=ctx,
                                 error=f"{type(e).__name__}: {e}"[:300]))
        for k in args.ks:
            try:
                rows += sampling_rows(batch, k, kw)
            except Exception as e:  # noqa: BLE001
                rows.append(dict(check="sampling", batch=batch, k=k,
                                 error=f"{type(e).__name__}: {e}"[:300]))
    print(f"{'check':22} {'B':>4} {'ours ms':>9} {'theirs ms':>9} {'ours/theirs':>11}")
    for r in rows:
        ratio = r["ours_ms"] / r["theirs_ms"] if "ours_ms" in r else None
        r["ratio"] = ratio
        print(f"{r['check']:22} {r['batch']:>4} {benchlib.fmt(r.get('ours_ms'), '9.4f')} "
              f"{benchlib.fmt(r.get('theirs_ms'), '9.4f')} {benchlib.fmt(ratio, '11.2f')}"
              + (f"  error: {r['error']}" if "error" in r else ""))
    benchlib.write_json(result, args.out, "peers_flashinfer")
    return 0


if __name__ == "__main__":
    sys.exit(main())
