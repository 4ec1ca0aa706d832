"""From an /edit reply to new file contents (app/chat/edit_plan.py), in memory: SEARCH/REPLACE blocks apply
exactly or are refused with the reason; a whole-file reply that drops what the request did not name is refused
(issue 19: a one-function reply replaced a three-function file); a hypothesis fuzz of the applier."""

from __future__ import annotations

from pathlib import Path

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from specchat.app.chat.edit_plan import EditBlock, apply_block, definitions, parse_blocks, plan_edit, split_lines
from specchat.app.chat.editing import EditTarget, load_edit_target

CALC = """def add(a, b):
    return a + b


def sub(a, b):
    return a - b


def mul(a, b):
    return a * b
"""


def block(search: str, replace: str, name: str = "calc.py") -> str:
    return f"{name}\n```python\n<<<<<<< SEARCH\n{search}=======\n{replace}>>>>>>> REPLACE\n```\n"


@pytest.fixture
def calc(tmp_path: Path) -> EditTarget:
    f = tmp_path / "calc.py"
    f.write_text(CALC)
    return load_edit_target(f)


# -- whole-file replies ------------------------------------------------------------------------------------------
def test_a_whole_file_reply_that_drops_unrelated_functions_is_refused_saying_what_it_drops(calc) -> None:
    reply = "Here is the updated function:\n```python\ndef sub(a: int, b: int) -> int:\n    return a - b\n```\n"
    plan = plan_edit([calc], reply, "add type hints to sub")
    assert not plan.ok and not plan.changes
    assert "drops add, mul, which the request does not ask to remove" in plan.message()  # "add" the verb
    assert plan.message().endswith("Nothing was written.")


def test_asking_for_the_complete_file_changes_nothing_when_the_reply_is_still_a_fragment(calc) -> None:
    reply = "```python\ndef sub(a, b):\n    return b - a\n```"
    assert "drops add, mul" in plan_edit([calc], reply, "give me the complete updated file with sub fixed").message()


def test_a_whole_file_reply_may_drop_what_the_request_names(calc) -> None:
    reply = "```python\n" + CALC.split("\n\n\ndef mul")[0] + "\n```\n"
    plan = plan_edit([calc], reply, "remove mul")
    assert plan.ok and plan.changes[0].how == "whole file" and "def mul" not in plan.changes[0].text


def test_a_whole_file_reply_that_keeps_everything_is_accepted(calc) -> None:
    new = CALC.replace("return a - b", "return a - b  # difference")
    plan = plan_edit([calc], f"Sure.\n```python\n{new}```\nDone.", "comment sub")
    assert plan.ok and plan.changes[0].text == new


def test_a_whole_file_reply_cut_short_is_refused(calc) -> None:
    plan = plan_edit([calc], "```python\n" + CALC[:40], "anything")
    assert "ended inside its code block" in plan.message()


def test_a_text_file_reply_keeping_under_half_its_lines_is_refused_unless_asked(tmp_path: Path) -> None:
    f = tmp_path / "notes.txt"
    f.write_text("".join(f"line {i}\n" for i in range(20)))
    target = load_edit_target(f)
    reply = "```text\nline 3\nline 4 changed\n```"
    assert "keep only 1 of the 20 lines" in plan_edit([target], reply, "fix line 4").message()
    assert plan_edit([target], reply, "shorten it to the essentials").ok


def test_definitions_of_other_languages(tmp_path: Path) -> None:
    js = "export function a() {}\nconst b = (x) => x\nclass C {}\nasync function d() {}\n"
    assert definitions(js, "javascript") == {"a", "b", "C", "d"}
    rust = "pub fn a() {}\nfn b() {}\nstruct S;\nimpl T for S {}\n"
    assert {"a", "b", "S"} <= definitions(rust, "rust")
    assert definitions("class A:\n    def m(self): pass\nX = 1\n", "python") == {"A", "A.m", "X"}


def test_a_reply_that_no_longer_parses_is_flagged(calc) -> None:
    plan = plan_edit([calc], block("    return a + b\n", "    return a +\n"), "break it")
    assert plan.ok and "does not parse as Python (line 2" in plan.changes[0].notes[0]


def test_a_file_without_a_final_newline_keeps_it(tmp_path: Path) -> None:
    f = tmp_path / "a.py"
    f.write_text("x = 1\ny = 2")
    target = load_edit_target(f)
    assert plan_edit([target], "```python\nx = 1\ny = 3\n```", "y = 3").changes[0].text == "x = 1\ny = 3"
    assert plan_edit([target], block("y = 2\n", "y = 3\n", "a.py"), "y = 3").changes[0].text == "x = 1\ny = 3"


# -- SEARCH/REPLACE blocks ----------------------------------------------------------------------------------------
def test_a_block_applies_exactly_and_leaves_the_rest(calc) -> None:
    plan = plan_edit(
        [calc],
        "Sure:\n\n"
        + block("def sub(a, b):\n    return a - b\n", "def sub(a: int, b: int) -> int:\n    return a - b\n"),
        "hints",
    )
    assert plan.ok and plan.changes[0].how == "SEARCH/REPLACE blocks"
    assert plan.changes[0].text == CALC.replace("def sub(a, b):", "def sub(a: int, b: int) -> int:")


def test_blocks_apply_in_order_and_without_fences_or_file_name(calc) -> None:
    reply = (
        "<<<<<<< SEARCH\n    return a + b\n=======\n    return b + a\n>>>>>>> REPLACE\n"
        "<<<<<<< SEARCH\n    return b + a\n=======\n    return (b + a)\n>>>>>>> REPLACE\n"
    )
    assert plan_edit([calc], reply).changes[0].text == CALC.replace("a + b", "(b + a)")


