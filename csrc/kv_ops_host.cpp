// Host launchers: validate, then run the element routines of kv_ops.h in the same work
// decomposition as the CUDA kernels (so a CPU test covers the GPU's code path too).
#include <stdexcept>
#include <string>
#include <unordered_set>
#include <vector>

#include "kv_ops.h"

namespace specengine {
namespace {

std::string slot_error(const char* what, int64_t i, int64_t slot, int64_t num_slots) {
  return std::string(what) + "[" + std::to_string(i) + "] = " + std::to_string(slot) +
         " is out of range for a cache of " + std::to_string(num_slots) + " slots";
}

template <int VEC>
void reshape_and_cache_loop(const ReshapeAndCacheParams& p) {
  const int64_t vecs = p.num_heads * p.head_bytes / VEC;
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = reshape_and_cache_slot(p, t);
    if (slot < 0) continue;
    for (int64_t v = 0; v < vecs; ++v) reshape_and_cache_element<VEC>(p, t, slot, v);
  }
}

// One iteration of the outer loops is one CUDA thread block's work: a (cache, column) pair
// here stands for the block's columns, which never share bytes.
template <int VEC>
void compact_kv_loop(const CompactKVParams& p) {
  const int64_t cols = p.row_bytes / VEC;
  PendingMove<VEC> pending[kCompactPairsPerStep];
  for (int64_t c = 0; c < p.num_caches; ++c) {
    for (int64_t col = 0; col < cols; ++col) {
      for (int64_t base = 0; base < p.num_pairs; base += kCompactPairsPerStep) {
        int n = 0;
        for (int64_t i = base; i < p.num_pairs && i < base + kCompactPairsPerStep; ++i) {
          pending[n++] = compact_kv_load<VEC>(p, c, i, col);
        }
        for (int k = 0; k < n; ++k) compact_kv_store<VEC>(pending[k]);
      }
    }
  }
}

}  // namespace

// Bounds, distinct destinations and the ordered-moves precondition of kv_ops.h.
void check_compaction(const CompactKVParams& p) {
  std::unordered_set<int64_t> all_dst;  // every destination, moving or not
  std::unordered_set<int64_t> written;  // destinations of earlier pairs that really move
  all_dst.reserve(static_cast<size_t>(p.num_pairs));
  written.reserve(static_cast<size_t>(p.num_pairs));
  for (int64_t i = 0; i < p.num_pairs; ++i) {
    const int64_t src = load_index(p.src_slots, p.slots_are_int64, i);
    const int64_t dst = load_index(p.dst_slots, p.slots_are_int64, i);
    if (src >= p.num_slots) throw std::out_of_range(slot_error("src_slots", i, src, p.num_slots));
    if (dst >= p.num_slots) throw std::out_of_range(slot_error("dst_slots", i, dst, p.num_slots));
    if (src < 0 || dst < 0) continue;
    if (!all_dst.insert(dst).second) {
      throw std::invalid_argument("dst_slots[" + std::to_string(i) + "] = " +
                                  std::to_string(dst) + " repeats an earlier destination");
    }
    if (src == dst) continue;
    if (written.count(src) != 0) {
      throw std::invalid_argument(
          "compact_kv moves must be ordered: pair " + std::to_string(i) + " reads slot " +
          std::to_string(src) + ", which an earlier pair writes (list each accepted path in "
          "path order)");
    }
    written.insert(dst);
  }
}

void reshape_and_cache_host(const ReshapeAndCacheParams& p) {
  for (int64_t t = 0; t < p.num_tokens; ++t) {
    const int64_t slot = load_index(p.slot_mapping, p.slot_mapping_is_int64, t);
    if (slot >= p.num_slots) {
      throw std::out_of_range(slot_error("slot_mapping", t, slot, p.num_slots));
    }
  }
  switch (p.vec_bytes) {
    case 16: return reshape_and_cache_loop<16>(p);
    case 8: return reshape_and_cache_loop<8>(p);
    case 4: return reshape_and_cache_loop<4>(p);
    case 2: return reshape_and_cache_loop<2>(p);
    case 1: return reshape_and_cache_loop<1>(p);
    default: throw std::invalid_argument("vec_bytes must be 1, 2, 4, 8 or 16");
  }
}

void compact_kv_host(const CompactKVParams& p) {
  check_compaction(p);
  switch (p.vec_bytes) {
    case 16: return compact_kv_loop<16>(p);
    case 8: return compact_kv_loop<8>(p);
    case 4: return compact_kv_loop<4>(p);
    case 2: return compact_kv_loop<2>(p);
    case 1: return compact_kv_loop<1>(p);
    default: throw std::invalid_argument("vec_bytes must be 1, 2, 4, 8 or 16");
  }
}

}  // namespace specengine
