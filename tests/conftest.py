"""The test suite mirrors the source: tests/backend/<folder> tests backend/<folder>, tests/app/<folder> tests
app/<folder>. Helpers shared across folders (tiny random-weight models, tiny engines, the fake engine and the
app harness) live in tests/support, which pytest puts on sys.path (pyproject's ``pythonpath``); each folder's
conftest.py holds the fixtures its tests share.
"""

import os
from pathlib import Path

import pytest

# The CPU native model's library (backend/kernels/native_build.py) is built once, into one folder every test
# shares (each test's own cache folder would build it again: ~1.5 min on 2 cores). It lives in the checkout
# (.native-cache/, ignored by git), so a clean clone (CI) builds it once per run and a working copy once per
# change of the C++ sources; the tests then run the native path wherever specchat would.
os.environ.setdefault("SPECCHAT_NATIVE_CACHE", str(Path(__file__).resolve().parents[1] / ".native-cache"))
# A start that must build the library waits for it in tests (the background build and the swap between replies
# have tests of their own: tests/backend/engine/test_native_upgrade.py).
os.environ.setdefault("SPECCHAT_NATIVE_BUILD", "wait")


@pytest.fixture(autouse=True)
def _own_data_dir(tmp_path_factory):
    """Each test its own data folder (history, /edit journals), never the user's: set without monkeypatch, so a
    test's ``monkeypatch.undo()`` cannot send its writes to the real one."""
    old = os.environ.get("SPECCHAT_DATA_DIR")
    os.environ["SPECCHAT_DATA_DIR"] = str(tmp_path_factory.mktemp("data"))
    yield
    if old is None:
        os.environ.pop("SPECCHAT_DATA_DIR", None)
    else:
        os.environ["SPECCHAT_DATA_DIR"] = old


def pytest_terminal_summary(terminalreporter) -> None:
    """The reliability tests' figures (tests/support/reliability.py): inputs fuzzed, kills, soak readings."""
    from reliability import summary_lines

    lines = summary_lines()
    if lines:
        terminalreporter.section("reliability figures")
        for line in lines:
            terminalreporter.write_line(line)
