"""GGUF -> safetensors conversion, done once and cached so later starts load in about a second.

Contract: ``ensure_converted(gguf_path, progress=None) -> Path`` returns a folder holding ``model.safetensors``,
``config.json``, the tokenizer and a marker file, under ``paths.cache_dir()/converted/<stem>-<sha256[:16]>-
transformers-<version>``. The key is the GGUF file's content hash (sha256, streamed; the hash itself is cached
in ``hashes.json`` keyed by path + size + mtime, so an unchanged file is hashed once) and the transformers
version (its GGUF de-quantisation and tensor naming may change between versions).

Crash safety: the conversion writes into a fresh ``.tmp-*`` folder beside the destination and renames it into
place only when complete (a rename within one file system is atomic), with the marker written last inside it.
A kill mid-conversion leaves only a temporary folder, which the next conversion removes (its writer process
is dead) before converting again; a destination without its marker is treated as absent.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

from specchat.backend.errors import ModelLoadError
from specchat.backend.files import write_atomic
from specchat.backend.models.capture import Progress
from specchat.backend.paths import cache_dir

MARKER = "specchat-conversion.json"
_TMP_PREFIX = ".tmp-"


def _hash_cache_file() -> Path:
    return cache_dir() / "hashes.json"


def file_sha256(path: Path, progress: Progress | None = None) -> str:
    """sha256 of ``path``'s bytes, remembered per (absolute path, size, mtime_ns)."""
    path = Path(path).resolve()
    stat = path.stat()
    key = f"{path}|{stat.st_size}|{stat.st_mtime_ns}"
    store = _hash_cache_file()
    try:
        known = json.loads(store.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        known = {}
    if isinstance(known, dict) and isinstance(known.get(key), str):
        return known[key]
    digest, done = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(f"Hashing {path.name}", done / max(stat.st_size, 1))
    value = digest.hexdigest()
    known = known if isinstance(known, dict) else {}
    known[key] = value
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(store, json.dumps(known, indent=0))  # a concurrent reader sees the old or the new file
    except OSError as exc:
        raise ModelLoadError(f"cannot write the hash cache {store}: {exc.strerror or exc}; make the folder "
                             "writable or set SPECCHAT_CACHE_DIR to a folder you can write") from exc
    return value


def converted_dir(gguf_path: Path, progress: Progress | None = None) -> Path:
    """Where the conversion of ``gguf_path`` lives (it may not exist yet)."""
    import transformers

    digest = file_sha256(gguf_path, progress)
    name = f"{Path(gguf_path).stem}-{digest[:16]}-transformers-{transformers.__version__}"
    return cache_dir() / "converted" / name


def is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def remove_stale_temporaries(parent: Path) -> list[Path]:
    """Delete ``.tmp-*`` folders left by dead writers (a killed conversion). Returns what was removed."""
    removed = []
    if not parent.is_dir():
        return removed
    for entry in parent.iterdir():
        if not (entry.is_dir() and entry.name.startswith(_TMP_PREFIX)):
            continue
        try:
            pid = int(entry.name.rsplit("-pid", 1)[1].split("-")[0])
        except (IndexError, ValueError):
            pid = -1
        if pid <= 0 or pid == os.getpid() or not _pid_alive(pid):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


def _convert_into(gguf_path: Path, folder: Path, progress: Progress | None) -> None:
    """Load the GGUF with transformers (de-quantising) and save model + tokenizer as safetensors into folder."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kwargs = {}
    try:  # newer transformers may keep GGUF blocks packed (kernels); a saved checkpoint needs plain weights
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    if progress is not None:
        progress(f"Reading the tokenizer from {gguf_path.name} (first start only)", None)
    tokenizer = AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    if progress is not None:
        progress(f"Converting {gguf_path.name} to safetensors (first start only)", None)
    model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, **kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if progress is not None:
        progress("Saving the converted model", None)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def ensure_converted(gguf_path: Path, progress: Progress | None = None) -> Path:
    """The cached safetensors folder for ``gguf_path``, converting first if needed (see module docstring)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path}: GGUF file not found; check the source path in models.yaml")
    dest = converted_dir(gguf_path, progress)
    if is_complete(dest):
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    remove_stale_temporaries(dest.parent)
    if dest.exists():  # no marker: not written by a finished conversion; never trust it
        shutil.rmtree(dest, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{dest.name}-pid{os.getpid()}-", dir=dest.parent))
    started = time.perf_counter()
    try:
        try:
            _convert_into(gguf_path, tmp, progress)
        except Exception as exc:  # noqa: BLE001 - the GGUF reader fails in many ways on a damaged file
            size = gguf_path.stat().st_size
            raise ModelLoadError(f"{gguf_path}: cannot convert this GGUF file ({size} bytes) with transformers "
                                 f"({type(exc).__name__}: {exc}); if it is truncated or damaged, download it again, "
                                 "else use a GGUF of an architecture transformers supports, or a safetensors "
                                 "directory") from exc
        info = {"gguf": str(gguf_path), "key": dest.name, "seconds": round(time.perf_counter() - started, 2)}
        (tmp / MARKER).write_text(json.dumps(info), encoding="utf-8")
        try:
            os.rename(tmp, dest)
        except OSError:
            if not is_complete(dest):  # not a lost race with another process: a real failure
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if progress is not None:
        progress("Converted model cached", 1.0)
    return dest
