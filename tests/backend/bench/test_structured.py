"""The structured bench (backend/bench/structured.py): its 56 cases load and every schema compiles; a run over a
tiny model reports validity per mode, the same reply in every mode, and the mask's share; the table prints."""

from __future__ import annotations

import json

from char_tokenizer import char_engine
from tiny_models import one_thread  # noqa: F401  (autouse)

from specchat.backend.api import ConstraintSpec
from specchat.backend.bench.structured import MODES, Case, load_cases, run_structured, table, valid
from specchat.backend.constraint_spec import check_grammar


def test_the_family_loads_and_every_schema_compiles():
    cases = load_cases()
    assert len(cases) >= 50 and len({c.id for c in cases}) == len(cases)
    assert {"nested", "array-of-objects", "enum", "pattern", "optional", "tool-call"} <= {c.shape for c in cases}
    for case in cases:
        check_grammar(ConstraintSpec("json_schema", json.dumps(case.schema)))


def test_a_run_reports_every_mode():
    schema = {"type": "object", "properties": {"k": {"enum": ["a", "bb"]}}, "required": ["k"]}
    cases = [Case("one", "enum", [{"role": "user", "content": "x"}], schema)]
    report = run_structured(char_engine(), cases, max_new_tokens=40, temperature=0.8, seed=3)
    assert report["replay_differences"] == 0 and set(report["summary"]) == set(MODES)
    for mode in MODES:
        s = report["summary"][mode]
        assert s["replies"] == 1 and s["validated"] == s["parsed"] == 1 and 0 < s["mask_share"] < 1
    assert report["summary"]["jump-forward"]["forced"] > 0 and report["summary"]["plain"]["forced"] == 0
    assert "spec+jump-forward" in table(report)
    assert valid('{"k": "a"}', schema) == (True, True) and valid("{", schema) == (False, False)
