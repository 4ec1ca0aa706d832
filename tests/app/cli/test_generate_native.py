"""`specchat generate` on the embedded default says how the model runs, on stderr, in the line the UI and `serve`
show: the CPU native model and its kernels, or, when they cannot be used (no compiler, a noted failed build),
the fallback and the one-line reason naming the build log, and the reply still comes."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from native_libraries import fake_library

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


def _failed_builds(monkeypatch, tmp_path, times: int):
    """A fresh native cache whose folder has noted ``times`` failed builds in a row (skips without a compiler)."""
    if native_build.unavailable() is not None:
        pytest.skip(native_build.unavailable())
    monkeypatch.setenv("SPECCHAT_NATIVE_CACHE", str(tmp_path / "native"))
    folder = native_build.folder_for(native_build.compiler())
    for _ in range(times):
        folder.note_failure("the build failed: c++: error: something broke", native_build.identity())
    return folder


def test_a_noted_failed_build_falls_back_naming_the_log(capsys, monkeypatch, tmp_path):
    folder = _failed_builds(monkeypatch, tmp_path, 1)
    record, err = _generate(capsys)
    (line,) = [line for line in err.splitlines() if "runs on" in line]
    assert "CPU int4 Python loop: the CPU kernels are unavailable: the build failed: c++: error: something" in line
    assert "specchat doctor --rebuild-native" in line and str(folder.log) in line and "tried again after" in line
    assert record["text"]


def test_a_first_start_replies_while_the_kernels_build_in_the_background(capsys, monkeypatch, tmp_path):
    """No library yet: the reply comes on the int4 path at once, the line says the kernels are being built."""
    if native_build.unavailable() is not None:
        pytest.skip(native_build.unavailable())
    monkeypatch.setenv("SPECCHAT_NATIVE_BUILD", "background")
    fake = fake_library(tmp_path, Path(sys.executable), "sleep", FAKE_SLEEP="30")  # a build that takes a while
    monkeypatch.setattr(native, "_library", fake)
    started = time.monotonic()
    record, err = _generate(capsys)
    (line,) = [line for line in err.splitlines() if "runs on" in line]
    assert line.startswith("specchat: smollm2-135m runs on CPU int4 Python loop: the CPU kernels are being built in")
    assert "take over between replies" in line and str(fake.folder.log) in line
    assert record["text"] and time.monotonic() - started < 25 and fake.child is not None
    fake.child.kill()
    fake.child.wait()


def test_doctor_names_a_failed_build_and_when_a_start_tries_again(capsys, monkeypatch, tmp_path):
    _failed_builds(monkeypatch, tmp_path, 2)
    assert main(["doctor"]) == 0
    out = capsys.readouterr().out
    assert "something broke" in out and "2 failed build(s) in a row" in out and "tries again after" in out
