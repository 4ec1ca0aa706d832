"""User settings of the chat app, validated and persisted as JSON in the config dir.

Contract: :func:`load_settings` is the file's input boundary and never raises, whatever the file holds (any
bytes, any JSON: non-finite or 5,000-digit numbers, lists where text belongs, deep nesting, a folder or a pipe
in its place): an unreadable file gives the defaults, a bad field gives that field's default, and the warning
names the file, each bad field, its value and the accepted form (the app shows it as a notification and keeps
running). What it returns passes :func:`validate_settings`, which raises :class:`SettingsError` naming the
field, the value and the accepted range (the settings screen's check). ``None`` in a sampling field means "the
pair's default" (models.yaml, else the model's generation_config). :func:`save_settings` writes the file
owner-only (0600) with ``specchat.backend.files.write_atomic``: a crash or a failed save leaves the previous
file whole; a failed save leaves no temporary file, and the next load removes those of a killed process. A
file or folder without write permission (decided from the mode bits, as root too) is left alone: the save
raises :class:`SettingsError` saying so.

The drafter is chosen per pair (``drafters``: pair name -> choice; a pair without an entry uses its own drafter):
a draft model or a tree of continuations that pays on one pair may not exist, or not pay, on another. An older
file's single ``drafter`` is kept for its ``last_pair`` only. :func:`drafter_options` lists every drafter of
``backend/limits.py`` for a pair, what each needs, and why one is not available for that pair.
"""

from __future__ import annotations

import errno
import json
import math
import os
import stat
from collections.abc import Callable
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Literal

from specchat.backend.api import SamplingParams
from specchat.backend.errors import SpecchatError
from specchat.backend.files import read_only_reason, remove_stale_temporaries, write_atomic
from specchat.backend.inputs import InputError, parse_json, shown
from specchat.backend.limits import (
    CHAT_MAX_NEW_TOKENS,
    CHAT_MAX_NEW_TOKENS_LIMIT,
    DRAFTERS,
    MAX_GAMMA,
    SAMPLING_LIMITS,
    DrafterName,
    Gamma,
    is_gamma,
)
from specchat.backend.paths import config_dir

SETTINGS_FILE = "settings.json"
DrafterChoice = Literal["pair"] | DrafterName  # "pair": the pair's own drafter (models.yaml)
DRAFTER_CHOICES: tuple[str, ...] = ("pair", *DRAFTERS)  # every drafter the engine knows (backend/limits.py)
MAX_PAIR_CHOICES = 1000  # pairs with a drafter of their own in the file (models.yaml holds a few dozen)
MAX_SETTINGS_BYTES = 1 << 20  # the file; a system prompt of a few pages is ~10 kB
MAX_SYSTEM_PROMPT_CHARS = 200_000
MAX_NAME_CHARS = 200  # theme, last_pair
_MAX_WHOLE = 2**63 - 1


class SettingsError(SpecchatError):
    """A setting has a value outside its accepted range (the message names the field and the range)."""


@dataclass(slots=True)
class Settings:
    temperature: float | None = None  # None: pair default; 0: greedy
    top_p: float | None = None  # None: pair default; else limits.SAMPLING_LIMITS' range
    top_k: int | None = None  # None: pair default; 0: no top-k
    max_new_tokens: int = CHAT_MAX_NEW_TOKENS
    drafters: dict[str, DrafterChoice] = field(default_factory=dict)  # pair name -> its drafter (absent: "pair")
    gamma: Gamma | None = None  # None: pair default; "auto": adaptive; int: fixed
    system_prompt: str = ""
    theme: str | None = None
    last_pair: str | None = None
    draft_from_history: bool = True  # the suffix drafter also matches earlier replies (read when a pair loads)

    def sampling(self) -> SamplingParams:
        """The request's sampling parameters (``None`` fields are resolved by the engine)."""
        return SamplingParams(
            temperature=self.temperature, top_k=self.top_k, top_p=self.top_p, max_new_tokens=self.max_new_tokens
        )

    def drafter_for(self, pair_name: str | None) -> DrafterChoice:
        """The drafter chosen for ``pair_name`` ("pair": its own; a choice for one pair never applies to another)."""
        return self.drafters.get(pair_name, "pair") if pair_name else "pair"

    def request_drafter(self, pair_name: str | None) -> DrafterName | None:
        """``GenerationRequest.drafter`` for a reply of ``pair_name``: None keeps the pair's drafter."""
        choice = self.drafter_for(pair_name)
        return None if choice == "pair" else choice

    def with_drafter(self, pair_name: str, choice: DrafterChoice) -> Settings:
        """These settings with ``choice`` for ``pair_name`` ("pair" removes the pair's entry)."""
        drafters = {name: value for name, value in self.drafters.items() if name != pair_name}
        if choice != "pair":
            drafters[pair_name] = choice
        return replace(self, drafters=drafters)


