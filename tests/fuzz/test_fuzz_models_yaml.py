"""Fuzzing models.yaml (backend/models/catalog/config.py + config_yaml.py, issue 20 item 5): any document either parses
to
pairs that are valid all the way down (names that can be selected, hub ids huggingface_hub accepts, numbers in
range) or raises one ConfigError line naming the file. Fails on the code before issue 20: a hub id ending in '-',
'.' or a newline passed (and ended in huggingface_hub's traceback), 60 levels of brackets hit the recursion
limit, an impossible date or a 5,000-digit number raised a bare ValueError, a pair name ending in a newline was
accepted."""

from __future__ import annotations

import copy
import math
from pathlib import Path

import pytest
from huggingface_hub.utils import HFValidationError, validate_repo_id
from hypothesis import strategies as st
from reliability import SCALES, Raw, dump_json, fuzz, values

from specchat.backend.errors import ConfigError
from specchat.backend.models.catalog.config import _PAIR_NAME, load_pairs, load_pairs_file

BASE = {
    "name": "fuzzed",
    "description": "a pair",
    "target": {
        "source": "org/model",
        "params": 1000,
        "num_layers": 2,
        "num_kv_heads": 1,
        "head_dim": 8,
        "hidden_size": 8,
        "vocab_size": 100,
    },
    "drafter": "prompt-lookup",
    "gamma": "auto",
    "context_length": 256,
    "sampling": {"temperature": 0.2},
}
PATHS = [
    ("name",),
    ("description",),
    ("target",),
    ("drafter",),
    ("gamma",),
    ("context_length",),
    ("sampling",),
    ("draft",),
    ("target", "source"),
    ("target", "revision"),
    ("target", "params"),
    ("target", "dtype"),
    ("target", "download_bytes"),
    ("target", "gated"),
    ("sampling", "top_k"),
    ("sampling", "temperature"),
    ("sampling", "max_new_tokens"),
    ("pairs",),
]
YAML_RAW = st.one_of(
    st.sampled_from(
        [
            "2001-13-45",
            "2001-02-29",
            "9" * 5000,
            "0b" + "1" * 200,
            "0x" + "f" * 100,
            ".inf",
            "-.inf",
            ".nan",
            "!!int x",
            "!!float y",
            "!!binary ==",
            "*nope",
            "&a [*a]",
            "!!python/name:os.system",
            "~",
            "1:2:3:4:5",
            "0o777",
            "1e400",
            "!!timestamp 2001-99-99",
            "? [a]",
            "'unclosed",
            "|-",
            "!!set {a, b}",
            "!!omap [a: 1]",
            "<<: 3",
        ]
    ),
    st.integers(min_value=33, max_value=3000).map(lambda n: "[" * n + "]" * n),
    st.integers(min_value=10, max_value=400).map(lambda n: "{a: " * n + "1" + "}" * n),
)
HUBBY = st.text(st.sampled_from("ab9-._/\n -"), min_size=1, max_size=12)  # near-misses of org/name
NAMEY = st.text(st.sampled_from("ab9-._\n \t"), min_size=1, max_size=10)


def _document(data: tuple) -> str:
    path, value = data
    pair = copy.deepcopy(BASE)
    if path == ("pairs",):
        return f"pairs: {dump_json(value)}\n"
    node = pair
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    return "pairs:\n  - " + dump_json(pair) + "\n"


DOCUMENTS = st.one_of(
    st.tuples(st.sampled_from(PATHS), values(YAML_RAW)).map(_document),
    st.tuples(st.just(("target", "source")), HUBBY).map(_document),
    st.tuples(st.just(("name",)), NAMEY).map(_document),
    st.tuples(st.just(("target", "revision")), st.one_of(HUBBY, st.text(max_size=8))).map(_document),
    st.tuples(st.just(_document((("name",), "ok"))), st.integers(min_value=0, max_value=400)).map(
        lambda t: t[0][: t[1]]
    ),
    st.text(max_size=200),
    YAML_RAW.map(lambda raw: f"pairs:\n  - name: x\n    target: {raw}\n"),
)


def _valid(pairs: dict) -> None:
    for name, pair in pairs.items():
        assert _PAIR_NAME.fullmatch(name), repr(name)
        for spec in (pair.target, pair.draft):
            if spec is None:
                continue
            if spec.kind == "hub":
                validate_repo_id(spec.source)  # huggingface_hub accepts what models.yaml accepted
            assert spec.revision is None or (spec.revision.isprintable() and " " not in spec.revision)
            assert spec.params >= 1 and spec.num_layers >= 1 and spec.download_bytes >= 0
        assert 64 <= pair.context_length <= 1 << 20 and (pair.gamma == "auto" or 1 <= pair.gamma <= 31)
        for value in pair.sampling.values():
            assert isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


@SCALES
def test_any_models_file_parses_to_valid_pairs_or_one_named_error(tmp_path: Path, scale: int) -> None:
    file = tmp_path / "models.yaml"

    def check(text: str) -> None:
        file.write_bytes(text.encode("utf-8", "surrogatepass"))
        try:
            pairs = load_pairs_file(file)
        except ConfigError as error:
            message = str(error)
            assert str(file) in message and "\n" not in message and len(message) < 2000, message
        else:
            try:
                _valid(pairs)
            except HFValidationError as error:
                pytest.fail(f"accepted a hub id huggingface_hub rejects: {error}")

    fuzz("models.yaml", DOCUMENTS, check, 250 * scale)


@pytest.mark.parametrize(
    "field, value, expected",
    [
        ("target.source", "org/name-", "hub id"),
        ("target.source", "org/name.", "hub id"),
        ("target.source", "org/name\n", "hub id"),
        ("target.source", "org/x.git", "hub id"),
        ("name", "pair\n", "must be 1-64 letters"),
        ("target.revision", "main\n", "not a branch"),
        ("context_length", Raw("9" * 5000), "5000 characters"),
        ("description", Raw("2001-13-45"), "looks like a date"),
        ("description", Raw("[" * 60 + "]" * 60), "nested deeper than 32"),
    ],
)
def test_the_classes_of_the_issue_are_named(tmp_path: Path, field: str, value: object, expected: str) -> None:
    file = tmp_path / "models.yaml"
    file.write_text(_document((tuple(field.split(".")), value)))
    with pytest.raises(ConfigError) as info:
        load_pairs_file(file)
    assert expected in str(info.value) and str(file) in str(info.value)


@pytest.mark.parametrize(
    "where, expected",
    [("/dev/null", "not a regular file"), ("folder", "is a folder"), ("missing.yaml", "models file not found")],
)
def test_a_models_path_that_is_not_a_file_says_what_it_is(tmp_path: Path, where: str, expected: str) -> None:
    path = where if where.startswith("/") else str(tmp_path / where)
    if where == "folder":
        (tmp_path / "folder").mkdir()
    with pytest.raises(ConfigError, match=expected):
        load_pairs(path)
