"""Per-prompt indexes of completions for the suffix drafter (``drafters/suffix.py``).

The structure is a **depth-bounded suffix trie** with occurrence counts (what SuffixDecoding
builds; vLLM's "suffix" method uses the same bound): every substring of length ``<= max_depth``
of every indexed document is a path from the root, and a node's ``count`` is how many times its
string occurs across the documents. Why this one:

- It is exact: a node's children and their counts are the true empirical next-token
  frequencies after that context (no hashing, no sampling).
- It is online: appending a token to a document costs ``O(max_depth)`` dict operations (the
  document keeps the nodes of its current suffixes, its *frontier*; each moves one level down),
  so a sibling still running is indexed token by token as it is accepted.
- It supports deletion exactly (replay the document's walk, decrementing), which LRU eviction
  under a token budget needs; a suffix automaton is smaller (<= 2n states) but neither its
  occurrence counts nor deletions are cheap online.

Memory is at most ``max_depth`` nodes per indexed token (far fewer on repetitive text: shared
substrings share nodes). Counting the continuations of a node (``cont``) separately from its
occurrences makes a document's end (no continuation yet: the querying sequence itself, or a
sibling in flight) neutral: shares are ``child.count / node.cont``.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass


class Node:
    """A trie node: the string of its root path occurs ``count`` times, ``cont`` of them are
    followed by a token (``cont == sum(child.count)``)."""

    __slots__ = ("count", "cont", "children")

    def __init__(self) -> None:
        self.count = 0
        self.cont = 0
        self.children: dict[int, Node] | None = None

    def ranked(self) -> list[tuple[int, int]]:
        """``(token, count)`` of the continuations, most frequent first (ties: first seen)."""
        if not self.children:
            return []
        return sorted(((t, c.count) for t, c in self.children.items()), key=lambda tc: -tc[1])

    def best(self) -> tuple[int, Node]:
        """The most frequent continuation and its node (ties: the first seen). Needs ``cont``."""
        assert self.children
        token, node = max(self.children.items(), key=lambda kv: kv[1].count)
        return token, node


class Doc:
    """One indexed token run: prompt tail + completion of one sequence (``seq_id``)."""

    __slots__ = ("seq_id", "index", "tokens", "frontier", "start", "live", "evicted")

    def __init__(self, seq_id: int, index: SuffixIndex, start: int) -> None:
        self.seq_id = seq_id
        self.index = index  # its prompt's
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


def advance(frontier: list[Node], root: Node, token: int, max_depth: int) -> list[Node]:
    """The frontier after ``token`` without changing the trie: nodes of the suffixes that
    occur, shortest first (a missing one ends it: if the last d tokens never occurred, no
    longer suffix did)."""
    out: list[Node] = []
    for node in (root, *frontier[: max_depth - 1]):
        child = node.children.get(token) if node.children else None
        if child is None:
            break
        out.append(child)
    return out


def deepest_with_continuation(frontier: list[Node]) -> tuple[Node | None, int]:
    """The longest matched suffix that was followed by something somewhere, and its length
    (``(None, 0)`` when none was)."""
    for d in range(len(frontier), 0, -1):
        if frontier[d - 1].cont:
            return frontier[d - 1], d
    return None, 0


@dataclass(frozen=True)
class Chain:
    """A proposed chain: per draft its token, its estimated probability of being reached and
    accepted (cumulative), the length of the context it was predicted from and whether that
    context is shorter than the longest one that occurred (it backed off past contexts
    never continued: a weaker match)."""

    tokens: list[int]
    probs: list[float]
    depths: list[int]
    backed_off: list[bool]


class SuffixIndex:
    """The trie of one prompt's documents (its siblings and earlier epochs)."""

    def __init__(self, max_depth: int, key: tuple[int, ...] = ()) -> None:
        if max_depth < 2:
            raise ValueError(f"suffix index max_depth must be >= 2, got {max_depth}")
        self.max_depth = max_depth
        self.key = key  # the prompt's token ids
        self.last_used = 0  # the store's clock at its last use (LRU)
        self.root = Node()
        self.docs: OrderedDict[int, Doc] = OrderedDict()  # by seq_id, oldest first
        self.num_tokens = 0

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
        """Nodes of the suffixes of ``tokens`` that occur in the index (shortest first), found
        by walking from the root (``O(max_depth^2)``; documents keep theirs incrementally)."""
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

    def continuation(self, frontier: list[Node], limit: int, min_prob: float,
                     smoothing: float = 0.0) -> Chain:
        """Greedy chain after the context whose frontier is given: at each step the most
        frequent continuation of the longest matched suffix that has one, while the product
        of the chosen tokens' shares ``count / (cont + smoothing)`` (the chain's estimated
        probability; ``smoothing`` > 0 makes few observations count for less than many that
        agree) stays ``>= min_prob``; at most ``limit`` tokens."""
        chain = Chain([], [], [], [])
        p = 1.0
        while len(chain.tokens) < limit:
            node, depth = deepest_with_continuation(frontier)
            if node is None:
                break
            token, child = node.best()
            p *= child.count / (node.cont + smoothing)
            if p < min_prob:
                break
            chain.tokens.append(token)
            chain.probs.append(p)
            chain.depths.append(depth)
            # The depth-max_depth node is a leaf: matching it fully is no back-off.
            chain.backed_off.append(depth < min(len(frontier), self.max_depth - 1))
            frontier = advance(frontier, self.root, token, self.max_depth)
        return chain

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


