"""The prompts a `specchat bench` run measures: a built-in suite's, or the user's own ``--prompts`` file's.

Contract: :func:`load_prompts` takes the bench parser's namespace (``suite``, ``limit``, ``prompts``) and returns
``BenchPrompt`` objects; a bad file raises RequestError naming the file and line (generate's input boundary).
"""

from __future__ import annotations

from typing import Any

CUSTOM_FAMILY = "custom"  # the family of --prompts FILE's prompts in the tables


def load_prompts(args: Any, limit: int | None) -> list:
    """The run's prompts: the ``--prompts`` file's (every one unless --limit is given) or ``--suite``'s, ``limit``
    per family. The file is read through generate's input boundary (errors name the file and line)."""
    from specchat.backend.bench.suites import BenchPrompt, load_suite, select

    path = getattr(args, "prompts", None)
    if path is None:
        return load_suite(args.suite, limit)
    from specchat.app.cli.generate import read_prompts

    prompts = [
        BenchPrompt(id=name, family=CUSTOM_FAMILY, category=CUSTOM_FAMILY, messages=_pairs(messages))
        for name, messages in read_prompts(path)
    ]
    return select(prompts, args.limit)


def _pairs(messages: list[dict]) -> tuple[tuple[str, str], ...]:
    return tuple((str(m["role"]), str(m["content"])) for m in messages)
