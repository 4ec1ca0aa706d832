"""Fuzzing `specchat add` (issue 47): sources that are good, broken, absurd or not files at all (a FIFO, a symlink
to a device, a folder named x.gguf, an empty folder, hostile text, hub ids offline), names that are taken (the
packaged default, a pair already in the file) or hostile, devices that do not exist. Every run exits 0 or 2 with
no traceback, names no trial ``.add-*.yaml``, prints no control character; a refused add leaves the user's
models.yaml byte for byte as it was, and a successful one keeps every earlier line and pair (no lost files)."""

from __future__ import annotations

import os
import re

import pytest
from gguf_files import absurd_gguf
from gguf_fixtures import gguf_pair
from hypothesis import strategies as st
from reliability import NASTY_TEXT, READINGS, fuzz

from specchat.app.cli.main import main
from specchat.backend.models.catalog.config import load_pairs_file, user_models_file

CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")
BEFORE = "# my own pairs: keep this comment\npairs:\n  - name: mine\n    target: {source: org/thing}\n"


@pytest.fixture(scope="module")
def sources(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("fuzz-add")
    good = gguf_pair("qwen2", "Q8_0", root)[1]
    (root / "empty").mkdir()
    (root / "x.gguf").mkdir()
    os.mkfifo(root / "fifo.gguf")
    (root / "null.gguf").symlink_to("/dev/null")
    (root / "zero").symlink_to("/dev/zero")
    (root / "broken.gguf").write_bytes(b"GGUF" + b"\xff" * 64)
    (root / "zero-bytes.gguf").write_bytes(b"")
    notes = root / "notes"
    notes.mkdir()
    (notes / "README.md").write_text("not a model", encoding="utf-8")
    found = {
        "good": str(good),
        "relative good": os.path.relpath(good),
        "empty folder": str(root / "empty"),
        "folder x.gguf": str(root / "x.gguf"),
        "fifo": str(root / "fifo.gguf"),
        "dev null": str(root / "null.gguf"),
        "dev zero folder": str(root / "zero"),
        "broken gguf": str(root / "broken.gguf"),
        "zero bytes": str(root / "zero-bytes.gguf"),
        "notes folder": str(notes),
        "missing": str(root / "missing.gguf"),
        "packaged": "packaged:smollm2-135m-instruct",
        "packaged unknown": "packaged:nope",
        "hub id offline": "org/some-model",
        "hub gguf offline": "hf:org/some-GGUF/some-q4_k_m.gguf",
    }
    for i, sizes in enumerate(
        [{"block_count": 2**32 - 1}, {"head_count": 0, "head_count_kv": 0}, {"embedding_length": 2**31}]
    ):
        found[f"absurd {i}"] = str(absurd_gguf(root / f"absurd{i}.gguf", **sizes))
    return found


def test_add_never_crashes_never_names_the_trial_and_never_loses_the_file(sources, tmp_path, monkeypatch, capsys):
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"SPECCHAT_{name}_DIR", str(tmp_path / name.lower()))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    file = user_models_file()
    file.parent.mkdir(parents=True)
    counts = {"runs": 0, "added": 0, "refused": 0, "tracebacks": 0, "escapes": 0, "lost": 0}
    inputs = st.tuples(
        st.one_of(st.sampled_from(sorted(sources)).map(sources.get), NASTY_TEXT),
        st.one_of(st.none(), st.sampled_from(["smollm2-135m", "mine", "new-one", "a" * 65]), NASTY_TEXT),
        st.one_of(st.none(), st.sampled_from(["cpu", "cuda:99", "cuda", "tpu", "cpu\x1b[31m"]), NASTY_TEXT),
        st.booleans(),
        st.one_of(st.none(), st.sampled_from([sources["fifo"], sources["empty folder"], sources["missing"]])),
    )

    def check(value: tuple) -> None:
        source, name, device, replace, draft = value
        file.write_text(BEFORE, encoding="utf-8")
        argv = ["add", source]
        argv += ["--name", name] if name is not None else []
        argv += ["--device", device] if device is not None else []
        argv += ["--replace"] if replace else []
        argv += ["--draft", draft] if draft is not None else []
        try:
            code = main(argv)
        except SystemExit as exit_:  # argparse refuses a value itself
            code = exit_.code
        out, err = capsys.readouterr()
        counts["runs"] += 1
        counts["tracebacks"] += "Traceback" in out + err
        counts["escapes"] += bool(CONTROL.search((out + err).replace("\n", "")))
        after = file.read_text(encoding="utf-8") if file.is_file() else ""
        kept = after == BEFORE if code != 0 else after.startswith(BEFORE) and "mine" in load_pairs_file(file)
        counts["lost"] += not kept
        counts["added" if code == 0 else "refused"] += 1
        assert code in (0, 2), (code, out, err)
        assert "Traceback" not in out + err and ".add-" not in out + err, out + err
        assert not CONTROL.search((out + err).replace("\n", "")), repr(out + err)
        assert kept, (code, after)

    known = [  # adds that must succeed, among the fuzzed ones
        (sources["good"], "new-one", "cpu", False, None),
        (sources["good"], None, None, False, None),
        (sources["packaged"], "smollm2-135m", "cpu", True, None),
        (sources["hub id offline"], None, "cpu", False, None),
    ]
    try:
        for value in known:
            check(value)
            assert counts["added"] == counts["runs"], value
        fuzz("specchat add", inputs, check, 130)
    finally:
        READINGS["add hostile run: runs, added, refused, tracebacks, escapes, lost files"] = ", ".join(
            str(counts[k]) for k in ("runs", "added", "refused", "tracebacks", "escapes", "lost")
        )
    assert counts["added"] and counts["refused"]
