"""Fixtures of the fuzzers (one per input surface, issue 20; helpers in tests/support/reliability.py):
``isolated_dirs`` points specchat's cache, config and data folders at a temporary folder, so no fuzzed input
touches the user's real files."""

from foundation_fixtures import isolated_dirs  # noqa: F401  (a fixture)
