"""GGUF -> transformers files, done once and cached; a damaged cache is noticed and made again.

Contract: ``ensure_converted(gguf_path, progress=None, *, weights=True) -> Path`` returns a folder under
``paths.cache_dir()/converted/`` holding ``config.json``, ``generation_config.json``, the tokenizer
(``tokenizer.json``) and a marker file, plus, with ``weights``, ``model.safetensors`` (the float32
de-quantisation of the file's weights: the ``quantization: none`` path; for the architectures of
``gguf_arch.ARCHS`` the configuration and weights are the file's own, read by ``gguf_to_hf.py``, else transformers'
GGUF loader's). Without ``weights`` only the metadata is written (the int4/int8 path reads the weights from the
GGUF itself, ``backend/models/loading/quantized.py``). Folder names:
``<stem>-<sha256[:16]>[-map<N>][-meta]-transformers-<version>`` (``-map<N>``: the mapping's version), keyed
by the GGUF's content hash (sha256,
streamed; remembered in ``hashes.json`` per path + size + mtime, so an unchanged file is hashed once; a value
there that is not a sha256 hex digest is ignored and recomputed, as it becomes part of a path) and the
transformers version (its GGUF tokenizer and de-quantisation may change between versions).

Verification: the marker lists every file with its size; :func:`is_complete` checks each is there with that
size, and that ``model.safetensors`` has a readable header whose tensors fill the file exactly. A folder that
fails is removed and converted again, so a truncated, emptied, garbage or missing file (or a missing
tokenizer) heals on the next start without asking anyone. A file damaged in a way only loading notices is
handed to :func:`invalidate` by the loader (``loading.py``), which converts once more.

Crash safety: a conversion writes into a fresh ``.tmp-*`` folder beside the destination while holding an
exclusive lock on a file inside it, and renames the folder into place only when complete (atomic within one
file system), the marker written last. Every call first removes ``.tmp-*`` folders whose lock no process
holds (their writer died, e.g. ``kill -9``; without the lock file, the writer's pid in the folder name
decides), so an abandoned half-conversion (~540 MB for the embedded model) never stays behind.

Errors: a disk too full for the conversion (checked before starting, and ENOSPC while writing) or a cache
folder that cannot be written names the cache folder and what to do; only a GGUF that cannot be read is
blamed on the GGUF.
"""

from __future__ import annotations

import contextlib
import copy
import errno
import json
import os
import re
import shutil
import struct
import tempfile
import time
from pathlib import Path
from types import ModuleType

from specchat.backend.errors import ModelLoadError
from specchat.backend.models.gguf.cache_keys import file_sha256, transformers_version
from specchat.backend.models.gguf.gguf_to_hf import MAPPING_VERSION
from specchat.backend.models.loading.capture import Progress, routed_gguf_progress, transformers_imported
from specchat.backend.paths import cache_dir

MARKER = "specchat-conversion.json"
LOCK = ".writer.lock"
WEIGHTS = "model.safetensors"
_TMP_PREFIX = ".tmp-"
_METADATA_BYTES = 64 * 2**20  # room the metadata-only conversion needs (tokenizer.json is a few MB)
_DISK_FULL = (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC))


def converted_dir(gguf_path: Path, progress: Progress | None = None, *, weights: bool = True) -> Path:
    """Where the conversion of ``gguf_path`` lives (it may not exist yet)."""
    digest = file_sha256(gguf_path, progress)
    stem = re.sub(r"[^A-Za-z0-9._-]", "_", Path(gguf_path).stem).lstrip(".") or "model"
    kind = "" if weights else "-meta"
    mapping = f"-map{MAPPING_VERSION}" if weights else ""  # the weights' conversion follows gguf_to_hf.py's mapping
    name = f"{stem[:80]}-{digest[:16]}{mapping}{kind}-transformers-{transformers_version()}"
    return cache_dir() / "converted" / name


