"""Tree drafts through the engine: the reply equals plain decoding token for token, greedy and seeded-sampled.

An oracle drafter that knows plain decoding's reply builds trees with wrong branches before, beside and after the
target's own path (several branches at several depths, EOS inside a branch, the token limit inside a branch), so
every step exercises the tree mask, the per-row reply positions, the repetition penalty of a node (its ancestors,
not the nodes before it) and the move of the accepted path's K/V. The real suffix drafter is checked the same way
on repetitive prompts.
"""

from __future__ import annotations

import random

import pytest
from engine_fixtures import tiny_engine
from tiny_models import FAMILIES, VOCAB_SIZE, one_thread, random_ids  # noqa: F401  (one_thread: autouse)

from specchat.backend.api import GenerationRequest, PolicyState, SamplingParams, TokenSource
from specchat.backend.speculative.drafters.base import Draft, StatelessHooks
from specchat.backend.speculative.request_stats import SpecStats

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=1234, max_new_tokens=40)
PENALISED = SamplingParams(temperature=0.0, repetition_penalty=1.5, max_new_tokens=40)


def run(engine, **kw):
    events = list(engine.generate(GenerationRequest(**kw)))
    return [t for e in events for t in e.token_ids], events


class OracleTree(StatelessHooks):
    """Trees around plain decoding's reply ``reference``: at each depth a wrong sibling (itself with a child)
    comes before the true node; the wrong sibling's token is the *next* true token, so a row that wrongly sees
    its siblings under a repetition penalty decides otherwise. With ``miss_every`` the true node is left out at
    some depths (the target's token is then recovered), and ``eos`` hangs an EOS leaf beside the path."""

    name = "suffix"

    def __init__(
        self, prompt_len: int, reference: list[int], *, seed: int = 0, miss_every: int = 0, eos: int | None = None
    ) -> None:
        self.prompt_len, self.reference, self.eos, self.miss_every = prompt_len, reference, eos, miss_every
        self.rng = random.Random(seed)
        self.trees: list[list[int]] = []

    def propose(self, context, max_tokens):
        done = len(context) - self.prompt_len
        truth = self.reference[done : done + 6]
        tokens: list[int] = []
        parents: list[int] = []
        parent = -1
        for depth, token in enumerate(truth):
            after = truth[depth + 1] if depth + 1 < len(truth) else token
            wrong = after if after != token else (token + 7) % VOCAB_SIZE
            tokens.append(wrong)
            parents.append(parent)
            tokens.append(self.rng.randrange(3, VOCAB_SIZE))  # the wrong branch goes on a little
            parents.append(len(tokens) - 2)
            if self.eos is not None and depth == 1 and token != self.eos:
                tokens.append(self.eos)
                parents.append(parent)
            if self.miss_every and self.rng.randrange(self.miss_every) == 0:
                break  # the true token is not in the tree at this depth
            tokens.append(token)
            parents.append(parent)
            parent = len(tokens) - 1
        self.trees.append(parents[:max_tokens])
        return Draft(token_ids=tokens[:max_tokens], parents=parents[:max_tokens])


def no_eos(engine):
    """Random tiny models say EOS often; without it every reply runs to its token limit (more steps to check)."""
    engine.eos_ids = frozenset()
    return engine


def tree_run(family, sampling, prompt, *, gamma=16, **oracle):
    reference, _ = run(no_eos(tiny_engine(family, drafter="none")), prompt_ids=prompt, sampling=sampling)
    engine = no_eos(tiny_engine(family, drafter="suffix", gamma=gamma))
    drafter = OracleTree(len(prompt), reference, **oracle)
    engine.drafters["suffix"] = drafter
    ids, events = run(engine, prompt_ids=prompt, sampling=sampling)
    return reference, ids, events, drafter


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED, PENALISED], ids=["greedy", "sampled", "penalised"])
def test_tree_drafts_give_plain_decodings_reply(family, sampling):
    reference, ids, events, drafter = tree_run(family, sampling, random_ids(20, seed=3), miss_every=4)
    assert ids == reference
    branching = [p for p in drafter.trees if len(p) != len(set(p))]
    assert branching, "the oracle proposed no tree with branches"
    stats = events[-1].stats
    assert stats.accepted > 0 and stats.tree_nodes > 0 and stats.tree_width > 1 and stats.tree_depth >= 2
    spec = [e for e in events if e.policy is PolicyState.SPECULATING]
    assert spec and sum(e.gamma for e in spec) == stats.drafted  # drafted counts the nodes verified
    assert TokenSource.RECOVERED in {s for e in events for s in e.sources}


@pytest.mark.parametrize("gamma", [1, 3, 16, "auto"])
def test_tree_drafts_at_every_budget(gamma):
    reference, ids, _, _ = tree_run("llama", SAMPLED, random_ids(20, seed=4), gamma=gamma)
    assert ids == reference


