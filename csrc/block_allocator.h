// Reference-counted allocator of paged-KV-cache blocks (host side, no Python).
#pragma once

#include <cstdint>
#include <stdexcept>
#include <vector>

namespace specengine {

// Raised when an allocation asks for more blocks than are free; nothing is allocated then.
class OutOfBlocksError : public std::runtime_error {
 public:
  using std::runtime_error::runtime_error;
};

// Hands out block ids in [0, num_blocks) with a reference count per block.
//
// Order is deterministic and LIFO: the free list is a stack, a fresh allocator hands out
// 0, 1, 2, ... and the blocks that one free() call returns to the free list come back, in the
// order they were passed, from the next allocation (recently used blocks are reused first).
//
// Every mutating call validates its whole input before changing anything, so a call that
// throws leaves the allocator exactly as it was. Invalid ids and double frees throw
// std::invalid_argument (ValueError in Python); exhaustion throws OutOfBlocksError.
class BlockAllocator {
 public:
  explicit BlockAllocator(int64_t num_blocks);

  // n fresh blocks (reference count 1 each), all or nothing.
  std::vector<int32_t> allocate(int64_t n);
  // One list per count, all or nothing: either every list is allocated or none is.
  std::vector<std::vector<int32_t>> allocate_batch(const std::vector<int64_t>& counts);

  // Drops one reference per occurrence; blocks reaching 0 return to the free list.
  void free(const std::vector<int64_t>& blocks);
  // free() over several lists, validated as one call.
  void free_batch(const std::vector<std::vector<int64_t>>& lists);
  // Adds one reference per occurrence (sharing a block, e.g. a forked prefix).
  void incref(const std::vector<int64_t>& blocks);

  int32_t ref_count(int64_t block) const;
  const std::vector<int32_t>& ref_counts() const { return refs_; }
  int64_t num_free() const { return static_cast<int64_t>(free_.size()); }
  int64_t num_blocks() const { return static_cast<int64_t>(refs_.size()); }

  // Every block free again, reference counts 0, order as after construction.
  void reset();

 private:
  void check_in_range(int64_t block) const;
  // Throws unless every id is allocated at least as often as it occurs in `blocks`.
  void check_releasable(const std::vector<int64_t>& blocks) const;
  std::vector<int32_t> pop(int64_t n);
  // Drops the references and returns the blocks that reached 0, in input order.
  void release(const std::vector<int64_t>& blocks, std::vector<int32_t>& zeroed);
  void push_freed(const std::vector<int32_t>& zeroed);

  std::vector<int32_t> refs_;  // reference count per block; 0 ⇔ on the free list
  std::vector<int32_t> free_;  // stack: back() is handed out next
};

}  // namespace specengine
