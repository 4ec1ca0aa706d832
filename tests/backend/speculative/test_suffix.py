"""suffix_index.py and suffix.py: the matching structure against a brute-force matcher (hypothesis), the bounded
memory of earlier replies, and the trees the suffix drafter proposes (branches, depth, budget, EOS, loops)."""

from __future__ import annotations

import doctest

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specchat.backend.speculative.drafters import suffix_index
from specchat.backend.speculative.drafters.suffix import ReplyMemory, SuffixDrafter
from specchat.backend.speculative.drafters.suffix_index import SuffixIndex


def test_worked_example() -> None:
    assert doctest.testmod(suffix_index).failed == 0


def brute_matches(
    seqs: list[list[int]], query: list[int], key_len: int, max_match: int, max_occurrences: int
) -> list[tuple[int, int]]:
    """(end, length) of every occurrence of the query's last key_len tokens, as SuffixIndex defines them."""
    flat: list[int] = []
    for i, s in enumerate(seqs):
        flat += s + ([-1] if i < len(seqs) - 1 else [])
    per_key: dict[tuple[int, ...], list[int]] = {}
    start = 0
    for s in seqs:
        for e in range(start + key_len, start + len(s) + 1):
            per_key.setdefault(tuple(flat[e - key_len : e]), []).append(e)
        start += len(s) + 1
    ends = per_key.get(tuple(query[-key_len:]), [])[-max_occurrences:]
    out = []
    for e in reversed(ends):
        if e >= len(flat) or flat[e] == -1:
            continue
        length = 0
        while (
            length < max_match
            and length < len(query)
            and e - length - 1 >= 0
            and flat[e - length - 1] == query[-length - 1]
            and flat[e - length - 1] != -1
        ):
            length += 1
        out.append((e, length))
    out.sort(key=lambda m: -m[1])
    return out


