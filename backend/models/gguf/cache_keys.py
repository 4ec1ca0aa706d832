"""What names a conversion in the cache (``convert.converted_dir``): the GGUF's sha256, remembered per file,
and the version of the transformers that converted it.

- ``file_sha256(path, progress=None)``: the digest of ``path``'s bytes, kept in ``cache_dir()/hashes.json`` per
  (absolute path, size, mtime) so a start does not hash a file it has hashed (a value there that is not a
  digest is ignored, never used as a path).
- ``transformers_version()``: read without importing transformers.
"""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import json
import re
from pathlib import Path

from specchat.backend.errors import ModelLoadError
from specchat.backend.files import write_atomic
from specchat.backend.models.loading.capture import Progress
from specchat.backend.paths import cache_dir

_DIGEST = re.compile(r"[0-9a-f]{64}")


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
    known = known if isinstance(known, dict) else {}
    value = known.get(key)
    if isinstance(value, str) and _DIGEST.fullmatch(value):
        return value
    digest, done = hashlib.sha256(), 0
    with open(path, "rb") as handle:
        while chunk := handle.read(1 << 22):
            digest.update(chunk)
            done += len(chunk)
            if progress is not None:
                progress(f"Hashing {path.name}", done / max(stat.st_size, 1))
    known[key] = value = digest.hexdigest()
    try:
        store.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(store, json.dumps(known, indent=0))  # a concurrent reader sees the old or the new file
    except OSError as exc:
        raise ModelLoadError(
            f"cannot write the hash cache {store}: {exc.strerror or exc}; make the folder "
            "writable or set SPECCHAT_CACHE_DIR to a folder you can write"
        ) from exc
    return value


@functools.lru_cache(maxsize=1)
def transformers_version() -> str:
    """The installed transformers' version, without importing it (seconds, which a start that finds its conversion
    cached does not otherwise pay) or parsing its metadata file (``benchmarks/RESULTS.md``, "Figures moved out of the
    code"): the name of its ``.dist-info`` folder beside the package, else the metadata, else the package itself."""
    spec = importlib.util.find_spec("transformers")
    if spec is not None and spec.origin:
        site = Path(spec.origin).parent.parent
        found = [p.name[len("transformers-") : -len(".dist-info")] for p in site.glob("transformers-*.dist-info")]
        if len(found) == 1:
            return found[0]
    try:
        return importlib.metadata.version("transformers")
    except importlib.metadata.PackageNotFoundError:
        import transformers

        return transformers.__version__
