"""A small GGUF drafts a larger GGUF of the same family, both on the CPU native path, from two ``source:`` lines
(issue 33, item 5): the tokenizers are checked, both runners run the file's blocks, and greedy decoding with the
draft model gives the same tokens as plain decoding (lossless)."""

from __future__ import annotations

from pathlib import Path

import pytest
from gguf_fixtures import build_source, gguf_pair, write_gguf
from native_fixtures import native_ready  # noqa: F401  (a fixture)

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import load_engine
from specchat.backend.models.catalog.config import load_pairs_file

pytestmark = pytest.mark.usefixtures("isolated_dirs")
PROMPT = [{"role": "user", "content": "hello world, hello world, hello"}]


def _pair(tmp_path: Path, target: Path, draft: Path):
    yaml = tmp_path / "models.yaml"
    yaml.write_text(
        f"pairs:\n  - name: p\n    target:\n      source: {target}\n    draft:\n      source: {draft}\n"
        "    drafter: draft-model\n    gamma: 4\n    context_length: 256\n",
        encoding="utf-8",
    )
    return load_pairs_file(yaml)["p"]


def _ids(engine, drafter: str) -> tuple[list[int], object]:
    ids, last = [], None
    greedy = SamplingParams(temperature=0, max_new_tokens=24, stop=(), seed=1)
    for event in engine.generate(GenerationRequest(messages=PROMPT, sampling=greedy, drafter=drafter)):
        ids.extend(event.token_ids)
        last = event
    return ids, last


def test_a_smaller_gguf_drafts_a_larger_one_on_the_native_path(tmp_path, native_ready):  # noqa: F811
    _, target = gguf_pair("qwen2", "Q8_0", tmp_path)
    small = build_source("qwen2", seed=3, num_hidden_layers=1)  # same family and vocabulary, one layer
    draft = write_gguf(small, tmp_path / "draft-q4_0.gguf", "Q4_0", "qwen2")
    pair = _pair(tmp_path, target, draft)
    assert pair.draft is not None and pair.draft.num_layers < pair.target.num_layers
    engine = load_engine(pair, device="cpu")
    try:
        assert engine.runner.path == "cpu-native" and engine.draft_runner.path == "cpu-native", engine.start_line
        plain, _ = _ids(engine, "none")
        drafted, last = _ids(engine, "draft-model")
        assert drafted == plain and plain  # greedy: the draft model changes nothing
        assert last.stats.drafted > 0  # the draft model really proposed tokens
    finally:
        engine.close()
