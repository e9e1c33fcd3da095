"""A request's ``n`` samples (a GRPO group, ``specengine.core.prefix_cache``): each sample's
seed, its params and its request id, in-process (no engine).

Sample 0 keeps the request's seed (so ``n=1`` is the request exactly); sample i > 0 gets
splitmix64(seed + i * golden ratio), the i-th output of a splitmix64 generator seeded with the
request's seed, reduced to [0, 2**63). The splitmix64 outputs below are the published test
vectors of the generator (Rosetta Code, "Pseudo-random numbers/Splitmix64"; Vigna's reference
``splitmix64.c`` seeded with 0), not values read off this code."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest

from specengine.core.prefix_cache import (
    SeqGroup,
    expand_samples,
    prefix_caching_on,
    sample_ids,
    sample_seed,
)
from specengine.sampling import MAX_SEED, SamplingParams

# the first outputs of splitmix64 seeded with 1234567 (Rosetta Code's vectors)
SPLITMIX_1234567 = [6457827717110365317, 3203168211198807973, 9817491932198370423,
                    4593380528125082431, 16408922859458223821]


def test_sample_seeds_are_the_splitmix64_sequence_of_the_request_seed() -> None:
    assert MAX_SEED == 2**63
    for i, out in enumerate(SPLITMIX_1234567, start=1):
        assert sample_seed(1234567, i) == out % MAX_SEED
    assert sample_seed(0, 1) == 0xE220A8397B1DCDAF % MAX_SEED  # splitmix64.c from state 0


def test_sample_zero_keeps_the_request_seed() -> None:
    for seed in (0, 1, 1234567, MAX_SEED - 1):
        assert sample_seed(seed, 0) == seed


def test_sample_seeds_wrap_at_64_bits_and_stay_below_max_seed() -> None:
    """The mix is modulo 2**64 (a large seed wraps), and the result fits a request seed."""
    seeds = [sample_seed(MAX_SEED - 1, i) for i in range(1, 200)]
    assert all(0 <= s < MAX_SEED for s in seeds) and len(set(seeds)) == len(seeds)
    # seed + 2**64 mixes like seed: only the 64-bit state counts
    assert sample_seed(5 + 2**64, 3) == sample_seed(5, 3)


def test_one_sample_is_the_request_itself() -> None:
    sp = SamplingParams(seed=9, max_tokens=4)
    [(params, sample)] = expand_samples(sp)
    assert params is sp and sample is None


def test_a_group_of_n_samples_shares_one_group_and_numbers_them() -> None:
    sp = SamplingParams(n=3, seed=1234567, temperature=0.7, max_tokens=5)
    out = expand_samples(sp)
    groups = {g for _, (g, _) in out}
    assert len(groups) == 1
    group = groups.pop()
    assert isinstance(group, SeqGroup) and group.n == 3
    assert [i for _, (_, i) in out] == [0, 1, 2]
    for i, (params, _) in enumerate(out):
        assert params == dataclasses.replace(sp, n=1, seed=sample_seed(1234567, i))
    assert [p.seed for p, _ in out] == [1234567, *(s % MAX_SEED for s in SPLITMIX_1234567[:2])]
    # another request's group is another group
    assert expand_samples(sp)[0][1][0].group_id != group.group_id


def test_unseeded_samples_draw_their_own_seeds() -> None:
    out = expand_samples(SamplingParams(n=2))
    assert [p.seed for p, _ in out] == [None, None] and all(p.n == 1 for p, _ in out)


def test_sample_request_ids() -> None:
    free = lambda rid: False  # noqa: E731
    assert sample_ids("r", 1, free) == ["r"]
    assert sample_ids(None, 3, free) == [None, None, None]
    assert sample_ids("r", 3, free) == ["r-0", "r-1", "r-2"]


@pytest.mark.parametrize("rid", ["", 7])
def test_a_group_needs_a_non_empty_string_request_id(rid: object) -> None:
    with pytest.raises(ValueError, match=f"^request_id must be a non-empty str, got {rid!r}$"):
        sample_ids(rid, 2, lambda r: False)  # type: ignore[arg-type]


def test_taken_sample_ids_are_refused_naming_three_at_most() -> None:
    taken = {"g-1", "g-2", "g-3", "g-4"}
    with pytest.raises(ValueError) as err:
        sample_ids("g", 5, taken.__contains__)
    assert str(err.value) == ("request ids ['g-1', 'g-2', 'g-3'] of the 5 samples of 'g' are "
                              "already used by unfinished requests")


def test_prefix_caching_follows_the_config_and_defaults_on() -> None:
    assert prefix_caching_on(SimpleNamespace(), None) is True
    assert prefix_caching_on(SimpleNamespace(enable_prefix_caching=False), object()) is False
    assert prefix_caching_on(SimpleNamespace(enable_prefix_caching=True), object()) is True
    assert prefix_caching_on(SimpleNamespace(enable_prefix_caching=0), None) is False
