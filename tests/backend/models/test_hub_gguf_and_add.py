"""hf: GGUF sources through a fake hub (nothing downloads here): size, progress, the size / sha256 check of what
arrived; ``specchat add`` writing the user's models.yaml without making it worse; ``specchat models`` at 80
columns saying where each number came from."""

from __future__ import annotations

import hashlib
import io
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from gguf_fixtures import gguf_pair
from tiny_models import one_thread  # noqa: F401  (a fixture)

from specchat.app.cli import add as cmd_add
from specchat.app.cli import models as cmd_models
from specchat.backend.errors import ConfigError, ModelLoadError
from specchat.backend.models.catalog.config import load_pairs, load_pairs_file, user_models_file
from specchat.backend.models.catalog.user_pairs import append_pair, default_name
from specchat.backend.models.hub import hub_gguf
from specchat.backend.models.hub import repos as hub

SOURCE = "hf:org/tiny-GGUF/tiny-q8_0.gguf"


@pytest.fixture(autouse=True)
def isolated(tmp_path, monkeypatch):
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"SPECCHAT_{name}_DIR", str(tmp_path / name.lower()))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return gguf_pair("qwen2", "Q8_0", tmp_path_factory.mktemp("hub"))[1]


class FakeHub:
    """hf_hub_download / get_hf_file_metadata over a local file, laid out as the HF cache is."""

    def __init__(self, root: Path, file: Path, *, sha256: str | None = None, size: int | None = None) -> None:
        self.root, self.file, self.downloads = root, file, 0
        self.sha256 = sha256 or hashlib.sha256(file.read_bytes()).hexdigest()
        self.size = size if size is not None else file.stat().st_size

    def hf_hub_download(self, repo, filename, *, revision=None, dry_run=False, tqdm_class=None, **_):
        if dry_run:
            return SimpleNamespace(file_size=self.size, will_download=True)
        folder = self.root / f"models--{repo.replace('/', '--')}"
        target = folder / "snapshots" / "c0ffee" / filename
        target.parent.mkdir(parents=True, exist_ok=True)
        (folder / "refs").mkdir(exist_ok=True)
        (folder / "refs" / "main").write_text("c0ffee")
        bar = tqdm_class(total=self.file.stat().st_size, unit="B", desc=f"Downloading {filename}")
        shutil.copyfile(self.file, target)
        bar.update(self.file.stat().st_size)
        bar.close()
        self.downloads += 1
        return str(target)

    def get_hf_file_metadata(self, url, **_):
        return SimpleNamespace(etag=f'"{self.sha256}"', size=self.size)


def _fake(monkeypatch, tmp_path: Path, file: Path, **kwargs) -> FakeHub:
    import huggingface_hub

    fake = FakeHub(tmp_path / "hf", file, **kwargs)
    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake.hf_hub_download)
    monkeypatch.setattr(huggingface_hub, "get_hf_file_metadata", fake.get_hf_file_metadata)
    return fake


def _spec(tmp_path: Path):
    yaml = tmp_path / "models.yaml"
    yaml.write_text(f"pairs:\n  - name: p\n    target: {{source: '{SOURCE}'}}\n", encoding="utf-8")
    return load_pairs_file(yaml)["p"]


def test_a_hub_gguf_is_sized_asked_for_fetched_with_progress_and_checked(tmp_path, tiny, monkeypatch):
    fake = _fake(monkeypatch, tmp_path, tiny)
    pair = _spec(tmp_path)
    assert hub_gguf.download_size(pair.target) == tiny.stat().st_size
    asked: list[int] = []
    with pytest.raises(ModelLoadError, match="declined"):
        hub.confirm_download([pair.target], lambda size: asked.append(size) or False, "pair 'p'")
    assert asked == [tiny.stat().st_size] and fake.downloads == 0
    seen: list[tuple[str, float | None]] = []
    path = hub_gguf.fetch(pair.target, lambda message, fraction: seen.append((message, fraction)))
    assert path.read_bytes() == tiny.read_bytes() and fake.downloads == 1
    assert any(fraction == 1.0 and "tiny-q8_0.gguf" in message for message, fraction in seen)
    assert hub_gguf.download_size(pair.target) == 0 and hub_gguf.fetch(pair.target) == path  # cached now
    from specchat.backend.models.hub.fetch import fetch_sources

    refreshed = fetch_sources(pair, confirm_download=lambda size: True)
    assert refreshed.target.sizes_known and refreshed.target.num_layers == 2


@pytest.mark.parametrize("damage", ["size", "sha256"])
def test_a_damaged_download_is_deleted_and_named(tmp_path, tiny, monkeypatch, damage):
    kwargs = {"size": 123} if damage == "size" else {"sha256": "0" * 64}
    _fake(monkeypatch, tmp_path, tiny, **kwargs)
    pair = _spec(tmp_path)
    with pytest.raises(ModelLoadError, match="damaged .*deleted: run again"):
        hub_gguf.fetch(pair.target)
    assert hub_gguf.cached_path(pair.target) is None


