"""Benchmark prompt suites: which prompts `specchat bench` runs, grouped into families.

Suites:

- ``spec-bench``: the 480 public Spec-Bench questions shipped in ``data/spec_bench.jsonl`` (see
  ``data/SPEC_BENCH_NOTICE.md``), in six families: ``mt-bench`` (its 8 categories; first turns only, so every
  mode sees the same input), ``translation``, ``summarization``, ``qa``, ``math-reasoning``, ``rag``;
- ``edit``: the fixed code-edit set ``data/code_edit.jsonl`` (family ``code-edit``; categories rename,
  type-hints, docstring) — functions with a request to edit them and return them whole — and the multi-turn
  set ``data/code_edit_multiturn.jsonl`` (family ``code-edit-multiturn``): the same function edited three
  times in one conversation (rename, then type hints, then a docstring), each turn after the reply to the
  last, as an editor agent works;
- ``rewrite``: ``data/rewrite.jsonl`` (family ``rewrite``; categories rename, type-hints, add-parameter, fix-bug,
  translate-comments): whole files of 50-320 lines (Python, JavaScript, Go) with a small requested change, the
  file in the prompt and, as each prompt's ``prediction``, the file itself; the reply starts inside the code
  block (``assistant_prefix``, appended to the rendered prompt) and ends at its closing fence (``stop``), so a
  row's time is the time to the finished file; each prompt has its own ``max_new_tokens`` (the file's tokens
  and a quarter more); not in ``all`` (a run of it takes long: replies of up to 4,000 tokens);
- ``all``: spec-bench and edit;
- a family name (``mt-bench``, ``code-edit``, ...): that family alone.

``limit`` is per family and spread over the family's categories: categories are taken round-robin (in file
order) and, within a category, prompts evenly spaced over the category rather than its first N. The choice
is a pure function of the files and the limit, so every run and every mode sees the same prompts.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from specchat.backend.errors import ConfigError

DATA_DIR = Path(__file__).with_name("data")
SPEC_BENCH_FILE = DATA_DIR / "spec_bench.jsonl"
CODE_EDIT_FILE = DATA_DIR / "code_edit.jsonl"
MULTI_EDIT_FILE = DATA_DIR / "code_edit_multiturn.jsonl"

MT_BENCH_CATEGORIES = ("writing", "roleplay", "reasoning", "math", "coding", "extraction", "stem", "humanities")
# Spec-Bench category -> family name used in tables (MT-bench's eight categories form one family).
_SPEC_BENCH_FAMILY = {c: "mt-bench" for c in MT_BENCH_CATEGORIES} | {
    "translation": "translation",
    "summarization": "summarization",
    "qa": "qa",
    "math_reasoning": "math-reasoning",
    "rag": "rag",
}
SPEC_BENCH_FAMILIES = ("mt-bench", "translation", "summarization", "qa", "math-reasoning", "rag")
CODE_EDIT_FAMILY = "code-edit"
MULTI_EDIT_FAMILY = "code-edit-multiturn"
EDIT_FAMILIES = (CODE_EDIT_FAMILY, MULTI_EDIT_FAMILY)
REWRITE_FAMILY = "rewrite"
REWRITE_FILE = DATA_DIR / "rewrite.jsonl"
SUITES = ("spec-bench", "edit", "all") + SPEC_BENCH_FAMILIES + EDIT_FAMILIES + (REWRITE_FAMILY,)


@dataclass(frozen=True, slots=True)
class BenchPrompt:
    """One benchmark prompt: a chat's first turn, and the user's later turns (each sent after the reply)."""

    id: str
    family: str
    category: str
    messages: tuple[tuple[str, str], ...]  # (role, content) pairs; hashable so prompts can key dicts
    turns: tuple[str, ...] = ()  # later user messages of a multi-turn prompt
    prediction: str | None = None  # the expected reply (the prediction mode sends it)
    assistant_prefix: str = ""  # the reply's start, appended to the rendered prompt
    stop: tuple[str, ...] = ()
    max_new_tokens: int | None = None  # None: the run's --max-new-tokens

    def message_dicts(self) -> list[dict[str, str]]:
        return [{"role": role, "content": content} for role, content in self.messages]


def _read_jsonl(path: Path) -> list[tuple[int, dict]]:
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as error:
        raise ConfigError(f"cannot read benchmark prompts {path}: {error}; reinstall specchat") from None
    rows = []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as error:
            raise ConfigError(f"{path}:{number}: not valid JSON ({error.msg})") from None
        if not isinstance(row, dict):
            raise ConfigError(f"{path}:{number}: expected a JSON object, got {type(row).__name__}")
        rows.append((number, row))
    return rows


def load_spec_bench(path: Path = SPEC_BENCH_FILE) -> list[BenchPrompt]:
    """Spec-Bench questions as first-turn prompts, in file order."""
    prompts = []
    for number, row in _read_jsonl(path):
        category, turns = row.get("category"), row.get("turns")
        if category not in _SPEC_BENCH_FAMILY:
            raise ConfigError(
                f"{path}:{number}: unknown category {category!r}; expected one of {', '.join(_SPEC_BENCH_FAMILY)}"
            )
        if not isinstance(turns, list) or not turns or not isinstance(turns[0], str):
            raise ConfigError(f"{path}:{number}: 'turns' must be a non-empty list of strings")
        prompts.append(
            BenchPrompt(
                id=f"spec-bench-{row.get('question_id', number)}",
                family=_SPEC_BENCH_FAMILY[category],
                category=category,
                messages=(("user", turns[0]),),
            )
        )
    return prompts


def load_code_edit(path: Path = CODE_EDIT_FILE, family: str = CODE_EDIT_FAMILY) -> list[BenchPrompt]:
    """A code-edit set (the `specchat generate --prompts` format plus a ``category`` field and, for multi-turn
    prompts, ``turns``: the later user messages)."""
    prompts = []
    for number, row in _read_jsonl(path):
        messages = row.get("messages")
        if (
            not isinstance(messages, list)
            or not messages
            or not all(
                isinstance(m, dict) and isinstance(m.get("role"), str) and isinstance(m.get("content"), str)
                for m in messages
            )
        ):
            raise ConfigError(f"{path}:{number}: 'messages' must be a list of {{role, content}} objects")
        turns = row.get("turns", [])
        if not isinstance(turns, list) or not all(isinstance(t, str) for t in turns):
            raise ConfigError(f"{path}:{number}: 'turns' must be a list of user messages (strings)")
        prompts.append(
            BenchPrompt(
                id=str(row.get("id", f"edit-{number}")),
                family=family,
                category=str(row.get("category", "edit")),
                messages=tuple((m["role"], m["content"]) for m in messages),
                turns=tuple(turns),
                **_rewrite_fields(row, f"{path}:{number}"),
            )
        )
    return prompts


def _rewrite_fields(row: dict, where: str) -> dict:
    """The optional fields of a rewrite prompt, checked: prediction, assistant_prefix, stop, max_new_tokens."""
    out: dict = {}
    for name, ok, what in (
        ("prediction", lambda v: isinstance(v, str), "a string"),
        ("assistant_prefix", lambda v: isinstance(v, str), "a string"),
        ("stop", lambda v: isinstance(v, list) and all(isinstance(t, str) and t for t in v), "a list of strings"),
        ("max_new_tokens", lambda v: type(v) is int and v >= 1, "a whole number >= 1"),
    ):
        if name in row:
            if not ok(row[name]):
                raise ConfigError(f"{where}: {name!r} must be {what}, got {row[name]!r:.60}")
            out[name] = tuple(row[name]) if name == "stop" else row[name]
    return out


def _spread(items: list[BenchPrompt], count: int) -> list[BenchPrompt]:
    """``count`` items evenly spaced over ``items`` (all of them when count >= len)."""
    if count >= len(items):
        return list(items)
    return [items[(i * len(items)) // count] for i in range(count)]


def select(prompts: list[BenchPrompt], limit: int | None) -> list[BenchPrompt]:
    """At most ``limit`` prompts per family, round-robin over each family's categories (file order).

    Families keep their first-appearance order; within a family the result is in round-robin order
    (category 1's first pick, category 2's first pick, ..., category 1's second pick, ...).
    """
    if limit is not None and limit < 1:
        raise ConfigError(f"--limit must be at least 1, got {limit}")
    families: dict[str, dict[str, list[BenchPrompt]]] = {}
    for prompt in prompts:
        families.setdefault(prompt.family, {}).setdefault(prompt.category, []).append(prompt)
    chosen: list[BenchPrompt] = []
    for categories in families.values():
        total = sum(len(v) for v in categories.values())
        want = total if limit is None else min(limit, total)
        # How many each category gives: round-robin, so counts differ by at most one (bounded by size).
        quota = {name: 0 for name in categories}
        while sum(quota.values()) < want:
            for name, items in categories.items():
                if sum(quota.values()) < want and quota[name] < len(items):
                    quota[name] += 1
        picks = {name: _spread(items, quota[name]) for name, items in categories.items()}
        for i in range(max(quota.values(), default=0)):
            for name in categories:
                if i < len(picks[name]):
                    chosen.append(picks[name][i])
    return chosen


def load_suite(suite: str, limit: int | None) -> list[BenchPrompt]:
    """The prompts of ``suite`` (one of SUITES), ``limit`` per family."""
    if suite not in SUITES:
        raise ConfigError(f"unknown suite {suite!r}; use one of {', '.join(SUITES)}")
    prompts: list[BenchPrompt] = []
    if suite in ("spec-bench", "all") or suite in SPEC_BENCH_FAMILIES:
        prompts += load_spec_bench()
    if suite in ("edit", "all", CODE_EDIT_FAMILY):
        prompts += load_code_edit()
    if suite in ("edit", "all", MULTI_EDIT_FAMILY):
        prompts += load_code_edit(MULTI_EDIT_FILE, MULTI_EDIT_FAMILY)
    if suite == REWRITE_FAMILY:
        prompts += load_code_edit(REWRITE_FILE, REWRITE_FAMILY)
    if suite in SPEC_BENCH_FAMILIES or suite in EDIT_FAMILIES:
        prompts = [p for p in prompts if p.family == suite]
    return select(prompts, limit)
