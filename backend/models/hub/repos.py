"""Hugging Face hub sources: how much a download would fetch, and fetching it into the standard HF cache.

Contract:

- ``download_size(spec) -> int``: bytes still to download for the files specchat needs (0 when cached).
  Online it asks the hub (a dry run: no file content is fetched); with ``HF_HUB_OFFLINE=1`` (or when the hub
  cannot be reached) a cached snapshot counts as 0 and a missing one raises :class:`ModelLoadError` saying
  how to get it. Gated and missing repositories raise with what to do (``hf auth login``).
- ``confirm_download`` counts ``hf:`` GGUF files too (``hub_gguf.py`` sizes and fetches them).
- ``snapshot(spec, *, tokenizer_only=False, progress=None) -> Path``: the local snapshot folder, downloading
  what is missing (progress reported through ``progress``). Never call it before the user agreed to the
  download size (``loading.load_pair`` asks first).

Only top-level files are fetched (repositories such as Llama's keep a second, pickle copy of the weights
under ``original/``), and pickle weights (``*.bin``, ``*.pt``) only when the spec sets ``allow_pickle``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from specchat.backend.errors import ModelLoadError
from specchat.backend.models.catalog.config import ModelSpec
from specchat.backend.models.facts.spec_facts import offline
from specchat.backend.models.loading.capture import Progress, progress_tqdm_class

_TOKENIZER_FILES = ["*.json", "tokenizer*", "*.model", "*.tiktoken", "*.txt", "*.jinja"]
_WEIGHTS = ["*.safetensors"]
_PICKLE = ["*.bin", "*.pt", "*.pth"]
_IGNORE = ["*/*"]  # subfolders: never needed by from_pretrained of a causal LM at the repo root


def _patterns(spec: ModelSpec, tokenizer_only: bool) -> list[str]:
    if tokenizer_only:
        return list(_TOKENIZER_FILES)
    extra = (_PICKLE if spec.allow_pickle else []) + (["*.py"] if spec.trust_remote_code else [])
    return _TOKENIZER_FILES + _WEIGHTS + extra


def _login_hint(spec: ModelSpec) -> str:
    return (
        f"accept its licence at https://huggingface.co/{spec.source}, then run `hf auth login` "
        "(older huggingface_hub: `huggingface-cli login`)"
    )


def _translate(spec: ModelSpec, exc: Exception) -> ModelLoadError:
    """Turn a huggingface_hub error into a message a user can act on."""
    from huggingface_hub import errors

    name = spec.source + (f"@{spec.revision}" if spec.revision else "")
    if isinstance(exc, errors.GatedRepoError):
        return ModelLoadError(f"hub repo {name} is gated: {_login_hint(spec)}")
    if isinstance(exc, errors.RepositoryNotFoundError):
        return ModelLoadError(
            f"hub repo {name} was not found (or is private): check the source in models.yaml, "
            "or log in with `hf auth login` if it is private"
        )
    if isinstance(exc, errors.RevisionNotFoundError):
        return ModelLoadError(f"hub repo {spec.source} has no revision {spec.revision!r}; fix revision in models.yaml")
    if isinstance(exc, errors.LocalEntryNotFoundError):
        why = "HF_HUB_OFFLINE is set" if offline() else "the hub cannot be reached"
        return ModelLoadError(
            f"hub repo {name} is not (completely) in the Hugging Face cache and {why}: connect "
            f"and retry, or download it elsewhere with `hf download {spec.source}` and copy the "
            "cache (HF_HOME)"
        )
    return ModelLoadError(f"hub repo {name}: download failed ({exc}); check the connection and retry")


def _cached(spec: ModelSpec, tokenizer_only: bool) -> Path | None:
    from huggingface_hub import errors, snapshot_download

    try:
        downloaded = snapshot_download(
            spec.source,
            revision=spec.revision,
            local_files_only=True,
            allow_patterns=_patterns(spec, tokenizer_only),
            ignore_patterns=_IGNORE,
        )
    except (errors.LocalEntryNotFoundError, OSError):
        return None
    folder = Path(downloaded)
    if (
        not tokenizer_only
        and not any(folder.glob("*.safetensors"))
        and not (spec.allow_pickle and any(p.suffix in {".bin", ".pt", ".pth"} for p in folder.iterdir()))
    ):
        return None  # only the tokenizer was fetched earlier (e.g. a declined or failed weights download)
    return folder


def is_cached(spec: ModelSpec) -> bool:
    """Whether the weights and tokenizer are in the local HF cache (no network access)."""
    return _cached(spec, tokenizer_only=False) is not None


def download_size(spec: ModelSpec) -> int:
    """Bytes the next ``snapshot(spec)`` would download (0 when everything is cached)."""
    from huggingface_hub import errors, snapshot_download

    if offline():
        if _cached(spec, tokenizer_only=False) is None:
            raise _translate(spec, errors.LocalEntryNotFoundError("offline"))
        return 0
    try:
        infos = snapshot_download(
            spec.source,
            revision=spec.revision,
            allow_patterns=_patterns(spec, False),
            ignore_patterns=_IGNORE,
            dry_run=True,
        )
    except (errors.GatedRepoError, errors.RepositoryNotFoundError, errors.RevisionNotFoundError) as exc:
        raise _translate(spec, exc) from exc
    except TypeError:  # an older huggingface_hub without dry runs: fall back to models.yaml's number
        return 0 if _cached(spec, tokenizer_only=False) is not None else spec.download_bytes
    except Exception as exc:  # no connection (DryRunError, httpx errors): the cache is all we have
        if _cached(spec, tokenizer_only=False) is not None:
            return 0
        raise _translate(spec, errors.LocalEntryNotFoundError(str(exc))) from exc
    return sum(info.file_size or 0 for info in infos if info.will_download)


def snapshot(spec: ModelSpec, *, tokenizer_only: bool = False, progress: Progress | None = None) -> Path:
    """The snapshot folder of ``spec`` in the HF cache, downloading the missing files (see module docstring)."""
    from huggingface_hub import snapshot_download

    cached = _cached(spec, tokenizer_only)
    if cached is not None and (offline() or tokenizer_only):
        return cached
    if progress is not None:
        what = "tokenizer of " if tokenizer_only else ""
        progress(f"Fetching the {what}{spec.source} from the Hugging Face hub", None)
    try:
        folder = snapshot_download(
            spec.source,
            revision=spec.revision,
            allow_patterns=_patterns(spec, tokenizer_only),
            ignore_patterns=_IGNORE,
            local_files_only=offline(),
            tqdm_class=progress_tqdm_class(progress),
        )
    except Exception as exc:  # noqa: BLE001 - every hub failure becomes one actionable message
        if cached is not None:  # the hub is unreachable but a complete snapshot is here
            return cached
        raise _translate(spec, exc) from exc
    return Path(folder)


def confirm_download(specs: list[ModelSpec], confirm: Callable[[int], bool] | None, label: str) -> None:
    """Ask ``confirm(bytes)`` once for the total hub download of ``specs`` (the loader, ``loading.py``, before
    anything loads); raise ModelLoadError if refused, or if a download is needed and no one can be asked."""
    from specchat.backend.models.hub import hub_gguf

    unique = {(s.source, s.revision): s for s in specs if s.kind in ("hub", "hub-gguf")}
    total = sum(
        hub_gguf.download_size(spec) if spec.kind == "hub-gguf" else download_size(spec) for spec in unique.values()
    )
    if total <= 0:
        return
    names = ", ".join(spec.source for spec in unique.values())
    size = f"{total / 1e9:.2f} GB"
    if confirm is None:
        raise ModelLoadError(
            f"{label} needs a {size} download from the Hugging Face hub ({names}); confirm it when "
            f"asked, or download first with `hf download REPO` for each of: {names}"
        )
    if not confirm(total):
        raise ModelLoadError(f"{label}: the {size} download of {names} was declined; nothing was downloaded")
