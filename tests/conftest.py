"""The test suite mirrors the source: tests/backend/<folder> tests backend/<folder>, tests/app/<folder> tests
app/<folder>. Helpers shared across folders (tiny random-weight models, tiny engines, the fake engine and the
app harness) live in tests/support, which pytest puts on sys.path (pyproject's ``pythonpath``); each folder's
conftest.py holds the fixtures its tests share.
"""

import os

# Runners would otherwise build the native decoder layers (backend/kernels/native.py) in the background, ~20 s of
# a compiler per cache directory; tests/backend/kernels/test_native.py builds them once and turns them on.
os.environ["SPECCHAT_NATIVE"] = "0"


def pytest_terminal_summary(terminalreporter) -> None:
    """The reliability tests' figures (tests/support/reliability.py): inputs fuzzed, kills, soak readings."""
    from reliability import summary_lines

    lines = summary_lines()
    if lines:
        terminalreporter.section("reliability figures")
        for line in lines:
            terminalreporter.write_line(line)
