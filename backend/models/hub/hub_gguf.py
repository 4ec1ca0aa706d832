"""One GGUF file of a Hugging Face hub repository (a ``hf:ORG/NAME/FILE.gguf`` source): its size, and fetching it
into the standard HF cache with progress, resumption and a check of what arrived.

Contract:

- :func:`cached_path(spec)`: the file in the local cache, or None (no network).
- :func:`download_size(spec)`: bytes still to fetch (0 when cached). Online it asks the hub (a dry run: no content
  is fetched); offline (``HF_HUB_OFFLINE``) or unreachable, a cached file counts 0 and a missing one raises
  :class:`ModelLoadError` saying how to get it. Missing repositories, files and gated ones raise with what to do.
- :func:`fetch(spec, progress=None)`: the local path, downloading when missing (``hf_hub_download``: progress
  reported as ``progress(message, fraction)``; an interrupted download resumes from its ``.incomplete`` part).
  What arrived is checked against the hub's record of the file: its size, and its sha256 where the hub states one
  (the LFS etag of a GGUF); a mismatch deletes the damaged file and raises, so the next try downloads it again.
  The check is remembered per file (``cache_keys.file_sha256`` keeps the digest per path, size and mtime).
"""

from __future__ import annotations

import re
from pathlib import Path

from specchat.backend.errors import ModelLoadError
from specchat.backend.models.catalog.model_spec import ModelSpec
from specchat.backend.models.facts.spec_facts import cached_hub_file, offline
from specchat.backend.models.loading.capture import Progress, progress_tqdm_class

_SHA256 = re.compile(r"[0-9a-f]{64}")


def _where(spec: ModelSpec) -> tuple[str, str]:
    repo, filename = spec.hub_repo, spec.hub_filename
    if repo is None or filename is None:
        raise ModelLoadError(f"{spec.source}: not a hub GGUF file (hf:ORG/NAME/FILE.gguf)")
    return repo, filename


def cached_path(spec: ModelSpec) -> Path | None:
    repo, filename = _where(spec)
    return cached_hub_file(repo, filename, spec.revision)


def _translate(spec: ModelSpec, exc: Exception) -> ModelLoadError:
    from huggingface_hub import errors

    repo, filename = _where(spec)
    if isinstance(exc, errors.GatedRepoError):
        return ModelLoadError(
            f"hub repo {repo} is gated: accept its licence at https://huggingface.co/{repo}, then run `hf auth login`"
        )
    if isinstance(exc, errors.RepositoryNotFoundError):
        return ModelLoadError(f"hub repo {repo} was not found (or is private): check the source in models.yaml")
    if isinstance(exc, errors.RevisionNotFoundError):
        return ModelLoadError(f"hub repo {repo} has no revision {spec.revision!r}; fix revision in models.yaml")
    if isinstance(exc, errors.LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set" if offline() else "the hub cannot be reached"
        return ModelLoadError(
            f"{filename} of hub repo {repo} is not in the Hugging Face cache and {why}: connect and retry, or "
            f"download it elsewhere with `hf download {repo} {filename}` and copy the cache (HF_HOME)"
        )
    if isinstance(exc, errors.EntryNotFoundError):
        return ModelLoadError(
            f"hub repo {repo} has no file {filename}: check the name in models.yaml (the repository's Files tab "
            "lists its GGUF files)"
        )
    return ModelLoadError(f"{filename} of hub repo {repo}: download failed ({exc}); check the connection and retry")


def download_size(spec: ModelSpec) -> int:
    """See the module docstring."""
    from huggingface_hub import errors, hf_hub_download

    if cached_path(spec) is not None:
        return 0
    if offline():
        raise _translate(spec, errors.LocalEntryNotFoundError("offline"))
    repo, filename = _where(spec)
    try:
        info = hf_hub_download(repo, filename, revision=spec.revision, dry_run=True)
    except (errors.GatedRepoError, errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as exc:
        raise _translate(spec, exc) from exc
    except errors.EntryNotFoundError as exc:
        raise _translate(spec, exc) from exc
    except Exception as exc:  # noqa: BLE001 - no connection: nothing cached either (checked above)
        raise _translate(spec, errors.LocalEntryNotFoundError(str(exc))) from exc
    size = getattr(info, "file_size", None)
    return int(size) if size else spec.download_bytes


def _expected(spec: ModelSpec) -> tuple[int | None, str | None]:
    """(size, sha256) the hub records for the file; (None, None) when it cannot be asked."""
    from huggingface_hub import get_hf_file_metadata, hf_hub_url

    repo, filename = _where(spec)
    try:
        meta = get_hf_file_metadata(hf_hub_url(repo, filename, revision=spec.revision))
    except Exception:  # noqa: BLE001 - offline, or the hub is down: the download itself said what it could
        return None, None
    etag = (meta.etag or "").strip('"').lower()
    return meta.size, etag if _SHA256.fullmatch(etag) else None


def _check(spec: ModelSpec, path: Path, progress: Progress | None) -> None:
    from specchat.backend.models.gguf.cache_keys import file_sha256

    size, sha256 = _expected(spec)
    actual = path.stat().st_size
    problem = None
    if size is not None and actual != size:
        problem = f"it has {actual} bytes where the hub has {size}"
    elif sha256 is not None:
        digest = file_sha256(path, progress)
        if digest != sha256:
            problem = f"its sha256 is {digest[:16]}... where the hub has {sha256[:16]}..."
    if problem is not None:
        blob = path.resolve()
        for damaged in {path, blob}:
            damaged.unlink(missing_ok=True)
        raise ModelLoadError(
            f"the download of {spec.source} is damaged ({problem}); it was deleted: run again to download it anew"
        )


def fetch(spec: ModelSpec, progress: Progress | None = None) -> Path:
    """See the module docstring."""
    from huggingface_hub import hf_hub_download

    cached = cached_path(spec)
    if cached is not None:
        return cached
    repo, filename = _where(spec)
    if progress is not None:
        progress(f"Downloading {filename} from the Hugging Face hub ({repo})", None)
    try:
        path = Path(
            hf_hub_download(
                repo,
                filename,
                revision=spec.revision,
                local_files_only=offline(),
                tqdm_class=progress_tqdm_class(progress),
            )
        )
    except Exception as exc:  # noqa: BLE001 - every hub failure becomes one actionable message
        raise _translate(spec, exc) from exc
    _check(spec, path, progress)
    return path