@dataclass(frozen=True, slots=True)
class DrafterOption:
    """One drafter as the settings list shows it for a pair."""

    name: str  # "pair" or a DrafterName
    label: str
    needs: str  # what it needs to run, or what it does
    unavailable: str | None = None  # why the pair cannot use it (None: it can)


# Label and what each drafter needs; a drafter the engine knows but this table does not is listed by its name.
DRAFTER_INFO: dict[str, tuple[str, str]] = {
    "none": ("Off", "plain decoding: one target pass a token"),
    "prompt-lookup": ("Prompt lookup", "needs nothing: copies text from the chat"),
    "suffix": ("Suffix tree", "needs nothing: the chat and earlier replies"),
    "draft-model": ("Draft model", "needs the pair's draft model"),
    "auto": ("Auto", "the engine picks the pair's best drafter"),
    "eagle3": ("EAGLE-3", "needs the pair's EAGLE-3 head"),
    "medusa": ("Medusa", "needs the pair's Medusa heads"),
    "prediction": ("Prediction", "needs a predicted output (an /edit's file)"),
}


def _unavailable(name: str, pair: Any) -> str | None:
    """Why ``pair`` (a PairConfig) cannot use drafter ``name``; None when it can, or when this cannot be told."""
    if getattr(pair, "remote", None) is not None:
        return "a remote pair: its server speculates itself"
    if name == "draft-model" and getattr(pair, "draft", None) is None:
        return f"needs a draft model; {pair.name} has none"
    if name in ("eagle3", "medusa") and hasattr(pair, name) and getattr(pair, name) is None:
        return f"{DRAFTER_INFO[name][1]}; {pair.name} has none"  # a pair config without the field: unknown
    return None


def drafter_options(pair: Any) -> list[DrafterOption]:
    """The settings' drafter list for ``pair`` (a PairConfig; None when no pair is loaded): the pair's own, then
    every drafter of ``backend/limits.py`` with what it needs and, when the pair cannot use it, why."""
    own = getattr(pair, "drafter", None)
    options = [DrafterOption("pair", f"Pair default ({own})" if own else "Pair default", "as models.yaml says")]
    for name in DRAFTERS:
        label, needs = DRAFTER_INFO.get(name, (name, ""))
        options.append(DrafterOption(name, label, needs, _unavailable(name, pair) if pair is not None else None))
    return options


def settings_path() -> Path:
    return config_dir() / SETTINGS_FILE


def _number(name: str, value: Any, kind: type) -> Any:
    """``value`` as a finite ``kind`` (a whole float such as 5.0 is an int); None stays None."""
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise SettingsError(f"setting {name!r}: expected a number, got {shown(value)}")
    if isinstance(value, float) and not math.isfinite(value):
        raise SettingsError(f"setting {name!r}: expected a finite number, got {value}")
    if kind is int:
        if isinstance(value, float) and not value.is_integer():
            raise SettingsError(f"setting {name!r}: expected a whole number, got {shown(value)}")
        if abs(value) > _MAX_WHOLE:
            raise SettingsError(f"setting {name!r}: {shown(value)} is too large (at most {_MAX_WHOLE})")
        return int(value)
    return float(value)


