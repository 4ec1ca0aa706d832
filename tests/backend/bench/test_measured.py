"""The bench's measured speeds kept per pair (``bench/measured.py``) and the line the listings show."""

from __future__ import annotations

from types import SimpleNamespace

from specchat.backend.bench.measured import expected_slower, expected_speed, record, store_file


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


def _pair(name: str, drafter: str, draft_quantization: str | None = None) -> SimpleNamespace:
    draft = SimpleNamespace(quantization=draft_quantization) if draft_quantization else None
    return SimpleNamespace(name=name, drafter=drafter, draft=draft, local_target=SimpleNamespace(source="src"))


def test_a_pair_expected_slower_than_plain_here_says_why(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_CACHE_DIR", str(tmp_path))
    nf4 = _pair("nf4", "draft-model", "nf4")
    assert "nf4 draft (bitsandbytes) de-quantises every weight" in (expected_slower(nf4, "cpu") or "")
    assert expected_slower(nf4, "cuda:0") is None and expected_slower(_pair("pl", "prompt-lookup"), "cpu") is None
    aggs = [_agg("nf4", "overall", "plain", 30.0), _agg("nf4", "overall", "draft-model", 11.2)]
    aggs += [_agg("pl", "overall", "plain", 10.0), _agg("pl", "overall", "prompt-lookup", 14.0)]
    aggs += [_agg("slow", "overall", "plain", 10.0), _agg("slow", "overall", "suffix", 9.5)]
    record(aggs, {"device": "cpu"}, {"nf4": "src", "pl": "src", "slow": "src"})
    assert expected_slower(nf4, "cpu") == "slower than plain decoding here: 11.2 against 30.0 tok/s plain in the bench"
    assert expected_slower(_pair("slow", "suffix"), "cuda:0").startswith("slower than plain decoding here: 9.5")
    assert expected_slower(_pair("pl", "prompt-lookup"), "cpu") is None  # measured, and it paid
