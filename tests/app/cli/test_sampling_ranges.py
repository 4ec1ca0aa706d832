"""`specchat generate` refuses sampling values outside backend/limits.py's ranges before the model loads (issue 47,
class 8): a denormal temperature or repetition penalty, a top-k past any vocabulary, each named."""

from __future__ import annotations

import pytest

import specchat.backend.engine.engine as engine_module
from specchat.app.cli.main import main


@pytest.mark.parametrize(
    ("option", "value", "field"),
    [
        ("--temperature", "1e-320", "temperature"),
        ("--repetition-penalty", "1e-320", "repetition_penalty"),
        ("--repetition-penalty", "0.01", "repetition_penalty"),
        ("--top-p", "5e-324", "top_p"),
        ("--top-k", str(2**70), "top_k"),
    ],
)
def test_out_of_range_sampling_is_refused_before_loading(capsys, monkeypatch, option, value, field) -> None:
    def never(*args, **kwargs):
        raise AssertionError("the model was loaded")

    monkeypatch.setattr(engine_module, "load_engine", never)
    assert main(["generate", "--prompt", "hi", option, value]) == 2
    err = capsys.readouterr().err
    assert f"{field}=" in err and "out of range" in err and "Traceback" not in err
