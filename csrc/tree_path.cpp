#include "tree_path.h"

#include <stdexcept>
#include <string>

#include "arena_slot.h"

namespace specengine {

namespace {

// Cache slot of position `pos` of the sequence in `slot`.
int64_t slot_of(const TreePathInput& in, int64_t row, int64_t slot, int64_t pos) {
  const int64_t block = pos / in.block_size;
  if (pos < 0 || block >= in.num_blocks[slot] || block >= in.width) {
    throw std::invalid_argument("tree_path_moves: row " + std::to_string(row) + " position " +
                                std::to_string(pos) + " is past its " +
                                std::to_string(in.num_blocks[slot]) + " KV blocks");
  }
  return static_cast<int64_t>(in.block_ids[slot * in.width + block]) * in.block_size +
         pos % in.block_size;
}

}  // namespace

TreePathMoves tree_path_moves(const TreePathInput& in) {
  TreePathMoves out;
  const int64_t n = in.num_tokens, stride = 3 * n + 1;
  for (int64_t r = 0; r < in.num_rows; ++r) {
    const double* row = in.packed + r * stride;
    const int64_t slot = in.row_slots[r];
    check_arena_slot("tree_path_moves", r, slot, in.num_slots);
    const auto accepted = static_cast<int64_t>(row[3 * n]);
    if (accepted < 0 || accepted >= n) {
      throw std::invalid_argument("tree_path_moves: row " + std::to_string(r) + " accepted " +
                                  std::to_string(accepted) + " drafts of a " +
                                  std::to_string(n) + "-node tree");
    }
    const int64_t ctx = in.lens[slot] - 1;
    for (int64_t depth = 1; depth <= accepted; ++depth) {
      const auto node = static_cast<int64_t>(row[2 * n + depth]);
      if (node < 1 || node >= n) {
        throw std::invalid_argument("tree_path_moves: row " + std::to_string(r) +
                                    " accepted node " + std::to_string(node) +
                                    " outside the tree");
      }
      if (node == depth) continue;  // already in place
      out.src.push_back(slot_of(in, r, slot, ctx + node));
      out.dst.push_back(slot_of(in, r, slot, ctx + depth));
    }
  }
  return out;
}

}  // namespace specengine
