"""`specchat bench` options: the temperature and seed take their defaults from backend/limits.py and are checked
once, against the engine's own ranges, before anything loads (a bad value names the option)."""

from __future__ import annotations

import pytest

from specchat.app.cli import bench as cmd_bench
from specchat.app.cli.main import build_parser, main
from specchat.backend.limits import BENCH_SEED, BENCH_TEMPERATURE, MAX_NEW_TOKENS, SAMPLING_LIMITS


def test_the_parser_gives_the_limits_defaults(isolated_dirs) -> None:
    args = build_parser().parse_args(["bench"])
    assert (args.temperature, args.seed) == (BENCH_TEMPERATURE, BENCH_SEED)


@pytest.mark.parametrize(
    "option, value, name",
    [
        ("--temperature", "10.5", "temperature"),
        ("--temperature", "-0.1", "temperature"),
        ("--temperature", "nan", "temperature"),
        ("--seed", "-1", "seed"),
        ("--seed", str(2**64), "seed"),
        ("--max-new-tokens", str(MAX_NEW_TOKENS + 1), "max_new_tokens"),
    ],
)
def test_a_value_out_of_the_engines_range_is_refused_naming_the_option(
    isolated_dirs, monkeypatch, capsys, option, value, name
) -> None:
    def never(*args, **kwargs):
        raise AssertionError("the bench started with a value the engine refuses")

    monkeypatch.setattr(cmd_bench, "execute", never)
    assert main(["bench", option, value]) == 2
    err = capsys.readouterr().err
    assert f"{option} must be {SAMPLING_LIMITS[name][1]}" in err and "Traceback" not in err


@pytest.mark.parametrize(
    "argv, message",
    [
        (["--gammas", "0"], "--gammas '0': use whole numbers"),
        (["--gammas", "fast"], "--gammas 'fast'"),
        (["--settings", "99"], "--settings 99: use 0 .. "),
        (["--seed", str(2**64 - 1), "--samples", "2"], "use --seed 18446744073709551614 or lower"),
    ],
)
def test_replay_options_are_checked_before_anything_loads(isolated_dirs, monkeypatch, capsys, argv, message) -> None:
    import specchat.backend.engine.engine as engine_module

    def never(*args, **kwargs):
        raise AssertionError("the replay bench loaded a pair for options it refuses")

    monkeypatch.setattr(engine_module, "load_engine", never)
    assert main(["bench", "--replay", *argv]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err


def test_replay_lists_its_settings(isolated_dirs, capsys) -> None:
    assert main(["bench", "--replay", "--settings", "-1"]) == 0
    out = capsys.readouterr().out
    assert " 3  T=1 top_p=0.9" in out and "T=1e-05" in out and "top_k=1" in out


def test_bench_prompts_file_gives_the_users_own_prompts(tmp_path) -> None:
    from specchat.app.cli.bench_prompts import CUSTOM_FAMILY, load_prompts

    path = tmp_path / "mine.jsonl"
    path.write_text(
        '{"id": "long-1", "messages": [{"role": "user", "content": "Summarise this."}]}\n'
        '{"id": "long-2", "messages": [{"role": "system", "content": "Be brief."}, '
        '{"role": "user", "content": "Hi"}]}\n',
        encoding="utf-8",
    )
    args = build_parser().parse_args(["bench", "--prompts", str(path)])
    prompts = load_prompts(args, 2)
    assert [p.id for p in prompts] == ["long-1", "long-2"]  # every prompt of the file, not --limit's default
    assert {p.family for p in prompts} == {CUSTOM_FAMILY}
    assert prompts[1].message_dicts() == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Hi"},
    ]
    args = build_parser().parse_args(["bench", "--prompts", str(path), "--limit", "1"])
    assert len(load_prompts(args, 1)) == 1
    args = build_parser().parse_args(["bench", "--suite", "mt-bench", "--limit", "1"])
    assert [p.family for p in load_prompts(args, 1)] == ["mt-bench"]


@pytest.mark.parametrize("replay", [False, True])
def test_a_bad_prompts_file_is_refused_naming_the_file_and_line(
    isolated_dirs, monkeypatch, capsys, tmp_path, replay
) -> None:
    import specchat.backend.engine.engine as engine_module

    def never(*args, **kwargs):
        raise AssertionError("the bench loaded a pair for a prompts file it cannot read")

    monkeypatch.setattr(engine_module, "load_engine", never)
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"id": "a", "messages": [{"role": "user", "content": "ok"}]}\n{"id": "b", "messages": 3}\n')
    argv = ["bench", "--prompts", str(bad), *(["--replay"] if replay else ["--modes", "plain"])]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "bad.jsonl" in err and ":2" in err and "Traceback" not in err
    assert main(["bench", "--prompts", str(tmp_path / "missing.jsonl"), *argv[3:]]) == 2
    assert "missing.jsonl does not exist" in capsys.readouterr().err
