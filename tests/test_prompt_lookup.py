import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from drafters import DraftContext, PromptLookupDrafter, find_ngram_continuation
from drafters.prompt_lookup import NgramIndex, _continue


@pytest.mark.parametrize(
    "tokens, min_n, max_n, k, expected",
    [
        # no earlier occurrence of any suffix n-gram: no draft
        ([1, 2, 3, 4], 2, 4, 5, ([], 0)),
        # bigram (3, 4) occurred before: copy what followed it
        ([1, 3, 4, 9, 9, 3, 4], 2, 4, 5, ([9, 9, 3, 4, 9], 2)),
        # the longer match wins over a more recent shorter one
        ([7, 3, 4, 5, 8, 4, 5, 6, 3, 4, 5], 2, 4, 2, ([8, 4], 3)),
        # tie rule: among equally long matches the most recent occurrence wins
        ([1, 2, 10, 1, 2, 20, 1, 2], 2, 2, 1, ([20], 2)),
        # k caps the continuation
        ([1, 2, 3, 4, 5, 6, 1, 2], 2, 3, 3, ([3, 4, 5], 2)),
        # a loop: the continuation repeats with the loop's period
        ([5, 6, 5, 6, 5, 6], 2, 3, 5, ([5, 6, 5, 6, 5], 3)),
        ([9, 7, 7, 7], 2, 2, 4, ([7, 7, 7, 7], 2)),
        # min_n larger than any match: nothing
        ([1, 2, 1, 2], 3, 4, 3, ([], 0)),
    ],
)
def test_find_ngram_continuation_table(tokens, min_n, max_n, k, expected):
    assert find_ngram_continuation(tokens, min_n, max_n, k) == expected


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 5), min_size=1, max_size=60),
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    k=st.integers(1, 8),
)
def test_incremental_index_matches_reference(tokens, min_n, extra, k):
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n)
    for i, t in enumerate(tokens):  # grow one token at a time, checking every prefix
        index.extend([t])
        end, n = index.find()
        found = (_continue(index.tokens, end, k), n) if n else ([], 0)
        assert found == find_ngram_continuation(tokens[: i + 1], min_n, max_n, k)


def test_drafter_follows_growing_context_and_respects_max_len():
    drafter = PromptLookupDrafter(min_n=2, max_n=4)
    tokens = [1, 2, 3, 4, 5, 1, 2]
    draft = drafter.propose(DraftContext(tokens), max_len=2)
    assert draft.tokens == [3, 4] and draft.match_length == 2
    tokens += [3, 4]
    drafter.on_commit(2, DraftContext(tokens))
    draft = drafter.propose(DraftContext(tokens), max_len=7)
    assert draft.tokens == [5, 1, 2, 3, 4, 5, 1] and draft.match_length == 4
    assert drafter.propose(DraftContext(tokens), max_len=0).tokens == []


def test_drafter_resets_when_history_is_rewritten():
    drafter = PromptLookupDrafter(2, 3)
    drafter.propose(DraftContext([1, 2, 3, 1, 2]), 3)
    draft = drafter.propose(DraftContext([9, 8, 9]), 3)  # a different sequence entirely
    assert draft.tokens == [] and drafter.index.tokens == [9, 8, 9]


def test_index_lookup_cost_does_not_grow_with_context():
    rng = random.Random(0)
    index = NgramIndex(2, 5)
    index.extend([rng.randrange(50_000) for _ in range(32_000)])
    # the index holds at most (max_n - min_n + 1) keys per position and lookup touches
    # at most that many keys: count dictionary probes by wrapping both dicts
    probes = 0

    class Counting(dict):
        def get(self, key, default=None):
            nonlocal probes
            probes += 1
            return super().get(key, default)

    index._last_end, index._ends = Counting(index._last_end), Counting(index._ends)
    index.find()
    assert probes == 4  # (random tokens: no suffix n-gram recurs, so every length is probed)


