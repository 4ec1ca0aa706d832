"""The bench's measured speeds kept per pair (``bench/measured.py``) and the line the listings show."""

from __future__ import annotations

from types import SimpleNamespace

from specchat.backend.bench.measured import expected_speed, record, store_file


def _agg(pair: str, family: str, mode: str, tok_s: float | None) -> SimpleNamespace:
    return SimpleNamespace(pair=pair, family=family, mode=mode, decode_tok_s=tok_s)


def test_a_measured_pair_shows_plain_and_its_fastest_mode(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    assert expected_speed("p", "src") == "not measured (specchat bench --pair p)"
    aggs = [
        _agg("p", "code", "plain", 9.0),
        _agg("p", "overall", "plain", 10.04),
        _agg("p", "overall", "suffix", 21.5),
        _agg("p", "overall", "draft-model", 15.0),
        _agg("p", "overall", "hf-plain", 99.0),  # transformers' modes are not what specchat will do
        _agg("p", "overall", "prompt-lookup", None),
    ]
    record(aggs, {"device": "cpu", "threads": 2}, {"p": "src"})
    line = expected_speed("p", "src")
    assert line.startswith("10.0 tok/s plain, 21.5 with suffix (bench ") and "cpu, 2 threads" in line
    assert expected_speed("p", "another-source").startswith("not measured")  # the pair now names another model
    store_file().write_text("not json", encoding="utf-8")
    assert expected_speed("p", "src").startswith("not measured")
