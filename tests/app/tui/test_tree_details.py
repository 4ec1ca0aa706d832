"""The details panel's line about the suffix drafter's latest tree (issue 17): its size and shape, and the
branch the target followed; nothing for chain drafters."""

from __future__ import annotations

from specchat.app.tui.bridge import LiveView
from specchat.app.tui.widgets.details_panel import render_details
from specchat.backend.api import RequestStats


def test_the_latest_tree_and_the_branch_the_target_followed() -> None:
    stats = RequestStats(drafter="suffix", tree_nodes=12, tree_depth=5, tree_width=3, tree_accepted=4, tree_branch=2)
    text = render_details(LiveView(stats=stats, drafter="suffix")).plain
    assert "tree 12 nodes · depth 5 · 3 branches; followed branch 2 for 4 tokens" in text
    missed = RequestStats(drafter="suffix", tree_nodes=1, tree_depth=1, tree_width=1)
    assert "tree 1 node · depth 1 · 1 branch; no branch matched" in render_details(LiveView(stats=missed)).plain


def test_a_chain_drafter_shows_no_tree() -> None:
    stats = RequestStats(drafter="prompt-lookup", drafted=8, accepted=5)
    assert "tree " not in render_details(LiveView(stats=stats, drafter="prompt-lookup")).plain


def test_a_heads_tree_shows_its_size_and_the_acceptance_per_depth() -> None:
    stats = RequestStats(
        drafter="eagle3", tree_nodes=7, tree_depth=4, tree_width=3, tree_accepted=2, tree_branch=1,
        per_position_acceptance=(0.8, 0.6, 0.25, None),
    )  # fmt: skip
    text = render_details(LiveView(stats=stats, drafter="eagle3")).plain
    assert "tree 7 nodes · depth 4 · 3 branches; followed branch 1 for 2 tokens" in text
    assert "Per-depth acceptance" in text and " 1 " in text and "80%" in text and "25%" in text
    chain = render_details(LiveView(stats=RequestStats(drafter="prompt-lookup", drafted=3))).plain
    assert "Per-position acceptance" in chain
