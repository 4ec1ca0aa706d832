"""verify_tree against a brute-force walk: random trees, a target whose token at a row depends on the path."""

from __future__ import annotations

import random

import pytest

from specchat.backend.api import TokenSource
from specchat.backend.speculative.verify import verify_tokens, verify_tree


def random_tree(rng: random.Random, n: int, vocab: int) -> tuple[list[int], list[int]]:
    tokens, parents = [], []
    for i in range(n):
        parents.append(rng.randrange(-1, i))
        tokens.append(rng.randrange(vocab))
    return tokens, parents


def brute_force(tokens, parents, target):
    """Every root-to-node path whose tokens are the target's own, the longest first found."""

    def path_to(node):
        out = []
        while node != -1:
            out.append(node)
            node = parents[node]
        return out[::-1]

    best: list[int] = []
    for node in range(len(tokens)):
        path = path_to(node)
        ok = all(tokens[n] == target([tokens[m] for m in path[:d]]) for d, n in enumerate(path))
        # among equal-token siblings the first is followed: a path through a later twin is not the walk's
        twins = all(
            min(i for i in range(len(tokens)) if parents[i] == parents[n] and tokens[i] == tokens[n]) == n for n in path
        )
        if ok and twins and len(path) > len(best):
            best = path
    return best


@pytest.mark.parametrize("block", range(3))
def test_the_walk_follows_the_targets_own_path(block):
    for seed in range(block * 100, block * 100 + 100):
        check_one_tree(random.Random(seed))


def check_one_tree(rng: random.Random) -> None:
    vocab = rng.choice([2, 3, 5])
    tokens, parents = random_tree(rng, rng.randrange(0, 12), vocab)
    salt = rng.randrange(1 << 30)

    def target(path):  # the target's token after a path: any fixed function of the path
        return hash((salt, tuple(path))) % vocab

    asked: list[tuple[int, list[int]]] = []

    def decide(row, path):
        asked.append((row, list(path)))
        return target(path)

    result = verify_tree(decide, tokens, parents)
    path = brute_force(tokens, parents, target)
    assert result.path == path
    accepted = [tokens[n] for n in path]
    assert result.tokens == accepted + [target(accepted)]
    assert result.accepted == len(path)
    has_children = any(p == (path[-1] if path else -1) for p in parents)
    assert result.sources[-1] is (
        TokenSource.TARGET if not tokens else TokenSource.RECOVERED if has_children else TokenSource.BONUS
    )
    assert result.tried == len(path) + has_children
    # only the rows on the path were decided, each with exactly its ancestors' tokens
    assert [row for row, _ in asked] == [0] + [n + 1 for n in path]
    assert [p for _, p in asked] == [accepted[:d] for d in range(len(path) + 1)]


def test_a_chain_as_a_tree_verifies_as_a_chain():
    rng = random.Random(0)
    for _ in range(200):
        draft = [rng.randrange(3) for _ in range(rng.randrange(0, 6))]
        targets = [rng.randrange(3) for _ in range(len(draft) + 1)]
        chain = verify_tokens(targets, draft)
        tree = verify_tree(lambda row, path, t=targets: t[row], draft, list(range(-1, len(draft) - 1)))
        assert (tree.tokens, tree.sources, tree.accepted) == (chain.tokens, chain.sources, chain.accepted)
        assert tree.positions_tried == chain.positions_tried


def test_a_parent_after_its_child_is_refused():
    with pytest.raises(ValueError, match="parent"):
        verify_tree(lambda row, path: 0, [1, 2], [1, -1])
