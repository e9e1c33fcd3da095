// See suffix_cache.h; specengine/drafters/suffix_index.py is the specification mirrored here
// (same operations in the same order, so the floating-point estimates agree bit for bit).
#include "suffix_cache.h"

#include <algorithm>
#include <stdexcept>

namespace specengine {

namespace {
constexpr uint64_t kEmpty = ~0ULL;
constexpr double kCapEps = 1e-6;  // suffix_index.CAP_EPS
}  // namespace

// ---- ChildTable ------------------------------------------------------------------------------
ChildTable::ChildTable() : keys_(16, kEmpty), vals_(16, -1), mask_(15) {}

int32_t ChildTable::find(int32_t parent, int32_t token) const {
  const uint64_t k = key(parent, token);
  for (uint64_t i = hash(k) & mask_;; i = (i + 1) & mask_) {
    if (keys_[i] == k) return vals_[i];
    if (keys_[i] == kEmpty) return -1;
  }
}

void ChildTable::insert(int32_t parent, int32_t token, int32_t child) {
  if (2 * (size_ + 1) > static_cast<int64_t>(keys_.size())) grow();
  const uint64_t k = key(parent, token);
  uint64_t i = hash(k) & mask_;
  while (keys_[i] != kEmpty) i = (i + 1) & mask_;
  keys_[i] = k;
  vals_[i] = child;
  ++size_;
}

void ChildTable::erase(int32_t parent, int32_t token) {
  const uint64_t k = key(parent, token);
  uint64_t i = hash(k) & mask_;
  while (keys_[i] != k) {
    if (keys_[i] == kEmpty) return;
    i = (i + 1) & mask_;
  }
  // Backward-shift: move later entries of the probe run into the hole when their home slot
  // does not lie (cyclically) after the hole.
  uint64_t hole = i;
  for (uint64_t j = (i + 1) & mask_; keys_[j] != kEmpty; j = (j + 1) & mask_) {
    const uint64_t home = hash(keys_[j]) & mask_;
    if (((j - home) & mask_) >= ((j - hole) & mask_)) {
      keys_[hole] = keys_[j];
      vals_[hole] = vals_[j];
      hole = j;
    }
  }
  keys_[hole] = kEmpty;
  vals_[hole] = -1;
  --size_;
}

void ChildTable::grow() {
  std::vector<uint64_t> keys(keys_.size() * 2, kEmpty);
  std::vector<int32_t> vals(vals_.size() * 2, -1);
  keys_.swap(keys);
  vals_.swap(vals);
  mask_ = keys_.size() - 1;
  for (size_t i = 0; i < keys.size(); ++i) {
    if (keys[i] == kEmpty) continue;
    uint64_t j = hash(keys[i]) & mask_;
    while (keys_[j] != kEmpty) j = (j + 1) & mask_;
    keys_[j] = keys[i];
    vals_[j] = vals[i];
  }
}

// ---- Trie ------------------------------------------------------------------------------------
Trie::Trie(int32_t depth) : nodes(1), max_depth(depth) {}

int32_t Trie::get_or_add(int32_t node, int32_t token) {
  int32_t c = child(node, token);
  if (c < 0) {
    if (!free_.empty()) {
      c = free_.back();
      free_.pop_back();
      nodes[c] = Node();
    } else {
      c = static_cast<int32_t>(nodes.size());
      nodes.emplace_back();
    }
    nodes[c].token = token;
    nodes[c].next_sibling = nodes[node].first_child;
    nodes[node].first_child = c;
    nodes[node].num_children += 1;
    table_.insert(node, token, c);
  }
  Node& ch = nodes[c];
  Node& n = nodes[node];
  ch.count += 1;
  n.cont += 1;
  if (node != 0) {
    const int32_t b = n.best;
    if (b < 0 || ch.count > nodes[b].count ||
        (ch.count == nodes[b].count && ch.token < nodes[b].token)) {
      n.best = c;
    }
  }
  return c;
}

void Trie::rescan_best(int32_t node) {
  int32_t best = -1;
  for (int32_t c = nodes[node].first_child; c >= 0; c = nodes[c].next_sibling) {
    if (best < 0 || nodes[c].count > nodes[best].count ||
        (nodes[c].count == nodes[best].count && nodes[c].token < nodes[best].token)) {
      best = c;
    }
  }
  nodes[node].best = best;
}

void Trie::append(SuffixDoc& doc, const int64_t* tokens, int64_t n) {
  std::vector<int32_t>& f = doc.frontier;
  for (int64_t j = 0; j < n; ++j) {
    const int32_t t = static_cast<int32_t>(tokens[j]);
    // new frontier: [child(root), child(f[0]), ..., child(f[D-2])], deepest first in place
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(f.size()) + 1, max_depth);
    f.resize(len);
    for (int64_t i = len - 1; i >= 1; --i) f[i] = get_or_add(f[i - 1], t);
    f[0] = get_or_add(0, t);
    doc.tokens.push_back(t);
  }
  num_tokens += n;
}

