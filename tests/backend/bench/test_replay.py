"""The replay harness (issue 32) on tiny models: for every drafter (prompt lookup, suffix, a draft model, auto)
× γ 1, 4, 16, auto × the grid's sampling settings × ``--samples`` blocks, a seed's reply equals plain decoding's,
on a prompt longer than a decoding pass (so the samples reuse a prompt prefilled in one attention call). And the
harness itself: it finds a difference when there is one, and says where."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch
from engine_fixtures import tiny_engine
from tiny_models import random_ids

from specchat.backend.api import GenerationRequest
from specchat.backend.bench.replay import (
    SETTINGS,
    Probe,
    ReplayPrompt,
    Row,
    Run,
    combinations,
    count_runs,
    first_difference,
    replay,
)


def long_prompt() -> ReplayPrompt:
    motif = random_ids(9, seed=7)
    return ReplayPrompt("motif", tuple(random_ids(30, seed=8) + motif * 6 + random_ids(12, seed=9)))  # 96 tokens


def test_every_drafter_gamma_setting_and_sample_replays_plain_decoding() -> None:
    engine = tiny_engine("llama", drafter="prompt-lookup", draft_family="llama", draft_seed=1, context_length=512)
    prompt = long_prompt()
    started = time.perf_counter()
    result = replay(engine, [prompt], settings=SETTINGS, seeds=(30501,), samples=2, max_new_tokens=20)
    elapsed = time.perf_counter() - started
    combos = combinations(["none", *engine.drafters, "auto"], (1, 4, 16, "auto"))
    assert set(engine.drafters) >= {"prompt-lookup", "suffix", "draft-model"}
    assert (result.runs, result.references) == count_runs(1, len(SETTINGS), 1, 2, len(combos))
    assert result.runs >= 300 and result.tokens > 0
    assert [d.describe() for d in result.differences] == []
    assert elapsed < 120, f"the suite's harness took {elapsed:.0f} s"


class Skewed:
    """An engine whose suffix drafter replies with the next seed's tokens: the harness must catch it."""

    def __init__(self, engine: Any) -> None:
        self.engine, self.drafters = engine, engine.drafters

    @property
    def trace(self) -> Any:
        return self.engine.trace

    @trace.setter
    def trace(self, probe: Any) -> None:
        self.engine.trace = probe

    def generate(self, request: GenerationRequest):
        if request.drafter == "suffix" and request.sampling.seed is not None:
            sampling = dataclasses.replace(request.sampling, seed=request.sampling.seed + 7)
            request = dataclasses.replace(request, sampling=sampling)
        return self.engine.generate(request)

    def forget(self, conversation: str) -> None:
        self.engine.forget(conversation)


def test_the_harness_reports_a_difference_with_its_position_and_rows() -> None:
    engine = Skewed(tiny_engine("llama", drafter="suffix", context_length=512))
    found: list[Any] = []
    result = replay(
        engine,
        [long_prompt()],
        settings=[SETTINGS[3]],  # T=1 top-p 0.9
        seeds=(5,),
        samples=1,
        gammas=(4,),
        max_new_tokens=12,
        on_difference=found.append,
    )
    assert result.runs == 4 and {d.drafter for d in result.differences} == {"suffix"}  # none, p-l, suffix, auto
    assert found == result.differences
    difference = result.differences[0]
    at = difference.position
    assert difference.expected.tokens[:at] == difference.got.tokens[:at]
    assert difference.expected.tokens[at] != difference.got.tokens[at]
    text = difference.describe()
    assert f"reply position {at}" in text and "drafter suffix γ 4" in text
    assert f"plain row {at}:" in text and f"run row {at}:" in text and "margin" in text
    assert engine.trace is None  # the probe is taken off again


def test_first_difference_and_rows() -> None:
    assert first_difference([1, 2, 3], [1, 2, 3]) is None
    assert first_difference([1, 2, 3], [1, 5, 3]) == 1
    assert first_difference([1, 2], [1, 2, 3]) == 2  # one run ended early
    probe = Probe()
    probe(range(3, 5), torch.tensor([[0.0, 2.0, 1.0], [5.0, 5.0, 0.0]]))
    rows = probe.take()
    assert rows[3].top[0] == (1, 2.0) and rows[3].margin == 1.0 and rows[4].margin == 0.0
    assert probe.take() == {}
    same = Run([1], {0: Row([(1, 1.0)], "aa")}, "length", {})
    assert same.rows[0].margin is None
