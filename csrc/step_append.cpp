#include "step_append.h"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace specengine {

namespace {

std::string row_msg(int64_t b) { return "append_step: row " + std::to_string(b) + ": "; }

}  // namespace

AppendResult append_step(const ArenaArrays& a, const PackedStep& s, int64_t* stats,
                         int64_t stats_width) {
  const int64_t n = s.num_tokens;
  const int64_t stride = 3 * n + 1;
  AppendResult res{0, 0, {}, {}};
  std::vector<int64_t> kept(static_cast<size_t>(s.num_rows));
  std::vector<int8_t> code(static_cast<size_t>(s.num_rows));
  // Pass 1: validate and plan every row; nothing is written unless all rows are valid and fit.
  int64_t need = 0;
  for (int64_t b = 0; b < s.num_rows; ++b) {
    const double* row = s.packed + b * stride;
    const int64_t slot = s.slots[b];
    if (slot < 0 || slot >= a.capacity) {
      throw std::invalid_argument(row_msg(b) + "slot " + std::to_string(slot) +
                                  " outside the arena's " + std::to_string(a.capacity));
    }
    const auto num_accepted = static_cast<int64_t>(row[3 * n]);
    if (num_accepted < 0 || num_accepted >= n) {
      throw std::invalid_argument(row_msg(b) + "num_accepted " + std::to_string(num_accepted) +
                                  " outside [0, " + std::to_string(n - 1) + "]");
    }
    if (s.depths[b] < 0 || s.depths[b] > stats_width) {
      throw std::invalid_argument(row_msg(b) + "draft depth " + std::to_string(s.depths[b]) +
                                  " outside [0, " + std::to_string(stats_width) + "]");
    }
    const int64_t emitted = num_accepted + 1;
    int64_t first_stop = n + 1;  // tokens up to and including the first stop token
    const int64_t* stops = a.stop_ids + slot * a.num_stop;
    for (int64_t j = 0; j < emitted && first_stop > n; ++j) {
      const auto tok = static_cast<int64_t>(row[j]);
      for (int64_t i = 0; i < a.num_stop; ++i) {
        if (stops[i] == tok) {
          first_stop = j + 1;
          break;
        }
      }
    }
    const int64_t len = a.lens[slot];
    const int64_t room = std::max<int64_t>(0, a.limit[slot] - len);
    const int64_t k = std::min({emitted, first_stop, room});
    kept[b] = k;
    code[b] = first_stop == k ? 1 : (len + k >= a.limit[slot] ? 2 : 0);
    need = std::max(need, len + k);
  }
  if (need > a.width) {
    res.needed_width = need;
    return res;
  }
  // Pass 2: write.
  for (int64_t b = 0; b < s.num_rows; ++b) {
    const double* row = s.packed + b * stride;
    const int64_t slot = s.slots[b];
    const int64_t len = a.lens[slot];
    const int64_t k = kept[b];
    int64_t* tok = a.tokens + slot * a.width + len;
    double* lp = a.logprobs + slot * a.width + len;
    int64_t* ver = a.versions + slot * a.width + len;
    for (int64_t j = 0; j < k; ++j) {
      tok[j] = static_cast<int64_t>(row[j]);
      lp[j] = row[n + j];
      ver[j] = s.version;
    }
    a.lens[slot] = len + k;
    a.done[slot] = code[b] != 0;
    const auto num_accepted = static_cast<int64_t>(row[3 * n]);
    a.counters[slot] += 1;
    a.counters[a.capacity + slot] += s.num_drafts[b];
    a.counters[2 * a.capacity + slot] += num_accepted;
    for (int64_t j = 0; j < s.depths[b]; ++j) stats[j] += 1;
    for (int64_t j = 0; j < std::min(num_accepted, s.depths[b]); ++j) stats[stats_width + j] += 1;
    res.num_kept += k;
    if (code[b] != 0) {
      res.ended_rows.push_back(b);
      res.ended_codes.push_back(code[b]);
    }
  }
  return res;
}

}  // namespace specengine
