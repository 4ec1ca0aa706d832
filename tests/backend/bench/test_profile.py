"""`specchat bench --profile` (backend/bench/profile.py): the parts of a step add up to the step, the native
model's counters fill the C++ parts (and cost nothing once off), and a path without them reports the forward
as one part."""

from __future__ import annotations

import dataclasses

from engine_fixtures import tiny_engine, tiny_loaded, tiny_pair
from native_fixtures import native_ready, tiny_native  # noqa: F401  (a fixture)

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.bench.profile import profile_engine, table
from specchat.backend.engine.engine import Engine

MESSAGES = [{"role": "user", "content": " ".join(f"w{i}" for i in range(10, 40))}]


def _sums_up(profile) -> bool:
    return abs(sum(profile.seconds.values()) - profile.wall_s) < 1e-6 and profile.steps > 0 and profile.tokens > 0


def test_a_transformers_path_reports_the_forward_whole():
    profile = profile_engine(tiny_engine("llama"), MESSAGES, "none", max_new_tokens=8)
    assert _sums_up(profile) and profile.seconds["kernels"] == 0 and profile.seconds["forward_other"] > 0
    assert "weight kernels" in table(profile) and "tok/s" in table(profile)


def test_the_native_models_counters_fill_its_parts(native_ready, tmp_path):  # noqa: F811
    _, loaded, _ = tiny_native("llama", tmp_path)
    target = dataclasses.replace(tiny_loaded("llama"), model=loaded)
    engine = Engine(target, None, tiny_pair(drafter="prompt-lookup"))
    assert engine.runner.path == "cpu-native"
    profile = profile_engine(engine, MESSAGES, "prompt-lookup", max_new_tokens=8)
    assert _sums_up(profile)
    assert all(profile.seconds[part] > 0 for part in ("kernels", "attention", "elementwise"))
    assert profile.rows >= profile.steps
    counted = engine.runner.native.profile()  # the counters are off after the profile: a reply leaves them
    list(
        engine.generate(GenerationRequest(messages=MESSAGES, sampling=SamplingParams(temperature=0, max_new_tokens=4)))
    )
    assert engine.runner.native.profile() == counted
