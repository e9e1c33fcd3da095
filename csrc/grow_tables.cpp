#include "grow_tables.h"

#include <algorithm>
#include <stdexcept>
#include <string>
#include <vector>

#include "arena_slot.h"

namespace specengine {

namespace {

// Blocks the sequence in `slot` needs for its next verify step.
int64_t blocks_needed(const GrowInput& in, int64_t slot) {
  const int64_t len = in.lens[slot];
  const int64_t room = std::max<int64_t>(0, in.max_model_len - len);
  const int64_t need = len + std::min(in.lookahead[slot], room);
  return (need + in.block_size - 1) / in.block_size;
}

}  // namespace

GrowResult grow_tables(const GrowInput& in, BlockAllocator& allocator) {
  int64_t total = 0, widest = 0;
  for (int64_t r = 0; r < in.num_rows; ++r) {
    const int64_t slot = in.slots[r];
    check_arena_slot("grow_tables", r, slot, in.num_slots);
    const int64_t blocks = blocks_needed(in, slot);
    const int64_t missing = blocks - in.num_blocks[slot];
    if (missing > 0) {
      total += missing;
      widest = std::max(widest, blocks);
    }
  }
  if (total == 0) return {kGrown, 0};
  if (widest > in.width) return {kTooNarrow, widest};
  if (total > allocator.num_free()) return {kShortOfFree, total};
  const std::vector<int32_t> ids = allocator.allocate(total);
  size_t next = 0;
  for (int64_t r = 0; r < in.num_rows; ++r) {
    const int64_t slot = in.slots[r];
    const int64_t blocks = blocks_needed(in, slot);
    int32_t* row = in.block_ids + slot * in.width;
    for (int64_t b = in.num_blocks[slot]; b < blocks; ++b) row[b] = ids[next++];
    in.num_blocks[slot] = std::max(in.num_blocks[slot], blocks);
  }
  return {kGrown, total};
}

}  // namespace specengine
