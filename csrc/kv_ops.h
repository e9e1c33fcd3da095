// KV-cache writes and accepted-path compaction: the element routines shared by the host loops
// (kv_ops_host.cpp) and the CUDA kernels (kv_ops.cu), so the CPU tests exercise the exact code
// the GPU runs. Plain C++17 as well as CUDA: no Python, no torch, no CUDA headers needed.
//
// Everything works on raw bytes (the element size only scales strides), so one instantiation
// serves fp32, fp16, bf16 and fp8 alike. Copies move VEC bytes at a time, VEC in {1,2,4,8,16},
// chosen by choose_vec_bytes() so that every address the routines touch is VEC-aligned.
//
// Layout (docs/design.md §5): each cache is a contiguous [num_blocks, block_size, Hkv, D] tensor,
// i.e. num_slots rows of row_bytes = Hkv * D * elem_size bytes, slot-major.
#pragma once

#include <cstdint>
#include <cstring>

#if defined(__CUDACC__)
#define SPECENGINE_HD __host__ __device__ __forceinline__
#else
#define SPECENGINE_HD inline
#endif

namespace specengine {

// ---------------------------------------------------------------------------------------------
// VEC-byte loads and stores
// ---------------------------------------------------------------------------------------------

template <int N>
struct Vec;
template <>
struct alignas(16) Vec<16> {
  uint32_t w[4];
};
template <>
struct alignas(8) Vec<8> {
  uint32_t w[2];
};
template <>
struct Vec<4> {
  uint32_t w;
};
template <>
struct Vec<2> {
  uint16_t w;
};
template <>
struct Vec<1> {
  uint8_t w;
};

// On the device an aligned dereference gives one vector load/store instruction; on the host
// memcpy of a constant size compiles to the same and keeps strict aliasing intact.
template <int N>
SPECENGINE_HD Vec<N> load_vec(const uint8_t* src) {
#if defined(__CUDA_ARCH__)
  return *reinterpret_cast<const Vec<N>*>(src);
#else
  Vec<N> v;
  std::memcpy(&v, src, N);
  return v;
#endif
}

template <int N>
SPECENGINE_HD void store_vec(uint8_t* dst, const Vec<N>& v) {
#if defined(__CUDA_ARCH__)
  *reinterpret_cast<Vec<N>*>(dst) = v;
#else
  std::memcpy(dst, &v, N);
#endif
}

// Slot indices come as int32 or int64 tensors; reading either avoids a conversion launch.
SPECENGINE_HD int64_t load_index(const void* base, bool is_int64, int64_t i) {
  return is_int64 ? static_cast<const int64_t*>(base)[i]
                  : static_cast<int64_t>(static_cast<const int32_t*>(base)[i]);
}

// Largest power of two <= 16 dividing every value (addresses, byte strides, row sizes).
inline int choose_vec_bytes(const uint64_t* values, int n) {
  uint64_t acc = 16;
  for (int i = 0; i < n; ++i) acc |= values[i];
  return static_cast<int>(acc & (~acc + 1));  // lowest set bit, at most 16
}

// ---------------------------------------------------------------------------------------------
// reshape_and_cache: key/value [T, Hkv, D] (any token and head stride, unit stride along D)
// scattered into slot_mapping[t] of k_cache/v_cache; a negative slot skips the token.
// ---------------------------------------------------------------------------------------------

struct ReshapeAndCacheParams {
  const uint8_t* key;
  const uint8_t* value;
  uint8_t* k_cache;
  uint8_t* v_cache;
  const void* slot_mapping;  // [num_tokens], int32 or int64
  bool slot_mapping_is_int64;
  int64_t num_tokens;
  int64_t num_heads;
  int64_t head_bytes;  // head_dim * elem_size
  int64_t key_token_stride, key_head_stride;  // bytes
  int64_t value_token_stride, value_head_stride;  // bytes
  int64_t num_slots;  // num_blocks * block_size
  int vec_bytes;  // from reshape_and_cache_vec_bytes()
};

// Widest VEC that keeps every address reshape_and_cache_element forms aligned.
inline int reshape_and_cache_vec_bytes(const ReshapeAndCacheParams& p) {
  const uint64_t v[] = {reinterpret_cast<uintptr_t>(p.key),
                        reinterpret_cast<uintptr_t>(p.value),
                        reinterpret_cast<uintptr_t>(p.k_cache),
                        reinterpret_cast<uintptr_t>(p.v_cache),
                        static_cast<uint64_t>(p.head_bytes),
                        static_cast<uint64_t>(p.key_token_stride),
                        static_cast<uint64_t>(p.key_head_stride),
                        static_cast<uint64_t>(p.value_token_stride),
                        static_cast<uint64_t>(p.value_head_stride)};
  return choose_vec_bytes(v, static_cast<int>(sizeof(v) / sizeof(v[0])));
}

// Slot of `token`, or -1 when it is skipped: negative (padding) or past the cache. The host
// launcher rejects the latter up front; on the device skipping keeps a bad slot from writing
// outside the cache without a host sync to check.
SPECENGINE_HD int64_t reshape_and_cache_slot(const ReshapeAndCacheParams& p, int64_t token) {
  const int64_t slot = load_index(p.slot_mapping, p.slot_mapping_is_int64, token);
  return (slot < 0 || slot >= p.num_slots) ? -1 : slot;
}

// Copies vector `v` (of the num_heads * head_bytes / VEC in a token's row) of `token`'s key and
// value into `slot` of both caches.
template <int VEC>
SPECENGINE_HD void reshape_and_cache_element(const ReshapeAndCacheParams& p, int64_t token,
                                             int64_t slot, int64_t v) {
  const int64_t vecs_per_head = p.head_bytes / VEC;
  const int64_t head = v / vecs_per_head;
  const int64_t offset = (v - head * vecs_per_head) * VEC;
  const int64_t dst = (slot * p.num_heads + head) * p.head_bytes + offset;
  store_vec<VEC>(p.k_cache + dst, load_vec<VEC>(p.key + token * p.key_token_stride +
                                                head * p.key_head_stride + offset));
  store_vec<VEC>(p.v_cache + dst, load_vec<VEC>(p.value + token * p.value_token_stride +
                                                head * p.value_head_stride + offset));
}

// ---------------------------------------------------------------------------------------------
// compact_kv: for every cache (all layers' K and V, one launch), copy slot src_slots[i] to slot
// dst_slots[i]. A pair with a negative slot, or with src == dst, is skipped.
//
// Safe ordering. The reference reads every source before writing any destination. Work is
// split by (cache, VEC column of the row), which touch disjoint bytes, and within one of those
// the pairs go in steps of kCompactPairsPerStep: all loads of a step, a barrier, then all its
// stores. That equals the reference whenever destinations are distinct and the moves are
// *ordered*: no pair reads a slot that an earlier pair (lower index) writes, i.e.
// src[i] != dst[j] for every j < i with src[j] != dst[j]. Accepted paths listed sequence by
// sequence, each in path order, always are: within a sequence dst increases and dst <= src,
// and sequences own disjoint slots. The host launcher checks the precondition and throws.
// ---------------------------------------------------------------------------------------------

constexpr int kCompactPairLanes = 8;  // threads along the pair axis (blockDim.y on the device)
constexpr int kCompactPairsPerLane = 4;  // pairs each of those holds in registers per step
constexpr int kCompactPairsPerStep = kCompactPairLanes * kCompactPairsPerLane;

struct CompactKVParams {
  uint8_t* const* caches;  // [num_caches] base pointers: every layer's K, then every layer's V
  int64_t num_caches;
  const void* src_slots;  // [num_pairs], int32 or int64 (same type as dst_slots)
  const void* dst_slots;
  bool slots_are_int64;
  int64_t num_pairs;
  int64_t row_bytes;  // Hkv * D * elem_size
  int64_t num_slots;  // num_blocks * block_size
  int vec_bytes;  // from compact_kv_vec_bytes()
};

// Widest VEC that keeps every address aligned; `cache_ptrs` are the host-side values of
// p.caches (which may live on the device).
inline int compact_kv_vec_bytes(const CompactKVParams& p, const uint64_t* cache_ptrs) {
  const uint64_t row = static_cast<uint64_t>(p.row_bytes);
  int vec = choose_vec_bytes(&row, 1);
  for (int64_t c = 0; c < p.num_caches; ++c) {
    const uint64_t v[] = {static_cast<uint64_t>(vec), cache_ptrs[c]};
    vec = choose_vec_bytes(v, 2);
  }
  return vec;
}

// A loaded source waiting for its store; dst == nullptr when the pair is skipped.
template <int VEC>
struct PendingMove {
  uint8_t* dst;
  Vec<VEC> value;
};

// Phase one for (cache, pair, column): read the source vector. Out-of-range slots are skipped
// for the same reason as in reshape_and_cache_slot.
template <int VEC>
SPECENGINE_HD PendingMove<VEC> compact_kv_load(const CompactKVParams& p, int64_t cache,
                                               int64_t pair, int64_t col) {
  PendingMove<VEC> m;
  m.dst = nullptr;
  const int64_t src = load_index(p.src_slots, p.slots_are_int64, pair);
  const int64_t dst = load_index(p.dst_slots, p.slots_are_int64, pair);
  if (src < 0 || dst < 0 || src == dst || src >= p.num_slots || dst >= p.num_slots) return m;
  uint8_t* base = p.caches[cache];
  m.value = load_vec<VEC>(base + src * p.row_bytes + col * VEC);
  m.dst = base + dst * p.row_bytes + col * VEC;
  return m;
}

// Phase two: write what compact_kv_load read.
template <int VEC>
SPECENGINE_HD void compact_kv_store(const PendingMove<VEC>& m) {
  if (m.dst != nullptr) store_vec<VEC>(m.dst, m.value);
}

// ---------------------------------------------------------------------------------------------
// Launchers. Host versions validate and loop over the element routines; CUDA versions launch
// kernels that call them on `stream` (a cudaStream_t passed as an integer) and throw
// std::runtime_error when the launch fails.
// ---------------------------------------------------------------------------------------------

// Throws std::out_of_range when a slot is >= num_slots (nothing is written then).
void reshape_and_cache_host(const ReshapeAndCacheParams& p);
// Throws std::out_of_range for a slot >= num_slots and std::invalid_argument for duplicate
// destinations or moves that are not ordered (see above); nothing is written then.
void compact_kv_host(const CompactKVParams& p);
// The checks of compact_kv_host alone, on host slot arrays (p.caches is not read): what the
// CUDA launcher runs first when the slots come from the host.
void check_compaction(const CompactKVParams& p);

#if defined(SPECENGINE_WITH_CUDA) || defined(__CUDACC__)
void reshape_and_cache_cuda(const ReshapeAndCacheParams& p, uintptr_t stream);
// p.caches must point to device memory holding the base pointers.
void compact_kv_cuda(const CompactKVParams& p, uintptr_t stream);
#endif

}  // namespace specengine