@pytest.mark.parametrize("max_new_tokens", [5, 6, 7, 9])
def test_the_token_limit_inside_a_branch(max_new_tokens):
    sampling = SamplingParams(temperature=0.8, seed=7, max_new_tokens=max_new_tokens)
    reference, ids, events, _ = tree_run("qwen2", sampling, random_ids(20, seed=5))
    assert ids == reference and len(ids) == max_new_tokens
    assert events[-1].finish_reason == "length"


def test_eos_inside_a_branch_and_on_the_path():
    prompt = random_ids(20, seed=6)
    free, _ = run(no_eos(tiny_engine("llama", drafter="none")), prompt_ids=prompt, sampling=GREEDY)
    stop = free[9]  # make the 10th token the end of the reply: EOS on the path, deep inside a tree
    reference = free[: free.index(stop) + 1]
    for eos_on_side in (None, stop):
        engine = tiny_engine("llama", drafter="suffix", gamma=16)
        engine.eos_ids = frozenset({stop})
        engine.drafters["suffix"] = OracleTree(len(prompt), free, eos=eos_on_side)
        ids, events = run(engine, prompt_ids=prompt, sampling=GREEDY)
        assert ids == reference and events[-1].finish_reason == "eos"


def test_the_cache_after_a_tree_serves_the_next_turn():
    """The accepted path's K/V moved into place: a second turn reusing the conversation equals a fresh one."""
    prompt = random_ids(20, seed=8)
    reference, ids, _, _ = tree_run("gemma2", GREEDY, prompt)
    assert ids == reference
    engine = no_eos(tiny_engine("gemma2", drafter="suffix", gamma=16))
    engine.drafters["suffix"] = OracleTree(len(prompt), reference)
    first, _ = run(engine, prompt_ids=prompt, sampling=GREEDY, conversation="c")
    follow = prompt + first + random_ids(5, seed=9)
    second, events = run(
        engine, prompt_ids=follow, sampling=SamplingParams(temperature=0.0, max_new_tokens=10), conversation="c"
    )
    fresh, _ = run(
        no_eos(tiny_engine("gemma2", drafter="none")),
        prompt_ids=follow,
        sampling=SamplingParams(temperature=0.0, max_new_tokens=10),
    )
    assert events[0].prefill_tokens == 6  # the first turn was reused but its last token (never fed) and the 5 new
    assert second == fresh


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("sampling", [GREEDY, SAMPLED], ids=["greedy", "sampled"])
def test_the_suffix_drafter_gives_plain_decodings_reply(family, sampling):
    """The first reply drafts from the conversation only; it is remembered, so a new conversation with the same
    prompt (the same reply, with the seed) drafts it from memory, and both equal plain decoding."""
    prompt = random_ids(30, seed=10)
    plain, _ = run(no_eos(tiny_engine(family, drafter="none")), prompt_ids=prompt, sampling=sampling)
    engine = no_eos(tiny_engine(family, drafter="suffix", gamma=16))
    first, _ = run(engine, prompt_ids=prompt, sampling=sampling)
    assert first == plain and engine.reply_memory.num_tokens == len(first)
    again, events = run(engine, prompt_ids=prompt, sampling=sampling, conversation="new")
    assert again == plain
    stats = events[-1].stats
    assert stats.accepted >= len(plain) // 2 and stats.mean_accepted_length > 3


def test_without_reply_memory_nothing_is_remembered():
    engine = no_eos(tiny_engine("llama", drafter="suffix", gamma=16))
    assert engine.use_reply_memory(True, ["w5 w6 w7 w8", "w9 w10"]) > 0
    assert engine.use_reply_memory(False) == 0
    run(engine, prompt_ids=random_ids(30, seed=10), sampling=GREEDY)
    assert engine.reply_memory.num_tokens == 0


def test_a_tree_step_counts_positions_along_the_followed_path():
    stats = SpecStats()
    # pending -> a(0) -> b(1); pending -> c(2); accepted a then nothing matched under b's parent? no: b is a leaf
    stats.observe_step(
        drafter="suffix",
        gamma=3,
        accepted=2,
        emitted=3,
        policy=PolicyState.SPECULATING,
        draft_s=0.0,
        verify_s=0.01,
        overhead_s=0.0,
        tried=2,
    )
    stats.observe_tree([-1, 0, -1], [0, 1])
    report = stats.report()
    assert report.per_position_acceptance == (1.0, 1.0, None)
    assert (report.drafted, report.accepted) == (3, 2)
    assert report.acceptance_rate is not None
    assert (report.tree_nodes, report.tree_depth, report.tree_width, report.tree_accepted, report.tree_branch) == (
        3,
        2,
        2,
        2,
        1,
    )