def _sampling(name: str, kind: type) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        value = _number(name, value, kind)
        ok, what = SAMPLING_LIMITS[name]  # the engine's ranges (backend/limits.py), said as it says them
        if value is not None and not ok(value):
            raise SettingsError(f"setting {name!r}: {shown(value)} is out of range: use {what}")
        return value

    return check


def _max_new_tokens(value: Any) -> int:
    number = _number("max_new_tokens", value, int)
    if number is None or not 1 <= number <= CHAT_MAX_NEW_TOKENS_LIMIT:
        raise SettingsError(f"setting 'max_new_tokens': {shown(number)} is outside 1 .. {CHAT_MAX_NEW_TOKENS_LIMIT}")
    return number


def _drafter(value: Any, name: str = "drafter", pair: str | None = None) -> str:
    if not isinstance(value, str) or value not in DRAFTER_CHOICES:
        where = f"setting {name!r}" if pair is None else f"setting {name!r}, pair {shown(pair)}"
        raise SettingsError(f"{where}: {shown(value)} is not one of {', '.join(DRAFTER_CHOICES)}")
    return value


def _drafters(value: Any) -> dict[str, str]:
    """{pair name: drafter choice}; a pair left at its own drafter has no entry."""
    if not isinstance(value, dict):
        raise SettingsError(f"setting 'drafters': expected an object of pair name -> drafter, got {shown(value)}")
    if len(value) > MAX_PAIR_CHOICES:
        raise SettingsError(f"setting 'drafters': {len(value):,} pairs (at most {MAX_PAIR_CHOICES:,})")
    out = {}
    for pair, choice in value.items():
        pair = _text("drafters", MAX_NAME_CHARS, optional=False, printable=True)(pair)
        choice = _drafter(choice, "drafters", pair)
        if choice != "pair":
            out[pair] = choice
    return out


def _gamma(value: Any) -> int | str | None:
    if value is None or value == "auto":
        return value
    number = _number("gamma", value, int)
    if not is_gamma(number):
        raise SettingsError(f"setting 'gamma': {shown(number)} is outside 1 .. {MAX_GAMMA} (or use 'auto')")
    return number


def _text(name: str, limit: int, *, optional: bool, printable: bool) -> Callable[[Any], Any]:
    def check(value: Any) -> Any:
        if value is None and optional:
            return None
        if not isinstance(value, str):
            raise SettingsError(f"setting {name!r}: expected text, got {shown(value)}")
        if len(value) > limit:
            raise SettingsError(f"setting {name!r}: {len(value):,} characters long (at most {limit:,})")
        if printable and not value.isprintable():
            raise SettingsError(f"setting {name!r}: {shown(value)} holds control characters; use a plain name")
        # A lone surrogate (JSON "\ud800") is not text: it cannot be drawn, saved as UTF-8 or tokenised.
        return value.encode("utf-8", "replace").decode("utf-8")

    return check


def _flag(name: str) -> Callable[[Any], bool]:
    def check(value: Any) -> bool:
        if not isinstance(value, bool):
            raise SettingsError(f"setting {name!r}: expected true or false, got {shown(value)}")
        return value

    return check


# One check per field: the value normalised, or SettingsError naming the field, the value and the accepted form.
_CHECKS: dict[str, Callable[[Any], Any]] = {
    "temperature": _sampling("temperature", float),
    "top_p": _sampling("top_p", float),
    "top_k": _sampling("top_k", int),
    "max_new_tokens": _max_new_tokens,
    "drafters": _drafters,
    "gamma": _gamma,
    "system_prompt": _text("system_prompt", MAX_SYSTEM_PROMPT_CHARS, optional=False, printable=False),
    "theme": _text("theme", MAX_NAME_CHARS, optional=True, printable=True),
    "last_pair": _text("last_pair", MAX_NAME_CHARS, optional=True, printable=True),
    "draft_from_history": _flag("draft_from_history"),
}


