"""`specchat models` names the forward path a model will run on (backend/models/facts/forward_path.py), read
offline: the CPU native kernels for the embedded default, the int4 torch loop with the reason where they cannot
run, the reason for a model the native model does not take."""

from __future__ import annotations

import dataclasses

import pytest

from specchat.backend.models.catalog.config import load_pairs
from specchat.backend.models.facts import forward_path, memory


@pytest.fixture
def default_target():
    return load_pairs()["smollm2-135m"].local_target


def test_the_default_runs_on_the_native_kernels_and_says_what_runs_before_they_are_built(default_target, monkeypatch):
    monkeypatch.setattr(memory, "native_unavailable", lambda *_: None)
    line = forward_path.describe(default_target, "cpu")
    assert line.startswith("CPU native kernels, the file's blocks as stored")
    assert "the int4/int8 torch loop (quantization: int4-torch)" in line


def test_without_the_kernels_it_names_the_fallback_and_why(default_target, monkeypatch):
    monkeypatch.setenv("SPECCHAT_NATIVE", "0")
    memory.native_unavailable.cache_clear()
    try:
        line = forward_path.describe(default_target, "cpu")
    finally:
        memory.native_unavailable.cache_clear()
    fallback = "the int4/int8 torch loop (quantization: int4-torch)"
    assert line == f"{fallback}: the CPU kernels cannot run, turned off (SPECCHAT_NATIVE=0)"


def test_bitsandbytes_and_uncovered_architectures_say_why(default_target, monkeypatch):
    monkeypatch.setattr(memory, "native_unavailable", lambda *_: None)
    nf4 = dataclasses.replace(default_target, quantization="nf4")
    assert forward_path.describe(nf4, "cpu") == "transformers' forward: quantization nf4 asks for bitsandbytes"
    other = dataclasses.replace(default_target, architecture="mamba")
    assert forward_path.describe(other, "cpu").endswith("the native model does not cover 'mamba'")
    assert forward_path.describe(default_target, "cuda").startswith("CUDA: transformers' forward")
