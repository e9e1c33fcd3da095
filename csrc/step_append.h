// The decode step's host postprocessing (specengine/core/seq_arena.py): append every row's
// emitted tokens to the running sequences' arena in one pass, with the stop-token, max_tokens
// and context cuts, the per-slot counters and the per-draft-position acceptance counts.
#pragma once

#include <cstdint>
#include <vector>

namespace specengine {

// The arena's arrays (row-major, numpy-owned; see SeqArena for their meaning).
struct ArenaArrays {
  int64_t* tokens;     // [capacity, width]
  double* logprobs;    // [capacity, width]
  int64_t* versions;   // [capacity, width]
  int64_t width;
  int64_t* lens;       // [capacity]
  const int64_t* limit;     // [capacity]
  const int64_t* stop_ids;  // [capacity, num_stop], -1 padded
  int64_t num_stop;
  bool* done;          // [capacity]
  int64_t* counters;   // [3, capacity]: steps, drafts proposed, drafts accepted
  int64_t capacity;
};

// One step's packed sampler output (sampler.SamplerOutput.pack): row b is
// [ids[N], logprobs[N], row_ids[N], num_accepted], float64.
struct PackedStep {
  const double* packed;  // [num_rows, 3N + 1]
  int64_t num_rows;
  int64_t num_tokens;  // N
  const int64_t* slots;       // [num_rows] arena slot of each row
  const int64_t* num_drafts;  // [num_rows] drafts proposed (counters)
  const int64_t* depths;      // [num_rows] draft positions proposed (acceptance counts)
  int64_t version;
};

struct AppendResult {
  int64_t needed_width;  // > 0: the arena is too narrow, nothing was changed
  int64_t num_kept;      // tokens kept over all rows
  std::vector<int64_t> ended_rows;   // rows whose sequence ended this step
  std::vector<int8_t> ended_codes;   // 1: a stop token, 2: max_tokens / max_model_len
};

// Row b emitted tokens 0 .. num_accepted[b]; keep them up to and including the first stop
// token, and no more than limit[slot] - lens[slot]; record `version` for each kept token.
// `stats` is [2, stats_width] (proposed, accepted per draft position), accumulated.
// Throws std::invalid_argument (nothing changed) on an out-of-range slot, a negative or too
// large num_accepted, or a depth past stats_width.
AppendResult append_step(const ArenaArrays& arena, const PackedStep& step, int64_t* stats,
                         int64_t stats_width);

}  // namespace specengine
