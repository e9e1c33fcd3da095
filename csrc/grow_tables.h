// The decode step's KV growth (specengine/kv_cache.py KVCache.ensure_running): every running
// sequence's block table grown to cover its next verify step, in one pass over the arena.
#pragma once

#include <cstdint>

#include "block_allocator.h"

namespace specengine {

struct GrowInput {
  const int64_t* slots;  // [num_rows] arena slots of the running sequences
  int64_t num_rows;
  const int64_t* lens;       // arena [num_slots]: tokens so far
  const int64_t* lookahead;  // arena [num_slots]: draft tokens fed after the newest token
  int64_t* num_blocks;       // arena [num_slots]: blocks owned (written)
  int32_t* block_ids;        // arena [num_slots, width]: the tables (written)
  int64_t width;
  int64_t num_slots;
  int64_t max_model_len;
  int64_t block_size;
};

enum GrowStatus : int64_t {
  kGrown = 0,       // done; value = blocks allocated (0: every table already covered)
  kShortOfFree = 1,  // the allocator's free blocks do not cover value blocks; nothing changed
  kTooNarrow = 2,    // a table needs value columns, more than width; nothing changed
};

struct GrowResult {
  int64_t status;
  int64_t value;
};

// Row r needs ceil(need / block_size) blocks, need = len + min(lookahead, max_model_len - len)
// (its context, its newest token and its drafts, capped by the context). All tables grow or
// none: the missing blocks come from one allocation, handed out in row order. Throws
// std::invalid_argument (nothing changed) on a slot outside the arena.
GrowResult grow_tables(const GrowInput& in, BlockAllocator& allocator);

}  // namespace specengine
