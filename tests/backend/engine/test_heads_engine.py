"""Draft heads through the engine: every tree shape gives plain decoding's reply, seeds replay, conversations
continue, ``auto`` drafts with the head where prompt lookup finds nothing.

The EAGLE-3 head is trained for a few seconds on the tiny target's own samples (tests/support/tiny_heads.py), so
trees are partly accepted and partly rejected; Medusa heads are random (mostly rejected). Both forwards that return
taps run: transformers' (a float target) and the compact one (an int4 target).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from engine_fixtures import tiny_loaded, tiny_pair
from tiny_heads import TAPS, medusa_folder, trained_eagle3
from tiny_models import one_thread, random_ids  # noqa: F401  (one_thread: autouse)

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import Engine
from specchat.backend.models.catalog.config_head import HeadSpec
from specchat.backend.models.loading.head_loading import LoadedHead, load_head
from specchat.backend.models.loading.quantized import quantize_model

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=48)
SAMPLED = SamplingParams(temperature=0.8, top_p=0.95, repetition_penalty=1.1, seed=77, max_new_tokens=48)
PROMPT = random_ids(12, seed=21)


def _target(path: str):
    if path == "transformers":
        return tiny_loaded("llama")
    loaded = tiny_loaded("llama")
    quantize_model(loaded.model, "int4-torch", torch.device("cpu"))
    return dataclasses.replace(loaded, dtype=torch.bfloat16)


def eagle3_engine(path: str = "transformers", *, top_k: int = 4, depth: int = 6, gamma="auto") -> Engine:
    engine = Engine(_target(path), None, tiny_pair(drafter="eagle3", gamma=gamma), head=None)
    engine.eos_ids = frozenset()  # random tiny models say EOS often: run every reply to its limit
    engine.attach_head(LoadedHead("eagle3", trained_eagle3(), TAPS, "tiny"))
    drafter = engine.drafters["eagle3"]
    drafter.top_k, drafter.depth = top_k, depth  # type: ignore[attr-defined]
    return engine


def medusa_engine(tmp_path, path: str = "transformers", *, choices=None, gamma="auto") -> Engine:
    target = _target(path)
    folder = medusa_folder(tmp_path / "medusa", target.model.config, heads=3, choices=choices)
    head = load_head(HeadSpec(str(folder), "local", path=str(folder)), "medusa", target.model.config,
                     torch.device("cpu"), target_name="tiny")  # fmt: skip
    engine = Engine(target, None, tiny_pair(drafter="medusa", gamma=gamma), head=head)
    engine.eos_ids = frozenset()
    return engine


def run(engine: Engine, sampling=GREEDY, prompt=PROMPT, **kw):
    events = list(engine.generate(GenerationRequest(prompt_ids=prompt, sampling=sampling, **kw)))
    return [t for e in events for t in e.token_ids], events


def plain(path: str, sampling=GREEDY, prompt=PROMPT) -> list[int]:
    engine = Engine(_target(path), None, tiny_pair(drafter="none"))
    engine.eos_ids = frozenset()
    return run(engine, sampling, prompt)[0]


@pytest.mark.parametrize("path", ["transformers", "compact"])
@pytest.mark.parametrize(
    ("top_k", "depth", "gamma"), [(1, 1, 1), (1, 6, 6), (2, 3, 4), (4, 6, 8), (8, 2, 16), (4, 8, 31)]
)
def test_eagle3_trees_of_every_shape_give_plain_decodings_reply(path, top_k, depth, gamma):
    ids, events = run(eagle3_engine(path, top_k=top_k, depth=depth, gamma=gamma))
    assert ids == plain(path)
    stats = events[-1].stats
    assert stats.drafter == "eagle3" and stats.drafted > 0
    if path == "transformers" and gamma > 1:
        assert stats.accepted > 0  # the trained head is right often enough


@pytest.mark.parametrize("path", ["transformers", "compact"])
@pytest.mark.parametrize(
    ("choices", "gamma"),
    [(None, 8), ([[0], [0, 0], [0, 0, 0]], 3), ([[0], [1], [2], [0, 0], [1, 0], [0, 1], [0, 0, 0]], 7), (None, 1)],
)
def test_medusa_static_trees_give_plain_decodings_reply(tmp_path, path, choices, gamma):
    ids, events = run(medusa_engine(tmp_path, path, choices=choices, gamma=gamma))
    assert ids == plain(path)
    assert events[-1].stats.drafter == "medusa" and events[-1].stats.drafted > 0


@pytest.mark.parametrize("path", ["transformers", "compact"])
def test_a_seed_replays_the_same_reply_with_every_drafter(tmp_path, path):
    reference = plain(path, SAMPLED)
    engine = eagle3_engine(path, gamma=5)
    assert run(engine, SAMPLED, drafter="eagle3")[0] == reference
    assert run(engine, SAMPLED, drafter="eagle3")[0] == reference  # the same seed again
    assert run(engine, SAMPLED, drafter="auto")[0] == reference
    assert run(medusa_engine(tmp_path, path, gamma=4), SAMPLED)[0] == reference


def test_a_conversation_continues_after_turns_without_the_head():
    """Turns reuse the cached prefix; a turn by another drafter leaves the head without features of its tokens,
    so the next head turn reads them again (the prefix reuse stops there) and still gives plain's reply."""
    turns = [random_ids(8, seed=s) for s in (31, 32, 33, 34)]
    drafters = ["eagle3", "eagle3", "none", "eagle3"]
    head_engine, plain_engine = eagle3_engine(gamma=6), Engine(tiny_loaded("llama"), None, tiny_pair(drafter="none"))
    plain_engine.eos_ids = frozenset()
    context: list[int] = []
    for turn, drafter in zip(turns, drafters):
        context = context + turn
        got, events = run(head_engine, prompt=context, drafter=drafter, conversation="c")
        want, _ = run(plain_engine, prompt=context, conversation="c")
        assert got == want
        if drafter == "eagle3" and turn is turns[-1]:
            assert events[0].prefill_tokens > len(turn)  # the tokens of the head-less turn were read again
        context = context + got


def test_auto_drafts_with_the_head_where_prompt_lookup_finds_nothing():
    engine = eagle3_engine()
    ids, events = run(engine, drafter="auto", prompt=random_ids(30, seed=5))
    assert ids == plain("transformers", prompt=random_ids(30, seed=5))
    used = {e.drafter for e in events if e.gamma}
    assert "eagle3" in used


def test_a_pair_without_a_head_refuses_the_head_drafters():
    from specchat.backend.errors import RequestError

    engine = Engine(tiny_loaded("llama"), None, tiny_pair(drafter="none"))
    with pytest.raises(RequestError, match="no eagle3 head"):
        run(engine, drafter="eagle3")


def test_auto_prefers_a_prompt_lookup_match_to_the_head():
    """After the head has drafted (its speed-up measured), a prompt whose continuation copies it (as an edit
    copies code) is drafted by prompt lookup where it matches: ids-only drafters are asked first."""
    engine = eagle3_engine()
    run(engine, drafter="auto", prompt=random_ids(30, seed=5))
    loop = random_ids(10, seed=8)
    reference = plain("transformers", prompt=loop * 4)
    ids, events = run(engine, drafter="auto", prompt=loop * 4)
    assert ids == reference
    used = [e.drafter for e in events if e.gamma]
    assert "prompt-lookup" in used or "suffix" in used, used
