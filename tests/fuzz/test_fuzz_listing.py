"""Fuzzing what `specchat models` prints of a models file (issue 47, class 4): descriptions holding colour codes,
OSC title sequences, C1 controls, carriage returns and any other text never put a control character on the
terminal; the listing either prints or refuses the file in one line."""

from __future__ import annotations

import json
import re

from hypothesis import strategies as st
from reliability import NASTY_TEXT, READINGS, fuzz

from specchat.app.cli.main import main

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
PIECES = ["\x1b[31m", "\x1b[0m", "\x1b]0;title\x07", "\x1b]8;;http://x\x1b\\", "\x9b2J", "\x1bP+q\x1b\\", "\r",
          "\x08", "\x07", "\x00", "\x85", "text", " ", "é", "\u202e", "[b]x[/b]"]  # fmt: skip
DESCRIPTIONS = st.one_of(st.lists(st.sampled_from(PIECES), max_size=8).map("".join), NASTY_TEXT)


def test_listing_prints_no_control_character(tmp_path, monkeypatch, capsys) -> None:
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"SPECCHAT_{name}_DIR", str(tmp_path / name.lower()))
    models = tmp_path / "models.yaml"
    counts = {"runs": 0, "escapes": 0}

    def check(description: str) -> None:
        text = json.dumps(description)  # a YAML double-quoted scalar (lone surrogates as \\u escapes)
        models.write_text(
            f"pairs:\n  - name: p\n    description: {text}\n    target: {{source: packaged:smollm2-135m-instruct}}\n",
            encoding="utf-8",
        )
        code = main(["models", "--models", str(models), "--device", "cpu"])
        out, err = capsys.readouterr()
        counts["runs"] += 1
        counts["escapes"] += bool(CONTROL.search((out + err).replace("\n", "")))
        assert code in (0, 2) and "Traceback" not in out + err
        assert not CONTROL.search((out + err).replace("\n", "")), repr(out + err)

    try:
        fuzz("specchat models: hostile descriptions", DESCRIPTIONS, check, 100)
    finally:
        READINGS["models listing hostile run: runs, escapes printed"] = f"{counts['runs']}, {counts['escapes']}"
