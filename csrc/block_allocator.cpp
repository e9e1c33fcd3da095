#include "block_allocator.h"

#include <algorithm>
#include <limits>
#include <string>
#include <utility>

namespace specengine {

namespace {

// (id, occurrences) per distinct id, ids increasing. Sorting a copy groups repeated ids, so a
// block passed several times in one call is counted (and checked) as often as it occurs.
std::vector<std::pair<int64_t, int64_t>> count_ids(const std::vector<int64_t>& blocks) {
  std::vector<int64_t> sorted(blocks);
  std::sort(sorted.begin(), sorted.end());
  std::vector<std::pair<int64_t, int64_t>> runs;
  for (size_t i = 0; i < sorted.size();) {
    size_t j = i;
    while (j < sorted.size() && sorted[j] == sorted[i]) ++j;
    runs.emplace_back(sorted[i], static_cast<int64_t>(j - i));
    i = j;
  }
  return runs;
}

}  // namespace

BlockAllocator::BlockAllocator(int64_t num_blocks) {
  if (num_blocks < 0 || num_blocks > std::numeric_limits<int32_t>::max()) {
    throw std::invalid_argument("num_blocks must be in [0, 2^31 - 1], got " +
                                std::to_string(num_blocks));
  }
  refs_.assign(static_cast<size_t>(num_blocks), 0);
  reset();
}

void BlockAllocator::reset() {
  std::fill(refs_.begin(), refs_.end(), 0);
  const auto n = static_cast<int32_t>(refs_.size());
  free_.resize(refs_.size());
  // Highest id at the bottom of the stack so a fresh allocator hands out 0, 1, 2, ...
  for (int32_t i = 0; i < n; ++i) free_[static_cast<size_t>(i)] = n - 1 - i;
}

void BlockAllocator::check_in_range(int64_t block) const {
  if (block < 0 || block >= num_blocks()) {
    throw std::invalid_argument("block id " + std::to_string(block) + " is out of range [0, " +
                                std::to_string(num_blocks()) + ")");
  }
}

std::vector<int32_t> BlockAllocator::pop(int64_t n) {
  std::vector<int32_t> out(static_cast<size_t>(n));
  for (auto& b : out) {
    b = free_.back();
    free_.pop_back();
    refs_[static_cast<size_t>(b)] = 1;
  }
  return out;
}

std::vector<int32_t> BlockAllocator::allocate(int64_t n) {
  if (n < 0) throw std::invalid_argument("cannot allocate a negative number of blocks: " +
                                         std::to_string(n));
  if (n > num_free()) {
    throw OutOfBlocksError("cannot allocate " + std::to_string(n) + " KV blocks: only " +
                           std::to_string(num_free()) + " of " + std::to_string(num_blocks()) +
                           " are free");
  }
  return pop(n);
}

std::vector<std::vector<int32_t>> BlockAllocator::allocate_batch(
    const std::vector<int64_t>& counts) {
  int64_t total = 0;
  for (size_t i = 0; i < counts.size(); ++i) {
    if (counts[i] < 0) {
      throw std::invalid_argument("counts[" + std::to_string(i) + "] = " +
                                  std::to_string(counts[i]) + " is negative");
    }
    total += counts[i];  // no overflow: each count was a 64-bit int and there are few
  }
  if (total > num_free()) {
    throw OutOfBlocksError("cannot allocate " + std::to_string(total) + " KV blocks for " +
                           std::to_string(counts.size()) + " requests: only " +
                           std::to_string(num_free()) + " of " + std::to_string(num_blocks()) +
                           " are free");
  }
  std::vector<std::vector<int32_t>> out;
  out.reserve(counts.size());
  for (int64_t c : counts) out.push_back(pop(c));
  return out;
}

void BlockAllocator::check_releasable(const std::vector<int64_t>& blocks) const {
  for (const auto& [b, times] : count_ids(blocks)) {
    check_in_range(b);
    const int32_t refs = refs_[static_cast<size_t>(b)];
    if (refs < times) {
      throw std::invalid_argument(
          "double free of KV block " + std::to_string(b) + ": it holds " +
          std::to_string(refs) + " reference(s) but is freed " + std::to_string(times) +
          " time(s)");
    }
  }
}

void BlockAllocator::release(const std::vector<int64_t>& blocks, std::vector<int32_t>& zeroed) {
  for (int64_t b : blocks) {
    if (--refs_[static_cast<size_t>(b)] == 0) zeroed.push_back(static_cast<int32_t>(b));
  }
}

void BlockAllocator::push_freed(const std::vector<int32_t>& zeroed) {
  // Reversed so the next allocation pops them in the order they were freed.
  free_.insert(free_.end(), zeroed.rbegin(), zeroed.rend());
}

void BlockAllocator::free(const std::vector<int64_t>& blocks) {
  check_releasable(blocks);
  std::vector<int32_t> zeroed;
  release(blocks, zeroed);
  push_freed(zeroed);
}

void BlockAllocator::free_batch(const std::vector<std::vector<int64_t>>& lists) {
  std::vector<int64_t> all;
  for (const auto& l : lists) all.insert(all.end(), l.begin(), l.end());
  free(all);
}

void BlockAllocator::incref(const std::vector<int64_t>& blocks) {
  for (const auto& [b, times] : count_ids(blocks)) {
    check_in_range(b);
    const int32_t refs = refs_[static_cast<size_t>(b)];
    if (refs == 0) {
      throw std::invalid_argument("incref of KV block " + std::to_string(b) +
                                  ", which is free (allocate it first)");
    }
    if (static_cast<int64_t>(refs) + times > std::numeric_limits<int32_t>::max()) {
      throw std::overflow_error("reference count of KV block " + std::to_string(b) +
                                " would overflow");
    }
  }
  for (int64_t b : blocks) ++refs_[static_cast<size_t>(b)];
}

int32_t BlockAllocator::ref_count(int64_t block) const {
  check_in_range(block);
  return refs_[static_cast<size_t>(block)];
}

}  // namespace specengine
