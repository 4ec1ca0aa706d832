"""The test suite mirrors the source: tests/backend/<folder> tests backend/<folder>, tests/app/<folder> tests
app/<folder>. Helpers shared across folders (tiny random-weight models, tiny engines, the fake engine and the
app harness) live in tests/support, which pytest puts on sys.path (pyproject's ``pythonpath``); each folder's
conftest.py holds the fixtures its tests share.
"""

import os

import pytest

# Runners would otherwise build the native decoder layers (backend/kernels/native.py) in the background, ~20 s of
# a compiler per cache directory; tests/backend/kernels/test_native.py builds them once and turns them on.
os.environ["SPECCHAT_NATIVE"] = "0"


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
