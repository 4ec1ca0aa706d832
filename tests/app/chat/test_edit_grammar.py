"""/edit's SEARCH/REPLACE grammar (issue 46): every SEARCH is whole consecutive lines of its file (at most 8,
starting on a line with text), the block syntax is enforced from the first token, REPLACE and the text after the
blocks are free but cannot open another block; a whole-file rewrite and very long files get no grammar. Checked
with llguidance over a character-level tokenizer, and end to end on a tiny random-weight model: whatever it writes,
every block it completes is found in its file."""

from __future__ import annotations

import llguidance
import pytest
from char_tokenizer import char_engine, char_tokenizer
from tiny_models import one_thread  # noqa: F401  (autouse)

from specchat.app.chat.edit_grammar import MAX_LINES, edit_constraint
from specchat.app.chat.edit_plan import parse_blocks
from specchat.app.chat.editing import edit_labels, load_edit_target
from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.constraint_spec import grammar_text
from specchat.backend.speculative.constraint import ll_tokenizer

LINES = [f"value_{i} = compute({i}, scale=2)" for i in range(110)] + ["", "def main():", "    return 0"]  # 3.6 KB
TEXT = "\n".join(LINES) + "\n"


@pytest.fixture
def target(tmp_path):
    path = tmp_path / "mod.py"
    path.write_text(TEXT, encoding="utf-8")
    return load_edit_target(path)


def matcher(targets):
    tok = char_tokenizer()
    spec = edit_constraint(targets)
    assert spec is not None
    return tok, llguidance.LLMatcher(ll_tokenizer(tok, len(tok), [2]), grammar_text(spec), log_level=0)


def accepts(targets, reply: str) -> bool:
    tok, m = matcher(targets)
    ids = tok.encode(reply, add_special_tokens=False)
    return m.validate_tokens(ids) == len(ids)


def block(label: str, search: list[str], replace: list[str]) -> str:
    body = "".join(f"{line}\n" for line in search) + "=======\n" + "".join(f"{line}\n" for line in replace)
    return f"{label}\n<<<<<<< SEARCH\n{body}>>>>>>> REPLACE\n"


def test_searches_are_consecutive_lines_of_the_file(target):
    label = edit_labels([target])[0]
    assert accepts([target], block(label, LINES[3:6], ["x = 1"]) + "\nRenamed it.\n")
    assert accepts([target], block(label, LINES[111:113], []) + block(label, LINES[0:1], ["y"]))
    assert not accepts([target], block(label, [LINES[3], LINES[5]], ["x"]))  # not consecutive
    assert not accepts([target], block(label, ["value_3 = compute(3, scale=3)"], ["x"]))  # not in the file
    assert not accepts([target], block(label, LINES[0:9], ["x"]))  # more than 8 lines
    assert not accepts([target], block(label, [""], ["x"]))  # a SEARCH starts on a line with text
    assert not accepts([target], "Sure! " + block(label, LINES[3:4], ["x"]))  # blocks first
    tail = block(label, LINES[3:4], ["x"]) + "\nmore\n<<<<<<< SEARCH\n"
    assert not accepts([target], tail)  # no block after the explanation, where SEARCH would be free
    tok, m = matcher([target])
    assert tok.decode(m.compute_ff_tokens()) == f"{label}\n<<<<<<< SEARCH\n"  # jump-forward drafts the head


def test_no_grammar_for_a_whole_rewrite_or_a_very_long_file(tmp_path):
    small = tmp_path / "small.py"
    small.write_text("x = 1\n", encoding="utf-8")
    assert edit_constraint([load_edit_target(small)]) is None
    long = tmp_path / "long.py"
    long.write_text("".join(f"v{i} = {i}\n" for i in range(MAX_LINES + 1)), encoding="utf-8")
    assert edit_constraint([load_edit_target(long)]) is None


def test_a_random_model_only_writes_searches_that_match(target):
    engine = char_engine(drafter="prompt-lookup", gamma=4)
    spec = edit_constraint([target])
    for seed in range(3):
        request = GenerationRequest(
            messages=[{"role": "user", "content": "edit"}],
            sampling=SamplingParams(temperature=1.0, seed=seed, max_new_tokens=300),
            constraint=spec,
        )
        reply = "".join(e.text for e in engine.generate(request))
        blocks, _ = parse_blocks(reply)
        assert reply.startswith(f"{edit_labels([target])[0]}\n<<<<<<< SEARCH\n")
        assert all(b.search and b.search in TEXT for b in blocks)
