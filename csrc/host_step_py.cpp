// Python bindings of the decode step's host passes (step_append.h, stage_rows.h): numpy
// arrays in, written in place.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <string>
#include <utility>

#include "block_allocator.h"
#include "grow_tables.h"
#include "lm_stage.h"
#include "stage_rows.h"
#include "step_append.h"
#include "tree_path.h"

namespace py = pybind11;

namespace {

// A C-contiguous array of exactly dtype T and `ndim` dimensions, never a converted copy: the
// arena's arrays are written in place, so a silent conversion would lose the writes.
template <typename T>
py::array_t<T> exact(py::handle obj, const char* name, int ndim, bool writable) {
  if (!py::isinstance<py::array>(obj)) {
    throw py::type_error(std::string(name) + " must be a numpy array");
  }
  auto arr = py::reinterpret_borrow<py::array>(obj);
  if (!py::isinstance<py::array_t<T>>(arr) || !(arr.flags() & py::array::c_style)) {
    throw py::type_error(std::string(name) + " must be a C-contiguous " +
                         py::str(py::dtype::of<T>()).cast<std::string>() + " array, got " +
                         py::str(arr.dtype()).cast<std::string>());
  }
  if (arr.ndim() != ndim) {
    throw py::value_error(std::string(name) + " must be " + std::to_string(ndim) + "-D, got " +
                          std::to_string(arr.ndim()) + "-D");
  }
  if (writable && !arr.writeable()) {
    throw py::value_error(std::string(name) + " must be writable");
  }
  return py::reinterpret_borrow<py::array_t<T>>(arr);
}

void same(int64_t got, int64_t want, const char* what) {
  if (got != want) {
    throw py::value_error(std::string(what) + ": got " + std::to_string(got) + ", expected " +
                          std::to_string(want));
  }
}

}  // namespace

