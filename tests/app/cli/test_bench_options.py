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
