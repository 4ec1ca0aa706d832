"""Fixtures of the command-line tests: ``isolated_dirs`` points specchat's cache, config and data folders at a
temporary folder, so no test touches the user's real files."""

from foundation_fixtures import isolated_dirs  # noqa: F401  (a fixture)
