// CUDA launchers for the KV element routines of kv_ops.h. Free of pybind11/Python so that CI can
// compile it alone with nvcc (.ci/compile_cuda.sh).
#include <cuda_runtime.h>

#include <algorithm>
#include <stdexcept>
#include <string>

#include "kv_ops.h"

namespace specengine {
namespace {

// One block per token (grid-strided), threads across the token's Hkv * D row.
template <int VEC>
__global__ void reshape_and_cache_kernel(ReshapeAndCacheParams p) {
  const int64_t vecs = p.num_heads * p.head_bytes / VEC;
  for (int64_t t = blockIdx.x; t < p.num_tokens; t += gridDim.x) {
    const int64_t slot = reshape_and_cache_slot(p, t);
    if (slot < 0) continue;
    for (int64_t v = threadIdx.x; v < vecs; v += blockDim.x) {
      reshape_and_cache_element<VEC>(p, t, slot, v);
    }
  }
}

// Block (x, y) = (group of row columns, cache); threadIdx.x picks the column, so a warp reads
// and writes contiguous bytes of one row, and threadIdx.y spreads a step's pairs. The barrier
// between a step's loads and its stores is what makes overlapping moves safe (kv_ops.h).
template <int VEC>
__global__ void __launch_bounds__(32 * kCompactPairLanes) compact_kv_kernel(CompactKVParams p) {
  const int64_t cols = p.row_bytes / VEC;
  const int64_t col = static_cast<int64_t>(blockIdx.x) * blockDim.x + threadIdx.x;
  const int64_t cache = blockIdx.y;
  const bool active = col < cols;
  for (int64_t base = 0; base < p.num_pairs; base += kCompactPairsPerStep) {
    PendingMove<VEC> pending[kCompactPairsPerLane];
#pragma unroll
    for (int r = 0; r < kCompactPairsPerLane; ++r) {
      const int64_t pair = base + r * kCompactPairLanes + threadIdx.y;
      pending[r].dst = nullptr;
      if (active && pair < p.num_pairs) pending[r] = compact_kv_load<VEC>(p, cache, pair, col);
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < kCompactPairsPerLane; ++r) compact_kv_store<VEC>(pending[r]);
  }
}

void check_launch(const char* what) {
  const cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) {
    throw std::runtime_error(std::string(what) + " launch failed: " + cudaGetErrorString(err));
  }
}

template <int VEC>
void launch_reshape_and_cache(const ReshapeAndCacheParams& p, cudaStream_t stream) {
  const int64_t vecs = p.num_heads * p.head_bytes / VEC;
  const int threads = static_cast<int>(std::min<int64_t>(256, (vecs + 31) / 32 * 32));
  const auto blocks = static_cast<unsigned>(std::min<int64_t>(p.num_tokens, 1 << 20));
  reshape_and_cache_kernel<VEC><<<blocks, threads, 0, stream>>>(p);
  check_launch("reshape_and_cache");
}

template <int VEC>
void launch_compact_kv(const CompactKVParams& p, cudaStream_t stream) {
  const int64_t cols = p.row_bytes / VEC;
  int width = 1;
  while (width < 32 && width < cols) width *= 2;  // small rows: fewer idle threads per block
  const dim3 threads(width, kCompactPairLanes);
  const dim3 blocks(static_cast<unsigned>((cols + width - 1) / width),
                    static_cast<unsigned>(p.num_caches));
  compact_kv_kernel<VEC><<<blocks, threads, 0, stream>>>(p);
  check_launch("compact_kv");
}

}  // namespace

void reshape_and_cache_cuda(const ReshapeAndCacheParams& p, uintptr_t stream) {
  if (p.num_tokens == 0) return;
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (p.vec_bytes) {
    case 16: return launch_reshape_and_cache<16>(p, s);
    case 8: return launch_reshape_and_cache<8>(p, s);
    case 4: return launch_reshape_and_cache<4>(p, s);
    case 2: return launch_reshape_and_cache<2>(p, s);
    case 1: return launch_reshape_and_cache<1>(p, s);
    default: throw std::invalid_argument("vec_bytes must be 1, 2, 4, 8 or 16");
  }
}

void compact_kv_cuda(const CompactKVParams& p, uintptr_t stream) {
  if (p.num_pairs == 0 || p.num_caches == 0) return;
  if (p.num_caches > 65535) {
    throw std::invalid_argument("compact_kv supports at most 65535 caches (K and V of every "
                                "layer), got " + std::to_string(p.num_caches));
  }
  const auto s = reinterpret_cast<cudaStream_t>(stream);
  switch (p.vec_bytes) {
    case 16: return launch_compact_kv<16>(p, s);
    case 8: return launch_compact_kv<8>(p, s);
    case 4: return launch_compact_kv<4>(p, s);
    case 2: return launch_compact_kv<2>(p, s);
    case 1: return launch_compact_kv<1>(p, s);
    default: throw std::invalid_argument("vec_bytes must be 1, 2, 4, 8 or 16");
  }
}

}  // namespace specengine
