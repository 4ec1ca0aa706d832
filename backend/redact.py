"""What specchat shows of text it did not write: secrets masked, terminal controls stripped. A leaf (standard
library only), used at every boundary where a file's or a server's text reaches a message, a listing, a log or
the UI.

Contract:

- :func:`mask_url` is a URL fit for any message or listing: the password of ``user:password@`` and every query
  value become ``***`` (a server URL in models.yaml may carry credentials either way); the scheme, user name,
  host, port and path stay, so the user still recognises the server. :func:`url_secrets` are those values.
- :class:`Secrets` masks configured secrets (a remote pair's API key, its URL's password and query values) in
  any text, as given and percent-encoded: what a server sends back may echo them ("invalid key: Bearer sk-…").
  Values under :data:`MIN_SECRET` characters are not masked (a ``?v=1`` would mask every "1").
- :func:`terminal_safe` removes what a terminal acts on: whole escape sequences (CSI such as colour codes, OSC
  such as a window title, DCS/APC/PM/SOS strings, two-character ESC sequences, their 8-bit C1 forms), then any
  C0 control left except tab and newline (so ESC, carriage return, backspace, bell), DEL and the C1 controls
  U+0080-U+009F. A sequence split across two pieces of a stream loses its ESC in the first, so no piece ever
  carries a control; only its printable tail may show. :func:`one_line` also folds line breaks and tabs and
  bounds the length. Mask after stripping: a control inside a secret must not hide it from the mask.
"""

from __future__ import annotations

import re
from collections.abc import Iterable
from urllib.parse import quote, urlsplit, urlunsplit

MASK = "***"
MIN_SECRET = 4
_SEQUENCES = re.compile(
    r"\x1b\[[0-?]*[ -/]*[@-~]"  # CSI: ESC [ parameters intermediates final
    r"|\x9b[0-?]*[ -/]*[@-~]"  # 8-bit CSI
    r"|(?:\x1b[\]PX^_]|[\x9d\x90\x98\x9e\x9f])[^\x07\x1b\x9c]*(?:\x07|\x1b\\|\x9c)?"  # OSC, DCS, SOS, PM, APC
    r"|\x1b[ -/]*[0-~]"  # other ESC sequences (charset, keypad mode, reset ...)
)
_CONTROLS = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def mask_url(url: str) -> str:
    """``url`` with its password and query values masked (see the module docstring)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return "<a URL that does not parse>"
    netloc = parts.netloc
    if "@" in netloc:
        user, _, host = netloc.rpartition("@")
        name, colon, _ = user.partition(":")
        netloc = f"{name}:{MASK}@{host}" if colon else f"{name}@{host}"
    pairs = parts.query.split("&") if parts.query else []
    query = "&".join(f"{p.partition('=')[0]}={MASK}" if "=" in p else p for p in pairs)
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))


def url_secrets(url: str) -> list[str]:
    """The password and the query values of ``url`` (what :func:`mask_url` hides)."""
    try:
        parts = urlsplit(url)
    except ValueError:
        return []
    found = [parts.password or ""]
    found += [p.partition("=")[2] for p in parts.query.split("&") if "=" in p]
    return [s for s in found if s]


class Secrets:
    """Configured secret values, masked wherever they appear in a text (see the module docstring)."""

    def __init__(self, values: Iterable[str | None] = ()) -> None:
        found = {v for v in values if v and len(v) >= MIN_SECRET}
        found |= {quote(v, safe="") for v in found}
        self.values = sorted(found, key=len, reverse=True)  # the longest first: a secret holding another

    def mask(self, text: str) -> str:
        for value in self.values:
            if value in text:
                text = text.replace(value, MASK)
        return text

    def __add__(self, other: Secrets) -> Secrets:
        return Secrets([*self.values, *other.values])


def terminal_safe(text: str) -> str:
    """``text`` without what a terminal acts on (see the module docstring); tab and newline stay."""
    return _CONTROLS.sub("", _SEQUENCES.sub("", text))


def one_line(text: str, most: int = 400) -> str:
    """Text for a one-line message: terminal-safe, line breaks folded, at most ``most`` characters."""
    text = " ".join(terminal_safe(text).split())
    return text if len(text) <= most else text[: most - 1] + "…"
