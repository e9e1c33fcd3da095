#include "stage_rows.h"

#include <algorithm>
#include <stdexcept>
#include <string>

#include "arena_slot.h"

namespace specengine {

namespace {

// Copy the arena row of `slot` into mirror row r (zeros past its count).
void copy_table_row(const StageInput& in, int64_t r, int64_t slot) {
  const int64_t n = in.num_blocks[slot];
  const int32_t* src = in.block_ids + slot * in.block_width;
  int32_t* dst = in.table + r * in.max_blocks;
  std::copy(src, src + n, dst);
  std::fill(dst + n, dst + in.max_blocks, 0);
  in.sent_blocks[r] = n;
}

}  // namespace

StageResult stage_rows(const StageInput& in) {
  StageResult res{0, 0};
  bool tree_fits = true;
  for (int64_t r = 0; r < in.num_rows; ++r) {
    const int64_t slot = in.row_slots[r];
    check_arena_slot("stage_rows", r, slot, in.num_slots);
    const int64_t len = in.lens[slot];
    if (len < 1 || len > in.width) {
      throw std::invalid_argument("stage_rows: row " + std::to_string(r) + " has length " +
                                  std::to_string(len));
    }
    const int64_t blocks = in.num_blocks[slot];
    if (blocks < 0 || blocks > in.max_blocks || blocks > in.block_width) {
      throw std::invalid_argument("stage_rows: row " + std::to_string(r) + " holds " +
                                  std::to_string(blocks) + " KV blocks, more than the " +
                                  std::to_string(in.max_blocks) + " of a block-table row");
    }
    if (in.tree_drafts >= 0 && len + in.tree_drafts > in.max_model_len) tree_fits = false;
  }
  for (int64_t i = 0; i < in.num_changed; ++i) {
    if (in.changed[i] < 0 || in.changed[i] >= in.num_rows) {
      throw std::invalid_argument("stage_rows: changed row " + std::to_string(in.changed[i]) +
                                  " is outside the batch of " + std::to_string(in.num_rows));
    }
  }
  int64_t* ints = in.ints;
  const int64_t cap = in.capacity;
  for (int64_t r = 0; r < in.num_rows; ++r) {
    const int64_t slot = in.row_slots[r];
    const int64_t len = in.lens[slot];
    ints[kCtx * cap + r] = len - 1;
    ints[kOffset * cap + r] = len;
    ints[kLast * cap + r] = in.tokens[slot * in.width + len - 1];
    int64_t d;
    if (in.num_drafts != nullptr) {
      d = in.num_drafts[r];
    } else if (in.tree_drafts >= 0) {
      d = tree_fits ? in.tree_drafts : 0;
    } else {  // speculate.num_drafts_for: the step emits at most d + 1 tokens, feeds len + d
      const int64_t left = in.limits[kMaxTokens * cap + r] - (len - in.limits[kPromptLen * cap + r]);
      d = std::max<int64_t>(0, std::min({in.k, left - 1, in.max_model_len - len}));
    }
    ints[kNumDraft * cap + r] = d;
    res.max_drafts = std::max(res.max_drafts, d);
    if (in.num_blocks[slot] != in.sent_blocks[r]) {  // grew since the mirror was written
      copy_table_row(in, r, slot);
      res.send_rows = r + 1;
    }
  }
  for (int64_t i = 0; i < in.num_changed; ++i) {  // another owner: the whole row again
    const int64_t r = in.changed[i];
    copy_table_row(in, r, in.row_slots[r]);
    res.send_rows = std::max(res.send_rows, r + 1);
  }
  for (int64_t r = in.num_rows; r < in.num_used; ++r) {  // rows that left the batch
    std::fill(in.table + r * in.max_blocks, in.table + (r + 1) * in.max_blocks, 0);
    in.sent_blocks[r] = 0;
    res.send_rows = r + 1;
  }
  return res;
}

}  // namespace specengine
