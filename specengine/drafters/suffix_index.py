"""The suffix drafter's index and proposal in plain Python: the **specification** of the C++
``specengine._C.SuffixCache`` the drafter runs (``csrc/suffix_cache.cpp``); tests replay random
token streams through both and require the same proposals.

Structure: **depth-bounded suffix tries** with occurrence counts (SuffixDecoding's). Every
substring of length ``<= max_depth`` of every indexed document is a path from the root; a
node's ``count`` is how many times its string occurs, ``cont`` how many of those are followed
by a token (``cont == sum(child.count)``; a document's end is neutral). Two kinds of trie:

- one **per prompt** (keyed by its token ids): the documents ``last prompt_tokens of the prompt
  + completion`` of its sequences (a GRPO group's siblings while they run, earlier epochs
  after), LRU over prompts within ``max_tokens``;
- one **global** trie over the same documents of every prompt (what completions share across
  prompts: formats, arithmetic facts), within ``global_tokens``, finished documents evicted
  oldest first.

Appending a token costs ``O(max_depth)`` per trie (a document keeps the nodes of its current
suffixes, its *frontier*; each moves one level down), so running sequences are indexed token
by token. Removal replays a document's walk, decrementing: exact.

**Proposal** (SuffixDecoding's scoring; arctic-inference's ``speculate``): in each trie, for
every match length ``m`` (the node of the sequence's last ``m`` tokens), the greedy path below
it: most frequent child (ties: the smaller token), estimated probability the running product
of ``child.count / (node.cont + open_weight * (node.count - node.cont) + smoothing)``
(``node.count - node.cont``: occurrences not continued yet, the querying sequence itself and
siblings standing at the same context; ``open_weight`` 1 counts them against the estimate as
SuffixDecoding does), extended while that product is
``>= min_prob`` and while the path has fewer than ``min(limit, int(m * spec_factor +
spec_offset))`` tokens. A path's score is the sum of its probabilities (expected accepted
drafts under the estimate); the highest score over both tries and all ``m`` wins (ties: the
longer match, then the per-prompt trie). Drafts are point masses: rejection sampling keeps the
policy's distribution whatever is proposed.

Trees: the winning match's node, then node ``i`` of the draft tree takes the ``rank``-th most
frequent child of its parent's trie node (ties: the smaller token); a rank with no such child
repeats rank 0, and a node off the trie repeats the newest token (verified, never kept
wrongly).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np

#: ``int(m * spec_factor + spec_offset + CAP_EPS)``: 1.0 * 3 stays 3 despite rounding
CAP_EPS = 1e-6


class Node:
    """A trie node: the string of its root path occurs ``count`` times, ``cont`` of them are
    followed by a token (``cont == sum(child.count)``)."""

    __slots__ = ("count", "cont", "children")

    def __init__(self) -> None:
        self.count = 0
        self.cont = 0
        self.children: dict[int, Node] | None = None

    def ranked(self) -> list[tuple[int, Node]]:
        """``(token, child)`` most frequent first (ties: the smaller token)."""
        if not self.children:
            return []
        return sorted(self.children.items(), key=lambda tc: (-tc[1].count, tc[0]))

    def best(self) -> tuple[int, Node]:
        """The most frequent continuation and its node (ties: the smaller token)."""
        assert self.children
        return min(self.children.items(), key=lambda tc: (-tc[1].count, tc[0]))


class Doc:
    """One indexed token run of one sequence (``seq_id``) in one trie."""

    __slots__ = ("seq_id", "index", "tokens", "frontier", "start", "live", "evicted")

    def __init__(self, seq_id: int, index: SuffixIndex, start: int) -> None:
        self.seq_id = seq_id
        self.index = index
        self.tokens: list[int] = []
        #: ``frontier[d - 1]``: the node of the document's last ``d`` tokens, d = 1..max_depth
        self.frontier: list[Node] = []
        self.start = start  # position in the sequence of ``tokens[0]``
        self.live = True  # its sequence is running: never evicted
        self.evicted = False

    @property
    def seq_end(self) -> int:
        """How many of the sequence's tokens the document covers."""
        return self.start + len(self.tokens)


