"""Bad input never crashes specchat (issue 7, part 1): each is refused with an error that names what is wrong,
where, and what to do, and no traceback reaches the user.

Covers: fuzzed and hostile models.yaml (wrong types, unknown keys, huge values, duplicate names, alias bombs,
python tags), an unknown pair through the CLI, missing / empty / truncated / corrupt GGUF and safetensors
sources, a draft whose tokenizer differs, prompts that are empty, beyond the context, full of control
characters, invalid UTF-8 or very long lines (engine and `specchat generate --prompts FILE`), and sampling
settings out of range (CLI and engine). /edit input is covered by tests/app/chat/test_editing.py.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import math
from pathlib import Path

import pytest
import yaml
from engine_fixtures import tiny_engine
from foundation_fixtures import local_spec, save_tiny_llama, word_tokenizer, write_tiny_gguf
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from tiny_models import one_thread  # noqa: F401  (one_thread: autouse)

from specchat.app.cli.main import main
from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.errors import ConfigError, ModelLoadError, RequestError
from specchat.backend.models.catalog.config import load_pairs_file
from specchat.backend.models.loading.pair import load_model

WORDS = [f"w{i}" for i in range(40)]
FUZZ = settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


@pytest.fixture(autouse=True)
def _isolate(isolated_dirs):
    return isolated_dirs


# --- models.yaml -------------------------------------------------------------------------------------------

BASE_PAIR = {
    "name": "fuzzed",
    "description": "a pair",
    "target": {
        "source": "org/fuzz-model",  # a hub id not in the cache: the numbers are overrides, unchecked
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
ANY_VALUE = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(10**30), max_value=10**30),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=30),
    st.lists(st.integers(), max_size=3),
    st.dictionaries(st.text(max_size=5), st.integers(), max_size=2),
)
FIELDS = [
    ("name",),
    ("description",),
    ("target",),
    ("drafter",),
    ("gamma",),
    ("context_length",),
    ("sampling",),
    ("draft",),
    ("target", "source"),
    ("target", "params"),
    ("target", "dtype"),
    ("target", "quantization"),
    ("target", "num_layers"),
    ("target", "revision"),
    ("target", "allow_pickle"),
    ("target", "trust_remote_code"),
    ("target", "download_bytes"),
    ("sampling", "temperature"),
    ("sampling", "top_p"),
    ("sampling", "top_k"),
    ("sampling", "max_new_tokens"),
    ("sampling", "repetition_penalty"),
]


def _write(tmp_path: Path, data) -> Path:
    file = tmp_path / "models.yaml"
    file.write_text(data if isinstance(data, str) else yaml.safe_dump(data, allow_unicode=True), encoding="utf-8")
    return file


def _load_or_error(file: Path):
    """load_pairs_file either parses or raises ConfigError naming the file on one line; nothing else."""
    try:
        return load_pairs_file(file), None
    except ConfigError as error:
        text = str(error)
        assert str(file) in text and "\n" not in text and len(text) < 2000, text
        return None, text


@FUZZ
@given(field=st.sampled_from(FIELDS), value=ANY_VALUE)
def test_fuzzed_field_values_are_accepted_or_named(tmp_path, field, value):
    pair = copy.deepcopy(BASE_PAIR)
    node = pair
    for key in field[:-1]:
        node = node[key]
    node[field[-1]] = value
    pairs, error = _load_or_error(_write(tmp_path, {"pairs": [pair]}))
    if error is not None:
        assert f"field '{'.'.join(field)}" in error, error  # the field, or a field inside it
    else:  # what passed is a valid pair: numbers in range, known choices
        (parsed,) = pairs.values()
        assert 64 <= parsed.context_length and (parsed.gamma == "auto" or 1 <= parsed.gamma <= 31)
        temperature = parsed.sampling.get("temperature", 0)
        assert isinstance(temperature, (int, float)) and not math.isnan(temperature) and 0 <= temperature <= 10


@FUZZ
# not YAML line breaks in keys, nor lone surrogates: no UTF-8 file holds one (PyYAML writes "\ud800" as an escape its
# own reader refuses: the user gets the syntax error test_bad_models_file_through_the_cli checks)
@given(
    key=st.text(
        st.characters(blacklist_categories=("Cs",), blacklist_characters="\r\x85\u2028\u2029"), min_size=1, max_size=20
    ),
    where=st.sampled_from(["pair", "target", "sampling", "top"]),
)
def test_unknown_keys_are_named(tmp_path, key, where):
    pair = copy.deepcopy(BASE_PAIR)
    data = {"pairs": [pair]}
    node = {"pair": pair, "target": pair["target"], "sampling": pair["sampling"], "top": data}[where]
    if key in node or key == "<<":
        return
    node[key] = 1
    _, error = _load_or_error(_write(tmp_path, data))
    assert error is not None and "unknown field" in error and "allowed fields" in error
    assert repr(key)[1:-1][:10] in error or key[:10] in error  # long keys are abbreviated


@FUZZ
@given(text=st.one_of(st.text(max_size=300), st.binary(max_size=300).map(lambda b: b.decode("latin-1"))))
def test_arbitrary_text_never_crashes_the_parser(tmp_path, text):
    _load_or_error(_write(tmp_path, text))


def test_duplicate_names_huge_values_and_non_finite_numbers(tmp_path):
    twice = {"pairs": [BASE_PAIR, dict(BASE_PAIR, description="again")]}
    _, error = _load_or_error(_write(tmp_path, twice))
    assert "'fuzzed'" in error and "already used" in error and "rename one" in error
    for field, value, expected in [
        ("context_length", 10**40, "between 64 and"),
        ("gamma", 10**12, "1 to 31"),
        ("gamma", -3, "1 to 31"),
        ("gamma", 0, "1 to 31"),
    ]:
        _, error = _load_or_error(_write(tmp_path, {"pairs": [dict(BASE_PAIR, **{field: value})]}))
        assert f"'{field}'" in error and expected in error, error
    for value in (".nan", ".inf", "-.inf", "1e400"):
        text = yaml.safe_dump({"pairs": [BASE_PAIR]}).replace("temperature: 0.2", f"temperature: {value}")
        _, error = _load_or_error(_write(tmp_path, text))
        assert "'sampling.temperature'" in error, (value, error)


def test_alias_bomb_is_refused_quickly_with_a_short_message(tmp_path):
    lines = ["pairs:", "  - name: bomb", "    description:", '      - &a ["lol","lol","lol","lol","lol","lol","lol"]']
    previous = "a"
    for name in "bcdefghij":  # 7**10 strings if expanded
        lines.append(f"      - &{name} [" + ",".join([f"*{previous}"] * 7) + "]")
        previous = name
    _, error = _load_or_error(_write(tmp_path, "\n".join(lines) + "\n"))
    assert "'description'" in error and "expected str" in error and len(error) < 600


@pytest.mark.parametrize(
    "tag",
    [
        "!!python/object/apply:os.system ['touch {marker}']",
        "!!python/name:os.system",
        "!!python/object/new:subprocess.Popen [['touch', '{marker}']]",
    ],
)
def test_python_tags_are_refused_and_run_nothing(tmp_path, tag):
    marker = tmp_path / "ran"
    text = yaml.safe_dump({"pairs": [BASE_PAIR]}).replace(
        "description: a pair", "description: " + tag.format(marker=marker)
    )
    _, error = _load_or_error(_write(tmp_path, text))
    assert "YAML syntax error" in error and "python" in error and not marker.exists()


# --- model files -------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory) -> tuple[Path, object]:
    folder = tmp_path_factory.mktemp("models") / "tiny"
    model = save_tiny_llama(folder, word_tokenizer(WORDS), len(WORDS) + 4)
    return folder, model


def _copy_model(tiny_dir, dest: Path) -> Path:
    import shutil

    shutil.copytree(tiny_dir[0], dest)
    return dest


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated", "header cut"])
def test_corrupt_safetensors_names_the_file_and_what_to_do(tmp_path, tiny_dir, damage):
    folder = _copy_model(tiny_dir, tmp_path / "m")
    weights = folder / "model.safetensors"
    good = weights.read_bytes()
    weights.write_bytes(
        {
            "empty": b"",
            "garbage": b"\x00not safetensors" * 50,
            "truncated": good[: len(good) // 2],
            "header cut": good[:100],
        }[damage]
    )
    with pytest.raises(ModelLoadError) as info:
        load_model(local_spec(folder, tiny_dir[1]), "cpu")
    text = str(info.value)
    assert "model.safetensors" in text and "damaged or incomplete" in text and "download or copy" in text


def test_missing_weights_and_config_name_the_folder(tmp_path, tiny_dir):
    folder = _copy_model(tiny_dir, tmp_path / "m")
    (folder / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match=r"no weights found \(\*\.safetensors\)"):
        load_model(local_spec(folder, tiny_dir[1]), "cpu")
    folder = _copy_model(tiny_dir, tmp_path / "m2")
    (folder / "config.json").write_text("{ not json")
    with pytest.raises(ModelLoadError, match=str(folder)):
        load_model(local_spec(folder, tiny_dir[1]), "cpu")


@pytest.mark.parametrize("damage", ["empty", "garbage", "truncated", "header cut"])
def test_corrupt_gguf_names_the_file_and_what_to_do(tmp_path, tiny_dir, damage):
    gguf = write_tiny_gguf(tmp_path / "tiny.gguf")
    good = gguf.read_bytes()
    gguf.write_bytes(
        {
            "empty": b"",
            "garbage": b"GGUF" + bytes(range(256)) * 2,
            "truncated": good[: len(good) // 2],
            "header cut": good[:100],
        }[damage]
    )
    spec = dataclasses.replace(local_spec(tmp_path, tiny_dir[1]), source=str(gguf), kind="gguf", path=str(gguf))
    with pytest.raises(ModelLoadError) as info:
        load_model(spec, "cpu")
    text = str(info.value)
    assert str(gguf) in text and "download it again" in text


def test_missing_gguf_is_a_config_error_naming_the_path(tmp_path):
    pair = dict(BASE_PAIR, target=dict(BASE_PAIR["target"], source=str(tmp_path / "absent.gguf")))
    _, error = _load_or_error(_write(tmp_path, {"pairs": [pair]}))
    assert "absent.gguf does not exist" in error and "'target.source'" in error


# --- the CLI -----------------------------------------------------------------------------------------------


def _spec_yaml(folder: Path, model, **extra) -> dict:
    config = model.config
    return {
        "source": str(folder),
        "dtype": "float32",
        "params": sum(p.numel() for p in model.parameters()),
        "num_layers": config.num_hidden_layers,
        "num_kv_heads": config.num_key_value_heads,
        "head_dim": config.head_dim,
        "hidden_size": config.hidden_size,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": config.tie_word_embeddings,
        **extra,
    }


@pytest.fixture
def models_file(tmp_path, tiny_dir) -> Path:
    pair = {"name": "tiny", "target": _spec_yaml(*tiny_dir), "drafter": "prompt-lookup", "context_length": 64}
    return _write(tmp_path, {"pairs": [pair]})


def cli(capsys, *argv) -> tuple[int, str, str]:
    try:
        code = main(list(argv))
    except SystemExit as exit_:  # argparse refuses bad option values itself
        code = exit_.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err and "Traceback" not in out
    return code, out, err


def _error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if "error" in line]
    assert len(lines) == 1, err
    return lines[0]


def test_unknown_pair_through_the_cli(capsys, models_file):
    code, _, err = cli(capsys, "generate", "--models", str(models_file), "--pair", "no-such-pair", "--prompt", "hi")
    line = _error_line(err)
    assert code == 2 and "unknown pair 'no-such-pair'" in line and "tiny" in line and "specchat models" in line


@pytest.mark.parametrize(
    "content, expected",
    [
        ("pairs: [\n", "YAML syntax error"),
        ("pairs:\n  - name: x\n    bogus: 1\n", "unknown field"),
        ("not-utf8", None),
    ],
)
def test_bad_models_file_through_the_cli(capsys, tmp_path, content, expected):
    file = tmp_path / "bad.yaml"
    if content == "not-utf8":
        file.write_bytes(b"pairs: \xff\xfe\n")
        expected = "not UTF-8"
    else:
        file.write_text(content)
    code, _, err = cli(capsys, "generate", "--models", str(file), "--prompt", "hi")
    line = _error_line(err)
    assert code == 2 and str(file) in line and expected in line
    code, _, err = cli(capsys, "generate", "--models", str(tmp_path / "nope.yaml"), "--prompt", "hi")
    assert code == 2 and "models file not found" in _error_line(err)


def test_draft_with_a_different_tokenizer_is_refused_through_the_cli(capsys, tmp_path, tiny_dir):
    other = tmp_path / "other"
    reordered = list(reversed(WORDS))
    draft_model = save_tiny_llama(other, word_tokenizer(reordered), len(WORDS) + 4, seed=1)
    pair = {
        "name": "mixed",
        "target": _spec_yaml(*tiny_dir),
        "drafter": "draft-model",
        "draft": _spec_yaml(other, draft_model),
        "context_length": 64,
    }
    file = _write(tmp_path, {"pairs": [pair]})
    code, _, err = cli(capsys, "generate", "--models", str(file), "--pair", "mixed", "--prompt", "w1 w2")
    line = _error_line(err)
    assert code == 2 and "different ids" in line and "same tokenizer" in line and str(other) in line


def test_corrupt_weights_through_the_cli(capsys, tmp_path, tiny_dir):
    folder = _copy_model(tiny_dir, tmp_path / "m")
    (folder / "model.safetensors").write_bytes(b"\x00" * 10)
    pair = {"name": "broken", "target": _spec_yaml(folder, tiny_dir[1]), "drafter": "none", "context_length": 64}
    code, _, err = cli(
        capsys, "generate", "--models", str(_write(tmp_path, {"pairs": [pair]})), "--pair", "broken", "--prompt", "w1"
    )
    assert code == 2 and "model.safetensors" in _error_line(err)


@pytest.mark.parametrize(
    "option, value, field",
    [
        ("--temperature", "-1", "temperature"),
        ("--temperature", "nan", "temperature"),
        ("--top-p", "1.5", "top_p"),
        ("--top-p", "0", "top_p"),
        ("--top-k", "-3", "top_k"),
        ("--repetition-penalty", "0", "repetition_penalty"),
        ("--seed", str(2**70), "seed"),
    ],
)
def test_sampling_out_of_range_through_the_cli(capsys, models_file, option, value, field):
    code, _, err = cli(
        capsys,
        "generate",
        "--models",
        str(models_file),
        "--pair",
        "tiny",
        "--prompt",
        "w1 w2",
        option,
        value,
        "--max-new-tokens",
        "2",
    )
    line = _error_line(err)
    assert code == 2 and f"{field}=" in line and "out of range" in line and "use " in line


@pytest.mark.parametrize("value", ["0", "-1", "65", "1000000", "many"])
def test_gamma_out_of_range_through_the_cli(capsys, models_file, value):
    code, _, err = cli(
        capsys, "generate", "--models", str(models_file), "--pair", "tiny", "--prompt", "w1", "--gamma", value
    )
    assert code == 2 and "--gamma" in err and value in err


def _prompts_file(tmp_path: Path, lines: list[bytes]) -> Path:
    file = tmp_path / "prompts.jsonl"
    file.write_bytes(b"\n".join(lines) + b"\n")
    return file


GOOD_LINE = json.dumps({"id": "ok", "messages": [{"role": "user", "content": "w1 w2"}]}).encode()


@pytest.mark.parametrize(
    "bad, expected",
    [
        (b'{"id": 1, "messages": [{"role": "user", "content": "w1 \xff\xfe"}]}', "not UTF-8 text (byte 0xff at column"),
        (b'{"id": 2, "messages": [', "not valid JSON"),
        (b"[" * 100000, "not valid JSON"),
        (b'{"id": 3, "messages": [{"role": "user", "content": 7}]}', "content must be text"),
        (b'{"id": 4, "messages": [{"role": "robot", "content": "hi"}]}', "role 'robot'"),
        (b'{"id": 5, "messages": [{"role": "user", "content": "   "}]}', "is empty"),
        (b'{"id": 6, "messages": []}', '"messages" list'),
    ],
)
def test_bad_prompts_line_is_named_before_loading(capsys, tmp_path, models_file, bad, expected):
    file = _prompts_file(tmp_path, [GOOD_LINE, bad])
    code, out, err = cli(capsys, "generate", "--models", str(models_file), "--pair", "tiny", "--prompts", str(file))
    line = _error_line(err)
    assert code == 2 and f"{file}:2" in line and expected in line and out == ""


def test_hostile_prompts_run_or_are_refused_by_name(capsys, tmp_path, models_file):
    control = "".join(chr(c) for c in range(32) if c != 10) + "\x7f\u202e\u200b\ufeff"
    lines = [
        json.dumps({"id": "ctrl", "messages": [{"role": "user", "content": f"w1 {control} w2"}]}).encode(),
        b'{"id": "sur\\ud800", "messages": [{"role": "user", "content": "w3 \\udcff w4 \\ud83d"}]}',
        json.dumps({"id": "longline", "messages": [{"role": "user", "content": "w5" * 200_000}]}).encode(),
        json.dumps({"id": "huge", "messages": [{"role": "user", "content": "w6 " * 500}]}).encode(),
    ]
    file = _prompts_file(tmp_path, lines)
    code, out, err = cli(
        capsys,
        "generate",
        "--models",
        str(models_file),
        "--pair",
        "tiny",
        "--prompts",
        str(file),
        "--json",
        "--max-new-tokens",
        "3",
    )
    records = [json.loads(line) for line in out.splitlines()]
    # A 200 000-character line without spaces is one (unknown) word: it runs; 500 words exceed the context.
    assert [r["id"] for r in records] == ["ctrl", "sur?", "longline"]  # the lone surrogate replaced
    assert all(r["finish_reason"] in ("length", "eos") for r in records)
    line = _error_line(err)
    assert code == 2 and f"{file}: prompt 'huge'" in line and "too long for the context" in line
    assert "context_length" in line


# --- the engine --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def engine():
    return tiny_engine("llama", drafter="prompt-lookup", context_length=64)


def _generate(engine, **kw):
    events = list(engine.generate(GenerationRequest(**kw)))
    assert events[-1].finish_reason is not None
    return events


@pytest.mark.parametrize(
    "request_kw, expected",
    [
        (dict(prompt_ids=[]), "the prompt is empty"),
        (dict(messages=[]), "no messages"),
        (dict(messages=[{"role": "user", "content": ""}]), "is empty"),
        (dict(messages=[{"role": "assistant", "content": "w1"}]), "no user message"),
        (dict(messages=[{"role": "user"}]), "'role' and 'content'"),
        (dict(messages=["w1"]), "'role' and 'content'"),
        (dict(prompt_ids=list(range(3, 100))), "context allows 63"),
        (dict(messages=[{"role": "user", "content": "w7 " * 100}]), "too long for the context"),
        (dict(prompt_ids=[5], drafter="magic"), "unknown drafter 'magic'"),
        (dict(prompt_ids=[5], drafter="draft-model"), "has no draft model"),
    ],
)
def test_bad_requests_are_refused_by_name(engine, request_kw, expected):
    with pytest.raises(RequestError, match=expected):
        _generate(engine, **request_kw)
    assert engine.blocks_in_use() == 0


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("temperature", float("nan")),
        ("temperature", float("inf")),
        ("temperature", "hot"),
        ("top_p", 1.01),
        ("top_p", 0.0),
        ("top_p", -1),
        ("top_k", -1),
        ("top_k", 2.5),
        ("repetition_penalty", 0),
        ("repetition_penalty", 1e9),
        ("max_new_tokens", 0),
        ("max_new_tokens", -5),
        ("max_new_tokens", 10**12),
        ("seed", 2**80),
        ("seed", "abc"),
    ],
)
def test_sampling_out_of_range_in_the_engine(engine, field, value):
    with pytest.raises(RequestError) as info:
        _generate(engine, prompt_ids=[5, 6], sampling=SamplingParams(**{field: value}))
    assert f"{field}=" in str(info.value) and "use " in str(info.value)


@pytest.mark.parametrize("gamma", [0, -1, 32, 65, 10**9, "fast", 2.5])
def test_gamma_out_of_range_in_the_engine(engine, gamma):
    with pytest.raises(RequestError, match="gamma must be 'auto' or a number from 1 to 31"):
        _generate(engine, prompt_ids=[5, 6], gamma=gamma)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(content=st.text(min_size=1, max_size=200), system=st.one_of(st.none(), st.text(max_size=50)))
def test_any_text_through_the_engine(engine, content, system):
    """Any Unicode (control characters, lone surrogates, RTL marks) either generates or is refused by name."""
    messages = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": content}
    ]
    try:
        events = _generate(engine, messages=messages, sampling=SamplingParams(temperature=0, max_new_tokens=2))
    except RequestError as error:
        assert "is empty" in str(error) or "too long" in str(error), error
    else:
        text = "".join(e.text for e in events)
        text.encode("utf-8")  # printable: never a lone surrogate in the output
    assert engine.blocks_in_use() == 0


def test_a_file_error_on_a_huge_path_is_one_short_line(capsys):
    """An OSError naming a 5,000-character path (the command-line fuzzer's `--out=999...`): one error line,
    both ends of the path and the reason kept, not the whole path."""
    code = main(["bench", "--device=cpu", "--out=" + "9" * 5000])
    err = capsys.readouterr().err
    lines = [line for line in err.splitlines() if "error" in line]
    assert code == 2 and "Traceback" not in err
    assert len(lines) == 1 and len(lines[0]) < 2000 and lines[0].endswith("free disk space")
    assert "File name too long" in lines[0] and "characters)" in lines[0]


@pytest.mark.parametrize(
    "argv",
    [
        ["models", "--models=--"],
        ["--models=--", "models"],
        ["generate", "--prompt=--"],
        ["bench", "--out=--"],
        ["serve", "--host=--"],
    ],
)
def test_an_option_whose_value_is_a_double_dash_is_named(argv, capsys):
    """argparse drops a ``--`` value and hands the option an empty list; that is a usage error naming the option,
    not a traceback deeper down (the CLI fuzzer found ``models --models=--``)."""
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    option = next(a for a in argv if a.endswith("=--")).split("=")[0]
    assert f"{option} needs a value" in err and "Traceback" not in err
