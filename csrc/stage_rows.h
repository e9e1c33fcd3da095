// The decode step's host staging (specengine/core/batch.py): every row's step fields and its
// draft plan in one pass over the batch, read from the running sequences' arena.
#pragma once

#include <cstdint>

namespace specengine {

// Rows of BatchState's int64 step-field mirror (batch.py CTX, LAST, OFFSET, NUM_DRAFT).
constexpr int64_t kCtx = 0, kLast = 1, kOffset = 2, kNumDraft = 3;
// Rows of its host limits (MAX_TOKENS, PROMPT_LEN).
constexpr int64_t kMaxTokens = 0, kPromptLen = 1;

struct StageInput {
  int64_t* ints;           // [>= 4, capacity] step fields (written)
  const int64_t* limits;   // [2, capacity]
  int64_t capacity;
  const int64_t* row_slots;  // [num_rows] arena slot of each row
  int64_t num_rows;
  const int64_t* lens;        // arena [slots]
  const int64_t* tokens;      // arena [slots, width]
  int64_t width;
  const int64_t* num_blocks;  // arena [slots]
  int64_t num_slots;
  // The draft plan: explicit counts (non-null, [num_rows]) or the rule below.
  const int64_t* num_drafts;
  int64_t k;            // chain: min(k, max_tokens left - 1, max_model_len - len) per row
  int64_t tree_drafts;  // >= 0: a tree's drafts for every row, or none for all when one row
                        // would feed past max_model_len; -1: a chain
  int64_t max_model_len;
  // Block tables: the arena's rows and the batch state's host mirror of the device table.
  const int32_t* block_ids;  // arena [slots, block_width]
  int64_t block_width;
  int32_t* table;            // [capacity, max_blocks] (written)
  int64_t max_blocks;
  int64_t* sent_blocks;      // [capacity] table entries the mirror holds per row (written)
  const int64_t* changed;    // [num_changed] rows whose owner changed: copied whole
  int64_t num_changed;
  int64_t num_used;          // rows the mirror held before (rows past num_rows are zeroed)
};

struct StageResult {
  int64_t max_drafts;  // the largest draft count staged
  int64_t send_rows;   // the mirror's rows 0 .. send_rows-1 hold every change (0: none)
};

// Writes the step fields and, for every row whose table grew (the arena's count differs from
// sent_blocks) or whose owner changed, its whole mirror row (zeros past its count); rows
// num_rows .. num_used-1 become zero. Throws std::invalid_argument (nothing written) on a slot
// outside the arena, an empty sequence, a changed row outside the batch or a table wider than
// max_blocks.
StageResult stage_rows(const StageInput& in);

}  // namespace specengine
