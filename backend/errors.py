"""User-facing errors. Every message says what is wrong, where (file, pair, field, value) and what to do.

The CLI prints ``str(error)`` on one line and exits with code 2; the UI shows it as a notification. Anything
that is not a :class:`SpecchatError` is a bug and keeps its traceback (in the log file for the UI).
"""

from __future__ import annotations


class SpecchatError(Exception):
    """Base class of errors whose message is meant for the user."""


class ConfigError(SpecchatError):
    """models.yaml (or a user override file) is malformed: names the file, the pair and the field."""


class ModelLoadError(SpecchatError):
    """A model, tokenizer or weight file could not be found, read or accepted (pickle, remote code, ...)."""


class IncompatiblePairError(ModelLoadError):
    """Draft and target tokenizers do not map text to the same ids."""


class InsufficientMemoryError(SpecchatError):
    """The pair does not fit in the device's free memory (the message carries the estimate and the free bytes)."""


class KVCacheFullError(SpecchatError):
    """The paged KV pool has no free block left."""


class RequestError(SpecchatError):
    """A generation request is invalid: bad sampling settings, empty prompt, unknown drafter, ..."""


class RemoteError(SpecchatError):
    """A remote pair's server could not be reached, refused a request (API key, model, busy) or broke off a reply:
    names the server and what to do."""


class ModelOutputError(SpecchatError):
    """The model's output cannot be decoded (NaN logits): the reply stops instead of emitting garbage."""