@settings(max_examples=200, deadline=None)
@given(
    seqs=st.lists(st.lists(st.integers(0, 3), max_size=30), min_size=1, max_size=4),
    query=st.lists(st.integers(0, 3), min_size=1, max_size=12),
    key_len=st.integers(1, 3),
    max_match=st.integers(3, 8),
    max_occurrences=st.integers(1, 6),
)
def test_matches_equal_a_brute_force_matcher(seqs, query, key_len, max_match, max_occurrences) -> None:
    max_match = max(max_match, key_len)
    index = SuffixIndex(key_len=key_len, max_match=max_match, max_occurrences=max_occurrences)
    for s in seqs:
        index.add_sequence(s[: len(s) // 2])
        index.extend(s[len(s) // 2 :])  # grown in two steps, as a conversation grows
    got = [(m.end, m.length) for m in index.matches(query, limit=100)]
    assert got == brute_matches(seqs, query, key_len, max_match, max_occurrences)
    for m in index.matches(query, limit=100):
        cont = index.continuation(m, 5)
        assert -1 not in cont and cont == index.tokens[m.end : m.end + len(cont)]
    assert index.sequences() == [list(s) for s in seqs]


def test_dropping_the_oldest_sequences_rebuilds_the_rest() -> None:
    index = SuffixIndex(key_len=2)
    for s in ([1, 2, 3, 4], [1, 2, 9], [5, 1, 2, 7]):
        index.add_sequence(s)
    index.close_sequence()
    index.drop_oldest(1)
    assert index.sequences() == [[1, 2, 9], [5, 1, 2, 7]]
    assert sorted(index.continuation(m, 1)[0] for m in index.matches([1, 2], limit=5)) == [7, 9]


def test_reply_memory_is_bounded_and_drops_the_oldest() -> None:
    memory = ReplyMemory(max_tokens=100, key_len=2)
    rebuilds = []
    drop = memory.index.drop_oldest
    memory.index.drop_oldest = lambda count: (rebuilds.append(count), drop(count))
    for i in range(30):
        memory.remember([i, i + 1000, i + 2000, i + 3000, i + 4000])
        assert memory.num_tokens <= 100
    # Full at reply 20: the six oldest go (down to 75 tokens), again at reply 26; the newest are kept.
    assert rebuilds == [6, 6] and memory.index.num_sequences == 18
    assert [seq[0] for seq in memory.index.sequences()] == list(range(12, 30))
    memory.remember(list(range(500)))  # a reply longer than the whole budget keeps its end
    assert memory.num_tokens == 100 and memory.index.sequences() == [list(range(400, 500))]
    memory.clear()
    assert memory.num_tokens == 0


def test_a_single_occurrence_drafts_a_chain_of_its_continuation() -> None:
    drafter = SuffixDrafter(key_len=2, min_prob=0.1)
    context = [9, 1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3]
    draft = drafter.propose(context, 4)
    assert draft.token_ids == [4, 5, 6, 7] and draft.parents == [-1, 0, 1, 2] and not draft.is_tree
    assert drafter.last_tree == (4, 4)
    assert drafter.propose(context + [99], 4).token_ids == []  # nothing ends like "3 99"


def test_disagreeing_occurrences_make_branches_by_frequency() -> None:
    # "0 1 2 3" was followed by "7 0" once and "4 5" once, with equal matches: two branches of weight 1/2.
    context = [9, 0, 1, 2, 3, 7, 0, 8, 0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3]
    drafter = SuffixDrafter(key_len=3, min_prob=0.1)
    draft = drafter.propose(context, 6)
    assert draft.is_tree and draft.parents.count(-1) == 2
    paths = {tuple(_path(draft, i)) for i in range(len(draft.token_ids))}
    assert {(7,), (4,), (7, 0), (4, 5)} <= paths
    assert all(p < i for i, p in enumerate(draft.parents))  # parents come first
    # A longer match outvotes shorter ones, which stay as a branch: "5 0 1 2 3" matched once (then 9 9),
    # "0 1 2 3" twice more (then 4): weights 1 vs 2 x 1/2.
    longer = [5, 0, 1, 2, 3, 9, 9, 8, 0, 1, 2, 3, 4, 6, 0, 1, 2, 3, 4, 6, 5, 0, 1, 2, 3]
    draft = SuffixDrafter(key_len=3, min_prob=0.1).propose(longer, 4)
    assert draft.token_ids[0] in (9, 4) and {(9,), (4,)} <= {tuple(_path(draft, i)) for i in range(4)}
    assert SuffixDrafter(key_len=3, min_prob=0.6).propose(longer, 4).token_ids == []  # no branch reaches 0.6


def test_budget_depth_eos_and_loops() -> None:
    eos = 2
    drafter = SuffixDrafter(key_len=2, eos_token_ids=[eos], spec_factor=1.0, spec_offset=0.0)
    context = [5, 6, 7, eos, 9, 5, 6]
    assert drafter.propose(context, 10).token_ids == [7, eos]  # cut after the EOS, kept
    loop = [3, 4] * 6
    draft = SuffixDrafter(key_len=2).propose(loop, 9)
    assert draft.token_ids == [3, 4, 3, 4, 3, 4, 3, 4, 3]  # runs past the context's end, copying itself
    assert len(SuffixDrafter(key_len=2).propose(loop, 3).token_ids) == 3  # the node budget
    shallow = SuffixDrafter(key_len=2, spec_factor=0.0, spec_offset=2.0)
    assert len(shallow.propose([8, 1, 2, 3, 4, 5, 1, 2], 10).token_ids) == 2  # depth = factor·match + offset


def test_earlier_replies_draft_what_the_conversation_never_said() -> None:
    memory = ReplyMemory(key_len=2)
    memory.remember([10, 11, 12, 13, 14])
    drafter = SuffixDrafter(memory=memory, key_len=2)
    assert drafter.propose([1, 2, 10, 11], 3).token_ids == [12, 13, 14]
    assert SuffixDrafter(memory=None, key_len=2).propose([1, 2, 10, 11], 3).token_ids == []


def test_a_changed_conversation_is_reindexed() -> None:
    drafter = SuffixDrafter(key_len=2)
    assert drafter.propose([1, 2, 3, 1, 2], 1).token_ids == [3]
    assert drafter.propose([7, 8, 9, 7, 8], 1).token_ids == [9]  # not the old conversation's "3"


def _path(draft, i: int) -> list[int]:
    out = []
    while i >= 0:
        out.append(draft.token_ids[i])
        i = draft.parents[i]
    return out[::-1]


@pytest.mark.parametrize("budget", [1, 4, 16])
def test_every_path_is_a_prefix_of_a_longest_match_continuation(budget) -> None:
    import random

    rng = random.Random(budget)
    for _ in range(50):
        context = [rng.randrange(4) for _ in range(rng.randrange(5, 60))]
        drafter = SuffixDrafter(key_len=2, min_prob=0.0, max_occurrences=64)
        draft = drafter.propose(context, budget)
        if not draft.token_ids:
            continue
        index = SuffixIndex(key_len=2, max_match=64, max_occurrences=64)
        index.add_sequence(context)
        found = index.matches(context, limit=100, exclude_end=len(context))
        conts = []
        for m in found:
            cont: list[int] = []
            for j in range(64):
                src = m.end + j
                cont.append(context[src] if src < len(context) else cont[src - len(context)])
            conts.append(cont)
        assert len(draft.token_ids) <= budget
        for i in range(len(draft.token_ids)):
            path = _path(draft, i)
            assert any(c[: len(path)] == path for c in conts), (context, path)
