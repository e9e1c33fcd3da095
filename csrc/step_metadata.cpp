#include "step_metadata.h"

#include <limits>
#include <stdexcept>
#include <string>

namespace specengine {

std::vector<int64_t> compute_slot_mapping(const int64_t* block_tables, int64_t num_seqs,
                                          int64_t max_blocks, const int64_t* seq_ids,
                                          const int64_t* positions, int64_t num_tokens,
                                          int64_t block_size) {
  if (block_size <= 0) {
    throw std::invalid_argument("block_size must be positive, got " + std::to_string(block_size));
  }
  std::vector<int64_t> slots(static_cast<size_t>(num_tokens));
  for (int64_t i = 0; i < num_tokens; ++i) {
    const int64_t s = seq_ids[i];
    const int64_t pos = positions[i];
    if (s == -1) {
      slots[static_cast<size_t>(i)] = -1;
      continue;
    }
    if (s < 0 || s >= num_seqs) {
      throw std::invalid_argument("token " + std::to_string(i) + ": seq_id " + std::to_string(s) +
                                  " is out of range for " + std::to_string(num_seqs) +
                                  " block-table rows (-1 marks padding)");
    }
    if (pos < 0) {
      throw std::invalid_argument("token " + std::to_string(i) + " (sequence " + std::to_string(s) +
                                  ") has negative position " + std::to_string(pos));
    }
    const int64_t col = pos / block_size;
    if (col >= max_blocks) {
      throw std::invalid_argument("token " + std::to_string(i) + " (sequence " + std::to_string(s) + ", position " +
                                  std::to_string(pos) + ") needs block-table column " +
                                  std::to_string(col) + " but block_tables has only " +
                                  std::to_string(max_blocks) + " columns");
    }
    const int64_t block = block_tables[s * max_blocks + col];
    if (block < 0) {
      throw std::invalid_argument("token " + std::to_string(i) + " (sequence " + std::to_string(s) + ", position " +
                                  std::to_string(pos) + ") falls in block-table column " +
                                  std::to_string(col) + ", which holds no block (" +
                                  std::to_string(block) + ")");
    }
    slots[static_cast<size_t>(i)] = block * block_size + pos % block_size;
  }
  return slots;
}

std::vector<int32_t> build_block_tables(const std::vector<std::vector<int64_t>>& tables,
                                        int64_t max_blocks) {
  if (max_blocks < 0) {
    throw std::invalid_argument("max_blocks must be >= 0, got " + std::to_string(max_blocks));
  }
  const auto cols = static_cast<size_t>(max_blocks);
  std::vector<int32_t> out(tables.size() * cols, kBlockTablePad);
  for (size_t r = 0; r < tables.size(); ++r) {
    const auto& t = tables[r];
    if (t.size() > cols) {
      throw std::invalid_argument("block table " + std::to_string(r) + " has " +
                                  std::to_string(t.size()) + " blocks, more than max_blocks = " +
                                  std::to_string(max_blocks));
    }
    for (size_t c = 0; c < t.size(); ++c) {
      if (t[c] < 0 || t[c] > std::numeric_limits<int32_t>::max()) {
        throw std::invalid_argument("block table " + std::to_string(r) + " entry " +
                                    std::to_string(c) + " = " + std::to_string(t[c]) +
                                    " is not a valid block id");
      }
      out[r * cols + c] = static_cast<int32_t>(t[c]);
    }
  }
  return out;
}

}  // namespace specengine
