"""Remote pairs in models.yaml (backend/models/catalog/config.py): the minimal entry works; every mistake names the
field."""

from __future__ import annotations

from pathlib import Path

import pytest

from specchat.backend.errors import ConfigError
from specchat.backend.models.catalog.config import REMOTE_DRAFTER, RemoteSpec, load_pairs, load_pairs_file


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "models.yaml"
    path.write_text(text, encoding="utf-8")
    return path


def test_the_minimal_entry_of_the_issue_works_with_no_other_field(tmp_path: Path) -> None:
    path = _write(
        tmp_path, "pairs:\n  - name: my-server\n    target: {server: http://127.0.0.1:8000/v1, model: NAME}\n"
    )
    pair = load_pairs_file(path)["my-server"]
    assert pair.remote == RemoteSpec(server="http://127.0.0.1:8000/v1", model="NAME")
    assert pair.remote.server_kind == "openai" and pair.remote.api_key_env is None
    assert pair.drafter == REMOTE_DRAFTER and pair.draft is None and pair.context_length == 0
    assert pair.target.source == "NAME @ http://127.0.0.1:8000/v1" and pair.target.kind == "remote"
    assert load_pairs()["smollm2-135m"].remote is None


def test_optional_fields_and_a_user_file_overlay(tmp_path: Path) -> None:
    user = _write(
        tmp_path,
        "pairs:\n  - name: big\n    description: 70B on the GPU box\n"
        "    target:\n      server: http://127.0.0.1:8000/v1/\n      model: meta/Llama-70B\n"
        "      kind: vllm\n      api_key_env: VLLM_KEY\n"
        "    sampling: {temperature: 0.7, max_new_tokens: 256}\n",
    )
    pairs = load_pairs(user_file=user)
    assert "smollm2-135m" in pairs
    big = pairs["big"]
    assert big.remote == RemoteSpec("http://127.0.0.1:8000/v1", "meta/Llama-70B", "vllm", "VLLM_KEY")
    assert big.sampling == {"temperature": 0.7, "max_new_tokens": 256}


@pytest.mark.parametrize(
    ("target", "extra", "field"),
    [
        ("{server: ftp://x/v1, model: m}", "", "target.server"),
        ("{server: http://127.0.0.1:8000/v1}", "", "target.model"),
        ("{server: http://127.0.0.1:8000/v1, model: m, kind: tgi}", "", "target.kind"),
        ("{server: http://127.0.0.1:8000/v1, model: m, api_key_env: 'not a name'}", "", "target.api_key_env"),
        ("{server: http://127.0.0.1:8000/v1, model: m, source: x}", "", "target.source"),
        ("{server: http://127.0.0.1:8000/v1, model: m}", "    drafter: prompt-lookup\n", "drafter"),
        ("{server: http://127.0.0.1:8000/v1, model: m}", "    context_length: 4096\n", "context_length"),
        ("{server: http://127.0.0.1:8000/v1, model: m}", "    sampling: {temperature: 99}\n", "sampling.temperature"),
    ],
)
def test_mistakes_name_the_field(tmp_path: Path, target: str, extra: str, field: str) -> None:
    path = _write(tmp_path, f"pairs:\n  - name: r\n    target: {target}\n{extra}")
    with pytest.raises(ConfigError) as caught:
        load_pairs_file(path)
    assert f"field '{field}'" in str(caught.value) and "pair 'r'" in str(caught.value)
