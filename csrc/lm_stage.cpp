#include "lm_stage.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "arena_slot.h"
#include "grow_tables.h"

namespace specengine {

namespace {


}  // namespace

LMStageResult lm_stage(const LMStageInput& in, BlockAllocator& allocator) {
  // Pass 1: check every row before changing anything.
  int64_t width = 0, k = 0;
  for (int64_t r = 0; r < in.num_rows; ++r) {
    const int64_t s = in.slots[r];
    if (s < 0) return {kStale, r, 0, 0, 0};  // a sequence outside the arena
    check_arena_slot("lm_stage", r, s, in.num_slots);
    if (in.lens[s] < 1 || in.lens[s] > in.token_width) {
      throw std::invalid_argument("lm_stage: row " + std::to_string(r) + " has " +
                                  std::to_string(in.lens[s]) + " tokens");
    }
    if (in.owner[s] != in.seq_ids[r] || in.epoch[s] != in.arena_epoch[s]) {
      return {kStale, r, 0, 0, 0};
    }
    const int64_t start = std::min(in.num_cached[s], in.lens[s] - 1);
    width = std::max(width, in.lens[s] - start);
    k = std::max(k, in.num_drafts[r]);
  }
  if (width > in.max_catch_up) return {kTooWide, width, 0, 0, 0};
  int64_t widest = 0;
  for (int64_t r = 0; r < in.num_rows; ++r) {
    const int64_t s = in.slots[r];
    const int64_t need = in.lens[s] + k - 1;
    widest = std::max(widest, (need + in.block_size - 1) / in.block_size);
  }
  if (widest > in.max_blocks) return {kOverDevice, widest, 0, 0, 0};
  // Pass 2: grow every table (all or nothing), noting the slots that grew.
  int64_t lo = in.num_slots, hi = 0;
  for (int64_t r = 0; r < in.num_rows; ++r) {
    const int64_t s = in.slots[r];
    in.need[s] = in.lens[s] + k - 1;
    if ((in.need[s] + in.block_size - 1) / in.block_size > in.num_blocks[s]) {
      lo = std::min(lo, s);
      hi = std::max(hi, s + 1);
    }
  }
  // lens = need and no lookahead: each row needs exactly need tokens (max_model_len 0: the
  // context cap adds nothing).
  const GrowInput grow{in.slots,     in.num_rows,    in.need,       in.zeros,
                       in.num_blocks, in.block_ids, in.block_width, in.num_slots,
                       0,             in.block_size};
  const GrowResult g = grow_tables(grow, allocator);
  if (g.status == kTooNarrow) return {kNarrow, g.value, 0, 0, 0};
  if (g.status == kShortOfFree) return {kShort, g.value, 0, 0, 0};
  // Pass 3: counters and fed tokens.
  const int64_t cols = in.max_catch_up + 2;
  for (int64_t r = 0; r < in.num_rows; ++r) {
    const int64_t s = in.slots[r], len = in.lens[s];
    const int64_t start = std::min(in.num_cached[s], len - 1);
    int64_t* row = in.out + r * cols;
    const int64_t* tok = in.tokens + s * in.token_width;
    for (int64_t j = 0; j < in.max_catch_up; ++j) row[j] = start + j < len ? tok[start + j] : 0;
    row[cols - 2] = start;
    row[cols - 1] = len - start;
    in.num_cached[s] = len;
    in.num_pending[s] = std::max<int64_t>(in.num_drafts[r] - 1, 0);
  }
  return {kStaged, width, lo, hi, k};
}

bool lm_observe(const int64_t* slots, const int64_t* seq_ids, const int64_t* num_accepted,
                int64_t num_rows, const int64_t* arena_epoch, const int64_t* owner,
                const int64_t* epoch, int64_t* num_cached, int64_t* num_pending,
                int64_t num_slots) {
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t s = slots[r];
    if (s < 0 || s >= num_slots || owner[s] != seq_ids[r] || epoch[s] != arena_epoch[s]) {
      return false;
    }
  }
  for (int64_t r = 0; r < num_rows; ++r) {
    const int64_t s = slots[r];
    num_cached[s] += std::min(num_pending[s], num_accepted[r]);
    num_pending[s] = 0;
  }
  return true;
}

}  // namespace specengine
