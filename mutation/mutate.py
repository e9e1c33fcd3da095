"""A small, dependency-free mutation runner (issue 29: tests that catch the bugs they exist for).

Each mutant is one hand-written change of one snippet of a critical module, with the tests
that cover that module. The runner applies it, runs those tests (``pytest -n 0``, within a time
limit), restores the file (in a ``finally``, byte for byte, mtime included) and reports it as
killed (the tests failed), survived, or an error of the runner itself (the snippet is gone,
no test was collected). Mutants judged equivalent (no behaviour can tell them apart) carry the
reason and are left out of the kill rate; ``EQUIVALENT.md`` lists them.

    python mutation/mutate.py --list
    python mutation/mutate.py --area prefix               # one area
    python mutation/mutate.py --only prefix-match-skips-hole,weights-align-removed
    python mutation/mutate.py --budget 600                # stop starting mutants after 600 s
    python mutation/mutate.py --only ID --tests "tests/x.py -k 'not new'"  # other tests

Run it on a clean tree: a mutant is written into the working tree while its tests run.
Bytecode is never written (``PYTHONDONTWRITEBYTECODE``), so a restored file can never be
shadowed by a mutant's cached bytecode.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import shlex
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutant:
    id: str
    file: str  # relative to the repository root
    original: str  # must occur exactly once in the file
    mutated: str
    tests: tuple[str, ...]  # pytest arguments
    equivalent: str | None = None  # why no test can kill it


# ---- test selections (each well under a minute on a 2-core CPU) -------------------------------
# The reference sampler's own tests, without the Triton kernel (the interpreter takes minutes).
SAMPLER = ("tests/test_mutants_sampler.py", "tests/test_rejection_sampling.py", "-k",
           "not kernel")
# Mutants that only change which random numbers are drawn keep the law: only the kernel's
# equality with the reference (same Philox counters) can see them.
SAMPLER_KERNEL = ("tests/test_mutants_sampler.py",
                  "tests/test_rejection_sampling.py::test_kernel_equals_reference[tree-100-16-4]")
# Without the two engine tests (a model each): the cache's own tests drive the real KV cache.
PREFIX = ("tests/test_prefix_cache.py", "-k", "not second_call and not weight_update_clears")
WEIGHTS = ("tests/test_mutants_weights.py",
           "tests/test_weight_sync.py::test_shared_copy_failing_midway_fails_closed",
           "tests/test_weight_sync.py::test_bad_bucket_size_is_refused")
ADMISSION = ("tests/test_mutants_admission.py",)

RS = "kernels/reference_sampling.py"
PC = "specengine/core/prefix_cache.py"
PROTO = "specengine/weights/protocol.py"
RECV = "specengine/weights/receiver.py"
REQ = "specengine/core/requests.py"

MUTANTS: list[Mutant] = [
    # ---- rejection sampler reference ----------------------------------------------------------
    Mutant("sampler-duplicate-siblings-ignored", RS,
           "r = torch.where(dup, 0.0, p_child[:, c])", "r = p_child[:, c]", SAMPLER),
    Mutant("sampler-residual-mass-not-updated", RS,
           "mass = torch.where(try_c & ~ok, mass - r, mass)", "mass = mass", SAMPLER),
    Mutant("sampler-tree-greedy-takes-any-child", RS,
           "ok = (r > 0) & (greedy | (u_child[c] * mass <= r))",
           "ok = greedy | (u_child[c] * mass <= r)", SAMPLER),
    Mutant("sampler-rejected-tokens-not-excluded", RS,
           "excl[rows, drafts[:, c]] |= used[:, c]", "pass", SAMPLER),
    Mutant("sampler-chain-accept-strict", RS,
           "ok = (p_child[:, c] > 0) & (u <= p_child[:, c])",
           "ok = (p_child[:, c] > 0) & (u < p_child[:, c])", SAMPLER,
           equivalent="differs only when the 24-bit uniform equals p(x) exactly (u = 1 with a "
                      "certain draft: 2**-24 per draft)"),
    Mutant("sampler-residual-unclamped", RS,
           "r = (w / s - q).clamp(min=0)", "r = (w / s - q)", SAMPLER,
           equivalent="the next line keeps only r > 0, so the clamp changes nothing"),
    Mutant("sampler-residual-is-p", RS,
           "key = torch.where(r > 0, r / e, -1.0)", "key = torch.where(r > 0, w / s / e, -1.0)",
           SAMPLER),
    Mutant("sampler-chain-ignores-q", RS,
           "ok = (qx > 0) & (u * qx <= p_child[:, c])", "ok = (qx > 0) & (u <= p_child[:, c])",
           SAMPLER),
    Mutant("sampler-num-accepted-off-by-one", RS,
           "fail.float().argmax(1) - 1, n)", "fail.float().argmax(1), n)", SAMPLER),
    Mutant("sampler-top-k-keeps-one-more", RS,
           "(top_k < vocab), top_k.long(), vocab)", "(top_k < vocab), top_k.long() + 1, vocab)",
           SAMPLER),
    Mutant("sampler-greedy-end-sampled", RS,
           "tok_end[:, j] = torch.where(greedy, argmax, end)", "tok_end[:, j] = end", SAMPLER),
    Mutant("sampler-uniform-can-be-zero", RS,
           "return ((x >> 8) + 1).float() * 2.0**-24", "return (x >> 8).float() * 2.0**-24",
           SAMPLER),
    Mutant("sampler-race-position-by-node", RS,
           "pos = offsets.long() + depth[j]", "pos = offsets.long() + j", SAMPLER_KERNEL),
    Mutant("sampler-tree-uniform-position", RS,
           "offsets.long() + depth[max(parents[c], 0)]", "offsets.long() + depth[c]",
           SAMPLER_KERNEL),
    # ---- prefix cache -------------------------------------------------------------------------
    Mutant("prefix-match-skips-hole", PC,
           "            if b is None:\n                break",
           "            if b is None:\n                continue", PREFIX),
    Mutant("prefix-epoch-guard-off", PC,
           "        if epoch != self.epoch:\n            return 0",
           "        if False:\n            return 0", PREFIX),
    Mutant("prefix-clear-keeps-epoch", PC,
           "        self.evictable.clear()\n        self.epoch += 1",
           "        self.evictable.clear()", PREFIX),
    Mutant("prefix-clear-keeps-names", PC,
           "        self.block_of.clear()\n        self.hash_of.clear()",
           "        self.hash_of.clear()", PREFIX),
    Mutant("prefix-clear-leaks-blocks", PC,
           "            self.allocator.free(np.asarray(list(self.hash_of), dtype=np.int64))",
           "            pass", PREFIX),
    Mutant("prefix-held-block-evictable", PC,
           "if b in self.hash_of and ref_count(b) == 1:", "if b in self.hash_of:", PREFIX),
    Mutant("prefix-release-prefix-first", PC,
           "for b in reversed(blocks):", "for b in blocks:", PREFIX),
    Mutant("prefix-evict-most-recent", PC,
           "b, _ = self.evictable.popitem(last=False)", "b, _ = self.evictable.popitem()",
           PREFIX),
    Mutant("prefix-acquire-stays-evictable", PC,
           "            self.evictable.pop(b, None)", "            pass", PREFIX),
    Mutant("prefix-hash-not-chained", PC,
           "prev = hashlib.blake2b(prev + arr[", "prev = hashlib.blake2b(arr[", PREFIX),
    Mutant("prefix-register-takes-no-reference", PC,
           "            self.allocator.incref(np.asarray([b for b, _ in new], dtype=np.int64))",
           "            pass", PREFIX),
    Mutant("prefix-register-renames-block", PC,
           "if h not in self.block_of and b not in self.hash_of]", "if h not in self.block_of]",
           PREFIX,
           equivalent="a named block is only ever registered again at its own position (same "
                      "hash, already skipped) or by a plan of an older epoch (refused first)"),
    # ---- weight protocol and receiver ---------------------------------------------------------
    Mutant("weights-align-removed", PROTO,
           "            offset = _align(offset + entry.nbytes)",
           "            offset = offset + entry.nbytes", WEIGHTS),
    Mutant("weights-align-one", PROTO, "ALIGN = 64\n", "ALIGN = 1\n", WEIGHTS),
    Mutant("weights-bucket-not-rounded", PROTO,
           "            bucket_bytes = bucket_bytes // ALIGN * ALIGN", "            pass",
           WEIGHTS),
    Mutant("weights-bucket-alignment-unchecked", PROTO,
           "self.bucket_bytes < MIN_BUCKET_BYTES or self.bucket_bytes % ALIGN:",
           "self.bucket_bytes < MIN_BUCKET_BYTES:", WEIGHTS),
    Mutant("weights-bucket-minimum-unchecked", PROTO,
           "self.bucket_bytes < MIN_BUCKET_BYTES or self.bucket_bytes % ALIGN:",
           "self.bucket_bytes % ALIGN:", WEIGHTS),
    Mutant("weights-pieces-bisect-left", PROTO,
           "i = bisect.bisect_right(ends, lo)", "i = bisect.bisect_left(ends, lo)", WEIGHTS,
           equivalent="an entry ending exactly at lo gives an empty piece, which pieces() skips"),
    Mutant("weights-which-unchecked", RECV,
           "    if manifest.which != which:\n", "    if False:\n", WEIGHTS),
    Mutant("weights-plan-version-unchecked", RECV,
           "    check_allowed(engine, manifest.version)\n    accepted, errors",
           "    accepted, errors", WEIGHTS),
    Mutant("weights-equal-version-allowed", RECV,
           "if version is not None and version <= engine.weight_version:",
           "if version is not None and version < engine.weight_version:", WEIGHTS),
    Mutant("weights-shared-bucket-sizes-unchecked", RECV,
           "    if sizes != [hi - lo for lo, hi in chunks]:", "    if False:", WEIGHTS),
    Mutant("weights-commit-ignores-version", RECV,
           "engine.weight_version = version if version is not None else "
           "engine.weight_version + 1",
           "engine.weight_version = engine.weight_version + 1", WEIGHTS),
    Mutant("weights-shared-not-torn", RECV,
           "    engine._torn_weights.update((which, n) for n in plan.accepted)\n"
           "    for (lo, hi), bucket in zip(chunks, handles.buckets):",
           "    for (lo, hi), bucket in zip(chunks, handles.buckets):", WEIGHTS),
    # ---- request admission --------------------------------------------------------------------
    Mutant("admission-no-draft-slots", REQ,
           "max_model_len) + k + 1", "max_model_len) + 1", ADMISSION),
    Mutant("admission-no-bonus-slot", REQ,
           "max_model_len) + k + 1", "max_model_len) + k", ADMISSION),
    Mutant("admission-no-tree-nodes", REQ,
           "            need += draft_tree.num_nodes", "            pass", ADMISSION),
    Mutant("admission-no-fit-check", REQ,
           "        kv_cache.check_fits(need)", "        pass", ADMISSION),
    Mutant("admission-uncapped-need", REQ,
           "need = min(len(ids) + sp.max_tokens, max_model_len)",
           "need = (len(ids) + sp.max_tokens)", ADMISSION),
    Mutant("admission-k1-without-drafter", REQ,
           "if k > 0 and not has_drafter:", "if k > 1 and not has_drafter:", ADMISSION),
    Mutant("admission-max-k-refused", REQ,
           "not 0 <= k <= MAX_K:", "not 0 <= k < MAX_K:", ADMISSION),
    Mutant("admission-bool-k", REQ,
           "    if isinstance(k, bool) or not isinstance(k, int)",
           "    if not isinstance(k, int)", ADMISSION),
    Mutant("admission-stop-id-equal-to-vocab", REQ,
           "sp.stop_token_ids if not 0 <= t < vocab_size]",
           "sp.stop_token_ids if not 0 <= t <= vocab_size]", ADMISSION),
    Mutant("admission-prompt-id-equal-to-vocab", REQ,
           "bad = [t for t in ids if not 0 <= t < vocab_size]",
           "bad = [t for t in ids if not 0 <= t <= vocab_size]", ADMISSION),
    Mutant("admission-bool-prompt-ids", REQ,
           "isinstance(t, int) and not isinstance(t, bool) for t in prompt",
           "isinstance(t, int) for t in prompt", ADMISSION),
    Mutant("admission-prompt-fills-max-model-len", REQ,
           "if len(ids) >= max_model_len:", "if len(ids) > max_model_len:", ADMISSION),
    Mutant("admission-tree-depth-unchecked", REQ,
           "        if k not in (0, draft_tree.max_depth):", "        if False:", ADMISSION),
]

AREAS = {"sampler": RS, "prefix": PC, "weights": (PROTO, RECV), "admission": REQ}


def area_of(m: Mutant) -> str:
    return m.id.split("-", 1)[0]


def run_one(m: Mutant, timeout_s: float) -> tuple[str, float]:
    """Apply ``m``, run its tests, restore the file. Returns (status, seconds)."""
    path = ROOT / m.file
    original = path.read_bytes()
    stat = path.stat()
    text = original.decode()
    if text.count(m.original) != 1:
        return f"error: the snippet occurs {text.count(m.original)} times", 0.0
    env = dict(os.environ, PYTHONDONTWRITEBYTECODE="1")
    start = time.monotonic()
    try:
        path.write_text(text.replace(m.original, m.mutated))
        cmd = [sys.executable, "-m", "pytest", "-n", "0", "-q", "-x", "-p", "no:cacheprovider",
               *m.tests]
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, timeout=timeout_s,
                                  start_new_session=True)
        except subprocess.TimeoutExpired:
            return "killed (timeout)", time.monotonic() - start
        rc = proc.returncode
        if rc == 0:
            return "survived", time.monotonic() - start
        if rc == 1:
            return "killed", time.monotonic() - start
        tail = proc.stdout.decode(errors="replace").strip().splitlines()[-1:]
        return f"error: pytest exit {rc} {tail}", time.monotonic() - start
    finally:
        path.write_bytes(original)
        # The mutant's mtime must not survive either: the original's bytecode stays valid.
        os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns))
        assert path.read_bytes() == original, f"{m.file} was not restored"


def _interrupt(signum: int, frame: object) -> None:
    # SIGTERM must restore the file too: raise, so run_one's finally runs.
    raise KeyboardInterrupt(f"signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--area", choices=sorted(AREAS), action="append")
    ap.add_argument("--only", help="comma-separated mutant ids")
    ap.add_argument("--skip-equivalent", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0, help="per mutant, seconds")
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="start no mutant after this many seconds")
    ap.add_argument("--tests", help="run these pytest arguments instead of each mutant's own "
                    "(e.g. the suite before new tests, to show a gap)")
    ap.add_argument("--list", action="store_true")
    args = ap.parse_args()

    chosen = [m for m in MUTANTS if not args.area or area_of(m) in args.area]
    if args.only:
        ids = set(args.only.split(","))
        unknown = ids - {m.id for m in MUTANTS}
        if unknown:
            ap.error(f"unknown mutant ids: {sorted(unknown)}")
        chosen = [m for m in chosen if m.id in ids]
    if args.tests:
        chosen = [dataclasses.replace(m, tests=tuple(shlex.split(args.tests))) for m in chosen]
    if args.skip_equivalent:
        chosen = [m for m in chosen if m.equivalent is None]
    if args.list:
        for m in chosen:
            print(f"{m.id:45s} {m.file}" + (f"  [equivalent: {m.equivalent}]"
                                              if m.equivalent else ""))
        return 0

    signal.signal(signal.SIGTERM, _interrupt)
    t0 = time.monotonic()
    results: list[tuple[Mutant, str]] = []
    for m in chosen:
        if time.monotonic() - t0 > args.budget:
            results.append((m, "not run (budget)"))
            continue
        status, secs = run_one(m, args.timeout)
        note = "  (equivalent)" if m.equivalent else ""
        print(f"{status:18s} {secs:6.1f}s  {m.id}{note}", flush=True)
        results.append((m, status))

    def rate(rows: list[tuple[Mutant, str]]) -> str:
        judged = [s for m, s in rows if m.equivalent is None and
                  (s.startswith("killed") or s == "survived")]
        killed = sum(s.startswith("killed") for s in judged)
        return f"{killed}/{len(judged)} killed" + (
            f" ({100 * killed / len(judged):.0f}%)" if judged else "")

    print("\nkill rate (equivalent mutants excluded):")
    for file in sorted({m.file for m, _ in results}):
        print(f"  {file:40s} {rate([r for r in results if r[0].file == file])}")
    print(f"  {'overall':40s} {rate(results)}")
    survivors = [m.id for m, s in results if s == "survived" and m.equivalent is None]
    errors = [m.id for m, s in results if s.startswith("error")]
    if survivors:
        print("survived:", ", ".join(survivors))
    if errors:
        print("errors:", ", ".join(errors))
    return 1 if survivors or errors else 0


if __name__ == "__main__":
    sys.exit(main())
