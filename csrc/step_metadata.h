// Per-step attention metadata built on the host (no Python): block tables and slot mappings.
#pragma once

#include <cstdint>
#include <vector>

namespace specengine {

// Block-table padding. -1, not 0: block 0 is a real block, so a kernel that wrongly read a
// padded entry would silently touch another sequence's KV; -1 turns that into an obvious bug.
constexpr int32_t kBlockTablePad = -1;

// Slot of token i: block_tables[seq_ids[i], positions[i] / block_size] * block_size +
// positions[i] % block_size (kernels.reference.slot_mapping). seq_ids[i] == -1 marks a padding
// token and yields slot -1 (which the KV writes skip). Every other index is bounds-checked and
// violations throw std::invalid_argument naming the token.
std::vector<int64_t> compute_slot_mapping(const int64_t* block_tables, int64_t num_seqs,
                                          int64_t max_blocks, const int64_t* seq_ids,
                                          const int64_t* positions, int64_t num_tokens,
                                          int64_t block_size);

// Row-major [tables.size(), max_blocks] int32, each row a table padded with kBlockTablePad.
std::vector<int32_t> build_block_tables(const std::vector<std::vector<int64_t>>& tables,
                                        int64_t max_blocks);

}  // namespace specengine
