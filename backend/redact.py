"""Secrets kept out of what specchat shows: a leaf (standard library only).

Contract: :func:`mask_url` is a URL fit for any message or listing: the password of ``user:password@`` and
every query value become ``***`` (a server URL in models.yaml may carry credentials either way); the scheme,
user name, host, port and path stay, so the user still recognises the server.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit


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
        netloc = f"{name}:***@{host}" if colon else f"{name}@{host}"
    pairs = parts.query.split("&") if parts.query else []
    query = "&".join(f"{p.partition('=')[0]}=***" if "=" in p else p for p in pairs)
    return urlunsplit((parts.scheme, netloc, parts.path, query, ""))
