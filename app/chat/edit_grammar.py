"""The grammar of an ``/edit`` reply in SEARCH/REPLACE blocks (issue 46): the block syntax enforced, each SEARCH
section constrained to whole lines that follow each other in its file, REPLACE and the explanation after the
blocks free.

Contract: :func:`edit_constraint` is the request's constraint (a Lark grammar for llguidance:
``backend/speculative/constraint.py``) for ``/edit`` files answered in blocks, None for a whole-file rewrite
(``editing.rewrites_whole``: that path keeps its prediction drafter and no grammar). The reply it allows is one or
more blocks, each ``LABEL\\n<<<<<<< SEARCH\\n`` + SEARCH + ``=======\\n`` + REPLACE + ``>>>>>>> REPLACE\\n``, then
optionally a blank line and free text that never starts another block. LABEL is one of the files' labels as the
prompt shows them (``editing.edit_labels``), so ``edit_names.py`` always finds the file. SEARCH is one or more
consecutive lines of that file, starting on a line that is not blank, at most ``SEARCH_LINES`` (a rule per line
and depth that may be followed by the next line's: a grammar linear in the file's length), so a block's SEARCH
always occurs in its file: a refusal is then about what the edit means (several places match, a definition
dropped), never a mismatch. REPLACE is at most ``REPLACE_LINES`` lines (of at most ``LINE_CHARS`` characters)
other than the three markers.
Why a grammar of lines rather than a suffix index: llguidance's Earley parser follows every place a partial
SEARCH could be at once (repeated lines included) with no code of ours, and the grammar compiles in milliseconds
(docs/constrained.md).
"""

from __future__ import annotations

import json

from specchat.app.chat.editing import DIVIDER, REPLACE, SEARCH, EditTarget, edit_labels, rewrites_whole
from specchat.backend.api import ConstraintSpec

SEARCH_LINES = 8  # at most this many lines a SEARCH (aider's advice: small blocks; a model copying on is stopped)
REPLACE_LINES = 24  # and a REPLACE, of lines of at most LINE_CHARS characters (a model may never end a line)
LINE_CHARS = 400
# Files of more lines in all get no grammar: every line may start a SEARCH, and llguidance's Earley parser refuses a
# row of more than 2,000 items (3,000 lines did not parse; 1,000 built in 0.18 s with masks of ~10 µs).
MAX_LINES = 1500
# The marker lines as edit_plan.py reads them (its _SEARCH, _DIVIDER, _REPLACE), for the free lines to avoid.
MARKERS = r"[ \t]*(<{5,9}[ \t]*SEARCH|={5,9}|>{5,9}[ \t]*REPLACE)[ \t]*"


def _literal(text: str) -> str:
    return json.dumps(text, ensure_ascii=False)


def edit_grammar(targets: list[EditTarget]) -> str:
    """The Lark grammar of a blocks reply for ``targets`` (module docstring)."""
    rules: list[str] = []
    blocks: list[str] = []
    for k, (target, label) in enumerate(zip(targets, edit_labels(targets))):
        lines = target.text.split("\n")
        if target.text.endswith("\n"):
            lines.pop()  # the text after the last newline is no line
        for i, line in enumerate(lines):  # f{k}_{i}_{d}: line i as the d-th line of a SEARCH, then maybe line i + 1
            for d in range(min(SEARCH_LINES, i + 1)):
                following = f" f{k}_{i + 1}_{d + 1}?" if i + 1 < len(lines) and d + 1 < SEARCH_LINES else ""
                rules.append(f"f{k}_{i}_{d}: {_literal(line + chr(10))}{following}")
        starts = [f"f{k}_{i}_0" for i, line in enumerate(lines) if line.strip()]  # a SEARCH starts on text
        rules.append(f"search{k}: " + (" | ".join(starts) if starts else '""'))
        blocks.append(f"{_literal(label + chr(10) + SEARCH + chr(10))} search{k}")
    head = [
        'start: block+ ("\\n" TEXT*)?',
        "block: ("
        + " | ".join(blocks)
        + f") {_literal(DIVIDER + chr(10))} LINE{{0,{REPLACE_LINES}}} {_literal(REPLACE + chr(10))}",
        f"LINE: /[^\\n]{{0,{LINE_CHARS}}}\\n/ & ~/{MARKERS}\\n/",
        f"TEXT: /[^\\n]*\\n?/ & ~/{MARKERS}\\n?/",
    ]
    return "\n".join(head + rules) + "\n"


def edit_constraint(targets: list[EditTarget]) -> ConstraintSpec | None:
    """The constraint of an ``/edit`` answered in blocks; None for a whole-file rewrite, and for files of more
    than ``MAX_LINES`` lines in all (their replies are then free, as before)."""
    if not targets or rewrites_whole(targets) or sum(t.text.count("\n") + 1 for t in targets) > MAX_LINES:
        return None
    return ConstraintSpec("grammar", edit_grammar(targets))