int64_t Trie::remove(SuffixDoc& doc) {
  std::vector<int32_t> f;
  f.reserve(max_depth);
  for (const int32_t t : doc.tokens) {
    const int64_t len = std::min<int64_t>(static_cast<int64_t>(f.size()) + 1, max_depth);
    f.resize(len);
    for (int64_t i = len - 1; i >= 0; --i) {
      const int32_t node = i == 0 ? 0 : f[i - 1];
      const int32_t c = child(node, t);
      if (c < 0) throw std::logic_error("suffix trie out of sync with its documents");
      Node& ch = nodes[c];
      ch.count -= 1;
      nodes[node].cont -= 1;
      if (ch.count == 0) {  // unlink; the walk still reaches its subtree through f
        table_.erase(node, t);
        int32_t* link = &nodes[node].first_child;
        while (*link != c) link = &nodes[*link].next_sibling;
        *link = ch.next_sibling;
        nodes[node].num_children -= 1;
        free_.push_back(c);
      }
      if (node != 0 && nodes[node].best == c) rescan_best(node);
      f[i] = c;
    }
  }
  const int64_t n = static_cast<int64_t>(doc.tokens.size());
  num_tokens -= n;
  doc.tokens.clear();
  doc.frontier.clear();
  doc.evicted = true;
  doc.live = false;
  return n;
}

// ---- SuffixCache -----------------------------------------------------------------------------
SuffixCache::SuffixCache(const SuffixParamsC& p) : p_(p), glob_(p.max_depth) {
  if (p.max_depth < 2 || p.max_depth > 256) {
    throw std::invalid_argument("SuffixCache: max_depth must be in 2..256");
  }
  if (p.max_tokens < 1 || p.global_tokens < 0 || p.prompt_tokens < 0) {
    throw std::invalid_argument(
        "SuffixCache: max_tokens must be >= 1, global_tokens and prompt_tokens >= 0");
  }
}

void SuffixCache::check(const TokenSource& s) const {
  // Everything is checked before anything changes: a bad batch leaves the cache as it was.
  for (int64_t b = 0; b < s.batch; ++b) {
    const int64_t r = s.rows[b], n = s.lens[b];
    if (r < 0 || r >= s.num_rows) {
      throw std::invalid_argument("SuffixCache: row " + std::to_string(r) +
                                  " outside the token matrix");
    }
    if (n < 0 || n > s.width || s.num_prompt[b] < 0 || s.num_prompt[b] > n) {
      throw std::invalid_argument("SuffixCache: sequence " + std::to_string(s.seq_ids[b]) +
                                  " has length " + std::to_string(n) + " and prompt " +
                                  std::to_string(s.num_prompt[b]) + " (matrix width " +
                                  std::to_string(s.width) + ")");
    }
    // Only the tokens not indexed yet are read as tokens (a long context is not rescanned
    // every step): from the end of the sequence's documents, or where new ones start.
    int64_t from = 0;
    auto it = by_seq_.find(s.seq_ids[b]);
    if (it != by_seq_.end()) {
      const int64_t start = std::max<int64_t>(0, s.num_prompt[b] - p_.prompt_tokens);
      from = n;
      for (const auto* doc : {it->second.local.get(), it->second.glob.get()}) {
        if (doc != nullptr) from = std::min(from, doc->evicted ? start : doc->seq_end());
      }
      if (p_.global_tokens > 0 && it->second.glob == nullptr) from = std::min(from, start);
    }
    const int64_t* row = s.tokens + r * s.width;
    for (int64_t j = from; j < n; ++j) {
      if (row[j] < 0 || row[j] > INT32_MAX) {
        throw std::invalid_argument("SuffixCache: token " + std::to_string(row[j]) +
                                    " is not a vocabulary id");
      }
    }
  }
}

