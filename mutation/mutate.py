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
           "    engine.torn_weights.update((which, n) for n in plan.accepted)\n"
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


# ---- the remaining paths: launchers, KV accounting, scheduler, params, server -----------------
# The launchers' checks: the bad-input tests only (each refusal comes before any launch).
LAUNCH = ("tests/test_mutants_launchers.py",
          "tests/test_attention_kernel.py::test_bad_inputs",
          "tests/test_attention_kernel.py::test_bad_num_splits",
          "tests/test_attention_kernel.py::test_max_q_len_given_and_empty_inputs",
          "tests/test_value_checks.py::test_bad_values_raise_when_checks_on",
          "tests/test_rejection_sampling.py::test_bad_inputs",
          "tests/test_kv_ops.py::test_reshape_and_cache_rejects_bad_inputs",
          "tests/test_compact_kv.py::test_compact_kv_rejects_bad_inputs")
KV = ("tests/test_mutants_kv.py", "tests/test_kv_cache.py", *PREFIX)
SCHED = ("tests/test_mutants_scheduler.py",
         "tests/test_scheduler.py::test_scheduler_invariants_under_random_load",
         "tests/test_request_isolation.py::test_admit_only_budget_room_and_refusal",
         "tests/test_request_isolation.py::test_decode_only_runs_just_the_running_ones")
PARAMS = ("tests/test_mutants_params.py", "tests/test_mutants_admission.py",
          "tests/test_admission_bounds.py", "-k", "sampling_params or mutants")
SERVER = ("tests/test_mutants_server.py",)

ATT_C = "kernels/attention_checks.py"
ATT = "kernels/attention.py"
SMP_C = "kernels/sampling_checks.py"
KVK = "kernels/kv_cache.py"
KVC = "specengine/core/kv_cache.py"
SCH = "specengine/core/scheduler.py"
SP = "specengine/sampling.py"
SCHEMA = "specengine/server/schemas.py"
APP = "specengine/server/app.py"