class SuffixIndex:
    """One depth-bounded suffix trie and its documents (by seq_id, oldest first)."""

    def __init__(self, max_depth: int, key: tuple[int, ...] = ()) -> None:
        if max_depth < 2:
            raise ValueError(f"suffix index max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.key = key  # the prompt's token ids (per-prompt tries)
        self.last_used = 0  # the store's clock at its last use (LRU)
        self.root = Node()
        self.docs: OrderedDict[int, Doc] = OrderedDict()
        self.num_tokens = 0

    def open(self, seq_id: int, start: int) -> Doc:
        doc = Doc(seq_id, self, start)
        self.docs[seq_id] = doc
        return doc

    def append(self, doc: Doc, tokens: Iterable[int]) -> int:
        """Index ``tokens`` at the end of ``doc``; returns how many."""
        n = 0
        root, depth = self.root, self.max_depth
        frontier = doc.frontier
        for token in tokens:
            new: list[Node] = []
            for node in (root, *frontier[: depth - 1]):
                children = node.children
                if children is None:
                    children = node.children = {}
                child = children.get(token)
                if child is None:
                    child = children[token] = Node()
                child.count += 1
                node.cont += 1
                new.append(child)
            frontier = new
            doc.tokens.append(token)
            n += 1
        doc.frontier = frontier
        self.num_tokens += n
        return n

    def remove(self, doc: Doc) -> int:
        """Take ``doc`` out of the trie exactly (its walk replayed, decrementing; nodes left
        with no occurrence are dropped). Returns the tokens removed."""
        root, depth = self.root, self.max_depth
        frontier: list[Node] = []
        for token in doc.tokens:
            new: list[Node] = []
            for node in (root, *frontier[: depth - 1]):
                children = node.children
                assert children is not None and token in children, "index out of sync"
                child = children[token]
                child.count -= 1
                node.cont -= 1
                if child.count == 0:  # later steps still reach its subtree through `new`
                    del children[token]
                    if not children:
                        node.children = None
                new.append(child)
            frontier = new
        del self.docs[doc.seq_id]
        n = len(doc.tokens)
        self.num_tokens -= n
        doc.tokens, doc.frontier, doc.evicted, doc.live = [], [], True, False
        return n

    def frontier_of(self, tokens: list[int]) -> list[Node]:
        """Nodes of the suffixes of ``tokens`` that occur (shortest first), walked from the
        root (documents keep theirs incrementally)."""
        tail = tokens[-self.max_depth:]
        out: list[Node] = []
        for d in range(1, len(tail) + 1):
            node: Node | None = self.root
            for t in tail[len(tail) - d:]:
                node = node.children.get(t) if node.children else None  # type: ignore[union-attr]
                if node is None:
                    return out
            out.append(node)  # type: ignore[arg-type]
        return out

    def check(self) -> None:
        """Recount every node from the documents (tests; O(tokens * max_depth))."""
        counts: dict[tuple[int, ...], int] = {}
        for doc in self.docs.values():
            toks = doc.tokens
            for i in range(len(toks)):
                for d in range(1, min(self.max_depth, len(toks) - i) + 1):
                    key = tuple(toks[i: i + d])
                    counts[key] = counts.get(key, 0) + 1
        seen: dict[tuple[int, ...], int] = {}

        def walk(node: Node, path: tuple[int, ...]) -> None:
            if node.children:
                assert node.cont == sum(c.count for c in node.children.values()), path
                for t, c in node.children.items():
                    seen[path + (t,)] = c.count
                    walk(c, path + (t,))
            else:
                assert node.cont == 0, path

        walk(self.root, ())
        assert seen == counts, "trie counts differ from a recount of the documents"


@dataclass(frozen=True)
class SuffixParams:
    """The suffix drafter's options (``draft_options`` keys are these names with ``suffix_``
    in front; see :class:`~specengine.drafters.suffix.SuffixDrafter`)."""

    max_depth: int = 16
    max_tokens: int = 1 << 18
    global_tokens: int = 1 << 16
    prompt_tokens: int = 8
    min_prob: float = 0.3
    smoothing: float = 1.0
    spec_factor: float = 1.0
    spec_offset: float = 0.0
    open_weight: float = 0.0

    def __post_init__(self) -> None:
        def bad(name: str, want: str) -> ValueError:
            return ValueError(f"suffix_{name} must be {want}, got {getattr(self, name)!r}")

        if not 2 <= self.max_depth <= 256:
            raise bad("max_depth", "in 2..256")
        if not 1 <= self.max_tokens < 2**40:
            raise bad("max_tokens", ">= 1")
        if not 0 <= self.global_tokens < 2**40:
            raise bad("global_tokens", ">= 0 (0: no global trie)")
        if not 0 <= self.prompt_tokens <= 1 << 20:
            raise bad("prompt_tokens", ">= 0")
        if not 0.0 <= self.min_prob <= 1.0:
            raise bad("min_prob", "in [0, 1]")
        if not 0.0 <= self.smoothing <= 1e6:
            raise bad("smoothing", "in [0, 1e6]")
        if not 0.0 <= self.spec_factor <= 1e3:
            raise bad("spec_factor", "in [0, 1000]")
        if not -1e3 <= self.spec_offset <= 1e3:
            raise bad("spec_offset", "in [-1000, 1000]")
        if not 0.0 <= self.open_weight <= 1e3:
            raise bad("open_weight", "in [0, 1000]")


@dataclass(frozen=True)
class Draft:
    """One trie's best path: tokens, their estimated probabilities (cumulative), the score
    (their sum), the match length it was drawn from and whether a longer suffix of the
    sequence was followed by something in that trie (a back-off: a weaker match)."""

    tokens: list[int]
    probs: list[float]
    score: float
    match_len: int
    backed_off: bool


NO_DRAFT = Draft([], [], 0.0, 0, False)


def draft_from(frontier: list[Node], limit: int, p: SuffixParams) -> tuple[Draft, Node | None]:
    """The best-scoring path below the frontier (module docstring) and its match node."""
    best, best_node = NO_DRAFT, None
    longest = next((m for m in range(len(frontier), 0, -1) if frontier[m - 1].cont), 0)
    for m in range(longest, 0, -1):
        cap = min(limit, max(0, int(m * p.spec_factor + p.spec_offset + CAP_EPS)))
        if cap <= best.score:  # no shorter match can score more than its cap
            break
        node = frontier[m - 1]
        tokens: list[int] = []
        probs: list[float] = []
        prob, score = 1.0, 0.0
        while len(tokens) < cap and node.cont:
            token, child = node.best()
            prob *= child.count / (node.cont + p.open_weight * (node.count - node.cont)
                                   + p.smoothing)
            if prob < p.min_prob:
                break
            tokens.append(token)
            probs.append(prob)
            score += prob
            node = child
        if score > best.score:
            best = Draft(tokens, probs, score, m, m < longest)
            best_node = frontier[m - 1]
    return best, best_node


@dataclass
class _SeqDocs:
    """A sequence's documents (per-prompt and global) and its prompt key."""

    key: tuple[int, ...]
    local: Doc | None = None
    glob: Doc | None = None


class SuffixCacheRef:
    """Per-prompt tries and the global trie, fed and queried a batch at a time; the same
    calls and results as ``specengine._C.SuffixCache`` (which the drafter runs).

    Token sources: ``tokens[rows[b], :lens[b]]`` are sequence ``seq_ids[b]``'s tokens, the first
    ``num_prompt[b]`` its prompt (the engine passes its sequence arena's matrix and slots)."""

    def __init__(self, params: SuffixParams) -> None:
        self.p = params
        self.indexes: dict[tuple[int, ...], SuffixIndex] = {}
        self.by_seq: dict[int, _SeqDocs] = {}
        self.glob = SuffixIndex(params.max_depth)
        #: finished / preempted documents of the global trie, oldest closed first
        self.closed: OrderedDict[int, Doc] = OrderedDict()
        self.num_tokens = 0  # over the per-prompt tries
        self._clock = 0

    # ---- indexing ------------------------------------------------------------------------
    def _touch(self, idx: SuffixIndex) -> None:
        self._clock += 1
        idx.last_used = self._clock

    def _catch_up(self, seq_id: int, toks: np.ndarray, num_prompt: int) -> _SeqDocs:
        """Open the sequence's documents (first sight, or evicted) and append what they
        miss."""
        p = self.p
        sd = self.by_seq.get(seq_id)
        if sd is None:
            sd = self.by_seq[seq_id] = _SeqDocs(tuple(int(t) for t in toks[:num_prompt]))
        start = max(0, num_prompt - p.prompt_tokens)
        n = len(toks)
        if sd.local is None or sd.local.evicted:
            idx = self.indexes.get(sd.key)
            if idx is None:
                idx = self.indexes[sd.key] = SuffixIndex(p.max_depth, sd.key)
            self._touch(idx)
            sd.local = idx.open(seq_id, start)
        sd.local.live = True
        if sd.local.seq_end < n:
            self.num_tokens += sd.local.index.append(
                sd.local, (int(t) for t in toks[sd.local.seq_end:]))
            if self.num_tokens > p.max_tokens:
                self._evict_local()
        if p.global_tokens > 0:
            if sd.glob is None or sd.glob.evicted:
                sd.glob = self.glob.open(seq_id, start)
            sd.glob.live = True
            self.closed.pop(seq_id, None)
            if sd.glob.seq_end < n:
                self.glob.append(sd.glob, (int(t) for t in toks[sd.glob.seq_end:]))
                self._evict_global()
        return sd

    def _evict_local(self) -> None:
        """Finished documents go, oldest first, from the least recently used prompts on,
        until the budget holds (or only running documents are left)."""
        for idx in sorted(self.indexes.values(), key=lambda i: i.last_used):
            if self.num_tokens <= self.p.max_tokens:
                return
            for doc in [d for d in idx.docs.values() if not d.live]:
                self.num_tokens -= idx.remove(doc)
                if self.num_tokens <= self.p.max_tokens:
                    break
            if not idx.docs:
                del self.indexes[idx.key]

    def _evict_global(self) -> None:
        while self.glob.num_tokens > self.p.global_tokens and self.closed:
            _, doc = self.closed.popitem(last=False)
            self.glob.remove(doc)

    def sync(self, tokens: np.ndarray, rows: np.ndarray, lens: np.ndarray,
             num_prompt: np.ndarray, seq_ids: np.ndarray) -> None:
        """Index every sequence's new tokens."""
        for b in range(len(seq_ids)):
            self._catch_up(int(seq_ids[b]), tokens[rows[b], : lens[b]], int(num_prompt[b]))

    def release(self, seq_id: int, tokens: np.ndarray, num_prompt: int, finished: bool) -> None:
        """The sequence left the batch: its last tokens are indexed, its documents become
        evictable (a finished sequence's are never appended to again; a preempted one
        resumes them)."""
        sd = self.by_seq.get(seq_id)
        if sd is None:
            return
        self._catch_up(seq_id, tokens, num_prompt)
        for doc in (sd.local, sd.glob):
            if doc is not None and not doc.evicted:
                doc.live = False
        if sd.glob is not None and not sd.glob.evicted:
            self.closed[seq_id] = sd.glob
        if finished:
            del self.by_seq[seq_id]
        self._evict_global()

    # ---- proposals -----------------------------------------------------------------------
    def _best(self, sd: _SeqDocs, limit: int) -> tuple[Draft, Node | None, int]:
        """The better of the per-prompt and global drafts (0 / 1: where from)."""
        assert sd.local is not None
        self._touch(sd.local.index)
        draft, node = draft_from(sd.local.frontier, limit, self.p)
        source = 0
        if sd.glob is not None:
            g_draft, g_node = draft_from(sd.glob.frontier, limit, self.p)
            if g_draft.score > draft.score:
                draft, node, source = g_draft, g_node, 1
        return draft, node, source

    def propose(self, tokens: np.ndarray, rows: np.ndarray, lens: np.ndarray,
                num_prompt: np.ndarray, seq_ids: np.ndarray, num_drafts: np.ndarray
                ) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        """Catch every sequence up, then its chain of at most ``num_drafts[b]``. Returns
        ``(ids [B, W] int64, counts [B] int64, probs [B, W] float64, match_len [B] int64,
        flags [B] int64)`` with ``W = max(num_drafts)`` and flags bit 0: from the global
        trie, bit 1: backed off."""
        num = len(seq_ids)
        width = int(max(num_drafts, default=0))
        ids = np.zeros((num, width), dtype=np.int64)
        probs = np.zeros((num, width), dtype=np.float64)
        counts = np.zeros(num, dtype=np.int64)
        match = np.zeros(num, dtype=np.int64)
        flags = np.zeros(num, dtype=np.int64)
        docs = [self._catch_up(int(seq_ids[b]), tokens[rows[b], : lens[b]], int(num_prompt[b]))
                for b in range(num)]
        for b, sd in enumerate(docs):
            if num_drafts[b] <= 0:
                continue
            draft, _, source = self._best(sd, int(num_drafts[b]))
            n = len(draft.tokens)
            ids[b, :n], probs[b, :n], counts[b] = draft.tokens, draft.probs, n
            match[b] = draft.match_len
            flags[b] = source | (2 * draft.backed_off)
        return ids, counts, probs, match, flags

    def propose_tree(self, tokens: np.ndarray, rows: np.ndarray, lens: np.ndarray,
                     num_prompt: np.ndarray, seq_ids: np.ndarray, parents: np.ndarray,
                     ranks: np.ndarray, depth: int) -> np.ndarray:
        """Tree drafts ``[B, N - 1]`` (node 0 is the root; module docstring)."""
        num, n_nodes = len(seq_ids), len(parents)
        ids = np.zeros((num, max(n_nodes - 1, 0)), dtype=np.int64)
        docs = [self._catch_up(int(seq_ids[b]), tokens[rows[b], : lens[b]], int(num_prompt[b]))
                for b in range(num)]
        for b, sd in enumerate(docs):
            _, base, _ = self._best(sd, depth)
            fallback = int(tokens[rows[b], lens[b] - 1]) if lens[b] > 0 else 0
            state: list[Node | None] = [base]
            for i in range(1, n_nodes):
                node = state[int(parents[i])]
                ranked = node.ranked() if node is not None else []
                r = int(ranks[i])
                if r < len(ranked):
                    token, child = ranked[r]
                elif ranked:
                    token, child = ranked[0]
                else:
                    token, child = fallback, None
                ids[b, i - 1] = token
                state.append(child)
        return ids


def cap_of(m: int, p: SuffixParams, limit: int) -> int:
    """The draft cap of a match of ``m`` tokens (tests)."""
    return min(limit, max(0, int(m * p.spec_factor + p.spec_offset + CAP_EPS)))


__all__ = ["Doc", "Draft", "Node", "SuffixCacheRef", "SuffixIndex", "SuffixParams",
           "draft_from", "cap_of"]