SuffixCache::SeqDocs& SuffixCache::catch_up(int64_t seq_id, const int64_t* toks, int64_t n,
                                            int64_t num_prompt) {
  auto it = by_seq_.find(seq_id);
  if (it == by_seq_.end()) {
    SeqDocs sd;
    sd.key.assign(reinterpret_cast<const char*>(toks), num_prompt * sizeof(int64_t));
    it = by_seq_.emplace(seq_id, std::move(sd)).first;
  }
  SeqDocs& sd = it->second;
  const int64_t start = std::max<int64_t>(0, num_prompt - p_.prompt_tokens);
  if (!sd.local || sd.local->evicted) {
    auto idx_it = indexes_.find(sd.key);
    if (idx_it == indexes_.end()) {
      idx_it = indexes_.emplace(sd.key, std::make_unique<PromptIndex>(sd.key, p_.max_depth)).first;
    }
    PromptIndex* idx = idx_it->second.get();
    touch(idx);
    auto doc = std::make_shared<SuffixDoc>();
    doc->seq_id = seq_id;
    doc->trie = &idx->trie;
    doc->prompt = idx;
    doc->start = start;
    idx->docs.push_back(doc);
    sd.local = doc;
  }
  sd.local->live = true;
  if (sd.local->seq_end() < n) {
    const int64_t from = sd.local->seq_end();
    sd.local->trie->append(*sd.local, toks + from, n - from);
    num_tokens_ += n - from;
    if (num_tokens_ > p_.max_tokens) evict_local();
  }
  if (p_.global_tokens > 0) {
    if (!sd.glob || sd.glob->evicted) {
      auto doc = std::make_shared<SuffixDoc>();
      doc->seq_id = seq_id;
      doc->trie = &glob_;
      doc->prompt = nullptr;
      doc->start = start;
      sd.glob = doc;
    }
    if (!sd.glob->live) {  // a live document is never on the closed list: no lookup per step
      auto at = closed_at_.find(seq_id);
      if (at != closed_at_.end()) {
        closed_.erase(at->second);
        closed_at_.erase(at);
      }
    }
    sd.glob->live = true;
    if (sd.glob->seq_end() < n) {
      const int64_t from = sd.glob->seq_end();
      glob_.append(*sd.glob, toks + from, n - from);
      evict_global();
    }
  }
  return sd;
}

void SuffixCache::evict_local() {
  std::vector<PromptIndex*> order;
  order.reserve(indexes_.size());
  for (auto& kv : indexes_) order.push_back(kv.second.get());
  std::sort(order.begin(), order.end(),
            [](const PromptIndex* a, const PromptIndex* b) { return a->last_used < b->last_used; });
  for (PromptIndex* idx : order) {
    if (num_tokens_ <= p_.max_tokens) return;
    auto& docs = idx->docs;
    for (size_t i = 0; i < docs.size();) {
      if (docs[i]->live) {
        ++i;
        continue;
      }
      num_tokens_ -= idx->trie.remove(*docs[i]);
      docs.erase(docs.begin() + static_cast<std::ptrdiff_t>(i));
      if (num_tokens_ <= p_.max_tokens) break;
    }
    if (docs.empty()) indexes_.erase(idx->key);
  }
}

void SuffixCache::evict_global() {
  while (glob_.num_tokens > p_.global_tokens && !closed_.empty()) {
    std::shared_ptr<SuffixDoc> doc = closed_.front();
    closed_.pop_front();
    closed_at_.erase(doc->seq_id);
    glob_.remove(*doc);
  }
}

void SuffixCache::sync(const TokenSource& s) {
  check(s);
  for (int64_t b = 0; b < s.batch; ++b) {
    catch_up(s.seq_ids[b], s.tokens + s.rows[b] * s.width, s.lens[b], s.num_prompt[b]);
  }
}

void SuffixCache::release(int64_t seq_id, const int64_t* tokens, int64_t len,
                          int64_t num_prompt, bool finished) {
  auto it = by_seq_.find(seq_id);
  if (it == by_seq_.end()) return;
  if (num_prompt < 0 || num_prompt > len) {
    throw std::invalid_argument("SuffixCache.release: prompt longer than the sequence");
  }
  for (int64_t j = 0; j < len; ++j) {
    if (tokens[j] < 0 || tokens[j] > INT32_MAX) {
      throw std::invalid_argument("SuffixCache: token " + std::to_string(tokens[j]) +
                                  " is not a vocabulary id");
    }
  }
  SeqDocs& sd = catch_up(seq_id, tokens, len, num_prompt);
  if (sd.local && !sd.local->evicted) sd.local->live = false;
  if (sd.glob && !sd.glob->evicted) {
    sd.glob->live = false;
    closed_.push_back(sd.glob);
    closed_at_[seq_id] = std::prev(closed_.end());
  }
  if (finished) by_seq_.erase(seq_id);
  evict_global();
}

