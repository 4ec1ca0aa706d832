"""The fast GGUF metadata reader (backend/models/gguf_file.MetadataReader) against the gguf package's reader,
as transformers' load_gguf_checkpoint sees them (backend/models/gguf/convert.py swaps it in on a first start)."""

from __future__ import annotations

import time

import pytest
from foundation_fixtures import write_tiny_gguf

from specchat.backend.models.gguf.convert import _gguf_metadata_read_once, _parse_with
from specchat.backend.models.gguf.gguf_file import GgufFormatError, MetadataReader


def _checkpoint():
    from transformers import modeling_gguf_pytorch_utils

    return modeling_gguf_pytorch_utils.load_gguf_checkpoint


@pytest.mark.parametrize("weights", ["F32", "Q4_1", "Q8_0"])
def test_transformers_parses_the_same_metadata_from_either_reader(tmp_path, weights):
    path = write_tiny_gguf(tmp_path / "tiny.gguf", weights=weights)
    parse = _checkpoint()
    expected = parse(path, return_tensors=False)
    got = _parse_with(MetadataReader, parse, path)
    assert got == expected
    assert got["tokenizer"]["tokens"][:3] == ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    import gguf

    assert gguf.GGUFReader is not MetadataReader  # swapped back after the call


def test_the_first_start_parse_uses_it_once(tmp_path, monkeypatch):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    made: list[str] = []

    class Counting(MetadataReader):
        def __init__(self, where):
            made.append(str(where))
            super().__init__(where)

    monkeypatch.setattr("specchat.backend.models.gguf.gguf_file.MetadataReader", Counting)
    with _gguf_metadata_read_once():
        first, second = _checkpoint()(path), _checkpoint()(path)
    assert first == second and made == [str(path)]


def test_a_damaged_file_is_named(tmp_path):
    path = write_tiny_gguf(tmp_path / "tiny.gguf")
    data = path.read_bytes()
    (tmp_path / "cut.gguf").write_bytes(data[:2000])
    with pytest.raises(GgufFormatError, match="ends early"):
        MetadataReader(tmp_path / "cut.gguf")
    (tmp_path / "junk.gguf").write_bytes(b"NOPE" + data[4:])
    with pytest.raises(GgufFormatError, match="junk.gguf"):
        MetadataReader(tmp_path / "junk.gguf")


@pytest.mark.slow
def test_the_embedded_files_metadata_parses_the_same_and_fast():
    from specchat.backend.models.loading.pair import packaged_gguf_path

    path = packaged_gguf_path()
    parse = _checkpoint()
    start = time.perf_counter()
    expected = parse(path, return_tensors=False)
    slow = time.perf_counter() - start
    start = time.perf_counter()
    got = _parse_with(MetadataReader, parse, path)
    fast = time.perf_counter() - start
    assert got == expected
    assert len(got["tokenizer"]["tokens"]) == 49152
    print(f"load_gguf_checkpoint metadata: gguf's reader {slow:.2f} s, MetadataReader {fast:.2f} s")
    assert fast < slow / 3


def test_the_block_sizes_known_here_are_ggmls():
    import gguf

    from specchat.backend.models.gguf import gguf_file

    for ggml_type, sizes in gguf_file._BLOCKS.items():
        assert gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType(ggml_type)] == sizes, gguf_file.TYPE_NAMES[ggml_type]
    q6_k = int(gguf.GGMLQuantizationType.Q6_K)  # a type not in the table still gets its size from gguf
    assert gguf_file._block_size(q6_k) == gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType.Q6_K]