def test_match_length_is_the_extent_of_the_match_up_to_its_cap():
    """An n-gram matched at max_n is extended backwards while both occurrences agree: a copied
    span reports how long it has been copied, a chance phrase only the n-gram."""
    copied = list(range(10, 30))  # 20 distinct tokens, then the first 12 of them again
    drafter = PromptLookupDrafter(min_n=2, max_n=4)
    draft = drafter.propose(DraftContext(copied + copied[:12]), max_len=3)
    assert draft.tokens == [22, 23, 24] and draft.match_length == 12
    drafter.MAX_EXTENT = 7
    assert drafter.propose(DraftContext(copied + copied[:12]), max_len=3).match_length == 7
    chance = [1, 2, 3, 4, 5, 6, 9, 3, 4, 5, 6]  # "3 4 5 6" recurs after a different token
    draft = PromptLookupDrafter(min_n=2, max_n=4).propose(DraftContext(chance), max_len=2)
    assert draft.tokens == [9, 3] and draft.match_length == 4
    short = [7, 8, 1, 2, 9, 1, 2]  # below max_n: the (n+1)-gram did not occur, so no extension
    assert PromptLookupDrafter(min_n=2, max_n=4).propose(DraftContext(short), max_len=1).match_length == 2


def test_the_occurrence_whose_match_extends_furthest_back_is_copied():
    """The last occurrence of the 4-gram "3 4 5 6" is a chance repeat (after 9); an older one
    follows "1 2" as the current suffix does: that one's continuation is drafted, and its
    extent reported. Among equally long extents the most recent occurrence still wins."""
    tokens = [1, 2, 3, 4, 5, 6, 70, 71, 9, 3, 4, 5, 6, 80, 81, 1, 2, 3, 4, 5, 6]
    draft = PromptLookupDrafter(min_n=2, max_n=4).propose(DraftContext(tokens), max_len=2)
    assert draft.tokens == [70, 71] and draft.match_length == 6
    tied = [9, 8, 3, 4, 5, 6, 70, 7, 8, 3, 4, 5, 6, 80, 8, 3, 4, 5, 6]  # both extend to 5
    draft = PromptLookupDrafter(min_n=2, max_n=4).propose(DraftContext(tied), max_len=1)
    assert draft.tokens == [80] and draft.match_length == 5
    one = PromptLookupDrafter(min_n=2, max_n=4)
    one.MATCH_CANDIDATES = 1  # only the most recent occurrence: the chance repeat
    one.reset()
    assert one.propose(DraftContext(tokens), max_len=2).tokens == [80, 81]
    with pytest.raises(ValueError):
        NgramIndex(2, 4, keep=0)


def _longest_match_brute_force(tokens, min_n, max_n, cap, candidates):
    """find_ngram_continuation's match; for a max_n-gram, the longest extent among its last
    ``candidates`` earlier occurrences (the most recent among equals)."""
    size = len(tokens)

    def extent(end):
        length = 0
        while length < cap and end - length >= 0 and tokens[end - length] == tokens[size - 1 - length]:
            length += 1
        return length

    for n in range(min(max_n, size - 1), min_n - 1, -1):
        ends = [e for e in range(n - 1, size - 1) if tokens[e - n + 1 : e + 1] == tokens[size - n :]]
        if ends:
            pool = ends[-candidates:] if n == max_n else ends[-1:]
            best = max(reversed(pool), key=extent)  # max keeps the first (most recent) of equals
            return best, max(n, extent(best)) if n < cap else n
    return -1, 0


@settings(max_examples=300, deadline=None)
@given(
    tokens=st.lists(st.integers(0, 3), min_size=30, max_size=70),  # long enough to repeat 5-grams often
    min_n=st.integers(1, 3),
    extra=st.integers(0, 3),
    cap=st.sampled_from([3, 6, 32]),
    candidates=st.integers(1, 5),
)
def test_longest_match_matches_brute_force(tokens, min_n, extra, cap, candidates):
    max_n = min_n + extra
    index = NgramIndex(min_n, max_n, keep=candidates)
    for i, t in enumerate(tokens):
        index.extend([t])
        assert index.longest_match(cap) == _longest_match_brute_force(
            tokens[: i + 1], min_n, max_n, cap, candidates)