void SuffixCache::draft_from(const Trie& trie, const std::vector<int32_t>& frontier,
                             int64_t limit, SuffixDraftC** best_out,
                             SuffixDraftC** cur_out) const {
  // Two buffers trade roles (the walk fills `cur`; a better walk becomes `best`): nothing is
  // copied or allocated per match length.
  SuffixDraftC* best = *best_out;
  SuffixDraftC* cur = *cur_out;
  best->num_tokens = 0;
  best->score = 0.0;
  best->match_len = 0;
  best->backed_off = false;
  best->node = -1;
  const Trie::Node* nodes = trie.nodes.data();
  int64_t longest = static_cast<int64_t>(frontier.size());
  while (longest > 0 && nodes[frontier[longest - 1]].cont == 0) --longest;
  for (int64_t m = longest; m >= 1; --m) {
    int64_t cap = static_cast<int64_t>(static_cast<double>(m) * p_.spec_factor + p_.spec_offset +
                                       kCapEps);
    cap = std::min(limit, std::max<int64_t>(0, cap));
    if (static_cast<double>(cap) <= best->score) break;
    int32_t node = frontier[m - 1];
    int64_t n = 0;
    double prob = 1.0, score = 0.0;
    while (n < cap && nodes[node].cont) {
      const Trie::Node& here = nodes[node];
      const int32_t c = here.best;
      prob *= static_cast<double>(nodes[c].count) /
              (static_cast<double>(here.cont) +
               p_.open_weight * static_cast<double>(here.count - here.cont) + p_.smoothing);
      if (prob < p_.min_prob) break;
      cur->tokens[n] = nodes[c].token;
      cur->probs[n] = prob;
      ++n;
      score += prob;
      node = c;
    }
    if (score > best->score) {
      std::swap(best, cur);
      best->num_tokens = n;
      best->score = score;
      best->match_len = m;
      best->backed_off = m < longest;
      best->node = frontier[m - 1];
    }
  }
  *best_out = best;
  *cur_out = cur;
}

const SuffixDraftC& SuffixCache::best(SeqDocs& sd, int64_t limit, int* source) {
  touch(sd.local->prompt);
  // Each trie's draft lands in one of its two scratch buffers (draft_from swaps its pointers).
  SuffixDraftC* d = &scratch_[0];
  SuffixDraftC* d_cur = &scratch_[1];
  draft_from(*sd.local->trie, sd.local->frontier, limit, &d, &d_cur);
  *source = 0;
  if (sd.glob) {
    SuffixDraftC* g = &scratch_[2];
    SuffixDraftC* g_cur = &scratch_[3];
    draft_from(glob_, sd.glob->frontier, limit, &g, &g_cur);
    if (g->score > d->score) {
      *source = 1;
      return *g;
    }
  }
  return *d;
}

uint64_t SuffixCache::memo_hash(const MemoKey& k) {
  uint64_t h = reinterpret_cast<uintptr_t>(k.local);
  for (const uint64_t v : {static_cast<uint64_t>(static_cast<uint32_t>(k.local_node)),
                           static_cast<uint64_t>(static_cast<uint32_t>(k.local_size)),
                           static_cast<uint64_t>(static_cast<uint32_t>(k.glob_node)),
                           static_cast<uint64_t>(static_cast<uint32_t>(k.glob_size)),
                           static_cast<uint64_t>(k.limit)}) {
    h = (h ^ v) * 0x9e3779b97f4a7c15ULL;
    h ^= h >> 29;
  }
  return h;
}

SuffixCache::MemoKey SuffixCache::memo_key(const SeqDocs& sd, int64_t limit) const {
  // A document's frontier is the chain of suffixes of its deepest node's string, so that node
  // and the frontier's length determine it (nothing changes in the tries during a proposal).
  // The global document holds the same tokens as the per-prompt one, so its part of the key
  // follows from the rest today; it is kept so the key stays right if the two ever differ.
  const auto& lf = sd.local->frontier;
  MemoKey k{sd.local->trie, lf.empty() ? -1 : lf.back(), static_cast<int32_t>(lf.size()), -1, 0,
            limit};
  if (sd.glob) {
    const auto& gf = sd.glob->frontier;
    k.glob_node = gf.empty() ? -1 : gf.back();
    k.glob_size = static_cast<int32_t>(gf.size());
  }
  return k;
}

