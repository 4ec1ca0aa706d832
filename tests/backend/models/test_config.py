"""models.yaml validation: the shipped file, good and bad user files, source resolution, user overrides.

Every error test checks that the one-line message names the file, the pair, the field and the bad value.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from specchat.backend.errors import ConfigError
from specchat.backend.limits import DEFAULT_PAIR
from specchat.backend.models.catalog.config import (
    ModelSpec,
    default_pair_name,
    get_pair,
    load_pairs,
    load_pairs_file,
    packaged_models_file,
    resolve_source,
)


@pytest.fixture(autouse=True)
def isolated_dirs(tmp_path, monkeypatch):
    """No test reads or writes the real user folders."""
    for name in ("CONFIG", "CACHE", "DATA"):
        monkeypatch.setenv(f"SPECCHAT_{name}_DIR", str(tmp_path / name.lower()))


TARGET = """\
      source: org/target-model
      params: 1000
      num_layers: 2
      num_kv_heads: 2
      head_dim: 16
      hidden_size: 64
      vocab_size: 300
"""


def pair_yaml(name: str = "p1", *, extra: str = "", target: str = TARGET, drafter: str = "prompt-lookup") -> str:
    return (
        f"  - name: {name}\n    description: a test pair\n    target:\n{target}"
        f"    drafter: {drafter}\n    context_length: 2048\n{extra}"
    )


def write(tmp_path: Path, body: str, name: str = "models.yaml") -> Path:
    path = tmp_path / name
    path.write_text(body if body.startswith("pairs") else "pairs:\n" + body, encoding="utf-8")
    return path


def error_of(path: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_pairs_file(path)
    return str(info.value)


def assert_names(message: str, *parts: str) -> None:
    for part in parts:
        assert part in message, f"{part!r} not in: {message}"


# --- the shipped file --------------------------------------------------------------------------------------

# Per hub model: (intermediate size, attention qkv bias) — with the YAML's numbers this gives the exact
# parameter count, so a wrong architecture number in models.yaml fails here.
ARCH_EXTRA = {
    "Qwen/Qwen2.5-7B-Instruct": (18944, True),
    "Qwen/Qwen2.5-Coder-7B-Instruct": (18944, True),
    "Qwen/Qwen2.5-14B-Instruct": (13824, True),
    "Qwen/Qwen2.5-0.5B-Instruct": (4864, True),
    "Qwen/Qwen2.5-Coder-0.5B-Instruct": (4864, True),
    "meta-llama/Llama-3.1-8B-Instruct": (14336, False),
    "meta-llama/Llama-3.2-1B-Instruct": (8192, False),
    "HuggingFaceTB/SmolLM2-1.7B-Instruct": (8192, False),
    "HuggingFaceTB/SmolLM2-135M-Instruct": (1536, False),
    "packaged:smollm2-135m-instruct": (1536, False),
}


def param_count(spec: ModelSpec, intermediate: int, qkv_bias: bool) -> int:
    h, kv = spec.hidden_size, spec.num_kv_heads * spec.head_dim
    q = (h // spec.head_dim) * spec.head_dim
    attention = h * q + 2 * h * kv + q * h + ((q + 2 * kv) if qkv_bias else 0)
    layer = attention + 3 * h * intermediate + 2 * h
    embeddings = spec.vocab_size * h * (1 if spec.tie_word_embeddings else 2)
    return spec.num_layers * layer + h + embeddings


def test_shipped_pairs_are_valid_and_true_to_their_models():
    pairs = load_pairs()
    assert packaged_models_file().resolve() == (Path(__file__).parents[3] / "models.yaml").resolve()
    for name in (
        "smollm2-135m",
        "smollm2-135m-nf4-draft",
        "qwen2.5-7b",
        "qwen2.5-coder-7b",
        "llama3.1-8b",
        "smollm2-1.7b",
        "qwen2.5-14b-nf4",
    ):
        assert name in pairs
    default = pairs[DEFAULT_PAIR]
    assert default_pair_name(pairs) == DEFAULT_PAIR
    assert (default.target.kind, default.drafter, default.draft) == ("packaged", "prompt-lookup", None)
    nf4 = pairs["smollm2-135m-nf4-draft"]
    assert nf4.draft.source == nf4.target.source and nf4.draft.quantization == "nf4"
    assert "slower than prompt lookup" in nf4.description
    assert pairs["qwen2.5-7b"].target.vocab_size == 152064 and pairs["qwen2.5-7b"].draft.vocab_size == 151936
    assert pairs["qwen2.5-14b-nf4"].target.quantization == "nf4"
    llama = pairs["llama3.1-8b"]
    assert llama.target.gated and llama.draft.gated and "huggingface-cli login" in llama.description
    assert "too weak for code edits" in default.description  # the embedded model is a demo, and says so
    cpu = {name: pair for name, pair in pairs.items() if pair.target.kind == "hub-gguf"}
    assert {"qwen2.5-coder-7b-q4", "qwen2.5-coder-1.5b-q4", "llama3.1-8b-q4", "llama3.2-3b-q4", "qwen3-8b-q4"} <= set(
        cpu
    )
    assert any("gemma-3" in pair.target.source for pair in cpu.values())
    for name, pair in cpu.items():  # sizes come from the files once downloaded; drafts are GGUF files too
        assert pair.target.hub_repo and (pair.target.hub_filename or "").endswith(".gguf"), name
        assert not pair.target.sizes_known and pair.context_length == 8192, name
        assert pair.draft is None or pair.draft.kind == "hub-gguf", name
    for pair in pairs.values():
        for spec in (pair.target, pair.draft):
            if spec is None or spec.kind == "hub-gguf":
                continue
            assert spec.params == param_count(spec, *ARCH_EXTRA[spec.source]), spec.source
            if spec.kind == "hub":  # bf16 safetensors plus tokenizer files
                assert 2 * spec.params <= spec.download_bytes <= 2 * spec.params * 1.01 + 20e6, spec.source
            else:
                assert spec.download_bytes == 0


def test_good_file_defaults(tmp_path):
    pairs = load_pairs_file(write(tmp_path, pair_yaml()))
    pair = pairs["p1"]
    assert pair.target.kind == "hub" and pair.target.path is None
    assert (pair.target.dtype, pair.target.quantization, pair.gamma, pair.sampling) == ("auto", "none", "auto", {})
    assert (pair.target.gated, pair.target.allow_pickle, pair.target.trust_remote_code) == (False, False, False)
    assert pair.source_file == str(tmp_path / "models.yaml")


def test_draft_model_pair_and_sampling(tmp_path):
    extra = (
        "    draft:\n"
        + TARGET.replace("org/target-model", "org/draft-model")
        + "    gamma: 5\n    sampling: {temperature: 0.7, top_k: 20, top_p: 0.8, max_new_tokens: 64}\n"
    )
    pair = load_pairs_file(write(tmp_path, pair_yaml(extra=extra, drafter="draft-model")))["p1"]
    assert pair.draft.source == "org/draft-model" and pair.gamma == 5
    assert pair.sampling == {"temperature": 0.7, "top_k": 20, "top_p": 0.8, "max_new_tokens": 64}


# --- errors ------------------------------------------------------------------------------------------------


def test_missing_field(tmp_path):
    path = write(tmp_path, pair_yaml(target=TARGET.replace("      source: org/target-model\n", "")))
    assert_names(error_of(path), str(path), "pair 'p1'", "'target.source'", "(missing)", "add it")


def test_sizes_are_optional_and_unknown_until_the_hub_files_are_here(tmp_path):
    path = write(tmp_path, "  - name: p1\n    target: {source: org/target-model}\n")
    pair = load_pairs_file(path)["p1"]
    assert pair.target.params == 0 and not pair.target.sizes_known
    assert dict(pair.target.origins) == dict.fromkeys(
        ("params", "num_layers", "num_kv_heads", "head_dim", "hidden_size", "vocab_size"), "unknown"
    )
    assert pair.drafter == "prompt-lookup" and pair.context_length == 8192  # the defaults of a minimal pair


def test_wrong_type(tmp_path):
    path = write(tmp_path, pair_yaml().replace("context_length: 2048", "context_length: 8k"))
    assert_names(error_of(path), str(path), "pair 'p1'", "'context_length'", "'8k'", "expected int (")


def test_bool_is_not_a_number(tmp_path):
    path = write(tmp_path, pair_yaml(target=TARGET.replace("num_layers: 2", "num_layers: true")))
    assert_names(error_of(path), str(path), "pair 'p1'", "'target.num_layers'", "True")


def test_unknown_drafter(tmp_path):
    path = write(tmp_path, pair_yaml(drafter="lookahead"))
    assert_names(
        error_of(path),
        str(path),
        "pair 'p1'",
        "'drafter'",
        "'lookahead'",
        "prompt-lookup, suffix, draft-model, eagle3, medusa, auto, none",
    )


def test_unknown_field_is_rejected(tmp_path):
    path = write(tmp_path, pair_yaml(target=TARGET + "      dtyp: float16\n"))
    assert_names(error_of(path), str(path), "pair 'p1'", "'target.dtyp'", "'float16'", "unknown field")


@pytest.mark.parametrize("field, value", [("dtype", "fp8"), ("quantization", "int4")])
def test_enum_fields(tmp_path, field, value):
    path = write(tmp_path, pair_yaml(target=TARGET + f"      {field}: {value}\n"))
    assert_names(error_of(path), str(path), "pair 'p1'", f"'target.{field}'", repr(value))


def test_malformed_yaml_names_file_and_line(tmp_path):
    path = write(tmp_path, pair_yaml() + "    sampling: {temperature: 0.7\n")
    message = error_of(path)
    assert_names(message, str(path), "YAML syntax error")
    line = int(message.split(str(path) + ":")[1].split(":")[0])
    assert line == 15  # where the parser gave up (end of file) ...
    assert "flow mapping at line 14" in message  # ... and where the unclosed brace opened


def test_top_level_must_be_pairs(tmp_path):
    path = tmp_path / "models.yaml"
    path.write_text("- name: p1\n", encoding="utf-8")
    assert_names(error_of(path), str(path), "'pairs:'")


def test_duplicate_pair_names(tmp_path):
    path = write(tmp_path, pair_yaml() + pair_yaml())
    assert_names(error_of(path), str(path), "pair 'p1'", "'name'", "already used", "line 2")


def test_duplicate_keys_in_a_mapping(tmp_path):
    path = write(tmp_path, pair_yaml(extra="    context_length: 4096\n"))
    assert_names(error_of(path), str(path), "'context_length'", "repeats")


@pytest.mark.parametrize(
    "gamma, ok", [(1, True), (31, True), ("auto", True), (0, False), (32, False), ("fast", False), ("true", False)]
)
def test_gamma(tmp_path, gamma, ok):
    path = write(tmp_path, pair_yaml(extra=f"    gamma: {gamma}\n"))
    if ok:
        assert load_pairs_file(path)["p1"].gamma == gamma
    else:
        assert_names(error_of(path), str(path), "pair 'p1'", "'gamma'")


@pytest.mark.parametrize("length", [0, 63, 1 << 21])
def test_context_length_bounds(tmp_path, length):
    path = write(tmp_path, pair_yaml().replace("context_length: 2048", f"context_length: {length}"))
    assert_names(error_of(path), str(path), "pair 'p1'", "'context_length'", str(length), "between")


def test_draft_required_and_forbidden(tmp_path):
    path = write(tmp_path, pair_yaml(drafter="draft-model"))
    assert_names(error_of(path), str(path), "pair 'p1'", "'draft'", "(missing)")
    path = write(tmp_path, pair_yaml(extra="    draft:\n" + TARGET), name="b.yaml")
    assert_names(error_of(path), str(path), "pair 'p1'", "'draft'", "drafter is prompt-lookup")


@pytest.mark.parametrize(
    "sampling, field",
    [
        ("{top_p: 1.5}", "sampling.top_p"),
        ("{temp: 1}", "sampling.temp"),
        ("{max_new_tokens: 0}", "sampling.max_new_tokens"),
    ],
)
def test_sampling_errors(tmp_path, sampling, field):
    path = write(tmp_path, pair_yaml(extra=f"    sampling: {sampling}\n"))
    assert_names(error_of(path), str(path), "pair 'p1'", f"'{field}'")


def test_bad_pair_name(tmp_path):
    path = write(tmp_path, pair_yaml(name="'has space'"))
    assert_names(error_of(path), str(path), "'name'", "'has space'")


def test_yaml_merge_keys_can_be_overridden(tmp_path):
    body = (
        "pairs:\n" + pair_yaml().replace("    target:\n", "    target: &t\n") + "    drafter_placeholder: 0\n"
    ).replace("    drafter_placeholder: 0\n", "")
    body += (
        "  - name: p2\n    target: *t\n    drafter: draft-model\n    context_length: 2048\n"
        "    draft:\n      <<: *t\n      quantization: nf4\n      params: 999\n"
    )
    pairs = load_pairs_file(write(tmp_path, body))
    assert pairs["p2"].draft.quantization == "nf4" and pairs["p2"].draft.params == 999
    assert pairs["p2"].target.params == 1000


# --- user file and --models --------------------------------------------------------------------------------


def test_user_file_overrides_and_adds(tmp_path):
    user = tmp_path / "config" / "models.yaml"
    user.parent.mkdir(parents=True)
    shipped = load_pairs()[DEFAULT_PAIR]
    override = (
        f"  - name: {DEFAULT_PAIR}\n    target:\n      source: packaged:smollm2-135m-instruct\n"
        "    drafter: none\n    context_length: 1024\n"
    )
    write(user.parent, override + pair_yaml("mine"))
    pairs = load_pairs()
    assert list(pairs)[0] == DEFAULT_PAIR and list(pairs)[-1] == "mine"  # override keeps its place
    assert pairs[DEFAULT_PAIR].context_length == 1024 and pairs[DEFAULT_PAIR].drafter == "none"
    assert pairs[DEFAULT_PAIR].source_file == str(user) and shipped.context_length != 1024
    assert "smollm2-135m-nf4-draft" in pairs  # untouched pairs stay


def test_errors_in_the_user_file_name_it(tmp_path):
    user = tmp_path / "config" / "models.yaml"
    user.parent.mkdir(parents=True)
    write(user.parent, pair_yaml("mine", drafter="lookahead"))
    with pytest.raises(ConfigError) as info:
        load_pairs()
    assert_names(str(info.value), str(user), "pair 'mine'", "'drafter'", "'lookahead'")


def test_models_file_replaces_the_packaged_one(tmp_path):
    other = write(tmp_path, pair_yaml("only"), name="other.yaml")
    assert list(load_pairs(other)) == ["only"]
    assert default_pair_name(load_pairs(other)) == "only"
    with pytest.raises(ConfigError, match="not found"):
        load_pairs(tmp_path / "missing.yaml")
    with pytest.raises(ConfigError, match="not found"):
        load_pairs(other, user_file=tmp_path / "nope.yaml")


def test_get_pair_names_the_known_pairs():
    pairs = load_pairs()
    assert get_pair(pairs, DEFAULT_PAIR).name == DEFAULT_PAIR
    with pytest.raises(ConfigError) as info:
        get_pair(pairs, "gpt-9")
    assert_names(str(info.value), "'gpt-9'", DEFAULT_PAIR, "qwen2.5-7b", "specchat models")


# --- source resolution -------------------------------------------------------------------------------------


def test_resolve_source_kinds(tmp_path):
    (tmp_path / "weights").mkdir()
    (tmp_path / "m.gguf").write_bytes(b"GGUF")
    assert resolve_source("packaged:smollm2-135m-instruct") == ("packaged", None)
    assert resolve_source("Qwen/Qwen2.5-7B-Instruct", base_dir=tmp_path) == ("hub", None)
    assert resolve_source("weights", base_dir=tmp_path) == ("local", str((tmp_path / "weights").resolve()))
    assert resolve_source(str(tmp_path / "weights")) == ("local", str((tmp_path / "weights").resolve()))
    assert resolve_source("m.gguf", base_dir=tmp_path) == ("gguf", str((tmp_path / "m.gguf").resolve()))


@pytest.mark.parametrize(
    "source, reason",
    [
        ("packaged:llama-70b", "no packaged model"),
        ("Qwen", "hub id"),
        ("a/b/c", "hub id"),
        ("org/-bad--name", "hub id"),
        ("./missing-dir", "does not exist"),
        ("/no/such/dir", "does not exist"),
        ("missing.gguf", "does not exist"),
        ("~/nope-specchat-test", "does not exist"),
    ],
)
def test_resolve_source_errors(tmp_path, source, reason):
    with pytest.raises(ValueError, match=reason):
        resolve_source(source, base_dir=tmp_path)


def test_source_errors_name_file_pair_field_value(tmp_path):
    path = write(tmp_path, pair_yaml(target=TARGET.replace("org/target-model", "./nowhere")))
    assert_names(error_of(path), str(path), "pair 'p1'", "'target.source'", "'./nowhere'", "does not exist")


def test_local_source_relative_to_the_file_and_revision_rules(tmp_path):
    (tmp_path / "ckpt").mkdir()
    path = write(tmp_path, pair_yaml(target=TARGET.replace("org/target-model", "ckpt")))
    spec = load_pairs_file(path)["p1"].target
    assert (spec.kind, spec.path) == ("local", str((tmp_path / "ckpt").resolve()))
    path = write(
        tmp_path, pair_yaml(target=TARGET.replace("org/target-model", "ckpt") + "      revision: main\n"), name="b.yaml"
    )
    assert_names(error_of(path), str(path), "pair 'p1'", "'target.revision'", "'main'", "only hub sources")