def test_a_block_whose_search_is_not_in_the_file_is_refused_with_the_closest_line(calc) -> None:
    plan = plan_edit([calc], block("def sub(a, b):\n    return a-b\n", "x\n"), "x")
    assert plan.refusals == (
        "Block 1 (calc.py) was refused: its SEARCH text is not in the file: its line 2 "
        "`return a-b` is not in calc.py; the closest is line 6: `return a - b`.",
    )


def test_a_block_differing_in_indentation_only_is_refused_and_says_so(calc) -> None:
    plan = plan_edit([calc], block("def sub(a, b):\nreturn a - b\n", "x\n"), "x")
    assert "differs from line 6 of calc.py in spaces or indentation only" in plan.message()


def test_an_ambiguous_block_is_refused(calc) -> None:
    plan = plan_edit([calc], block("\n\ndef", "x"), "x")
    assert not plan.ok
    plan = plan_edit([calc], block("\n", "x\n"), "x")
    assert "empty SEARCH part" in plan.message()
    twice = CALC + "\ndef add(a, b):\n    return a + b\n"
    target = EditTarget(path=calc.path, text=twice, encoding="utf-8", mtime=0, sha256="", original=twice)
    assert "matches 2 places (lines 1, 12)" in plan_edit([target], block("def add(a, b):\n", "x\n"), "x").message()


def test_one_refused_block_refuses_the_whole_edit(calc) -> None:
    reply = block("    return a + b\n", "    return 0\n") + block("not there\n", "x\n")
    plan = plan_edit([calc], reply, "x")
    assert not plan.changes and plan.refusals[0].startswith("Block 2 (calc.py) was refused")


def test_an_incomplete_block_is_refused(calc) -> None:
    assert parse_blocks("<<<<<<< SEARCH\na\n=======\nb\n")[1] == [
        "Block 1 is incomplete: no `>>>>>>> REPLACE` line (the reply ended inside it)."
    ]
    assert "no `=======` line" in plan_edit([calc], "<<<<<<< SEARCH\n    return a + b\n", "x").message()


def test_blocks_that_change_nothing_are_refused(calc) -> None:
    assert "change nothing" in plan_edit([calc], block("    return a + b\n", "    return a + b\n")).message()


def test_several_files_in_one_reply(tmp_path: Path, calc) -> None:
    util = tmp_path / "util.py"
    util.write_text("def helper():\n    return add(1, 2)\n")
    other = load_edit_target(util)
    reply = (
        block("def add(a, b):\n", "def plus(a, b):\n")
        + "\nand\n\n"
        + block("    return add(1, 2)\n", "    return plus(1, 2)\n", name="util.py")
    )
    plan = plan_edit([calc, other], reply, "rename add to plus")
    assert plan.ok and [c.target.path.name for c in plan.changes] == ["calc.py", "util.py"]
    assert "plus(1, 2)" in plan.changes[1].text
    refused = plan_edit([calc, other], block("x\n", "y\n", name="missing.py"), "x")
    assert "`missing.py`, which is not attached (attached: " in refused.message()
    unnamed = plan_edit([calc, other], "<<<<<<< SEARCH\nx\n=======\ny\n>>>>>>> REPLACE\n", "x")
    assert "does not name its file" in unnamed.message()


def test_a_reply_with_neither_blocks_nor_code_is_refused(calc) -> None:
    assert "neither SEARCH/REPLACE blocks nor a code block" in plan_edit([calc], "I cannot do that.").message()


@settings(max_examples=300, deadline=None)
@given(st.text(max_size=400))
def test_planning_never_raises_on_any_reply(reply: str) -> None:
    target = EditTarget(path=Path("/x/calc.py"), text=CALC, encoding="utf-8", mtime=0, sha256="", original=CALC)
    plan = plan_edit([target], reply, "anything")
    assert plan.ok or plan.refusals


# -- the fuzz of the applier -------------------------------------------------------------------------------------
LINES = st.lists(
    st.sampled_from(["a", "b", "c", "", "  a", "def f():", "    return 1", "x = 1", "\t", "é"]), min_size=1, max_size=25
)


@settings(max_examples=400, deadline=None)
@given(LINES, st.data())
def test_a_block_applies_exactly_where_its_search_text_occurs_once_else_is_refused(lines, data) -> None:
    text = "\n".join(lines) + data.draw(st.sampled_from(["", "\n"]))
    file_lines = split_lines(text)
    assume(file_lines)
    start = data.draw(st.integers(0, len(file_lines) - 1))
    stop = data.draw(st.integers(start + 1, len(file_lines)))
    search = "".join(file_lines[start:stop])
    search = search if search.endswith("\n") else search + "\n"
    if data.draw(st.booleans()):  # sometimes a SEARCH text the model got wrong
        search = data.draw(st.sampled_from(["zz\n", search.replace("a", "A"), " " + search]))
    replace = "".join(f"{line}\n" for line in data.draw(LINES))
    new, why = apply_block(text, EditBlock(1, "", search, replace), "f.txt")
    hay = text if text.endswith("\n") else text + "\n"
    where = [i for i in range(len(hay)) if hay.startswith(search, i) and (i == 0 or hay[i - 1] == "\n")]
    if len(where) != 1 or not search.strip():
        assert new is None and why.startswith("Block 1 (f.txt)")  # refused, with the reason
        return
    assert why == ""
    expected = hay[: where[0]] + replace + hay[where[0] + len(search) :]
    if not text.endswith("\n") and expected.endswith("\n"):
        expected = expected[:-1]
    assert new == expected  # exactly the one occurrence replaced, nothing else touched
