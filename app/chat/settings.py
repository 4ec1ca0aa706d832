"""User settings of the chat app, validated and persisted as JSON in the config dir.

Contract: :func:`load_settings` never raises for a bad file: it returns the defaults and a warning naming the
file and the problem (the app shows it as a notification and keeps running). :func:`validate_settings` raises
:class:`SettingsError` naming the field, the value and the accepted range. ``None`` in a sampling field means
"the pair's default" (models.yaml, else the model's generation_config). :func:`save_settings` writes the file
owner-only (0600) with ``specchat.backend.files.write_atomic``: a crash or a failed save leaves the previous
file whole and no temporary file behind.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, fields, replace
from pathlib import Path
from typing import Any, Literal

from specchat.backend.api import MAX_GAMMA, MAX_TEMPERATURE, DrafterName, SamplingParams
from specchat.backend.errors import SpecchatError
from specchat.backend.files import write_atomic
from specchat.backend.paths import config_dir

SETTINGS_FILE = "settings.json"
DrafterChoice = Literal["pair", "prompt-lookup", "none"]
DRAFTER_CHOICES: dict[str, str] = {"pair": "Pair default", "prompt-lookup": "Prompt lookup", "none": "Off"}
MAX_NEW_TOKENS_LIMIT = 32768


class SettingsError(SpecchatError):
    """A setting has a value outside its accepted range (the message names the field and the range)."""


@dataclass(slots=True)
class Settings:
    temperature: float | None = None  # None: pair default; 0: greedy
    top_p: float | None = None  # None: pair default; (0, 1]
    top_k: int | None = None  # None: pair default; 0: no top-k
    max_new_tokens: int = 1024
    drafter: DrafterChoice = "pair"
    gamma: int | Literal["auto"] | None = None  # None: pair default; "auto": adaptive; int: fixed
    system_prompt: str = ""
    theme: str | None = None
    last_pair: str | None = None

    def sampling(self) -> SamplingParams:
        """The request's sampling parameters (``None`` fields are resolved by the engine)."""
        return SamplingParams(temperature=self.temperature, top_k=self.top_k, top_p=self.top_p,
                              max_new_tokens=self.max_new_tokens)

    def request_drafter(self) -> DrafterName | None:
        """``GenerationRequest.drafter``: None keeps the pair's drafter."""
        return None if self.drafter == "pair" else self.drafter


def settings_path() -> Path:
    return config_dir() / SETTINGS_FILE


def _number(name: str, value: Any, kind: type) -> Any:
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingsError(f"setting {name!r}: expected a number, got {value!r}")
    if kind is int and float(value) != int(value):
        raise SettingsError(f"setting {name!r}: expected a whole number, got {value!r}")
    return kind(value)


def validate_settings(settings: Settings) -> Settings:
    """Return ``settings`` with numbers normalised; raise :class:`SettingsError` on the first bad field."""
    temperature = _number("temperature", settings.temperature, float)
    if temperature is not None and not 0.0 <= temperature <= MAX_TEMPERATURE:
        raise SettingsError(f"setting 'temperature': {temperature} is outside 0 (greedy) .. {MAX_TEMPERATURE:g}")
    top_p = _number("top_p", settings.top_p, float)
    if top_p is not None and not 0.0 < top_p <= 1.0:
        raise SettingsError(f"setting 'top_p': {top_p} is outside (0, 1] (1 turns top-p off)")
    top_k = _number("top_k", settings.top_k, int)
    if top_k is not None and top_k < 0:
        raise SettingsError(f"setting 'top_k': {top_k} is negative (0 turns top-k off)")
    max_new = _number("max_new_tokens", settings.max_new_tokens, int)
    if max_new is None or not 1 <= max_new <= MAX_NEW_TOKENS_LIMIT:
        raise SettingsError(f"setting 'max_new_tokens': {max_new!r} is outside 1 .. {MAX_NEW_TOKENS_LIMIT}")
    if settings.drafter not in DRAFTER_CHOICES:
        raise SettingsError(f"setting 'drafter': {settings.drafter!r} is not one of {', '.join(DRAFTER_CHOICES)}")
    gamma = settings.gamma
    if gamma is not None and gamma != "auto":
        gamma = _number("gamma", gamma, int)
        if not 1 <= gamma <= MAX_GAMMA:
            raise SettingsError(f"setting 'gamma': {gamma} is outside 1 .. {MAX_GAMMA} (or use 'auto')")
    if not isinstance(settings.system_prompt, str):
        raise SettingsError(f"setting 'system_prompt': expected text, got {settings.system_prompt!r}")
    for name in ("theme", "last_pair"):
        value = getattr(settings, name)
        if value is not None and not isinstance(value, str):
            raise SettingsError(f"setting {name!r}: expected text, got {value!r}")
    return replace(settings, temperature=temperature, top_p=top_p, top_k=top_k, max_new_tokens=max_new,
                   gamma=gamma)


def load_settings(path: Path | None = None) -> tuple[Settings, str | None]:
    """Read the settings file. Returns (settings, warning); a missing file is not a warning."""
    path = path or settings_path()
    try:
        raw = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return Settings(), None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        return Settings(), f"Settings file {path} could not be read ({error}); using the defaults."
    if not isinstance(raw, dict):
        return Settings(), f"Settings file {path} does not hold a JSON object; using the defaults."
    known = {f.name for f in fields(Settings)}
    try:
        # Unknown keys (a newer version's settings) are ignored rather than fatal.
        return validate_settings(Settings(**{k: v for k, v in raw.items() if k in known})), None
    except SettingsError as error:
        return Settings(), f"Settings file {path}: {error}; using the defaults."


def save_settings(settings: Settings, path: Path | None = None) -> None:
    """Write the settings atomically; :class:`SettingsError` if the directory cannot be written."""
    path = path or settings_path()
    text = json.dumps(asdict(settings), indent=2)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, mode=0o600)
    except OSError as error:
        raise SettingsError(f"could not save the settings to {path}: {error}. Check the directory's "
                            "permissions or set SPECCHAT_CONFIG_DIR.") from error