def validate_settings(settings: Settings) -> Settings:
    """Return ``settings`` with numbers normalised; raise :class:`SettingsError` on the first bad field."""
    return replace(settings, **{name: check(getattr(settings, name)) for name, check in _CHECKS.items()})


def _read(path: Path) -> tuple[Any, str | None]:
    """The file's JSON value, or (None, why it cannot be used). Never raises, never blocks on a pipe."""
    try:
        mode = path.stat().st_mode
        if not stat.S_ISREG(mode):
            kind = "a folder" if stat.S_ISDIR(mode) else "not a regular file"
            return None, f"is {kind}"
        with open(path, "rb") as handle:
            data = handle.read(MAX_SETTINGS_BYTES + 1)
    except OSError as error:
        return None, f"could not be read ({error.strerror or error})"
    if len(data) > MAX_SETTINGS_BYTES:
        return None, f"is larger than {MAX_SETTINGS_BYTES >> 20} MiB"
    try:
        text = data.decode("utf-8").removeprefix("\ufeff")  # a byte-order mark some editors add
    except UnicodeDecodeError as error:
        return None, f"is not UTF-8 text (byte {data[error.start]:#04x} at offset {error.start})"
    try:
        return parse_json(text, max_chars=MAX_SETTINGS_BYTES, non_finite=True), None  # the field is named below
    except InputError as error:
        return None, f"is not valid JSON ({error})"


def load_settings(path: Path | None = None) -> tuple[Settings, str | None]:
    """Read the settings file. Returns (settings, warning); a missing file is not a warning."""
    path = path or settings_path()
    remove_stale_temporaries(path)  # of a save that was killed
    if not os.path.lexists(path):
        return Settings(), None
    raw, problem = _read(path)
    if problem is None and not isinstance(raw, dict):
        problem = "does not hold a JSON object"
    if problem is not None:
        return Settings(), f"Settings file {path} {problem}; using the defaults."
    values, errors, bad = {}, [], []
    for name, check in _CHECKS.items():
        if name not in raw:  # unknown keys (a newer version's settings) are ignored rather than fatal
            continue
        try:
            values[name] = check(raw[name])
        except SettingsError as error:
            errors.append(str(error))
            bad.append(repr(name))
    if "drafter" in raw:  # an older file's one drafter for every pair: kept for the pair it was last used with
        try:
            legacy = _drafter(raw["drafter"])
        except SettingsError as error:
            errors.append(str(error))
            bad.append("'drafter'")
        else:
            last = values.get("last_pair")
            if legacy != "pair" and last and last not in values.get("drafters", {}):
                values["drafters"] = {**values.get("drafters", {}), last: legacy}
    if not errors:
        return Settings(**values), None
    more = f"; also bad: {', '.join(bad[3:])}" if len(errors) > 3 else ""
    return Settings(**values), (
        f"Settings file {path}: {'; '.join(errors[:3])}{more}; "
        f"{'that setting uses its' if len(errors) == 1 else 'those settings use their'} "
        "default."
    )


def _save_error(path: Path, error: OSError) -> SettingsError:
    if error.errno in (errno.ENOSPC, errno.EDQUOT):
        advice = "the disk is full: free some space and change a setting again"
    elif error.errno == errno.EROFS:
        advice = "the file system is read-only: set SPECCHAT_CONFIG_DIR to a writable folder"
    else:
        advice = "check the directory's permissions or set SPECCHAT_CONFIG_DIR"
    return SettingsError(
        f"could not save the settings to {path}: {error.strerror or error}; {advice}. The "
        "change applies to this session."
    )


def save_settings(settings: Settings, path: Path | None = None) -> None:
    """Write the settings atomically; :class:`SettingsError` if they cannot be written (read-only, disk full)."""
    path = path or settings_path()
    reason = read_only_reason(path)
    if reason is not None:
        raise SettingsError(
            f"the settings are not saved: {reason}. The change applies to this session; make it "
            "writable (chmod u+w) to keep settings."
        )
    text = json.dumps(asdict(settings), indent=2)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write_atomic(path, text, mode=0o600)
    except OSError as error:
        raise _save_error(path, error) from error