void SuffixCache::propose(const TokenSource& s, const int64_t* num_drafts, int64_t width,
                          int64_t* out_ids, int64_t* out_counts, double* out_probs,
                          int64_t* out_match, int64_t* out_flags) {
  check(s);
  std::vector<SeqDocs*> docs(s.batch);
  for (int64_t b = 0; b < s.batch; ++b) {
    docs[b] = &catch_up(s.seq_ids[b], s.tokens + s.rows[b] * s.width, s.lens[b],
                        s.num_prompt[b]);
  }
  size_t slots = 16;
  while (slots < 2 * static_cast<size_t>(s.batch)) slots *= 2;
  memo_rows_.assign(slots, -1);
  memo_keys_.resize(slots);
  const uint64_t mask = slots - 1;
  for (int64_t b = 0; b < s.batch; ++b) {
    out_counts[b] = out_match[b] = out_flags[b] = 0;
    int64_t* ids = out_ids + b * width;
    double* probs = out_probs + b * width;
    std::fill(ids, ids + width, 0);
    std::fill(probs, probs + width, 0.0);
    if (num_drafts[b] <= 0) continue;
    const int64_t limit = std::min(num_drafts[b], width);
    const MemoKey key = memo_key(*docs[b], limit);
    uint64_t i = memo_hash(key) & mask;
    while (memo_rows_[i] >= 0 && !(memo_keys_[i] == key)) i = (i + 1) & mask;
    if (memo_rows_[i] >= 0) {  // a sibling at the same nodes: same draft
      touch(docs[b]->local->prompt);
      const int64_t a = memo_rows_[i];
      std::copy(out_ids + a * width, out_ids + (a + 1) * width, ids);
      std::copy(out_probs + a * width, out_probs + (a + 1) * width, probs);
      out_counts[b] = out_counts[a];
      out_match[b] = out_match[a];
      out_flags[b] = out_flags[a];
      continue;
    }
    memo_rows_[i] = b;
    memo_keys_[i] = key;
    int source = 0;
    const SuffixDraftC& d = best(*docs[b], limit, &source);
    for (int64_t j = 0; j < d.num_tokens; ++j) {
      ids[j] = d.tokens[j];
      probs[j] = d.probs[j];
    }
    out_counts[b] = d.num_tokens;
    out_match[b] = d.match_len;
    out_flags[b] = source | (d.backed_off ? 2 : 0);
  }
}

void SuffixCache::propose_tree(const TokenSource& s, const int64_t* parents,
                               const int64_t* ranks, int64_t num_nodes, int64_t depth,
                               int64_t* out_ids) {
  check(s);
  for (int64_t i = 1; i < num_nodes; ++i) {
    if (parents[i] < 0 || parents[i] >= i || ranks[i] < 0) {
      throw std::invalid_argument("SuffixCache.propose_tree: node " + std::to_string(i) +
                                  " has a parent not before it or a negative rank");
    }
  }
  std::vector<SeqDocs*> docs(s.batch);
  for (int64_t b = 0; b < s.batch; ++b) {
    docs[b] = &catch_up(s.seq_ids[b], s.tokens + s.rows[b] * s.width, s.lens[b],
                        s.num_prompt[b]);
  }
  const int64_t w = std::max<int64_t>(num_nodes - 1, 0);
  std::vector<std::pair<int32_t, const Trie*>> state(num_nodes);
  std::vector<std::pair<int32_t, int32_t>> ranked;  // (-count, token) sorted; then node ids
  std::vector<int32_t> ranked_node;
  for (int64_t b = 0; b < s.batch; ++b) {
    int source = 0;
    const SuffixDraftC& d = best(*docs[b], depth, &source);
    const Trie* trie = source == 1 ? &glob_ : docs[b]->local->trie;
    const int64_t n = s.lens[b];
    const int64_t fallback = n > 0 ? s.tokens[s.rows[b] * s.width + n - 1] : 0;
    state[0] = {d.node, trie};
    for (int64_t i = 1; i < num_nodes; ++i) {
      const auto [node, t] = state[parents[i]];
      int64_t token = fallback;
      int32_t child = -1;
      if (node >= 0 && t->nodes[node].first_child >= 0) {
        ranked.clear();
        for (int32_t c = t->nodes[node].first_child; c >= 0; c = t->nodes[c].next_sibling) {
          ranked.emplace_back(-t->nodes[c].count, t->nodes[c].token);
        }
        const size_t r = static_cast<size_t>(ranks[i]) < ranked.size()
                             ? static_cast<size_t>(ranks[i]) : 0;
        std::nth_element(ranked.begin(), ranked.begin() + static_cast<std::ptrdiff_t>(r),
                         ranked.end());
        token = ranked[r].second;
        child = t->child(node, static_cast<int32_t>(token));
      }
      out_ids[b * w + i - 1] = token;
      state[i] = {child, t};
    }
  }
}

}  // namespace specengine
