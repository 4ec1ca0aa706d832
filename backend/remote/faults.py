"""What a remote pair's server may do wrong, said in one line a user can act on; and server text made safe to show.

Contract:

- :func:`shown_url` is a server URL fit for any message: a password in it (``user:password@``) and the values
  of its query string become ``***``; :func:`redact` does the same to any text that may quote the URL or the
  password (an exception's message) and the pair's API key (:func:`pair_secrets`: a server may echo it in an
  error). No message of backend/remote shows a URL or a server's text otherwise.
- Server text is made terminal-safe by the shared helper (``backend/redact.terminal_safe``: escape sequences and
  control characters stripped); :func:`one_line` also folds line breaks and bounds the length.
- :func:`http_error` and :func:`network_error` build the :class:`RemoteError` for a non-2xx answer and for a
  fault of the network or the HTTP exchange (connect, TLS, DNS, timeouts, a reset, a broken or lying answer, a
  body that does not decompress), naming the server (:func:`shown_url`) and what to check; never a traceback.
"""

from __future__ import annotations

import json
import os
import socket
import ssl
from collections.abc import Mapping

import httpx

from specchat.backend.errors import RemoteError
from specchat.backend.models.catalog.config import RemoteSpec
from specchat.backend.redact import Secrets, mask_url, terminal_safe, url_secrets
from specchat.backend.redact import one_line as _one_line

MAX_SHOWN = 400  # characters of a server's text in one message


def shown_url(url: str) -> str:
    """``url`` with the password of its user part and its query values masked (see the module docstring)."""
    return terminal_safe(mask_url(url))


def pair_secrets(spec: RemoteSpec) -> Secrets:
    """What a remote pair must never show: its API key (read from ``api_key_env`` now), its URL's password and
    query values."""
    key = os.environ.get(spec.api_key_env) if spec.api_key_env else None
    return Secrets([key, *url_secrets(spec.server)])


def redact(text: str, spec: RemoteSpec) -> str:
    """``text`` terminal-safe, with the pair's URL shown masked and every secret of the pair replaced by ***."""
    text = terminal_safe(text).replace(spec.server, shown_url(spec.server))
    return pair_secrets(spec).mask(text)


def one_line(text: str, most: int = MAX_SHOWN) -> str:
    """A server's text for a one-line message: terminal-safe, line breaks folded, at most ``most`` characters."""
    return _one_line(text, most)


def error_text(body: bytes, content_type: str, reason: str) -> str:
    """The message of an error answer's (capped) body: an OpenAI-style JSON error's message, else its text; an
    HTML page is named as one instead of shown."""
    if "html" in content_type.lower() or body.lstrip()[:15].lower().startswith((b"<!doctype", b"<html")):
        return "an HTML page, not the API's JSON"
    text = body.decode("utf-8", "replace")
    try:
        data = json.loads(text)
    except (ValueError, RecursionError):
        return _capped(text) or reason
    if isinstance(data, Mapping):
        error = data.get("error", data.get("detail", data.get("message")))
        if isinstance(error, Mapping):
            error = error.get("message", error)
        if error is not None:
            return _capped(str(error))
    return _capped(str(data)) or reason


def _capped(text: str) -> str:
    """A server's text bounded, but not yet cut to a message's length: the caller masks secrets first."""
    return " ".join(terminal_safe(text[: MAX_SHOWN * 8]).split())


def http_error(spec: RemoteSpec, pair_name: str, status: int, text: str) -> RemoteError:
    """A RemoteError for a non-2xx answer, saying what to do about each common status."""
    server = shown_url(spec.server)
    text = one_line(redact(text, spec))
    where = f"pair '{pair_name}': {server} answered {status}"
    if status in (401, 403):
        env = spec.api_key_env
        fix = f"check the key in {env}" if env else "set api_key_env: VAR in the pair and export VAR=<the key>"
        return RemoteError(f"{where} (API key refused: {text}); {fix}")
    if status == 404:
        return RemoteError(
            f"{where} ({text}); check the pair's server URL (it ends in /v1) and model "
            f"'{one_line(spec.model, 80)}' against GET {server}/models"
        )
    if status in (429, 503):
        return RemoteError(f"{where} (busy: {text}); try again in a moment")
    if status >= 500:
        return RemoteError(f"{where} (a server error: {text}); check the server's log")
    return RemoteError(f"{where}: {text}")


def _cause(error: BaseException, kind: type[BaseException]) -> BaseException | None:
    seen = 0
    current: BaseException | None = error
    while current is not None and seen < 10:
        if isinstance(current, kind):
            return current
        current, seen = current.__cause__ or current.__context__, seen + 1
    return None


def describe(error: BaseException) -> str:
    """What went wrong on the wire, in a few words (for a reply that broke off mid-stream)."""
    if isinstance(error, httpx.ReadTimeout):
        return "stopped answering"
    if isinstance(error, httpx.DecodingError):
        return "sent a body that does not decompress (a wrong Content-Encoding)"
    if isinstance(error, httpx.RemoteProtocolError):
        return "broke the HTTP exchange (a wrong Content-Length or a closed connection)"
    if isinstance(error, (httpx.ReadError, ConnectionError)):
        return "closed the connection"
    return f"failed ({type(error).__name__})"


def network_error(spec: RemoteSpec, pair_name: str, error: BaseException) -> RemoteError:
    """A fault before the answer came (see the module docstring), as one line naming what to check."""
    server = shown_url(spec.server)
    where = f"pair '{pair_name}': {server}"
    detail = one_line(redact(str(error), spec), 160) or type(error).__name__
    if _cause(error, ssl.SSLError) is not None:
        return RemoteError(
            f"{where}: the TLS handshake failed ({detail}); check http:// against https:// in the URL and the "
            "server's certificate"
        )
    if _cause(error, socket.gaierror) is not None:
        return RemoteError(f"{where}: the host name does not resolve ({detail}); check the URL's host")
    if isinstance(error, httpx.ConnectTimeout):
        return RemoteError(f"{where} did not accept a connection in time; is the host up and the port right?")
    if isinstance(error, httpx.ConnectError):
        return RemoteError(
            f"pair '{pair_name}': cannot reach {server} ({detail}); is the server running and the URL right?"
        )
    if isinstance(error, (httpx.UnsupportedProtocol, httpx.InvalidURL)):
        return RemoteError(f"{where}: not a URL specchat can use ({detail}); write http://host:port/v1")
    if isinstance(error, httpx.TimeoutException):
        return RemoteError(f"{where} did not answer in time ({type(error).__name__}); check the server")
    if isinstance(error, (httpx.WriteError, httpx.RemoteProtocolError, httpx.ReadError)):
        return RemoteError(
            f"{where} closed the connection or did not answer in HTTP ({detail}); check that the URL's port "
            "is the API's and its scheme (http or https) is right"
        )
    if isinstance(error, httpx.DecodingError):
        return RemoteError(f"{where} sent a body that does not decompress ({detail}); check the server or a proxy")
    return RemoteError(f"{where}: the request failed ({type(error).__name__}: {detail}); check the server and URL")
