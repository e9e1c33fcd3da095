// The suffix drafter's index and proposal (specengine/drafters/suffix.py): per-prompt
// depth-bounded suffix tries plus one global trie over all prompts' completions, fed and
// queried a batch per call. specengine/drafters/suffix_index.py is the specification (the
// algorithm, the tie rules and the eviction order are described there); tests replay random
// token streams through both and require the same proposals.
#pragma once

#include <cstdint>
#include <list>
#include <memory>
#include <string>
#include <unordered_map>
#include <vector>

namespace specengine {

struct SuffixParamsC {
  int32_t max_depth;
  int64_t max_tokens;     // per-prompt tries, all prompts together
  int64_t global_tokens;  // the global trie (0: none)
  int64_t prompt_tokens;  // prompt tail that starts each document
  double min_prob, smoothing, spec_factor, spec_offset, open_weight;
};

// (parent node, token) -> child node: open addressing, linear probing, backward-shift deletion.
class ChildTable {
 public:
  ChildTable();
  int32_t find(int32_t parent, int32_t token) const;
  void insert(int32_t parent, int32_t token, int32_t child);
  void erase(int32_t parent, int32_t token);

 private:
  static uint64_t key(int32_t parent, int32_t token) {
    return (static_cast<uint64_t>(static_cast<uint32_t>(parent)) << 32) |
           static_cast<uint32_t>(token);
  }
  static uint64_t hash(uint64_t k) {  // splitmix64's finaliser
    k ^= k >> 30;
    k *= 0xbf58476d1ce4e5b9ULL;
    k ^= k >> 27;
    k *= 0x94d049bb133111ebULL;
    return k ^ (k >> 31);
  }
  void grow();
  std::vector<uint64_t> keys_;
  std::vector<int32_t> vals_;
  uint64_t mask_;
  int64_t size_ = 0;
};

class Trie;

struct SuffixDoc {
  int64_t seq_id;
  Trie* trie;
  struct PromptIndex* prompt;  // its per-prompt index (nullptr in the global trie)
  std::vector<int32_t> tokens;
  std::vector<int32_t> frontier;  // frontier[d - 1]: node of the last d tokens
  int64_t start;                  // sequence position of tokens[0]
  bool live = true, evicted = false;
  int64_t seq_end() const { return start + static_cast<int64_t>(tokens.size()); }
};

class Trie {
 public:
  struct Node {
    int32_t count = 0, cont = 0;
    int32_t best = -1;  // most frequent child (ties: smaller token); not kept for the root
    int32_t first_child = -1, next_sibling = -1;
    int32_t token = 0;
    int32_t num_children = 0;
  };
  explicit Trie(int32_t max_depth);
  void append(SuffixDoc& doc, const int64_t* tokens, int64_t n);
  int64_t remove(SuffixDoc& doc);
  // Small fan-out (most nodes below the first levels) walks the sibling list, whose nodes the
  // step touches anyway; wide nodes (the first levels) look the pair up in the table.
  int32_t child(int32_t node, int32_t token) const {
    if (nodes[node].num_children <= kListChildren) {
      for (int32_t c = nodes[node].first_child; c >= 0; c = nodes[c].next_sibling) {
        if (nodes[c].token == token) return c;
      }
      return -1;
    }
    return table_.find(node, token);
  }
  static constexpr int32_t kListChildren = 4;
  std::vector<Node> nodes;  // nodes[0]: the root
  int64_t num_tokens = 0;
  int32_t max_depth;

