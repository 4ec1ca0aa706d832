"""Fuzzing the command line (app/cli/main.py and each subcommand's argument checks, issue 20 items 11 and 13):
``specchat generate``, ``bench`` and ``models`` with any option values either run or exit with status 2 and one
error line naming the option or the value, never a traceback. The models are never loaded: ``generate`` runs on
the fake engine, ``bench`` stops where it would start measuring. Fails on the code before issue 20: ``--pair ""``
silently used the default, ``--models /dev/null`` said "not found", and the mode and number checks are here to
keep non-ASCII digits out."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from fake_engine import FakeEngine
from hypothesis import strategies as st
from reliability import NASTY_TEXT, SCALES, UNICODE_DIGITS, fuzz

import specchat.backend.bench.synthetic as synthetic
import specchat.backend.engine.engine as engine_module
from specchat.app.cli import bench as bench_command
from specchat.app.cli.main import main
from specchat.backend.inputs import shown


class Reached(Exception):
    """The bench got past its argument checks to where it would load or measure."""


NUMBERS = st.one_of(
    st.integers(min_value=-5, max_value=70).map(str),
    st.integers().map(str),
    st.floats().map(repr),
    st.text(st.sampled_from(UNICODE_DIGITS + "0123456789.-e"), min_size=1, max_size=6),
    st.sampled_from(["nan", "inf", "-inf", "1e400", "", " 3", "0x10", "1_0", "9" * 5000, "auto", "²", "٣"]),
)
NAMES = st.one_of(st.sampled_from(["smollm2-135m", "", " ", "nope", "smollm2-135m\n"]), NASTY_TEXT)
MODES = st.lists(
    st.one_of(
        st.sampled_from(["plain", "prompt-lookup", "auto", "hf-plain", "draft-model"]),
        st.tuples(st.sampled_from(["prompt-lookup", "auto", "plain"]), NUMBERS).map(lambda t: f"{t[0]}:{t[1]}"),
        NASTY_TEXT,
    ),
    min_size=1,
    max_size=3,
)
DEVICES = st.one_of(st.sampled_from(["cpu", "cuda", "cuda:7", "cpu:1", "mps", "", "auto", "cuda:-1"]), NASTY_TEXT)


def _files(tmp: Path) -> dict[str, str]:
    good = tmp / "prompts.jsonl"
    good.write_text(json.dumps({"id": "é", "messages": [{"role": "user", "content": "hello"}]}) + "\n")
    bad = tmp / "bad.jsonl"
    bad.write_bytes(b'{"id": ' + b"9" * 5000 + b"}\n")
    (tmp / "folder").mkdir(exist_ok=True)
    (tmp / "a-file").write_text("not a folder")
    (tmp / "bad.yaml").write_text("pairs: [[[\n")
    return {
        "good": str(good),
        "bad": str(bad),
        "missing": str(tmp / "missing"),
        "folder": str(tmp / "folder"),
        "devnull": "/dev/null",
        "file": str(tmp / "a-file"),
        "yaml": str(tmp / "bad.yaml"),
    }


def _argv(tmp: Path) -> st.SearchStrategy[list[str]]:
    files = _files(tmp)
    paths = st.one_of(st.sampled_from(sorted(files.values())), NASTY_TEXT.filter(lambda t: "\x00" not in t))
    common = {"--device": DEVICES, "--models": paths, "--pair": NAMES}
    options = {
        "generate": {
            **common,
            "--drafter": st.sampled_from(["none", "prompt-lookup", "auto", "draft-model", "x"]),
            "--max-new-tokens": NUMBERS,
            "--temperature": NUMBERS,
            "--top-k": NUMBERS,
            "--top-p": NUMBERS,
            "--repetition-penalty": NUMBERS,
            "--seed": NUMBERS,
            "--samples": NUMBERS,
            "--gamma": NUMBERS,
            "--system": NASTY_TEXT,
        },
        "bench": {
            **common,
            "--suite": st.sampled_from(["all", "edit", "mt-bench", "nope"]),
            "--limit": NUMBERS,
            "--max-new-tokens": NUMBERS,
            "--out": paths,
            "--temperature": NUMBERS,
            "--seed": NUMBERS,
            "--synthetic": st.sampled_from(["tiny", "llama3-8b", "nope", ""]),
            "--modes": MODES,
        },
        "models": common,
    }

    @st.composite
    def argv(draw: st.DrawFn) -> list[str]:
        command = draw(st.sampled_from(sorted(options)))
        args = [command]
        if command == "generate":
            source = draw(st.sampled_from(["--prompt", "--prompts"]))
            args += [source, draw(NASTY_TEXT) if source == "--prompt" else draw(paths)]
        for option in draw(st.lists(st.sampled_from(sorted(options[command])), max_size=4, unique=True)):
            value = draw(options[command][option])
            args += [option, *value] if isinstance(value, list) else [f"{option}={value}"]
        if command == "generate" and "--max-new-tokens" not in args:
            args += ["--max-new-tokens", "4"]
        return args

    return argv()


@pytest.fixture
def no_models(isolated_dirs, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(engine_module, "load_engine", lambda pair, **kwargs: FakeEngine(pair))

    def reached(*args, **kwargs):
        raise Reached

    monkeypatch.setattr(bench_command, "execute", reached)
    monkeypatch.setattr(synthetic, "measure", reached)


@SCALES
def test_any_command_line_runs_or_names_the_bad_option(no_models, tmp_path: Path, capsys, scale: int) -> None:
    def check(argv: list[str]) -> None:
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse's own refusal
            code = exit_.code
        except Reached:
            code = 0
        out, err = capsys.readouterr()
        assert "Traceback" not in err and code in (0, 2), (code, err[-2000:])
        if code == 2:
            lines = [line for line in err.splitlines() if "error" in line]
            assert len(lines) == 1 and len(lines[0]) < 2000, err[-3000:]
            names = {a.split("=", 1)[0] for a in argv if a.startswith("--")}
            names |= {n.strip("-").replace("-", "_") for n in set(names)} | {"pair", "prompt"}
            values = {a.split("=", 1)[-1] for a in argv} - {""}
            named = [n for n in names | values | {shown(v)[1:-1] for v in values} if n and n in lines[0]]
            assert named, (argv, lines[0])

    fuzz("command line", _argv(tmp_path), check, 250 * scale)


@pytest.mark.parametrize(
    "argv, expected",
    [
        (["generate", "--pair", "", "--prompt", "hi"], "expected a pair name"),
        (["generate", "--models", "/dev/null", "--prompt", "hi"], "not a regular file"),
        (["bench", "--modes", "prompt-lookup:٣"], "gamma must be 1..31"),
        (["bench", "--out", "{file}"], "is a file, not a folder"),
        (["generate", "--prompt", "hi", "--max-new-tokens", "٣"], "written in digits 0-9"),
    ],
)
def test_the_classes_of_the_issue_are_refused_by_name(no_models, tmp_path: Path, capsys, argv, expected) -> None:
    file = tmp_path / "a-file"
    file.write_text("x")
    try:
        code = main([a.format(file=file) for a in argv])
    except SystemExit as exit_:
        code = exit_.code
    err = capsys.readouterr().err
    assert code == 2 and expected in err and "Traceback" not in err, err


def test_synthetic_llama3_8b_on_a_small_cpu_is_refused_before_allocating(no_models, monkeypatch, capsys) -> None:
    import specchat.backend.models.facts.memory as memory

    monkeypatch.setattr(memory, "free_memory", lambda device: 16 << 30)
    code = main(["bench", "--synthetic", "llama3-8b", "--device", "cpu"])
    err = capsys.readouterr().err
    assert code == 2 and "needs about" in err and "is free" in err and "--synthetic tiny on CPU" in err, err