def _safetensors_whole(path: Path) -> bool:
    """Whether ``path`` starts with a safetensors header whose tensors end exactly at the end of the file."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as handle:
            (length,) = struct.unpack("<Q", handle.read(8))
            if not 2 <= length <= size - 8:
                return False
            header = json.loads(handle.read(length))
        ends = [entry["data_offsets"][1] for name, entry in header.items() if name != "__metadata__"]
        return bool(ends) and 8 + length + max(ends) == size
    except (OSError, ValueError, KeyError, TypeError, IndexError, struct.error):
        return False


def is_complete(folder: Path) -> bool:
    """A finished conversion whose files are all there, at their recorded sizes (see the module docstring)."""
    try:
        info = json.loads((folder / MARKER).read_text(encoding="utf-8"))
        files = info["files"]
        for name, size in files.items():
            if "/" in name or "\\" in name or (folder / name).stat().st_size != size:
                return False
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False
    if "tokenizer.json" not in files or "config.json" not in files:
        return False
    return WEIGHTS not in files or _safetensors_whole(folder / WEIGHTS)


def invalidate(folder: Path) -> None:
    """Remove a cache folder that turned out to be damaged, so the next ``ensure_converted`` makes it again."""
    if folder.parent.name == "converted" and folder.parent.parent == cache_dir():
        shutil.rmtree(folder, ignore_errors=True)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except (PermissionError, OSError):
        return True
    return True


def _writer_alive(entry: Path) -> bool:
    """Whether a live process still writes the temporary folder ``entry`` (its lock is held)."""
    fcntl: ModuleType | None
    try:
        import fcntl
    except ImportError:  # Windows: the pid in the name decides
        fcntl = None
    lock = entry / LOCK
    if fcntl is not None and lock.is_file():
        try:
            fd = os.open(lock, os.O_RDWR)
        except OSError:
            return True
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return True  # held: its writer is alive (this process included)
        finally:
            os.close(fd)  # closing drops the lock we may have taken
        return False
    try:
        pid = int(entry.name.rsplit("-pid", 1)[1].split("-")[0])
    except (IndexError, ValueError):
        return False
    return pid > 0 and (pid == os.getpid() or _pid_alive(pid))


def remove_stale_temporaries(parent: Path) -> list[Path]:
    """Delete ``.tmp-*`` folders left by dead writers (a killed conversion). Returns what was removed."""
    removed: list[Path] = []
    if not parent.is_dir():
        return removed
    for entry in parent.iterdir():
        if entry.is_dir() and entry.name.startswith(_TMP_PREFIX) and not _writer_alive(entry):
            shutil.rmtree(entry, ignore_errors=True)
            removed.append(entry)
    return removed


@contextlib.contextmanager
def _gguf_metadata_read_once():
    """Within the block, transformers' ``load_gguf_checkpoint(path, return_tensors=False)`` parses a file once.

    Why: for architectures its fast metadata reader does not cover (llama, qwen2, mistral, ... in transformers
    5.x), both ``AutoTokenizer`` and ``AutoConfig`` call it, and its reader walks every element of the
    vocabulary arrays: seconds each for the embedded file's 49,152 tokens, most of a first start
    (``benchmarks/RESULTS.md``, "Figures moved out of the code").
    The callers import the function from its module when they run, so replacing the module's attribute for
    the block reaches them; each gets its own deep copy of the one result. That one parse reads the file
    with ``gguf_file.MetadataReader`` instead of the ``gguf`` package's reader (``benchmarks/RESULTS.md``, "Start
    time and memory")."""
    try:
        from transformers import modeling_gguf_pytorch_utils as gguf_utils
    except ImportError:  # another transformers layout: nothing to share
        yield
        return
    original = getattr(gguf_utils, "load_gguf_checkpoint", None)
    if original is None:
        yield
        return
    parsed: dict[str, object] = {}

    def once(path, return_tensors=False, *args, **kwargs):
        if return_tensors or args or kwargs:
            return original(path, return_tensors, *args, **kwargs)
        key = os.fspath(path)
        if key not in parsed:
            from specchat.backend.models.gguf.gguf_file import MetadataReader

            parsed[key] = _parse_with(MetadataReader, original, path)
        return copy.deepcopy(parsed[key])

    # The swap is the point (see the docstring); its parameters are named otherwise than the original's.
    gguf_utils.load_gguf_checkpoint = once  # type: ignore[assignment]
    try:
        with routed_gguf_progress(gguf_utils):  # its bars go where the open capture block sends progress
            yield
    finally:
        gguf_utils.load_gguf_checkpoint = original


