// The small-LM drafter's static decode step on the host (specengine/drafters/static_lm_chain.py):
// every row's catch-up planned, its draft-cache table grown, its counters set and its fed tokens
// gathered from the arena, in one pass; and the counters' update after the verify step.
#pragma once

#include <cstdint>

#include "block_allocator.h"

namespace specengine {

struct LMStageInput {
  const int64_t* slots;        // [num_rows] arena slots of the batch rows
  const int64_t* seq_ids;      // [num_rows] their sequence ids
  const int64_t* num_drafts;   // [num_rows] drafts each row asked for
  int64_t num_rows;
  const int64_t* arena_epoch;  // arena [num_slots]: takes of each slot
  const int64_t* lens;         // arena [num_slots]: tokens so far
  const int64_t* tokens;       // arena [num_slots, token_width]
  int64_t token_width;
  const int64_t* owner;        // LMSlots [num_slots]: holder's sequence id
  const int64_t* epoch;        // LMSlots [num_slots]: holder's take
  int64_t* num_cached;         // LMSlots [num_slots] (written)
  int64_t* num_pending;        // LMSlots [num_slots] (written)
  int64_t* need;               // LMSlots [num_slots]: tokens each table must hold (written)
  const int64_t* zeros;        // [num_slots] zeros (grow_tables' lookahead)
  int64_t* num_blocks;         // LMSlots [num_slots] (written)
  int32_t* block_ids;          // LMSlots [num_slots, block_width] (written)
  int64_t block_width;
  int64_t num_slots;
  int64_t block_size;
  int64_t max_blocks;          // columns of the device table
  int64_t* out;                // [>= num_rows, max_catch_up + 2]: fed tokens, start, count
  int64_t max_catch_up;
};

enum LMStageStatus : int64_t {
  kStaged = 0,     // done; value = catch-up width
  kStale = 1,      // row `value` is not held by its sequence (claim it first) or has slot -1
                   // (a sequence outside the arena); nothing changed
  kTooWide = 2,    // the catch-up needs `value` > max_catch_up tokens; nothing changed
  kNarrow = 3,     // a table needs `value` columns > block_width (widen); nothing changed
  kShort = 4,      // `value` more blocks than are free; nothing changed
  kOverDevice = 5,  // a table needs `value` > max_blocks columns; nothing changed
};

struct LMStageResult {
  int64_t status;
  int64_t value;
  int64_t lo, hi;  // slots whose table grew: [lo, hi) (empty when lo >= hi)
  int64_t k;       // max num_drafts (when staged)
};

// Row r (slot s, k = max num_drafts): start = min(num_cached[s], len - 1), count = len - start;
// its table grows to len + k - 1 tokens (one allocation for all rows, all or nothing); then
// num_cached[s] = len, num_pending[s] = max(num_drafts[r] - 1, 0), and out[r] holds
// tokens[s, start:len] (zeros after them, up to max_catch_up), start, count. Throws
// std::invalid_argument (nothing changed) on a slot past the arena or an empty sequence.
LMStageResult lm_stage(const LMStageInput& in, BlockAllocator& allocator);

// After the verify step: if every row's slot is held by its sequence (owner, epoch), then
// num_cached[s] += min(num_pending[s], num_accepted[r]) and num_pending[s] = 0, and true;
// otherwise false with nothing changed.
bool lm_observe(const int64_t* slots, const int64_t* seq_ids, const int64_t* num_accepted,
                int64_t num_rows, const int64_t* arena_epoch, const int64_t* owner,
                const int64_t* epoch, int64_t* num_cached, int64_t* num_pending,
                int64_t num_slots);

}  // namespace specengine
