"""Fuzzing settings.json (app/chat/settings.py, issue 20 item 1): whatever the file holds, ``load_settings`` never
raises, every field it keeps is the file's value or is named in the warning, what it returns is valid, builds a
request and survives a save and a reload. Fails on the code before issue 20: a 5,000-digit integer, deep nesting,
a list as the drafter and 1e400 as top_k raised out of ``load_settings`` (the chat app did not start)."""

from __future__ import annotations

import json
from pathlib import Path

from hypothesis import strategies as st
from reliability import JSON_RAW, SCALES, dump_json, fuzz, values

from specchat.app.chat.settings import Settings, load_settings, save_settings, validate_settings

FIELDS = ["temperature", "top_p", "top_k", "max_new_tokens", "drafters", "gamma", "system_prompt", "theme", "last_pair"]
GOOD = {
    "temperature": 0.7,
    "top_p": 0.9,
    "top_k": 40,
    "max_new_tokens": 256,
    "drafters": {"smollm2-135m": "none"},
    "gamma": 4,
    "system_prompt": "be brief",
    "theme": "nord",
    "last_pair": "smollm2-135m",
}

# A settings object: good fields and garbage ones, sometimes with unknown keys; or a truncated file; or raw bytes.
DOCUMENTS = st.one_of(
    st.dictionaries(st.sampled_from(FIELDS), values(JSON_RAW), max_size=5).map(lambda bad: dump_json({**GOOD, **bad})),
    st.dictionaries(st.sampled_from(FIELDS + ["x", "theme2"]), values(JSON_RAW), max_size=4).map(dump_json),
    st.tuples(st.just(dump_json(GOOD)), st.integers(min_value=0, max_value=200)).map(lambda t: t[0][: t[1]]),
    values(JSON_RAW).map(dump_json),
)
FILES = st.one_of(DOCUMENTS.map(lambda text: text.encode("utf-8", "surrogatepass")), st.binary(max_size=300))


def _same(kept: object, written: object) -> bool:
    if isinstance(written, str) and isinstance(kept, str):
        return kept == written.encode("utf-8", "replace").decode("utf-8")
    return type(kept) in (int, float) and kept == written or kept is written or kept == written


@SCALES
def test_any_settings_file_loads_to_valid_settings(tmp_path: Path, scale: int) -> None:
    path = tmp_path / "settings.json"

    def check(data: bytes) -> None:
        path.write_bytes(data)
        settings, warning = load_settings(path)
        assert validate_settings(settings) == settings
        settings.sampling()  # a request can be built from them (SamplingParams checks the engine's limits)
        if warning is not None:
            assert str(path) in warning and "\n" not in warning and len(warning) < 1500, warning
        try:
            raw = json.loads(data.decode("utf-8"))
        except (ValueError, RecursionError):
            raw = None
        if isinstance(raw, dict) and warning is not None and "setting '" in warning:
            for field in FIELDS:  # each field: the file's value, or named as bad
                if field in raw and f"'{field}'" not in warning:
                    assert _same(getattr(settings, field), raw[field]), (field, raw[field], warning)
        elif isinstance(raw, dict) and warning is None:
            for field in FIELDS:
                if field in raw:
                    assert _same(getattr(settings, field), raw[field]), (field, raw[field])
        copy = tmp_path / "copy.json"
        save_settings(settings, copy)
        assert load_settings(copy) == (settings, None)

    fuzz("settings.json", FILES, check, 300 * scale)


def test_the_classes_of_the_issue_are_named(tmp_path: Path) -> None:
    """One of each class issue 20 lists: the value is named with its field (or the file's problem), never raised."""
    path = tmp_path / "settings.json"
    cases = {
        '{"temperature": Infinity, "system_prompt": "kept"}': "'temperature': expected a finite number",
        '{"top_p": NaN}': "'top_p': expected a finite number",
        '{"drafter": ["x"]}': "'drafter': ['x'] is not one of",
        '{"gamma": {"a": 1}}': "'gamma': expected a number",
        '{"max_new_tokens": ' + "9" * 5000 + "}": "a number with 5000 digits",
        "[" * 100_000: "nested deeper than 32 levels",
        '{"top_k": 1e400}': "'top_k': expected a finite number",
        '{"theme": "a\\u0000b"}': "'theme'",
        # the setting that falls back is named as a whole, then the entry (fuzzing found 'drafters.a', not 'drafters')
        '{"drafters": {"a": null}}': "setting 'drafters', pair 'a': None is not one of",
    }
    for text, expected in cases.items():
        path.write_text(text)
        settings, warning = load_settings(path)
        assert warning is not None and expected in warning, (text[:40], warning)
    path.write_text('{"temperature": Infinity, "system_prompt": "kept"}')
    assert load_settings(path)[0] == Settings(system_prompt="kept")  # a bad field costs only that field