namespace specengine {

void bind_host_step(py::module_& m) {
  m.def(
      "append_step",
      [](py::handle tokens, py::handle logprobs, py::handle versions, py::handle lens,
         py::handle limit, py::handle stop_ids, py::handle done, py::handle counters,
         py::handle packed, int64_t num_rows, py::handle slots, py::handle num_drafts,
         py::handle depths, py::handle stats, int64_t version) {
        auto tok = exact<int64_t>(tokens, "tokens", 2, true);
        auto lp = exact<double>(logprobs, "logprobs", 2, true);
        auto ver = exact<int64_t>(versions, "versions", 2, true);
        auto ln = exact<int64_t>(lens, "lens", 1, true);
        auto lim = exact<int64_t>(limit, "limit", 1, false);
        auto stop = exact<int64_t>(stop_ids, "stop_ids", 2, false);
        auto dn = exact<bool>(done, "done", 1, true);
        auto cnt = exact<int64_t>(counters, "counters", 2, true);
        auto pk = exact<double>(packed, "packed", 2, false);
        auto sl = exact<int64_t>(slots, "slots", 1, false);
        auto nd = exact<int64_t>(num_drafts, "num_drafts", 1, false);
        auto dp = exact<int64_t>(depths, "depths", 1, false);
        auto st = exact<int64_t>(stats, "stats", 2, true);
        const int64_t cap = tok.shape(0);
        same(lp.shape(0), cap, "logprobs rows");
        same(lp.shape(1), tok.shape(1), "logprobs width");
        same(ver.shape(0), cap, "versions rows");
        same(ver.shape(1), tok.shape(1), "versions width");
        same(ln.shape(0), cap, "lens length");
        same(lim.shape(0), cap, "limit length");
        same(stop.shape(0), cap, "stop_ids rows");
        same(dn.shape(0), cap, "done length");
        same(cnt.shape(0), 3, "counters rows");
        same(cnt.shape(1), cap, "counters columns");
        same(st.shape(0), 2, "stats rows");
        if (num_rows < 0 || num_rows > pk.shape(0)) {
          throw py::value_error("num_rows " + std::to_string(num_rows) + " outside [0, " +
                                std::to_string(pk.shape(0)) + "]");
        }
        if (pk.shape(1) < 4 || (pk.shape(1) - 1) % 3 != 0) {
          throw py::value_error("packed must be [rows, 3N + 1], got " +
                                std::to_string(pk.shape(1)) + " columns");
        }
        for (const auto* a : {&sl, &nd, &dp}) {
          if (a->shape(0) < num_rows) {
            throw py::value_error("slots, num_drafts and depths need num_rows entries");
          }
        }
        ArenaArrays arena{tok.mutable_data(), lp.mutable_data(), ver.mutable_data(),
                          tok.shape(1),       ln.mutable_data(), lim.data(),
                          stop.data(),        stop.shape(1),     dn.mutable_data(),
                          cnt.mutable_data(), cap};
        PackedStep step{pk.data(), num_rows, (pk.shape(1) - 1) / 3, sl.data(),
                        nd.data(), dp.data(), version};
        AppendResult r;
        try {
          r = append_step(arena, step, st.mutable_data(), st.shape(1));
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
        py::list ended;
        for (size_t i = 0; i < r.ended_rows.size(); ++i) {
          ended.append(py::make_tuple(r.ended_rows[i], static_cast<int>(r.ended_codes[i])));
        }
        return py::make_tuple(r.needed_width, r.num_kept, ended);
      },
      R"doc(
Append one step's packed sampler output (``[rows, 3N + 1]`` float64) to the sequences' arena
in place (``specengine.core.seq_arena.SeqArena.append_packed`` calls it; the reference is
``tests/arena_reference.py``). Returns ``(needed_width, num_kept, [(row, code)])``:
``needed_width > 0`` means the arena is too narrow and nothing changed; code 1 = a stop token,
2 = the length limit.
)doc");
  m.def(
      "stage_rows",
      [](py::handle ints, py::handle limits, py::handle row_slots, int64_t num_rows,
         py::handle lens, py::handle tokens, py::handle num_blocks, py::object num_drafts,
         int64_t k, int64_t tree_drafts, int64_t max_model_len, py::handle block_ids,
         py::handle table, py::handle sent_blocks, py::handle changed, int64_t num_used) {
        auto in = exact<int64_t>(ints, "ints", 2, true);
        auto lim = exact<int64_t>(limits, "limits", 2, false);
        auto sl = exact<int64_t>(row_slots, "row_slots", 1, false);
        auto ln = exact<int64_t>(lens, "lens", 1, false);
        auto tok = exact<int64_t>(tokens, "tokens", 2, false);
        auto nb = exact<int64_t>(num_blocks, "num_blocks", 1, false);
        auto ids = exact<int32_t>(block_ids, "block_ids", 2, false);
        auto tab = exact<int32_t>(table, "table", 2, true);
        auto sent = exact<int64_t>(sent_blocks, "sent_blocks", 1, true);
        auto ch = exact<int64_t>(changed, "changed", 1, false);
        const int64_t cap = in.shape(1);
        if (in.shape(0) < 4) throw py::value_error("ints needs the 4 step-field rows");
        same(lim.shape(0), 2, "limits rows");
        same(lim.shape(1), cap, "limits columns");
        same(tab.shape(0), cap, "table rows");
        same(sent.shape(0), cap, "sent_blocks length");
        if (num_rows < 0 || num_rows > cap || sl.shape(0) < num_rows) {
          throw py::value_error("num_rows " + std::to_string(num_rows) +
                                " exceeds the capacity or row_slots");
        }
        if (num_used < 0 || num_used > cap) throw py::value_error("num_used exceeds the capacity");
        same(ln.shape(0), tok.shape(0), "lens vs tokens rows");
        same(nb.shape(0), tok.shape(0), "num_blocks vs tokens rows");
        same(ids.shape(0), tok.shape(0), "block_ids vs tokens rows");
        const int64_t* drafts = nullptr;
        py::array_t<int64_t> nd;
        if (!num_drafts.is_none()) {
          nd = exact<int64_t>(num_drafts, "num_drafts", 1, false);
          same(nd.shape(0), num_rows, "num_drafts length");
          drafts = nd.data();
        }
        StageInput input{in.mutable_data(), lim.data(),   cap,          sl.data(),
                         num_rows,          ln.data(),    tok.data(),   tok.shape(1),
                         nb.data(),         tok.shape(0), drafts,       k,
                         tree_drafts,       max_model_len, ids.data(),  ids.shape(1),
                         tab.mutable_data(), tab.shape(1), sent.mutable_data(), ch.data(),
                         ch.shape(0),       num_used};
        StageResult r;
        try {
          r = stage_rows(input);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
        return py::make_tuple(r.max_drafts, r.send_rows);
      },
      R"doc(
Write rows ``0 .. num_rows-1`` of the batch state's step fields (CTX, LAST, OFFSET, NUM_DRAFT)
from the arena and plan their drafts (``num_drafts`` given, a tree's ``tree_drafts`` for all,
or a chain of ``k`` cut per row as ``speculate.num_drafts_for``); copy into the block-table
mirror ``table`` the arena rows of the rows that grew (per ``sent_blocks``) or are ``changed``,
and zero rows ``num_rows .. num_used-1``. Returns ``(max drafts, rows of the mirror to send)``
(``core.batch.BatchState.stage_step`` calls it).
)doc");
  m.def(
      "grow_tables",
      [](BlockAllocator& allocator, py::handle slots, int64_t num_rows, py::handle lens,
         py::handle lookahead, py::handle num_blocks, py::handle block_ids,
         int64_t max_model_len, int64_t block_size) {
        auto sl = exact<int64_t>(slots, "slots", 1, false);
        auto ln = exact<int64_t>(lens, "lens", 1, false);
        auto la = exact<int64_t>(lookahead, "lookahead", 1, false);
        auto nb = exact<int64_t>(num_blocks, "num_blocks", 1, true);
        auto ids = exact<int32_t>(block_ids, "block_ids", 2, true);
        if (num_rows < 0 || num_rows > sl.shape(0)) {
          throw py::value_error("num_rows " + std::to_string(num_rows) + " exceeds slots");
        }
        if (block_size < 1) throw py::value_error("block_size must be >= 1");
        same(la.shape(0), ln.shape(0), "lookahead vs lens length");
        same(nb.shape(0), ln.shape(0), "num_blocks vs lens length");
        same(ids.shape(0), ln.shape(0), "block_ids rows vs lens length");
        GrowInput input{sl.data(),        num_rows,     ln.data(),     la.data(),
                        nb.mutable_data(), ids.mutable_data(), ids.shape(1), ln.shape(0),
                        max_model_len,    block_size};
        GrowResult r;
        try {
          r = grow_tables(input, allocator);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
        return py::make_tuple(r.status, r.value);
      },
      R"doc(
Grow the block tables of the sequences in arena ``slots[:num_rows]`` to cover their next
verify step (length + lookahead, capped by ``max_model_len``), all from one allocation.
Returns ``(status, value)``: 0 = done (value: blocks allocated), 1 = short of free blocks
(value: blocks needed), 2 = ``block_ids`` too narrow (value: columns needed); nothing changes
unless 0 (``kv_cache.KVCache.ensure_running`` calls it).
)doc");
  m.def(
      "tree_path_moves",
      [](py::handle packed, int64_t num_rows, py::handle row_slots, py::handle lens,
         py::handle num_blocks, py::handle block_ids, int64_t block_size) {
        auto pk = exact<double>(packed, "packed", 2, false);
        auto sl = exact<int64_t>(row_slots, "row_slots", 1, false);
        auto ln = exact<int64_t>(lens, "lens", 1, false);
        auto nb = exact<int64_t>(num_blocks, "num_blocks", 1, false);
        auto ids = exact<int32_t>(block_ids, "block_ids", 2, false);
        if ((pk.shape(1) - 1) % 3 != 0 || pk.shape(1) < 4) {
          throw py::value_error("packed must be [rows, 3N + 1] with N >= 1");
        }
        if (num_rows < 0 || num_rows > pk.shape(0) || num_rows > sl.shape(0)) {
          throw py::value_error("num_rows " + std::to_string(num_rows) +
                                " exceeds packed or row_slots");
        }
        if (block_size < 1) throw py::value_error("block_size must be >= 1");
        same(nb.shape(0), ln.shape(0), "num_blocks vs lens length");
        same(ids.shape(0), ln.shape(0), "block_ids rows vs lens length");
        TreePathInput input{pk.data(),  num_rows,     (pk.shape(1) - 1) / 3, sl.data(),
                            ln.data(),  nb.data(),    ids.data(),            ids.shape(1),
                            ln.shape(0), block_size};
        TreePathMoves moves;
        try {
          moves = tree_path_moves(input);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
        const auto m = static_cast<py::ssize_t>(moves.src.size());
        py::array_t<int64_t> out({py::ssize_t{2}, m});
        if (m > 0) {
          std::copy(moves.src.begin(), moves.src.end(), out.mutable_data(0, 0));
          std::copy(moves.dst.begin(), moves.dst.end(), out.mutable_data(1, 0));
        }
        return out;
      },
      R"doc(
The accepted tree paths' KV moves of one verify step: ``[2, M]`` int64 cache slots (row 0
sources, row 1 destinations), rows in order, from the packed sampler output (``num_rows`` rows,
``SamplerOutput.pack``) and the arena's block tables (lengths before the step's append).
``speculate._compact_tree_path`` calls it.
)doc");
  m.def(
      "lm_stage",
      [](BlockAllocator& allocator, py::handle slots, int64_t num_rows, py::handle seq_ids,
         py::handle num_drafts, py::handle arena_epoch, py::handle lens, py::handle tokens,
         py::handle owner, py::handle epoch, py::handle num_cached, py::handle num_pending,
         py::handle need, py::handle zeros, py::handle num_blocks, py::handle block_ids,
         int64_t block_size, int64_t max_blocks, py::handle out) {
        auto sl = exact<int64_t>(slots, "slots", 1, false);
        auto si = exact<int64_t>(seq_ids, "seq_ids", 1, false);
        auto nd = exact<int64_t>(num_drafts, "num_drafts", 1, false);
        auto ae = exact<int64_t>(arena_epoch, "arena_epoch", 1, false);
        auto ln = exact<int64_t>(lens, "lens", 1, false);
        auto tok = exact<int64_t>(tokens, "tokens", 2, false);
        auto ow = exact<int64_t>(owner, "owner", 1, false);
        auto ep = exact<int64_t>(epoch, "epoch", 1, false);
        auto nc = exact<int64_t>(num_cached, "num_cached", 1, true);
        auto np_ = exact<int64_t>(num_pending, "num_pending", 1, true);
        auto ne = exact<int64_t>(need, "need", 1, true);
        auto ze = exact<int64_t>(zeros, "zeros", 1, false);
        auto nb = exact<int64_t>(num_blocks, "num_blocks", 1, true);
        auto ids = exact<int32_t>(block_ids, "block_ids", 2, true);
        auto o = exact<int64_t>(out, "out", 2, true);
        if (num_rows < 0 || num_rows > sl.shape(0) || num_rows > si.shape(0) ||
            num_rows > nd.shape(0) || num_rows > o.shape(0)) {
          throw py::value_error("num_rows " + std::to_string(num_rows) +
                                " exceeds slots, seq_ids, num_drafts or out");
        }
        if (block_size < 1 || max_blocks < 1) {
          throw py::value_error("block_size and max_blocks must be >= 1");
        }
        if (o.shape(1) < 3) throw py::value_error("out needs max_catch_up + 2 >= 3 columns");
        const int64_t n = ln.shape(0);
        for (auto [len, what] : {std::pair{ae.shape(0), "arena_epoch"},
                                 std::pair{tok.shape(0), "tokens rows"},
                                 std::pair{ow.shape(0), "owner"}, std::pair{ep.shape(0), "epoch"},
                                 std::pair{nc.shape(0), "num_cached"},
                                 std::pair{np_.shape(0), "num_pending"},
                                 std::pair{ne.shape(0), "need"}, std::pair{ze.shape(0), "zeros"},
                                 std::pair{nb.shape(0), "num_blocks"},
                                 std::pair{ids.shape(0), "block_ids rows"}}) {
          same(len, n, what);
        }
        LMStageInput input{sl.data(),          si.data(),          nd.data(),
                           num_rows,           ae.data(),          ln.data(),
                           tok.data(),         tok.shape(1),       ow.data(),
                           ep.data(),          nc.mutable_data(),  np_.mutable_data(),
                           ne.mutable_data(),  ze.data(),          nb.mutable_data(),
                           ids.mutable_data(), ids.shape(1),       n,
                           block_size,         max_blocks,         o.mutable_data(),
                           o.shape(1) - 2};
        LMStageResult r;
        try {
          r = lm_stage(input, allocator);
        } catch (const std::invalid_argument& e) {
          throw py::value_error(e.what());
        }
        return py::make_tuple(r.status, r.value, r.lo, r.hi, r.k);
      },
      R"doc(
The small-LM drafter's static step on the host (``StaticLMChain.propose``): checks every row,
grows every draft-cache table to ``len + k - 1`` tokens from one allocation, sets the counters
and writes each row's fed tokens, start and count to ``out``; returns ``(status, value, lo,
hi, k)`` (``csrc/lm_stage.h``: 0 staged with value = catch-up width, [lo, hi) the slots whose
table grew and k = max num_drafts; otherwise nothing changed).
)doc");
  m.def(
      "lm_observe",
      [](py::handle slots, int64_t num_rows, py::handle seq_ids, py::handle num_accepted,
         py::handle arena_epoch, py::handle owner, py::handle epoch, py::handle num_cached,
         py::handle num_pending) {
        auto sl = exact<int64_t>(slots, "slots", 1, false);
        auto si = exact<int64_t>(seq_ids, "seq_ids", 1, false);
        auto na = exact<int64_t>(num_accepted, "num_accepted", 1, false);
        auto ae = exact<int64_t>(arena_epoch, "arena_epoch", 1, false);
        auto ow = exact<int64_t>(owner, "owner", 1, false);
        auto ep = exact<int64_t>(epoch, "epoch", 1, false);
        auto nc = exact<int64_t>(num_cached, "num_cached", 1, true);
        auto np_ = exact<int64_t>(num_pending, "num_pending", 1, true);
        if (num_rows < 0 || num_rows > sl.shape(0) || num_rows > si.shape(0) ||
            num_rows > na.shape(0)) {
          throw py::value_error("num_rows " + std::to_string(num_rows) +
                                " exceeds slots, seq_ids or num_accepted");
        }
        const int64_t n = ow.shape(0);
        same(ae.shape(0), n, "arena_epoch vs owner length");
        same(ep.shape(0), n, "epoch vs owner length");
        same(nc.shape(0), n, "num_cached vs owner length");
        same(np_.shape(0), n, "num_pending vs owner length");
        return lm_observe(sl.data(), si.data(), na.data(), num_rows, ae.data(), ow.data(),
                          ep.data(), nc.mutable_data(), np_.mutable_data(), n);
      },
      R"doc(
After a verify step, the small LM's counters of every row (slot held by its sequence: owner,
epoch): num_cached += min(num_pending, num_accepted), num_pending = 0; False with nothing
changed when a row's slot is not held.
)doc");
}

}  // namespace specengine