def _parse_with(reader, parse, path):
    """``parse(path)`` (transformers' ``load_gguf_checkpoint``, metadata only) with the ``gguf`` package's reader
    replaced by ``reader`` for the call (it imports the reader from the package when it runs)."""
    import gguf

    original = gguf.GGUFReader
    gguf.GGUFReader = reader  # type: ignore[misc]  # the swap is the point (see the docstring)
    try:
        return parse(path, return_tensors=False)
    finally:
        gguf.GGUFReader = original  # type: ignore[misc]  # and back


def _gguf_tokenizer(gguf_path: Path, progress: Progress | None):
    """The tokenizer transformers builds from the GGUF's metadata (call inside :func:`_gguf_metadata_read_once`,
    so what else reads the metadata next shares its parse)."""
    from transformers import AutoTokenizer

    transformers_imported()
    if progress is not None:
        progress(f"Reading the tokenizer from {gguf_path.name} (first start only)", 0.0)
    return AutoTokenizer.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)


def _gguf_tokenizer_and_config(gguf_path: Path, progress: Progress | None):
    from transformers import AutoConfig

    with _gguf_metadata_read_once():
        tokenizer = _gguf_tokenizer(gguf_path, progress)
        if progress is not None:
            progress(f"Reading the model configuration from {gguf_path.name} (first start only)", 0.5)
        config = AutoConfig.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name)
    return tokenizer, config


def _convert_metadata(gguf_path: Path, folder: Path, progress: Progress | None) -> None:
    """config.json, generation_config.json and the tokenizer of ``gguf_path`` (no weights) into ``folder``."""
    from transformers import GenerationConfig

    tokenizer, config = _gguf_tokenizer_and_config(gguf_path, progress)
    config.save_pretrained(folder)
    GenerationConfig.from_model_config(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    if progress is not None:
        progress(f"Read the tokenizer and configuration of {gguf_path.name}", 1.0)


def _convert_into(gguf_path: Path, folder: Path, progress: Progress | None) -> None:
    """Load the GGUF with transformers (de-quantising) and save model + tokenizer as safetensors into folder."""
    from transformers import AutoModelForCausalLM

    transformers_imported()
    kwargs = {}
    try:  # newer transformers may keep GGUF blocks packed (kernels); a saved checkpoint needs plain weights
        from transformers import GgufConfig

        kwargs["quantization_config"] = GgufConfig(dequantize=True)
    except ImportError:
        pass
    from specchat.backend.models.gguf.gguf_to_hf import mapped_config, mapped_model

    with _gguf_metadata_read_once():
        tokenizer = _gguf_tokenizer(gguf_path, progress)
        if progress is not None:
            progress(f"Converting {gguf_path.name} to safetensors (first start only)", 0.1)
        config = mapped_config(gguf_path)  # the file's own model (gguf_to_hf.py); None: transformers' loader
        if config is not None:
            model = mapped_model(gguf_path, config)
        else:
            model = AutoModelForCausalLM.from_pretrained(gguf_path.parent, gguf_file=gguf_path.name, **kwargs)
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None:
        quantizer.remove_quantization_config(model)
    elif hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    if progress is not None:
        progress("Saving the converted model", 0.8)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)


def _needed_bytes(gguf_path: Path, weights: bool) -> int:
    """Disk space the conversion writes: float32 weights (4 bytes a parameter) plus the metadata."""
    if not weights:
        return _METADATA_BYTES
    from specchat.backend.models.gguf.gguf_file import read_gguf

    try:
        params = sum(int(max(1, t.raw.shape[0])) * t.shape[-1] for t in read_gguf(gguf_path).tensors.values())
    except (ValueError, OSError):
        params = gguf_path.stat().st_size * 2  # unreadable here: the converter will say why; a rough size
    return 4 * params + _METADATA_BYTES


def _disk_full(where: Path, need: int, exc: BaseException | None = None) -> ModelLoadError:
    try:
        free = f"{shutil.disk_usage(where).free / 2**20:.0f} MB free"
    except OSError:
        free = "free space unknown"
    cause = f" ({exc})" if exc is not None else ""
    return ModelLoadError(
        f"no room on the disk holding the model cache {where}{cause}: the converted model needs "
        f"about {need / 2**20:.0f} MB ({free}); free some space there, or set SPECCHAT_CACHE_DIR "
        "to a folder on a disk with room"
    )


