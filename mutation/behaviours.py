"""Issue 37, item 1: each behaviour the new ``tests/test_behaviours_*.py`` pin, broken by hand,
must fail those tests. Each break below is the behaviour written wrong (not a mutant someone
saw); the runner of ``mutation/mutate.py`` applies it, runs the test file that pins it,
restores the file byte for byte (mtime included), and reports killed / survived.

    python mutation/behaviours.py              # every break (about 3 minutes on 2 cores)
    python mutation/behaviours.py --list
    python mutation/behaviours.py --only prefix-hash-drops-last-token

Run it on a clean tree (a break is written into the working tree while its tests run).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from mutate import Mutant, run_one  # noqa: E402

T = "tests/test_behaviours_"
PC = "specengine/core/prefix_cache.py"
KV = "specengine/core/kv_cache.py"
STEP = "specengine/core/step.py"
STOP = "specengine/core/stop_strings.py"
OAI = "specengine/server/openai_api.py"
SGL = "specengine/server/sglang_api.py"
SRECV = "specengine/weights/sglang_receiver.py"
PROTO = "specengine/weights/protocol.py"
RS = "kernels/reference_sampling.py"
SPASS = "kernels/sampling_pass.py"

BREAKS: list[Mutant] = [
    # ---- prefix cache ------------------------------------------------------------------------
    Mutant("prefix-hash-drops-last-token", PC,
           "arr[i * block_size:(i + 1) * block_size].tobytes()",
           "arr[i * block_size:(i + 1) * block_size - 1].tobytes()", (T + "prefix.py",)),
    Mutant("prefix-next-token-left-out", PC,
           "out.append(hashlib.blake2b(prev + nxt, digest_size=16).digest())",
           "out.append(hashlib.blake2b(prev, digest_size=16).digest())", (T + "prefix.py",)),
    Mutant("prefix-held-blocks-evictable", PC,
           "if b in self.hash_of and ref_count(b) == 1:", "if b in self.hash_of:",
           (T + "prefix.py",)),
    Mutant("admission-counts-held-shared-blocks", KV,
           "taken = self.prefix.num_evictable_in(plan.shared) if",
           "taken = len(plan.shared) if", (T + "prefix.py",)),
    Mutant("admission-ignores-evictable-shared-blocks", KV,
           "return need <= self.num_free_blocks - taken", "return need <= self.num_free_blocks",
           (T + "prefix.py",)),
    # ---- step bookkeeping --------------------------------------------------------------------
    Mutant("step-keeps-stale-draft-counts", STEP,
           "if (proposed != num_drafts).any():", "if False:", (T + "drafts.py", "-k", "fewer")),
    Mutant("step-counts-not-restaged", STEP,
           "state.restage_num_drafts(num_drafts)", "pass", (T + "drafts.py", "-k", "fewer")),
    Mutant("step-counts-stop-cut-tokens", STEP,
           "kept -= cut_at_stop_strings(arena, seqs, slots, num_rows)",
           "cut_at_stop_strings(arena, seqs, slots, num_rows)", (T + "drafts.py", "-k", "stop")),
    # ---- text ----------------------------------------------------------------------------------
    Mutant("min-tokens-one-early", STOP, "if i + 1 <= p.min_tokens:", "if i + 1 < p.min_tokens:",
           (T + "text.py", "-k", "min_tokens")),
    Mutant("min-tokens-one-late", STOP, "if i + 1 <= p.min_tokens:", "if i <= p.min_tokens:",
           (T + "text.py", "-k", "min_tokens")),
    Mutant("stop-text-shows-cut-character", STOP,
           "if len(full) <= len(self._prefix_text) or full.endswith(_INCOMPLETE):",
           "if len(full) <= len(self._prefix_text):", (T + "text.py", "-k", "not stream")),
    Mutant("stream-hands-out-cut-character", OAI,
           'if len(now) <= len(before) or now.endswith("\\ufffd"):',
           "if len(now) <= len(before):", (T + "text.py", "-k", "stream")),
    # ---- SGLang --------------------------------------------------------------------------------
    Mutant("sglang-broadcast-skips-finite-check", SRECV,
           "    if check_finite:\n        check_finite_tensors(received)",
           "    if False:\n        check_finite_tensors(received)",
           (T + "weights.py", "-k", "broadcast")),
    Mutant("sglang-dtype-torch-prefix-unknown", SRECV, 'name.removeprefix("torch.")', "name",
           (T + "weights.py", "-k", "dtype")),
    Mutant("sglang-top-logprobs-num-dropped", SGL, "out.weight_version, top_n)}",
           "out.weight_version)}", (T + "server.py", "-k", "top_logprobs")),
    Mutant("sglang-top-logprobs-num-uncut", SGL, "key=lambda kv: -kv[1])[:top_n]]",
           "key=lambda kv: -kv[1])]", (T + "server.py", "-k", "top_logprobs")),
    Mutant("sglang-stream-index-per-prompt", SGL, 'chunk["index"] = offsets[i] + sample',
           'chunk["index"] = sample', (T + "server.py", "-k", "streamed")),
    Mutant("sglang-stream-index-prompt-only", SGL, 'chunk["index"] = offsets[i] + sample',
           'chunk["index"] = i + sample', (T + "server.py", "-k", "streamed")),
    Mutant("openai-cached-tokens-summed", OAI,
           "cached = sum(o.num_cached_tokens for o in outs if o.sample_index == 0)",
           "cached = sum(o.num_cached_tokens for o in outs)",
           (T + "server.py", "-k", "cached")),
    # ---- weights -------------------------------------------------------------------------------
    Mutant("manifest-shape-bool-taken", PROTO,
           "isinstance(s, int) and not isinstance(s, bool) for s in shape",
           "isinstance(s, int) for s in shape", (T + "weights.py", "-k", "manifest")),
    Mutant("manifest-shape-float-truncated", PROTO,
           "isinstance(s, int) and not isinstance(s, bool) for s in shape",
           "isinstance(s, (int, float)) and not isinstance(s, bool) for s in shape",
           (T + "weights.py", "-k", "manifest")),
    # ---- top-p at exactly top_p ----------------------------------------------------------------
    Mutant("top-p-reference-needs-more-than-top-p", RS,
           "short = fixed.double() < need[:, None]", "short = fixed.double() <= need[:, None]",
           (T + "sampling.py", "-k", "not kernel")),
    Mutant("top-p-kernel-needs-more-than-top-p", SPASS,
           "ok = tl.sum(imass, 0).to(tl.float64) >= need",
           "ok = tl.sum(imass, 0).to(tl.float64) > need", (T + "sampling.py",)),
]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--only", help="comma-separated break ids")
    ap.add_argument("--list", action="store_true")
    ap.add_argument("--timeout", type=float, default=300.0)
    args = ap.parse_args()
    chosen = BREAKS
    if args.only:
        ids = set(args.only.split(","))
        chosen = [m for m in BREAKS if m.id in ids]
    if args.list:
        for m in chosen:
            print(f"{m.id:45s} {m.file:40s} {' '.join(m.tests)}")
        return 0
    bad = []
    for m in chosen:
        status, secs = run_one(m, args.timeout)
        print(f"{status:18s} {secs:6.1f}s  {m.id:45s} {' '.join(m.tests)}", flush=True)
        if not status.startswith("killed"):
            bad.append(m.id)
    print(f"\n{len(chosen) - len(bad)}/{len(chosen)} breaks fail their tests"
          + (f"; not caught: {', '.join(bad)}" if bad else ""))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