MUTANTS += [
    # ---- kernel launchers' host logic ---------------------------------------------------------
    Mutant("launchers-attn-cache-stride-unchecked", ATT_C,
           "        if c.stride(3) != 1:", "        if False:", LAUNCH),
    Mutant("launchers-attn-head-dim-mismatch", ATT_C,
           "    if dk != d:", "    if False:", LAUNCH),
    Mutant("launchers-attn-head-dim-min", ATT_C,
           "if not _is_pow2(d) or d < 16:", "if not _is_pow2(d) or d < 8:", LAUNCH),
    Mutant("launchers-attn-indptr-longer", ATT_C,
           "if qo_indptr.shape[0] != num_seqs + 1:", "if qo_indptr.shape[0] < num_seqs + 1:",
           LAUNCH),
    Mutant("launchers-attn-device-unchecked", ATT_C,
           "        if t is not None and t.device != q.device:", "        if False:", LAUNCH),
    Mutant("launchers-attn-tree-words-floor", ATT,
           "tree_mask.shape[1] < (max_q_len + 31) // 32:",
           "tree_mask.shape[1] < max_q_len // 32:", LAUNCH),
    Mutant("launchers-attn-scale-unchecked", ATT,
           "    if not math.isfinite(scale):", "    if False:", LAUNCH),
    Mutant("launchers-attn-bound-off-by-one", ATT_C,
           "if max_q_len is not None and max_q_len < longest:",
           "if max_q_len is not None and max_q_len < longest - 1:", LAUNCH),
    Mutant("launchers-sampler-vector-contiguity", SMP_C,
           '    _check(t.is_contiguous(), f"{name} must be contiguous")', "    pass", LAUNCH),
    Mutant("launchers-sampler-temperature-finite", SMP_C,
           "(((temperature >= 0) & torch.isfinite(temperature)).all(),",
           "((temperature >= 0).all(),", LAUNCH),
    Mutant("launchers-sampler-tree-num-draft", SMP_C,
           "(((n == 0) | (n == n_rows - 1)).all(),", "((n >= 0).all(),", LAUNCH),
    Mutant("launchers-sampler-num-draft-bound", SMP_C,
           "(((n >= 0) & (n <= n_rows - 1)).all()", "(((n >= 0) & (n <= n_rows)).all()",
           LAUNCH),
    Mutant("launchers-kv-head-dim-stride", KVK,
           "        if t.stride(2) != 1:", "        if False:", LAUNCH),
    Mutant("launchers-kv-slots-device", KVK,
           "    if slots.device != device:", "    if False:", LAUNCH),
    Mutant("launchers-kv-compact-dtype-mismatch", KVK,
           "    if src_slots.dtype != dst_slots.dtype:", "    if False:", LAUNCH),
    # ---- KV allocator accounting --------------------------------------------------------------
    Mutant("kv-free-blocks-ignore-evictable", KVC,
           "return int(self.allocator.num_free) + evictable",
           "return int(self.allocator.num_free)", KV),
    Mutant("kv-can-ensure-strict", KVC,
           "return self.num_missing_blocks(seq, num_tokens) <= self.num_free_blocks",
           "return self.num_missing_blocks(seq, num_tokens) < self.num_free_blocks", KV),
    Mutant("kv-allocate-never-evicts", KVC,
           "if short > 0 and self.prefix is not None and short <= len(self.prefix.evictable):",
           "if False:", KV),
    Mutant("kv-grow-gives-up-early", KVC,
           "if self.prefix is None or short > len(self.prefix.evictable):",
           "if self.prefix is None or short >= len(self.prefix.evictable):", KV),
    Mutant("kv-free-not-released-to-prefix", KVC,
           "                self.prefix.released(table)", "                pass", KV),
    Mutant("kv-free-keeps-cached-count", KVC,
           "        seq.block_table = []\n        seq.num_cached_tokens = 0",
           "        seq.block_table = []", KV),
    Mutant("kv-free-keeps-pending-plan", KVC,
           '            self.pending.pop(getattr(seq, "seq_id", None), None)',
           "            pass", KV),
    Mutant("kv-can-admit-shared-evictable-counted-free", KVC,
           "taken = self.prefix.num_evictable_in(plan.shared) if self.prefix is not None else 0",
           "taken = 0", KV),
    Mutant("kv-can-admit-shared-not-subtracted", KVC,
           "need = self.blocks_for(len(plan.seq)) - len(plan.shared)",
           "need = self.blocks_for(len(plan.seq))", KV),
    Mutant("kv-plan-reuses-last-token", KVC,
           "reusable = (n - 1) // self.block_size", "reusable = n // self.block_size", KV),
    Mutant("kv-admit-shared-not-referenced", KVC,
           "                self.allocator.incref(np.asarray(plan.shared, dtype=np.int64))",
           "                pass", KV),
    Mutant("kv-invalidate-keeps-prefix", KVC,
           "        if self.prefix is not None:\n            self.prefix.clear()",
           "        if self.prefix is not None:\n            pass", KV),
    Mutant("kv-names-without-draft", KVC,
           "register = drafted or not self.names_need_draft", "register = True", KV),
    Mutant("kv-check-fits-strict", KVC,
           "        if need > self.num_blocks:", "        if need >= self.num_blocks:", KV),
    # ---- scheduler admission and preemption ---------------------------------------------------
    Mutant("sched-batch-size-off-by-one", SCH,
           "while self.waiting and len(self.running) + len(batch) < self.max_batch_size:",
           "while self.waiting and len(self.running) + len(batch) <= self.max_batch_size:",
           SCHED),
    Mutant("sched-token-budget-ignored", SCH,
           "            if batch and num_tokens + plan.num_computed > self.max_num_batched_tokens:"
           "\n                break\n            if not self.kv_cache.can_admit(plan):",
           "            if not self.kv_cache.can_admit(plan):", SCHED),
    Mutant("sched-token-budget-blocks-first", SCH,
           "            if batch and num_tokens + plan.num_computed > self.max_num_batched_tokens:"
           "\n                break\n            if not self.kv_cache.can_admit(plan):",
           "            if num_tokens + plan.num_computed > self.max_num_batched_tokens:"
           "\n                break\n            if not self.kv_cache.can_admit(plan):", SCHED),
    Mutant("sched-admits-without-room", SCH,
           "            if not self.kv_cache.can_admit(plan):\n                break",
           "            if False:\n                break", SCHED),
    Mutant("sched-preempted-to-the-back", SCH,
           "        self.waiting.appendleft(seq)", "        self.waiting.append(seq)", SCHED),
    Mutant("sched-preempts-oldest", SCH,
           "        for seq in reversed(self.running):", "        for seq in self.running:",
           SCHED),
    Mutant("sched-preemptions-uncounted", SCH,
           "        self.num_preemptions += 1", "        pass", SCHED),
    Mutant("sched-on-preempt-skipped", SCH,
           "        if self.on_preempt is not None:\n            self.on_preempt(seq)",
           "        if self.on_preempt is not None:\n            pass", SCHED),
    Mutant("sched-decode-lookahead-uncapped", SCH,
           "need = lens + np.minimum(arena.lookahead[slots], arena.max_model_len - lens)",
           "need = lens + arena.lookahead[slots]", SCHED),
    Mutant("sched-preempts-scheduled", SCH,
           "victim = self._last_running(exclude=(seq, *scheduled))",
           "victim = self._last_running(exclude=(seq,))", SCHED),
    Mutant("sched-finish-keeps-decode-batch", SCH,
           "            self.running.remove(seq)\n            self._changed()\n"
           "        seq.detach()",
           "            self.running.remove(seq)\n        seq.detach()", SCHED),
    Mutant("sched-admit-only-batch-limit", SCH,
           "or len(self.running) + len(batch) >= self.max_batch_size):",
           "or len(self.running) + len(batch) > self.max_batch_size):", SCHED),
    Mutant("sched-abort-keeps-pending", SCH,
           "        self.kv_cache.pending.clear()", "        pass", SCHED,
           equivalent="KVCache.free drops each aborted sequence's plan just before, and only "
                      "a running sequence has one"),
    Mutant("sched-borrows-when-not-fresh", SCH,
           "fresh = len(seq) == seq.num_prompt_tokens", "fresh = True", SCHED),
    # ---- SamplingParams and request validation ------------------------------------------------
    Mutant("params-bool-is-a-count", SP,
           "return isinstance(value, int) and not isinstance(value, bool)",
           "return isinstance(value, int)", PARAMS),
    Mutant("params-int-high-exclusive", SP,
           "if not _is_int(value) or not low <= value <= high:",
           "if not _is_int(value) or not low <= value < high:", PARAMS),
    Mutant("params-float-bool", SP,
           "if (isinstance(value, bool) or not isinstance(value, (int, float))",
           "if (not isinstance(value, (int, float))", PARAMS),
    Mutant("params-float-finite-dropped", SP,
           "or not math.isfinite(value) or not ok(value)):", "or not ok(value)):", PARAMS,
           equivalent="every ok() is a bounded range (0 or [1e-4, 1e4]; (0, 1]), which inf and "
                      "NaN fail too"),
    Mutant("params-temperature-min-exclusive", SP,
           "lambda t: t == 0 or MIN_TEMPERATURE <= t <= MAX_TEMPERATURE",
           "lambda t: t == 0 or MIN_TEMPERATURE < t <= MAX_TEMPERATURE", PARAMS),
    Mutant("params-top-p-zero", SP,
           'lambda p: 0 < p <= 1)', 'lambda p: 0 <= p <= 1)', PARAMS),
    Mutant("params-top-k-below-minus-one", SP,
           'check_int("top_k", self.top_k, -1,', 'check_int("top_k", self.top_k, -2,', PARAMS),
    Mutant("params-max-tokens-zero", SP,
           'check_int("max_tokens", self.max_tokens, 1,',
           'check_int("max_tokens", self.max_tokens, 0,', PARAMS),
    Mutant("params-ignore-eos-unchecked", SP,
           "        if not isinstance(self.ignore_eos, bool):", "        if False:", PARAMS),
    Mutant("params-seed-2-63", SP,
           'check_int("seed", self.seed, 0, MAX_SEED - 1,',
           'check_int("seed", self.seed, 0, MAX_SEED,', PARAMS),
    Mutant("params-negative-lag", SP,
           'check_int("max_policy_lag", self.max_policy_lag, 0,',
           'check_int("max_policy_lag", self.max_policy_lag, -1,', PARAMS),
    Mutant("params-stop-bytes", SP,
           "if (isinstance(stops, (str, bytes, bytearray, memoryview))\n                or not",
           "if (not", PARAMS),
    Mutant("params-stop-count-with-repeats", SP,
           "if len(stops) > MAX_STOP_TOKEN_IDS and len(set(stops)) > MAX_STOP_TOKEN_IDS:",
           "if len(stops) > MAX_STOP_TOKEN_IDS:", PARAMS),
    Mutant("params-stop-ids-not-frozen", SP,
           '        object.__setattr__(self, "stop_token_ids", stops)', "        pass", PARAMS),
    Mutant("params-n-over-max", SP,
           'check_int("n (samples per prompt)", self.n, 1, MAX_N,',
           'check_int("n (samples per prompt)", self.n, 1, MAX_N + 1,', PARAMS),
    Mutant("params-request-empty-prompt", REQ,
           "        if not ids:\n", "        if False:\n", PARAMS),
    Mutant("params-request-sampling-count", REQ,
           "if len(params) != len(prompts) or not all(", "if not all(", PARAMS),
    # ---- the server's request mapping ---------------------------------------------------------
    Mutant("server-null-kept", SCHEMA,
           "if value is not None or name in _NONE_MEANS_SOMETHING}", "if True}", SERVER),
    Mutant("server-null-seed-dropped", SCHEMA,
           "if value is not None or name in _NONE_MEANS_SOMETHING}", "if value is not None}",
           SERVER, equivalent="SamplingParams' default for seed and max_policy_lag is None, the "
                              "same as the explicit null"),
    Mutant("server-not-strict", SCHEMA,
           'ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)',
           'ConfigDict(extra="forbid", allow_inf_nan=False)', SERVER),
    Mutant("server-extra-allowed", SCHEMA,
           'ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)',
           'ConfigDict(strict=True, allow_inf_nan=False)', SERVER),
    Mutant("server-nan-allowed", SCHEMA,
           'ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)',
           'ConfigDict(extra="forbid", strict=True)', SERVER),
    Mutant("server-two-prompts-allowed", SCHEMA,
           "if (self.prompt_token_ids is None) == (self.prompt is None):",
           "if self.prompt_token_ids is None and self.prompt is None:", SERVER),
    Mutant("server-request-id-unbounded", SCHEMA,
           "    request_id: str | None = Field(default=None, min_length=1,\n"
           "                                   max_length=MAX_REQUEST_ID_CHARS)",
           "    request_id: str | None = Field(default=None, min_length=1)", SERVER),
    Mutant("server-sampling-params-ignored", APP,
           "params = body.sampling_params.to_params() if body.sampling_params else None",
           "params = None", SERVER),
    Mutant("server-k-ignored", APP,
           "k = state.default_k if body.k is None else body.k", "k = state.default_k", SERVER),
    Mutant("server-k-max-ignored", APP,
           "k_max = state.default_k_max if body.k_max is None else body.k_max",
           "k_max = state.default_k_max", SERVER),
    Mutant("server-request-id-ignored", APP,
           'rid = body.request_id or f"http-{uuid.uuid4().hex}"',
           'rid = f"http-{uuid.uuid4().hex}"', SERVER),
    Mutant("server-live-id-reused", APP,
           "        if rid in state.live:\n", "        if False:\n", SERVER),
]

AREAS = {"sampler": RS, "prefix": PC, "weights": (PROTO, RECV), "admission": REQ,
         "launchers": (ATT_C, ATT, SMP_C, KVK), "kv": KVC, "sched": SCH,
         "params": (SP, REQ), "server": (SCHEMA, APP)}


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
        if rc < 0 and -rc in (signal.SIGSEGV, signal.SIGBUS, signal.SIGABRT):
            # The tests crashed the interpreter (a kernel read out of bounds): a failure the
            # real code does not have, so the mutant is caught.
            return f"killed (crash, signal {-rc})", time.monotonic() - start
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