def _is_disk_full(exc: BaseException) -> bool:
    return (isinstance(exc, OSError) and exc.errno in _DISK_FULL) or "no space left" in str(exc).lower()


def ensure_converted(gguf_path: Path, progress: Progress | None = None, *, weights: bool = True) -> Path:
    """The cached folder for ``gguf_path``, converting (again) first when missing or damaged (see the docstring)."""
    gguf_path = Path(gguf_path)
    if not gguf_path.is_file():
        raise ModelLoadError(f"{gguf_path}: GGUF file not found; check the source path in models.yaml")
    dest = converted_dir(gguf_path, progress, weights=weights)
    parent = dest.parent
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temporaries(parent)
        if is_complete(dest):
            return dest
        if dest.exists():  # damaged or unfinished: never trust it
            shutil.rmtree(dest)
        need = _needed_bytes(gguf_path, weights)
        if shutil.disk_usage(parent).free < need:
            raise _disk_full(parent, need)
        tmp = Path(tempfile.mkdtemp(prefix=f"{_TMP_PREFIX}{dest.name}-pid{os.getpid()}-", dir=parent))
    except OSError as exc:
        raise ModelLoadError(
            f"cannot use the model cache {parent}: {exc.strerror or exc}; make it writable or set "
            "SPECCHAT_CACHE_DIR to a folder you can write"
        ) from exc
    started = time.perf_counter()
    lock_fd = _hold_lock(tmp)
    try:
        try:
            (_convert_into if weights else _convert_metadata)(gguf_path, tmp, progress)
        except Exception as exc:  # noqa: BLE001 - the GGUF reader fails in many ways on a damaged file
            if _is_disk_full(exc):
                raise _disk_full(parent, _needed_bytes(gguf_path, weights), exc) from exc
            if isinstance(exc, OSError) and exc.filename and str(exc.filename).startswith(str(parent)):
                raise ModelLoadError(
                    f"cannot write the converted model into {parent}: {exc.strerror or exc}; make "
                    "the folder writable or set SPECCHAT_CACHE_DIR to another folder"
                ) from exc
            size = gguf_path.stat().st_size
            raise ModelLoadError(
                f"{gguf_path}: cannot convert this GGUF file ({size} bytes) with transformers "
                f"({type(exc).__name__}: {exc}); if it is truncated or damaged, download it again, "
                "else use a GGUF of an architecture transformers supports, or a safetensors "
                "directory"
            ) from exc
        files = {p.name: p.stat().st_size for p in tmp.iterdir() if p.is_file() and not p.name.startswith(LOCK)}
        info = {
            "gguf": str(gguf_path),
            "key": dest.name,
            "seconds": round(time.perf_counter() - started, 2),
            "files": files,
        }
        try:
            (tmp / MARKER).write_text(json.dumps(info), encoding="utf-8")
            (tmp / LOCK).unlink()
            os.rename(tmp, dest)
        except OSError as exc:
            if not is_complete(dest):  # not a lost race with another process: a real failure
                if _is_disk_full(exc):
                    raise _disk_full(parent, _needed_bytes(gguf_path, weights), exc) from exc
                raise ModelLoadError(
                    f"cannot finish the converted model in {parent}: {exc.strerror or exc}; make "
                    "the folder writable or set SPECCHAT_CACHE_DIR to another folder"
                ) from exc
    finally:
        if lock_fd is not None:
            os.close(lock_fd)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    if progress is not None:
        progress("Converted model cached", 1.0)
    return dest


def _hold_lock(folder: Path) -> int | None:
    """Create and lock ``folder/LOCK`` for this process's lifetime of the conversion (None without fcntl)."""
    try:
        import fcntl
    except ImportError:
        return None
    fresh = folder / f"{LOCK}.new"
    fd = os.open(fresh, os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(fd, fcntl.LOCK_EX)
    os.rename(fresh, folder / LOCK)  # appears already locked: a cleaner never sees it free while we live
    return fd
