"""api.py: every limit (limits.py) is checked when a request is built; RequestStats round-trips through the
dict the history stores and reads back damaged rows without raising."""

from __future__ import annotations

import json

import pytest

from specchat.backend import limits
from specchat.backend.api import (
    JSON_STATS_FIELDS,
    GammaSummary,
    GenerationRequest,
    PolicyState,
    RequestStats,
    SamplingParams,
)
from specchat.backend.errors import RequestError
from specchat.backend.limits import check_gamma


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("temperature", -0.5),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("temperature", limits.MAX_TEMPERATURE + 0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -1),
        ("top_k", 2.5),
        ("top_k", True),
        ("repetition_penalty", 0.0),
        ("repetition_penalty", -1.0),
        ("repetition_penalty", limits.MAX_REPETITION_PENALTY * 2),
        # values that passed but meant nothing (issue 47, class 8)
        ("temperature", 1e-320),
        ("temperature", 5e-324),
        ("temperature", limits.MIN_TEMPERATURE / 2),
        ("repetition_penalty", 1e-320),
        ("repetition_penalty", limits.MIN_REPETITION_PENALTY / 2),
        ("top_p", 1e-320),
        ("top_k", 2**70),
        ("top_k", limits.MAX_TOP_K + 1),
        ("max_new_tokens", 0),
        ("max_new_tokens", 2.0),
        ("max_new_tokens", limits.MAX_NEW_TOKENS + 1),
        ("seed", -1),
        ("seed", limits.MAX_SEED + 1),
        ("seed", "abc"),
    ],
)
def test_sampling_params_refuse_out_of_range_values_by_name(field, value) -> None:
    with pytest.raises(RequestError) as info:
        SamplingParams(**{field: value})
    assert f"{field}={value!r}" in str(info.value) and "use " in str(info.value)


def test_sampling_params_accept_the_limits_themselves() -> None:
    SamplingParams(temperature=0.0, top_k=0, top_p=1.0, repetition_penalty=1.0, seed=0)
    SamplingParams(
        temperature=limits.MAX_TEMPERATURE,
        top_p=limits.MIN_TOP_P,
        top_k=limits.MAX_TOP_K,
        repetition_penalty=limits.MAX_REPETITION_PENALTY,
        max_new_tokens=limits.MAX_NEW_TOKENS,
        seed=limits.MAX_SEED,
    )
    SamplingParams(temperature=limits.MIN_TEMPERATURE, repetition_penalty=limits.MIN_REPETITION_PENALTY)
    SamplingParams()  # every field unset: the pair's defaults


@pytest.mark.parametrize("gamma", [0, -1, limits.MAX_GAMMA + 1, 2.5, "fast", True])
def test_gamma_limit(gamma) -> None:
    with pytest.raises(RequestError, match=f"from 1 to {limits.MAX_GAMMA}"):
        check_gamma(gamma)
    with pytest.raises(RequestError, match="gamma"):
        GenerationRequest(prompt_ids=[1], gamma=gamma)
    assert check_gamma(limits.MAX_GAMMA) == limits.MAX_GAMMA and check_gamma("auto") == "auto"


def test_unknown_drafter_is_refused_when_the_request_is_built() -> None:
    with pytest.raises(RequestError, match="unknown drafter 'magic'"):
        GenerationRequest(prompt_ids=[1], drafter="magic")  # type: ignore[arg-type]


def test_request_stats_round_trip_and_the_json_contract() -> None:
    stats = RequestStats(
        new_tokens=12,
        wall_s=1.5,
        ttft_s=0.2,
        tok_s=8.0,
        steps=5,
        drafted=8,
        accepted=6,
        acceptance_rate=0.75,
        mean_accepted_length=2.5,
        per_position_acceptance=(1.0, 0.5, None),
        gamma=GammaSummary(4, 3.5, 4),
        drafter="prompt-lookup",
        last_policy=PolicyState.PAUSED,
        accepted_length_histogram=(1, 0, 2),
        policy={"alpha_hat": 0.6},
        no_draft_steps=2,
        draft_prefill_tokens=3,
        draft_reused_tokens=40,
        seed=2**64 - 1,
    )
    data = stats.to_dict()
    assert RequestStats.from_dict(data) == stats
    assert RequestStats.from_dict(json.loads(json.dumps(data))).seed == 2**64 - 1  # a whole number, exact
    assert RequestStats.from_dict({**data, "last_policy": "no-draft"}).last_policy is PolicyState.NO_DRAFT
    assert list(stats.to_json_stats()) == list(JSON_STATS_FIELDS)
    assert stats.to_json_stats()["gamma"] == {"mode": 4, "mean": 3.5, "max": 4}


@pytest.mark.parametrize(
    "damage",
    [
        {"new_tokens": "many"},
        {"gamma": [1, 2]},
        {"per_position_acceptance": "x"},
        {"last_policy": "dancing"},
        {"tok_s": float("nan")},
        {"drafter": 7},
        {"steps": "x"},
        {"policy": [1]},
        {"unknown_field": 1},
        {"seed": 1.5},
        {"seed": "7"},
    ],
)
def test_request_stats_from_a_damaged_row_keeps_what_it_can(damage) -> None:
    row = {"new_tokens": 3, "wall_s": 2.0} | damage
    stats = RequestStats.from_dict(row)
    for name in damage:
        if hasattr(stats, name):
            assert getattr(stats, name) == getattr(RequestStats(), name)  # the damaged field: its default
    assert stats.new_tokens == (3 if "new_tokens" not in damage else 0) and stats.wall_s == 2.0
