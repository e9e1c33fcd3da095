#include "stage_rows.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace specengine {

StageResult stage_rows(const StageInput& in) {
  StageResult res{0, {}};
  bool tree_fits = true;
  for (int64_t r = 0; r < in.num_rows; ++r) {
    const int64_t slot = in.row_slots[r];
    if (slot < 0 || slot >= in.num_slots) {
      throw std::invalid_argument("stage_rows: row " + std::to_string(r) + " has slot " +
                                  std::to_string(slot) + " outside the arena's " +
                                  std::to_string(in.num_slots));
    }
    const int64_t len = in.lens[slot];
    if (len < 1 || len > in.width) {
      throw std::invalid_argument("stage_rows: row " + std::to_string(r) + " has length " +
                                  std::to_string(len));
    }
    if (in.tree_drafts >= 0 && len + in.tree_drafts > in.max_model_len) tree_fits = false;
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
    if (in.num_blocks[slot] != in.sent_blocks[r]) res.grown.push_back(r);
  }
  return res;
}

}  // namespace specengine