def test_offline_and_missing_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    pair = _spec(tmp_path)
    with pytest.raises(ModelLoadError, match="hf download org/tiny-GGUF tiny-q8_0.gguf"):
        hub_gguf.download_size(pair.target)


def test_add_appends_without_touching_what_is_there(tmp_path, tiny, monkeypatch):
    file = user_models_file()
    file.parent.mkdir(parents=True)
    before = "# my notes\npairs:\n    - name: mine   # keep this comment\n      target: {source: org/thing}\n\n"
    file.write_text(before, encoding="utf-8")
    monkeypatch.chdir(tiny.parent)
    added = append_pair(file, "tiny", tiny.name)  # a relative path: written absolute
    text = file.read_text(encoding="utf-8")
    assert text.startswith(before) and f'source: "{tiny}"' in text and '\n    - name: "tiny"' in text
    assert list(load_pairs_file(file)) == ["mine", "tiny"] and added.target.num_layers == 2
    with pytest.raises(ConfigError, match="already there"):
        append_pair(file, "tiny", str(tiny))
    with pytest.raises(ConfigError, match="does not exist"):
        append_pair(file, "other", str(tmp_path / "absent.gguf"))
    assert file.read_text(encoding="utf-8") == text  # a refused add leaves the file as it was


def test_add_refuses_a_flow_style_file_and_prints_the_entry(tmp_path, tiny):
    file = user_models_file()
    file.parent.mkdir(parents=True)
    file.write_text("pairs: [{name: a, target: {source: org/a}}]\n", encoding="utf-8")
    with pytest.raises(ConfigError, match="add this pair by hand") as info:
        append_pair(file, "tiny", str(tiny))
    assert str(tiny) in str(info.value) and file.read_text(encoding="utf-8").startswith("pairs: [")


def test_add_command_checks_tokenizers_and_shows_the_estimate(tmp_path, tiny):
    draft = gguf_pair("qwen2", "Q4_K", tmp_path, seed=1)[1]
    out = io.StringIO()
    args = SimpleNamespace(source=str(tiny), draft=str(draft), name=None, device="cpu")
    assert cmd_add.run(args, out) == 0
    text = out.getvalue()
    assert "Added pair 'tiny-qwen2-q8_0'" in text and "needs about" in text and "specchat --pair" in text
    pair = load_pairs()["tiny-qwen2-q8_0"]
    assert pair.drafter == "draft-model" and pair.draft is not None and pair.draft.path == str(draft)
    other = gguf_pair("gemma2", "Q8_0", tmp_path)[1]  # another vocabulary's specials order: same ids here
    assert default_name(str(other)) == "tiny-gemma2-q8_0"


def test_models_listing_fits_80_columns_and_names_origins(tmp_path, tiny, monkeypatch):
    monkeypatch.setattr("specchat.backend.models.facts.memory.free_memory", lambda device: 4 * 2**30)
    append_pair(user_models_file(), "tiny", str(tiny))
    out = io.StringIO()
    assert cmd_models.run(SimpleNamespace(models=None, device="cpu", pair=None), out) == 0
    text = out.getvalue()
    assert max(len(line) for line in text.splitlines()) <= 80, text
    assert "all from the file" in text and "all from models.yaml" in text
    assert "memory known after the download" in text and "unknown until its files are downloaded" in text
    assert "stored as Q8_0" in text and "not measured (specchat bench --pair tiny)" in text
    assert "too weak for code" in text


def test_models_listing_says_where_each_number_and_the_weights_bytes_came_from(tmp_path, tiny, monkeypatch):
    from specchat.backend.models.facts.memory import as_stored, estimate_pair, format_bytes

    spec = load_pairs_file(_write(tmp_path / "probe.yaml", tiny, ""))["p"].target
    user = _write(user_models_file(), tiny, f"      num_layers: {spec.num_layers}\n")  # an override, checked
    out = io.StringIO()
    assert cmd_models.run(SimpleNamespace(models=None, device="cpu", pair="p"), out) == 0
    text = " ".join(out.getvalue().split())  # unfolded
    named = "params file; num_layers from models.yaml; num_kv_heads file; head_dim file; hidden_size file"
    assert named in text and "vocab_size file" in text, text
    pair = load_pairs_file(user)["p"]
    estimate = estimate_pair(pair, "cpu")
    assert f"target weights {format_bytes(estimate.target_weights)}" in text
    native = as_stored(pair.target, "cpu")
    assert ("weights: target as stored in the file, CPU native" in text) == native, text
    assert ("weights: target 32-bit floats" in text) == (not native), text


def _write(path: Path, source: Path, extra: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f"pairs:\n  - name: p\n    target:\n      source: {source}\n{extra}", encoding="utf-8")
    return path
