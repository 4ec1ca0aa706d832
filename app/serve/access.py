"""`specchat serve`'s access log: one line per request, written when its answer ends (or its client left).

Contract: :class:`AccessLog` wraps the ASGI app; each HTTP request gets an :class:`Entry` in its scope
(``scope[ENTRY]``) that the route fills in (tokens, outcome, the prompt when asked for) and that is written as

    2026-05-01T12:00:00 127.0.0.1:53412 "POST /v1/chat/completions" 200 ok tokens=31+48 1.204s

to the logger ``specchat.serve.access`` (app/cli/serve.py sends it to stderr or a file): the time, the client's
address and port, method and path, the HTTP status (499 when the client left before its answer), the outcome
(ok, cancelled, error, invalid, rejected, unauthorised, client-left), prompt + completion tokens when the engine
ran, and the time from the request head to the answer's end. The prompt's text is never written unless the
server was started with ``--log-prompts``: then ``prompt="..."`` (the last user message, JSON-escaped, at most
:data:`PROMPT_CHARS` characters). A path or prompt can hold no line break nor terminal escape: both are
escaped. Refusals before any request (a malformed head, a connection over the limit, a head timeout) are
written by :func:`refused` in the same shape.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("specchat.serve.access")
ENTRY = "specchat.access"  # the scope key of a request's Entry
PROMPT_CHARS = 500


@dataclass
class Entry:
    client: str
    method: str
    path: str
    started: float = field(default_factory=time.monotonic)
    status: int = 0  # 0 until the answer starts
    outcome: str = ""
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    prompt: str | None = None  # only with --log-prompts

    def line(self) -> str:
        status = self.status or 499
        outcome = self.outcome or ("ok" if status < 400 else "client-left" if status == 499 else "invalid")
        parts = [
            time.strftime("%Y-%m-%dT%H:%M:%S"),
            self.client,
            f'"{_escape(self.method, 16)} {_escape(self.path, 200)}"',
            str(status),
            outcome,
        ]
        if self.prompt_tokens is not None or self.completion_tokens is not None:
            parts.append(f"tokens={self.prompt_tokens or 0}+{self.completion_tokens or 0}")
        parts.append(f"{time.monotonic() - self.started:.3f}s")
        if self.prompt is not None:
            shown = self.prompt if len(self.prompt) <= PROMPT_CHARS else self.prompt[: PROMPT_CHARS - 1] + "…"
            parts.append("prompt=" + json.dumps(shown, ensure_ascii=True))
        return " ".join(parts)


def _escape(text: str, most: int) -> str:
    text = text if len(text) <= most else text[: most - 1] + "…"
    return "".join('\\"' if c == '"' else c if c.isprintable() else repr(c)[1:-1] for c in text)


def _client(scope: dict[str, Any]) -> str:
    client = scope.get("client")
    return f"{client[0]}:{client[1]}" if client else "-"


def refused(client: str, status: int, why: str) -> None:
    """The line of a connection refused before any request was read (app/serve/protocol.py)."""
    log.info('%s %s "- -" %d invalid %s', time.strftime("%Y-%m-%dT%H:%M:%S"), client, status, _escape(why, 120))


class AccessLog:
    """ASGI middleware writing one :class:`Entry` line per HTTP request (see the module docstring)."""

    def __init__(self, app: Any) -> None:
        self.app = app

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        entry = Entry(_client(scope), scope.get("method", "-"), scope.get("path", "-"))
        scope[ENTRY] = entry

        async def logged_send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start" and not entry.status:
                entry.status = int(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, logged_send)
        finally:
            log.info("%s", entry.line())