class SuffixStore:
    """Indexes by prompt (its token ids), least recently used first, within ``max_tokens``
    indexed tokens. Eviction takes finished documents (oldest first) from the least recently
    used prompts, and drops a prompt once it has no document; documents of running
    sequences are never evicted (they are bounded by the running batch)."""

    def __init__(self, max_depth: int, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"suffix_max_tokens must be >= 1, got {max_tokens}")
        self.max_depth = max_depth
        self.max_tokens = max_tokens
        #: by prompt token ids, in order of creation (use order is each index's last_used:
        #: hashing a long prompt on every use would cost more than the lookup it serves)
        self.indexes: dict[tuple[int, ...], SuffixIndex] = {}
        #: documents of sequences that may still append (running, or released unfinished:
        #: preempted ones resume their document)
        self.by_seq: dict[int, Doc] = {}
        self.num_tokens = 0
        self._clock = 0

    def touch(self, idx: SuffixIndex) -> None:
        """Mark ``idx`` most recently used."""
        self._clock += 1
        idx.last_used = self._clock

    def index(self, key: tuple[int, ...]) -> SuffixIndex:
        """The prompt's index (made if new), marked most recently used."""
        idx = self.indexes.get(key)
        if idx is None:
            idx = self.indexes[key] = SuffixIndex(self.max_depth, key)
        self.touch(idx)
        return idx

    def open(self, seq_id: int, key: tuple[int, ...], start: int) -> Doc:
        """A new, empty live document of ``seq_id`` under prompt ``key``."""
        idx = self.index(key)
        doc = Doc(seq_id, idx, start)
        idx.docs[seq_id] = doc
        self.by_seq[seq_id] = doc
        return doc

    def append(self, doc: Doc, tokens: list[int]) -> None:
        """Index ``tokens`` at the end of ``doc``, then evict down to the budget."""
        if doc.evicted or not tokens:
            return
        self.num_tokens += doc.index.append(doc, tokens)
        if self.num_tokens > self.max_tokens:
            self.evict()

    def close(self, doc: Doc, finished: bool) -> None:
        """Its sequence left the batch: the document becomes evictable; a finished one will
        never append again (an unfinished one, preempted, resumes it when it runs again)."""
        doc.live = False
        if finished:
            self.by_seq.pop(doc.seq_id, None)

    def evict(self) -> None:
        """Finished documents go, oldest first, from the least recently used prompts on,
        until the budget holds (or only running documents are left)."""
        for idx in sorted(self.indexes.values(), key=lambda i: i.last_used):
            if self.num_tokens <= self.max_tokens:
                return
            for doc in [d for d in idx.docs.values() if not d.live]:
                self.num_tokens -= idx.remove(doc)
                if self.by_seq.get(doc.seq_id) is doc:
                    del self.by_seq[doc.seq_id]
                if self.num_tokens <= self.max_tokens:
                    break
            if not idx.docs:
                del self.indexes[idx.key]
