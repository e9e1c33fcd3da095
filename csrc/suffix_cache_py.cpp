// Python binding of the suffix drafter's cache (suffix_cache.h): numpy arrays in, numpy out.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>

#include "suffix_cache.h"

namespace py = pybind11;

namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// An integer array-like as a C-contiguous int64 array of `ndim` dimensions (read only, so a
// converted copy is fine; floats are refused rather than truncated).
I64 ints(py::handle obj, const char* name, int ndim) {
  py::array arr = py::array::ensure(obj);
  if (!arr) throw py::type_error(std::string(name) + " must be an integer array");
  const char kind = arr.dtype().kind();
  if (arr.size() > 0 && kind != 'i' && kind != 'u') {
    throw py::type_error(std::string(name) + " must hold integers, got dtype " +
                         py::str(arr.dtype()).cast<std::string>());
  }
  if (arr.ndim() != ndim && !(arr.size() == 0 && ndim == 1)) {
    throw py::value_error(std::string(name) + " must be " + std::to_string(ndim) + "-D, got " +
                          std::to_string(arr.ndim()) + "-D");
  }
  return I64::ensure(arr);
}

struct Source {
  I64 tokens, rows, lens, num_prompt, seq_ids;
  specengine::TokenSource view() const {
    const int64_t b = seq_ids.size();
    if (rows.size() != b || lens.size() != b || num_prompt.size() != b) {
      throw py::value_error("SuffixCache: rows, lens, num_prompt and seq_ids must have one "
                            "entry per sequence (" + std::to_string(b) + ")");
    }
    return {tokens.data(), tokens.ndim() == 2 ? tokens.shape(0) : 0,
            tokens.ndim() == 2 ? tokens.shape(1) : 0, rows.data(), lens.data(),
            num_prompt.data(), seq_ids.data(), b};
  }
};

Source source(py::handle tokens, py::handle rows, py::handle lens, py::handle num_prompt,
              py::handle seq_ids) {
  return {ints(tokens, "tokens", 2), ints(rows, "rows", 1), ints(lens, "lens", 1),
          ints(num_prompt, "num_prompt", 1), ints(seq_ids, "seq_ids", 1)};
}

}  // namespace

namespace specengine {

void bind_suffix_cache(py::module_& m) {
  py::class_<SuffixCache>(m, "SuffixCache", R"doc(
The suffix drafter's per-prompt and global suffix tries and its proposal, a batch per call
(specengine/drafters/suffix_index.py is the specification: ``SuffixCacheRef`` takes the same
calls and gives the same results). Sequence b's tokens are ``tokens[rows[b], :lens[b]]``, the
first ``num_prompt[b]`` its prompt.
)doc")
      .def(py::init([](int32_t max_depth, int64_t max_tokens, int64_t global_tokens,
                       int64_t prompt_tokens, double min_prob, double smoothing,
                       double spec_factor, double spec_offset, double open_weight) {
             return new SuffixCache({max_depth, max_tokens, global_tokens, prompt_tokens,
                                     min_prob, smoothing, spec_factor, spec_offset,
                                     open_weight});
           }),
           py::arg("max_depth"), py::arg("max_tokens"), py::arg("global_tokens"),
           py::arg("prompt_tokens"), py::arg("min_prob"), py::arg("smoothing"),
           py::arg("spec_factor"), py::arg("spec_offset"), py::arg("open_weight") = 0.0)
      .def(
          "sync",
          [](SuffixCache& c, py::handle tokens, py::handle rows, py::handle lens,
             py::handle num_prompt, py::handle seq_ids) {
            Source s = source(tokens, rows, lens, num_prompt, seq_ids);
            c.sync(s.view());
          },
          py::arg("tokens"), py::arg("rows"), py::arg("lens"), py::arg("num_prompt"),
          py::arg("seq_ids"), "Index every sequence's new tokens.")
      .def(
          "propose",
          [](SuffixCache& c, py::handle tokens, py::handle rows, py::handle lens,
             py::handle num_prompt, py::handle seq_ids, py::handle num_drafts) {
            Source s = source(tokens, rows, lens, num_prompt, seq_ids);
            specengine::TokenSource v = s.view();
            I64 want = ints(num_drafts, "num_drafts", 1);
            if (want.size() != v.batch) {
              throw py::value_error("SuffixCache.propose: num_drafts needs one entry per "
                                    "sequence");
            }
            int64_t width = 0;
            for (int64_t b = 0; b < v.batch; ++b) width = std::max(width, want.data()[b]);
            py::array_t<int64_t> ids({v.batch, width}), counts(v.batch), match(v.batch),
                flags(v.batch);
            py::array_t<double> probs({v.batch, width});
            c.propose(v, want.data(), width, ids.mutable_data(), counts.mutable_data(),
                      probs.mutable_data(), match.mutable_data(), flags.mutable_data());
            return py::make_tuple(ids, counts, probs, match, flags);
          },
          py::arg("tokens"), py::arg("rows"), py::arg("lens"), py::arg("num_prompt"),
          py::arg("seq_ids"), py::arg("num_drafts"),
          "Catch up, then each sequence's chain: ``(ids [B, W], counts [B], probs [B, W], "
          "match_len [B], flags [B])``; flags bit 0: global trie, bit 1: backed off.")
      .def(
          "propose_tree",
          [](SuffixCache& c, py::handle tokens, py::handle rows, py::handle lens,
             py::handle num_prompt, py::handle seq_ids, py::handle parents, py::handle ranks,
             int64_t depth) {
            Source s = source(tokens, rows, lens, num_prompt, seq_ids);
            specengine::TokenSource v = s.view();
            I64 par = ints(parents, "parents", 1), rk = ints(ranks, "ranks", 1);
            if (par.size() != rk.size()) {
              throw py::value_error("SuffixCache.propose_tree: parents and ranks differ in "
                                    "length");
            }
            const int64_t w = std::max<int64_t>(par.size() - 1, 0);
            py::array_t<int64_t> ids({v.batch, w});
            c.propose_tree(v, par.data(), rk.data(), par.size(), depth, ids.mutable_data());
            return ids;
          },
          py::arg("tokens"), py::arg("rows"), py::arg("lens"), py::arg("num_prompt"),
          py::arg("seq_ids"), py::arg("parents"), py::arg("ranks"), py::arg("depth"),
          "Catch up, then tree drafts ``[B, N - 1]``.")
      .def(
          "release",
          [](SuffixCache& c, int64_t seq_id, py::handle tokens, int64_t num_prompt,
             bool finished) {
            I64 t = ints(tokens, "tokens", 1);
            c.release(seq_id, t.data(), t.size(), num_prompt, finished);
          },
          py::arg("seq_id"), py::arg("tokens"), py::arg("num_prompt"), py::arg("finished"),
          "The sequence left the batch (its documents become evictable; a finished one's "
          "record goes).")
      .def_property_readonly("num_tokens", &SuffixCache::num_tokens)
      .def_property_readonly("num_global_tokens", &SuffixCache::num_global_tokens)
      .def_property_readonly("num_prompts", &SuffixCache::num_prompts)
      .def_property_readonly("num_seqs", &SuffixCache::num_seqs);
}

}  // namespace specengine
