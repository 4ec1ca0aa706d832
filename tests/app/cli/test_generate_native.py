"""`specchat generate` on the embedded default says how the model runs, on stderr, in the line the UI and `serve`
show: the CPU native model and its kernels, or, when they cannot be used (no compiler, a noted failed build),
the fallback and the one-line reason naming the build log, and the reply still comes."""

from __future__ import annotations

import json

import pytest

from specchat.app.cli.main import main
from specchat.backend.kernels import native, native_build

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs, monkeypatch):
    # A fresh view of the library for this process (the session's build stays where conftest put it).
    monkeypatch.setattr(native, "_checked", False)
    monkeypatch.setattr(native, "_reason", None)
    monkeypatch.setattr(native, "_library", None)
    return isolated_dirs


def _generate(capsys) -> tuple[dict, str]:
    code = main(["generate", "--prompt", "Say hi.", "--json", "--temperature", "0", "--max-new-tokens", "6"])
    out, err = capsys.readouterr()
    assert code == 0, err
    return json.loads(out.splitlines()[-1]), err


def test_the_native_path_is_named(capsys):
    if native_build.unavailable() is not None:
        pytest.skip(native_build.unavailable())
    record, err = _generate(capsys)
    assert "specchat: smollm2-135m runs on CPU native (" in err and "Q4_1, Q8_0 as stored" in err
    assert record["text"]


def test_no_compiler_falls_back_with_one_line(capsys, monkeypatch):
    monkeypatch.setenv("CXX", "/nonexistent/c++")
    record, err = _generate(capsys)
    lines = [line for line in err.splitlines() if "runs on" in line]
    assert lines == [
        "specchat: smollm2-135m runs on CPU int4 Python loop: the CPU kernels are unavailable: no C++ compiler "
        "found (install g++ or clang++, or set CXX)"
    ]
    assert record["text"] and "Traceback" not in err


def test_a_noted_failed_build_falls_back_naming_the_log(capsys, monkeypatch, tmp_path):
    if native_build.unavailable() is not None:
        pytest.skip(native_build.unavailable())
    monkeypatch.setenv("SPECCHAT_NATIVE_CACHE", str(tmp_path / "native"))
    folder = native_build.folder_for(native_build.compiler())
    folder.note_failure("the build failed: c++: error: something broke")
    record, err = _generate(capsys)
    (line,) = [line for line in err.splitlines() if "runs on" in line]
    assert "CPU int4 Python loop: the CPU kernels are unavailable: the build failed: c++: error: something" in line
    assert "specchat doctor --rebuild-native" in line and str(folder.log) in line
    assert record["text"]
