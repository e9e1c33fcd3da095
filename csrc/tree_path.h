// The KV moves of accepted tree paths (specengine/speculate.py _compact_tree_path): computed
// from the packed sampler output and the arena's block tables in one pass over the batch.
#pragma once

#include <cstdint>
#include <vector>

namespace specengine {

struct TreePathInput {
  const double* packed;  // [num_rows, 3N + 1]: ids, logprobs, row ids (N each), num accepted
  int64_t num_rows;
  int64_t num_tokens;        // N: tree nodes fed per row
  const int64_t* row_slots;  // [num_rows] arena slot of each row
  const int64_t* lens;       // arena [num_slots]: tokens before this step's are appended
  const int64_t* num_blocks;  // arena [num_slots]
  const int32_t* block_ids;   // arena [num_slots, width]
  int64_t width;
  int64_t num_slots;
  int64_t block_size;
};

struct TreePathMoves {
  std::vector<int64_t> src, dst;  // cache slots: entry src[i] moves to dst[i]
};

// Row r accepted a = num_accepted[r] drafts along nodes row_ids[r, 1..a] (node 0, the root,
// stays). With ctx = lens[slot] - 1, node i's entry sits at position ctx + i and the path's
// depth-d node belongs at ctx + d: one move per depth whose node is not d, rows in order and
// depths increasing within a row (the order compact_kv needs). Throws std::invalid_argument on
// a slot outside the arena, a count or node outside the tree, or a position past the table.
TreePathMoves tree_path_moves(const TreePathInput& in);

}  // namespace specengine