 private:
  int32_t get_or_add(int32_t node, int32_t token);
  void rescan_best(int32_t node);
  ChildTable table_;
  std::vector<int32_t> free_;
};

struct PromptIndex {
  std::string key;  // the prompt's token ids, as bytes
  Trie trie;
  std::vector<std::shared_ptr<SuffixDoc>> docs;  // opening order
  int64_t last_used = 0;
  explicit PromptIndex(const std::string& k, int32_t depth) : key(k), trie(depth) {}
};

// One trie's best path (fixed arrays: a proposal allocates nothing per sequence).
struct SuffixDraftC {
  static constexpr int kMax = 256;  // >= max_depth >= any draft
  int32_t tokens[kMax];
  double probs[kMax];
  int64_t num_tokens = 0;
  double score = 0.0;
  int64_t match_len = 0;
  bool backed_off = false;
  int32_t node = -1;  // the match's node
};

struct TokenSource {  // tokens[rows[b], :lens[b]] are sequence b's; the first num_prompt[b] prompt
  const int64_t* tokens;
  int64_t num_rows, width;
  const int64_t* rows;
  const int64_t* lens;
  const int64_t* num_prompt;
  const int64_t* seq_ids;
  int64_t batch;
};

class SuffixCache {
 public:
  explicit SuffixCache(const SuffixParamsC& p);
  void sync(const TokenSource& src);
  // out_ids / out_probs [batch, width], out_counts / out_match / out_flags [batch]; flags bit 0:
  // from the global trie, bit 1: backed off.
  void propose(const TokenSource& src, const int64_t* num_drafts, int64_t width, int64_t* out_ids,
               int64_t* out_counts, double* out_probs, int64_t* out_match, int64_t* out_flags);
  void propose_tree(const TokenSource& src, const int64_t* parents, const int64_t* ranks,
                    int64_t num_nodes, int64_t depth, int64_t* out_ids);
  void release(int64_t seq_id, const int64_t* tokens, int64_t len, int64_t num_prompt,
               bool finished);
  int64_t num_tokens() const { return num_tokens_; }
  int64_t num_global_tokens() const { return glob_.num_tokens; }
  int64_t num_prompts() const { return static_cast<int64_t>(indexes_.size()); }
  int64_t num_seqs() const { return static_cast<int64_t>(by_seq_.size()); }

 private:
  struct SeqDocs {
    std::string key;
    std::shared_ptr<SuffixDoc> local, glob;
  };
  void check(const TokenSource& src) const;
  SeqDocs& catch_up(int64_t seq_id, const int64_t* toks, int64_t n, int64_t num_prompt);
  void touch(PromptIndex* idx) { idx->last_used = ++clock_; }
  void evict_local();
  void evict_global();
  // The trie's best path below the frontier, in *best (*cur: scratch; the two may swap).
  void draft_from(const Trie& trie, const std::vector<int32_t>& frontier, int64_t limit,
                  SuffixDraftC** best, SuffixDraftC** cur) const;
  // The better of the sequence's two drafts, in scratch_[0..3]; returns the winner.
  const SuffixDraftC& best(SeqDocs& sd, int64_t limit, int* source);
  // Sequences of the batch whose documents stand at the same trie nodes (GRPO siblings in
  // lockstep) get the same draft: the first one's row is copied (propose's memo).
  struct MemoKey {
    const Trie* local;
    int32_t local_node, local_size, glob_node, glob_size;
    int64_t limit;
    bool operator==(const MemoKey& o) const {
      return local == o.local && local_node == o.local_node && local_size == o.local_size &&
             glob_node == o.glob_node && glob_size == o.glob_size && limit == o.limit;
    }
  };
  static uint64_t memo_hash(const MemoKey& k);
  MemoKey memo_key(const SeqDocs& sd, int64_t limit) const;
  std::vector<MemoKey> memo_keys_;
  std::vector<int64_t> memo_rows_;  // open addressing over batch rows (-1: empty)
  std::unique_ptr<SuffixDraftC[]> scratch_{new SuffixDraftC[4]};

  SuffixParamsC p_;
  std::unordered_map<std::string, std::unique_ptr<PromptIndex>> indexes_;
  std::unordered_map<int64_t, SeqDocs> by_seq_;
  Trie glob_;
  std::list<std::shared_ptr<SuffixDoc>> closed_;  // global docs, oldest closed first
  std::unordered_map<int64_t, std::list<std::shared_ptr<SuffixDoc>>::iterator> closed_at_;
  int64_t num_tokens_ = 0;
  int64_t clock_ = 0;
};

}  // namespace specengine
