// The pybind11 module specengine._C: block allocator, step metadata and the KV-op launchers.
//
// KV launchers take raw addresses (tensor.data_ptr()), sizes and strides in elements, never
// tensors, so the module needs no torch at build time; kernels/kv_cache.py validates the
// tensors and calls them.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <sstream>
#include <string>
#include <vector>

#include "block_allocator.h"
#include "kv_ops.h"
#include "step_metadata.h"

namespace specengine {
void bind_host_step(pybind11::module_& m);  // host_step_py.cpp
void bind_suffix_cache(pybind11::module_& m);  // suffix_cache_py.cpp
}  // namespace specengine

namespace py = pybind11;
using specengine::BlockAllocator;

namespace {

using Int64Array = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Any integer array-like (numpy array, CPU tensor, list) as a C-contiguous int64 array. The
// dtype check keeps forcecast from silently truncating floats; empty inputs (np.asarray([]) is
// float64) are accepted whatever their dtype.
Int64Array int64_array(py::handle obj, const std::string& name, int ndim) {
  py::array arr = py::array::ensure(obj);
  if (!arr) throw py::type_error(name + " must be an integer array");
  const char kind = arr.dtype().kind();
  if (arr.size() > 0 && kind != 'i' && kind != 'u') {
    throw py::type_error(name + " must hold integers, got dtype " +
                         py::str(arr.dtype()).cast<std::string>());
  }
  if (arr.ndim() != ndim && !(arr.size() == 0 && ndim == 1)) {
    throw py::value_error(name + " must be " + std::to_string(ndim) + "-D, got " +
                          std::to_string(arr.ndim()) + "-D");
  }
  return Int64Array::ensure(arr);
}

std::vector<int64_t> int64_vector(py::handle obj, const std::string& name) {
  Int64Array a = int64_array(obj, name, 1);
  return std::vector<int64_t>(a.data(), a.data() + a.size());
}

template <typename T>
py::array_t<T> to_numpy(const std::vector<T>& v) {
  return py::array_t<T>(static_cast<py::ssize_t>(v.size()), v.data());
}

void bind_allocator(py::module_& m) {
  py::register_exception<specengine::OutOfBlocksError>(m, "OutOfBlocksError",
                                                       PyExc_RuntimeError);
  py::class_<BlockAllocator>(m, "BlockAllocator", R"doc(
Reference-counted allocator of KV-cache blocks ``0 .. num_blocks - 1``.

LIFO and deterministic: a fresh allocator hands out 0, 1, 2, ...; the blocks one ``free`` call
releases come back, in the order they were passed, from the next allocation. Every call checks
its whole input before changing anything: ``OutOfBlocksError`` (a ``RuntimeError``) when too few
blocks are free, ``ValueError`` for out-of-range ids and double frees.
)doc")
      .def(py::init<int64_t>(), py::arg("num_blocks"))
      .def(
          "allocate",
          [](BlockAllocator& a, int64_t n) { return to_numpy(a.allocate(n)); }, py::arg("n"),
          "``n`` fresh blocks (reference count 1) as an int32 array, all or nothing.")
      .def(
          "allocate_batch",
          [](BlockAllocator& a, py::handle counts) {
            py::list out;
            for (const auto& blocks : a.allocate_batch(int64_vector(counts, "counts"))) {
              out.append(to_numpy(blocks));
            }
            return out;
          },
          py::arg("counts"), "One int32 array per count; every request succeeds or none does.")
      .def(
          "free", [](BlockAllocator& a, py::handle blocks) { a.free(int64_vector(blocks, "blocks")); },
          py::arg("blocks"),
          "Drop one reference per occurrence; blocks reaching 0 return to the free list.")
      .def(
          "free_batch",
          [](BlockAllocator& a, py::iterable lists) {
            std::vector<std::vector<int64_t>> all;
            for (py::handle l : lists) all.push_back(int64_vector(l, "blocks"));
            a.free_batch(all);
          },
          py::arg("lists"), "``free`` of several arrays, validated as a whole first.")
      .def(
          "incref", [](BlockAllocator& a, py::handle blocks) { a.incref(int64_vector(blocks, "blocks")); },
          py::arg("blocks"), "Add one reference per occurrence to allocated blocks (sharing).")
      .def("ref_count", &BlockAllocator::ref_count, py::arg("block"))
      .def(
          "ref_counts", [](const BlockAllocator& a) { return to_numpy(a.ref_counts()); },
          "Reference count of every block (int32 array, a copy).")
      .def("reset", &BlockAllocator::reset, "Free every block; as freshly constructed.")
      .def_property_readonly("num_free", &BlockAllocator::num_free)
      .def_property_readonly("num_blocks", &BlockAllocator::num_blocks)
      .def("__repr__", [](const BlockAllocator& a) {
        std::ostringstream s;
        s << "BlockAllocator(num_blocks=" << a.num_blocks() << ", num_free=" << a.num_free()
          << ")";
        return s.str();
      });
}

void bind_step_metadata(py::module_& m) {
  m.def(
      "compute_slot_mapping",
      [](py::handle block_tables, py::handle seq_ids, py::handle positions, int64_t block_size) {
        Int64Array tables = int64_array(block_tables, "block_tables", 2);
        Int64Array seqs = int64_array(seq_ids, "seq_ids", 1);
        Int64Array pos = int64_array(positions, "positions", 1);
        if (seqs.size() != pos.size()) {
          throw py::value_error("seq_ids and positions differ in length: " +
                                std::to_string(seqs.size()) + " vs " +
                                std::to_string(pos.size()));
        }
        const int64_t rows = tables.ndim() == 2 ? tables.shape(0) : 0;
        const int64_t cols = tables.ndim() == 2 ? tables.shape(1) : 0;
        return to_numpy(specengine::compute_slot_mapping(tables.data(), rows, cols, seqs.data(),
                                                         pos.data(), seqs.size(), block_size));
      },
      py::arg("block_tables"), py::arg("seq_ids"), py::arg("positions"), py::arg("block_size"),
      R"doc(
Cache slot of every token as an int64 array ``[T]`` (``kernels.reference.slot_mapping``):
``block_tables[seq_ids[i], positions[i] // block_size] * block_size + positions[i] % block_size``.

``seq_ids[i] == -1`` marks a padding token and gives slot -1. Every index is bounds-checked:
``ValueError`` names the first bad token (sequence out of range, negative position, position
past the table, or a padded table entry).
)doc");
  m.def(
      "build_block_tables",
      [](py::iterable tables, int64_t max_blocks) {
        std::vector<std::vector<int64_t>> rows;
        for (py::handle t : tables) rows.push_back(int64_vector(t, "block table"));
        std::vector<int32_t> flat = specengine::build_block_tables(rows, max_blocks);
        py::array_t<int32_t> out({static_cast<py::ssize_t>(rows.size()),
                                  static_cast<py::ssize_t>(max_blocks)});
        std::copy(flat.begin(), flat.end(), out.mutable_data());
        return out;
      },
      py::arg("tables"), py::arg("max_blocks"),
      R"doc(
Stack per-sequence block lists into an int32 ``[B, max_blocks]`` array padded with -1.

-1 rather than 0 because block 0 is a real block: a kernel reading past a sequence's blocks
would silently use another sequence's KV, while -1 makes the bug loud. ``ValueError`` when a
list is longer than ``max_blocks`` or holds an invalid id.
)doc");
  m.attr("block_table_pad") = specengine::kBlockTablePad;
}

specengine::ReshapeAndCacheParams reshape_params(uintptr_t key, uintptr_t value,
                                                 uintptr_t k_cache, uintptr_t v_cache,
                                                 uintptr_t slot_mapping, bool slots_int64,
                                                 int64_t num_tokens, int64_t num_heads,
                                                 int64_t head_dim, int64_t elem_size,
                                                 int64_t key_stride_token, int64_t key_stride_head,
                                                 int64_t value_stride_token,
                                                 int64_t value_stride_head, int64_t num_slots) {
  specengine::ReshapeAndCacheParams p{};
  p.key = reinterpret_cast<const uint8_t*>(key);
  p.value = reinterpret_cast<const uint8_t*>(value);
  p.k_cache = reinterpret_cast<uint8_t*>(k_cache);
  p.v_cache = reinterpret_cast<uint8_t*>(v_cache);
  p.slot_mapping = reinterpret_cast<const void*>(slot_mapping);
  p.slot_mapping_is_int64 = slots_int64;
  p.num_tokens = num_tokens;
  p.num_heads = num_heads;
  p.head_bytes = head_dim * elem_size;
  p.key_token_stride = key_stride_token * elem_size;
  p.key_head_stride = key_stride_head * elem_size;
  p.value_token_stride = value_stride_token * elem_size;
  p.value_head_stride = value_stride_head * elem_size;
  p.num_slots = num_slots;
  p.vec_bytes = specengine::reshape_and_cache_vec_bytes(p);
  return p;
}

specengine::CompactKVParams compact_params(const std::vector<uint64_t>& cache_ptrs,
                                           uintptr_t table, uintptr_t src, uintptr_t dst,
                                           bool slots_int64, int64_t num_pairs,
                                           int64_t num_heads, int64_t head_dim,
                                           int64_t elem_size, int64_t num_slots) {
  specengine::CompactKVParams p{};
  p.caches = reinterpret_cast<uint8_t* const*>(table);
  p.num_caches = static_cast<int64_t>(cache_ptrs.size());
  p.src_slots = reinterpret_cast<const void*>(src);
  p.dst_slots = reinterpret_cast<const void*>(dst);
  p.slots_are_int64 = slots_int64;
  p.num_pairs = num_pairs;
  p.row_bytes = num_heads * head_dim * elem_size;
  p.num_slots = num_slots;
  p.vec_bytes = specengine::compact_kv_vec_bytes(p, cache_ptrs.data());
  return p;
}

#define SPECENGINE_RESHAPE_ARGS                                                             \
  py::arg("key_ptr"), py::arg("value_ptr"), py::arg("k_cache_ptr"), py::arg("v_cache_ptr"), \
      py::arg("slot_mapping_ptr"), py::arg("slot_mapping_is_int64"), py::arg("num_tokens"), \
      py::arg("num_heads"), py::arg("head_dim"), py::arg("elem_size"),                      \
      py::arg("key_stride_token"), py::arg("key_stride_head"),                              \
      py::arg("value_stride_token"), py::arg("value_stride_head"), py::arg("num_slots")

void bind_kv_ops(py::module_& m) {
  m.def(
      "reshape_and_cache_host",
      [](uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t slots,
         bool slots_int64, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
         int64_t elem_size, int64_t kst, int64_t ksh, int64_t vst, int64_t vsh,
         int64_t num_slots) {
        const auto p = reshape_params(key, value, k_cache, v_cache, slots, slots_int64,
                                      num_tokens, num_heads, head_dim, elem_size, kst, ksh, vst,
                                      vsh, num_slots);
        py::gil_scoped_release nogil;
        specengine::reshape_and_cache_host(p);
      },
      SPECENGINE_RESHAPE_ARGS,
      "Host reshape_and_cache on raw CPU addresses (strides in elements). IndexError for a slot "
      ">= num_slots; negative slots are skipped. Use kernels.kv_cache.reshape_and_cache.");
  m.def(
      "compact_kv_host",
      [](const std::vector<uint64_t>& cache_ptrs, uintptr_t src, uintptr_t dst,
         bool slots_int64, int64_t num_pairs, int64_t num_heads, int64_t head_dim,
         int64_t elem_size, int64_t num_slots) {
        std::vector<uint8_t*> table;
        for (uint64_t ptr : cache_ptrs) table.push_back(reinterpret_cast<uint8_t*>(ptr));
        const auto p = compact_params(cache_ptrs, reinterpret_cast<uintptr_t>(table.data()), src,
                                      dst, slots_int64, num_pairs, num_heads, head_dim,
                                      elem_size, num_slots);
        py::gil_scoped_release nogil;
        specengine::compact_kv_host(p);
      },
      py::arg("cache_ptrs"), py::arg("src_slots_ptr"), py::arg("dst_slots_ptr"),
      py::arg("slots_are_int64"), py::arg("num_pairs"), py::arg("num_heads"),
      py::arg("head_dim"), py::arg("elem_size"), py::arg("num_slots"),
      "Host compact_kv over caches at `cache_ptrs` (every layer's K then V). IndexError for a "
      "slot >= num_slots, ValueError for repeated destinations or unordered moves. Use "
      "kernels.kv_cache.compact_kv.");
  m.def(
      "check_compact_kv",
      [](uintptr_t src, uintptr_t dst, bool slots_int64, int64_t num_pairs, int64_t num_slots) {
        specengine::CompactKVParams p{};
        p.src_slots = reinterpret_cast<const void*>(src);
        p.dst_slots = reinterpret_cast<const void*>(dst);
        p.slots_are_int64 = slots_int64;
        p.num_pairs = num_pairs;
        p.num_slots = num_slots;
        py::gil_scoped_release nogil;
        specengine::check_compaction(p);
      },
      py::arg("src_slots_ptr"), py::arg("dst_slots_ptr"), py::arg("slots_are_int64"),
      py::arg("num_pairs"), py::arg("num_slots"),
      "compact_kv_host's checks alone on host slot arrays: IndexError for a slot >= num_slots, "
      "ValueError for repeated destinations or unordered moves. The CUDA launcher runs it on "
      "slots that come from the host (on the device they cannot be checked without a sync).");
#if defined(SPECENGINE_WITH_CUDA)
  m.def(
      "reshape_and_cache_cuda",
      [](uintptr_t key, uintptr_t value, uintptr_t k_cache, uintptr_t v_cache, uintptr_t slots,
         bool slots_int64, int64_t num_tokens, int64_t num_heads, int64_t head_dim,
         int64_t elem_size, int64_t kst, int64_t ksh, int64_t vst, int64_t vsh,
         int64_t num_slots, uintptr_t stream) {
        const auto p = reshape_params(key, value, k_cache, v_cache, slots, slots_int64,
                                      num_tokens, num_heads, head_dim, elem_size, kst, ksh, vst,
                                      vsh, num_slots);
        py::gil_scoped_release nogil;
        specengine::reshape_and_cache_cuda(p, stream);
      },
      SPECENGINE_RESHAPE_ARGS, py::arg("stream"),
      "CUDA reshape_and_cache on device addresses, launched on `stream` (a cudaStream_t as "
      "int). Slots out of range are skipped, not reported (no host sync).");
  m.def(
      "compact_kv_cuda",
      [](const std::vector<uint64_t>& cache_ptrs, uintptr_t table, uintptr_t src, uintptr_t dst,
         bool slots_int64, int64_t num_pairs, int64_t num_heads, int64_t head_dim,
         int64_t elem_size, int64_t num_slots, uintptr_t stream) {
        const auto p = compact_params(cache_ptrs, table, src, dst, slots_int64, num_pairs,
                                      num_heads, head_dim, elem_size, num_slots);
        py::gil_scoped_release nogil;
        specengine::compact_kv_cuda(p, stream);
      },
      py::arg("cache_ptrs"), py::arg("cache_ptr_table"), py::arg("src_slots_ptr"),
      py::arg("dst_slots_ptr"), py::arg("slots_are_int64"), py::arg("num_pairs"),
      py::arg("num_heads"), py::arg("head_dim"), py::arg("elem_size"), py::arg("num_slots"),
      py::arg("stream"),
      "CUDA compact_kv, one launch for all caches. `cache_ptr_table` is the device address of "
      "an int64 copy of `cache_ptrs`. The ordered-moves precondition is not checked here.");
#endif
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "specengine C++/CUDA extension: KV block allocator, step metadata, KV-cache ops.";
  bind_allocator(m);
  bind_step_metadata(m);
  bind_kv_ops(m);
  specengine::bind_host_step(m);
  specengine::bind_suffix_cache(m);
#if defined(SPECENGINE_WITH_CUDA)
  m.attr("has_cuda_kernels") = true;
  m.attr("cuda_archs") = py::tuple(py::str(SPECENGINE_CUDA_ARCH_LIST).attr("split")(","));
#else
  m.attr("has_cuda_kernels") = false;
  m.attr("cuda_archs") = py::tuple();
#endif
}
