"""The C++ block allocator (``specengine._C.BlockAllocator``) against a Python model of
ownership.

The model keeps which sequence owns which block references and the allocator's free stack;
after every one of 10,000 random operations the allocator's reference counts, free count and
handed-out ids must equal the model's. Failing calls must raise the documented error and change
nothing.
"""

from __future__ import annotations

import random
from collections import Counter

import numpy as np
import pytest

from specengine import _C


class Model:
    """What the allocator must look like: the free stack and who owns which references."""

    def __init__(self, num_blocks: int) -> None:
        self.num_blocks = num_blocks
        self.stack = list(range(num_blocks - 1, -1, -1))  # back is handed out next
        self.seqs: dict[int, list[int]] = {}  # sequence -> its block references, in order
        self.next_seq = 0

    def refs(self) -> list[int]:
        counts = Counter(b for blocks in self.seqs.values() for b in blocks)
        return [counts.get(b, 0) for b in range(self.num_blocks)]

    def pop(self, n: int) -> list[int]:
        out = [self.stack.pop() for _ in range(n)]
        return out

    def release(self, blocks: list[int]) -> None:
        """Drop the references (already removed from their owners) and push the zeroed ones."""
        refs = Counter(b for owned in self.seqs.values() for b in owned)
        for b in blocks:
            assert 0 <= b < self.num_blocks
        remaining = Counter(blocks)
        zeroed = []
        for b in blocks:
            remaining[b] -= 1
            if refs[b] == 0 and remaining[b] == 0:
                zeroed.append(b)
        self.stack.extend(reversed(zeroed))

    def new_seq(self, blocks: list[int]) -> int:
        sid = self.next_seq
        self.next_seq += 1
        self.seqs[sid] = list(blocks)
        return sid


def check(a, model: Model) -> None:
    refs = a.ref_counts().tolist()
    expected = model.refs()
    assert refs == expected, "reference counts differ from the ownership model"
    assert all(r >= 0 for r in refs)
    free = sum(1 for r in refs if r == 0)
    assert a.num_free == free == len(model.stack)
    assert sorted(model.stack) == [b for b in range(model.num_blocks) if refs[b] == 0]


def expect_unchanged(a, model: Model, exc: type[BaseException], call) -> None:
    before = a.ref_counts().tolist(), a.num_free
    with pytest.raises(exc):
        call()
    assert (a.ref_counts().tolist(), a.num_free) == before
    check(a, model)


@pytest.mark.parametrize("seed,num_blocks", [(0, 48), (1, 7), (2, 200)])
def test_random_operations_match_model(seed: int, num_blocks: int) -> None:
    rng = random.Random(seed)
    a = _C.BlockAllocator(num_blocks)
    model = Model(num_blocks)
    ops = ["allocate", "extend", "allocate_batch", "free_tail", "finish", "finish_batch", "fork",
           "double_free", "out_of_range", "incref_free", "exhaust"]
    weights = [10, 12, 5, 8, 8, 3, 6, 3, 2, 2, 3]
    seen = Counter()
    for _ in range(10_000):
        op = rng.choices(ops, weights)[0]
        seen[op] += 1
        sids = list(model.seqs)
        if op == "allocate":
            n = rng.randint(0, 6)
            if n > len(model.stack):
                expect_unchanged(a, model, _C.OutOfBlocksError, lambda n=n: a.allocate(n))
                continue
            got = a.allocate(n).tolist()
            assert got == model.pop(n)  # deterministic LIFO order
            model.new_seq(got)
        elif op == "extend" and sids:
            sid = rng.choice(sids)
            n = rng.randint(1, 4)
            if n > len(model.stack):
                expect_unchanged(a, model, _C.OutOfBlocksError, lambda n=n: a.allocate(n))
                continue
            got = a.allocate(n).tolist()
            assert got == model.pop(n)
            model.seqs[sid].extend(got)
        elif op == "allocate_batch":
            counts = [rng.randint(0, 4) for _ in range(rng.randint(0, 4))]
            if sum(counts) > len(model.stack):
                expect_unchanged(a, model, _C.OutOfBlocksError,
                                 lambda c=counts: a.allocate_batch(c))
                continue
            got = [x.tolist() for x in a.allocate_batch(counts)]
            assert [len(x) for x in got] == counts
            for blocks in got:
                assert blocks == model.pop(len(blocks))
                model.new_seq(blocks)
        elif op == "free_tail" and sids:
            # A sequence gives back its last few blocks (e.g. a rejected speculative tail).
            sid = rng.choice(sids)
            owned = model.seqs[sid]
            k = rng.randint(0, len(owned))
            tail = owned[len(owned) - k:]
            del owned[len(owned) - k:]
            a.free(np.asarray(tail, dtype=rng.choice([np.int32, np.int64])))
            model.release(tail)
        elif op == "finish" and sids:
            sid = rng.choice(sids)
            blocks = model.seqs.pop(sid)
            a.free(blocks)
            model.release(blocks)
        elif op == "finish_batch" and sids:
            chosen = rng.sample(sids, rng.randint(1, min(4, len(sids))))
            lists = [model.seqs.pop(s) for s in chosen]
            a.free_batch(lists)
            model.release([b for blocks in lists for b in blocks])
        elif op == "fork" and sids:
            # A new sequence shares a prefix of an existing one (references, not copies).
            parent = model.seqs[rng.choice(sids)]
            prefix = parent[: rng.randint(0, len(parent))]
            a.incref(prefix)
            model.new_seq(prefix)
        elif op == "double_free":
            refs = model.refs()
            owned = [b for b in range(num_blocks) if refs[b] > 0]
            if owned and rng.random() < 0.5:
                b = rng.choice(owned)
                bad = [b] * (refs[b] + 1)  # one more reference than exists
            else:
                free_ids = [b for b in range(num_blocks) if refs[b] == 0]
                if not free_ids:
                    continue
                bad = [rng.choice(free_ids)]
            valid = owned[:1]  # a valid id in the same call must not be freed either
            mixed = valid + bad
            rng.shuffle(mixed)
            expect_unchanged(a, model, ValueError, lambda m=mixed: a.free(m))
        elif op == "out_of_range":
            bad = rng.choice([-1, num_blocks, num_blocks + rng.randint(1, 1000), -(2**33)])
            refs = model.refs()
            valid = [b for b in range(num_blocks) if refs[b] > 0][:2]
            call = rng.choice([a.free, a.incref])
            expect_unchanged(a, model, ValueError, lambda c=call, v=valid + [bad]: c(v))
            expect_unchanged(a, model, ValueError, lambda b=bad: a.ref_count(b))
        elif op == "incref_free":
            refs = model.refs()
            free_ids = [b for b in range(num_blocks) if refs[b] == 0]
            if free_ids:
                b = rng.choice(free_ids)
                expect_unchanged(a, model, ValueError, lambda b=b: a.incref([b]))
        elif op == "exhaust":
            n = len(model.stack) + rng.randint(1, 3)
            expect_unchanged(a, model, _C.OutOfBlocksError, lambda n=n: a.allocate(n))
            expect_unchanged(a, model, _C.OutOfBlocksError,
                             lambda n=n: a.allocate_batch([0, n - 1, 1]))
        check(a, model)
        for b in rng.sample(range(num_blocks), min(3, num_blocks)):
            assert a.ref_count(b) == model.refs()[b]
    # Every kind of operation really happened, and the pool is whole once everyone finishes.
    assert all(seen[op] > 50 for op in ops)
    a.free_batch(list(model.seqs.values()))
    assert a.num_free == num_blocks and not any(a.ref_counts())
