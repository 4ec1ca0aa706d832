"""One streamed reply of a remote pair, read safely: server-sent events under byte caps, each chunk turned into a
:class:`~specchat.backend.api.StepEvent`, with the token limit enforced here.

Contract:

- :func:`capped_lines` splits a byte stream into lines (``\\n``, a ``\\r`` before it dropped; UTF-8, bad bytes
  replaced) and raises :class:`TooLarge` when a line passes ``max_line`` bytes or the stream ``max_total``:
  nothing a server sends can grow memory past those. :func:`sse_data` joins ``data:`` lines into events up to
  ``[DONE]``.
- :class:`ReplyState` reads each event (untrusted JSON: wrong types are ignored, never raised): text and token
  ids through ``clean`` (terminal-safe, the pair's secrets masked), the server's statistics, the finish
  reason, an error chunk. It counts the reply's tokens (ids when the server gives them, else one per chunk with
  text, which is never more than the tokens) and marks the reply over once they pass ``max_new_tokens``: a
  server that streams on regardless is cut there (finish ``length``, with a message saying so).
- :meth:`ReplyState.watch` ends a stream that carries :data:`MAX_BYTES_WITHOUT_TOKEN` bytes without a token
  (endless keep-alives or empty chunks) with :class:`TooLarge`.
- :meth:`ReplyState.last` is the reply's last event: ``cancelled``, ``error`` (with a one-line message naming the
  server and keeping the partial reply) or the finish reason the server gave.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from specchat.backend.api import FinishReason, PolicyState, RequestStats, StepEvent, TokenSource
from specchat.backend.redact import terminal_safe
from specchat.backend.remote.faults import one_line
from specchat.backend.remote.passthrough import read_logprobs
from specchat.backend.remote.stats import PREDICTION_FIELDS, remote_stats, server_figures

MAX_LINE_BYTES = 1 << 20  # one server-sent event line
MAX_BYTES_WITHOUT_TOKEN = 1 << 20  # of a stream between two tokens (keep-alive comments, empty chunks)
MAX_ERROR_CHARS = 400


class TooLarge(Exception):
    """A line or a whole answer over its byte cap."""


def capped_lines(chunks: Iterator[bytes], *, max_line: int, max_total: int) -> Iterator[str]:
    """The lines of a byte stream, under caps (see the module docstring)."""
    buffer = bytearray()
    total = 0
    for chunk in chunks:
        total += len(chunk)
        if total > max_total:
            raise TooLarge(f"the answer passed {max_total:,} bytes")
        buffer += chunk
        start = 0
        while (end := buffer.find(b"\n", start)) >= 0:
            yield bytes(buffer[start:end]).removesuffix(b"\r").decode("utf-8", "replace")
            start = end + 1
        del buffer[:start]
        if len(buffer) > max_line:
            raise TooLarge(f"a line passed {max_line:,} bytes")
    if buffer:
        yield bytes(buffer).removesuffix(b"\r").decode("utf-8", "replace")


def sse_data(lines: Iterator[str]) -> Iterator[str]:
    """The data of each server-sent event (``data:`` lines joined by newlines; comments and other fields
    skipped), up to ``[DONE]``."""
    data: list[str] = []
    for line in lines:
        if line == "":
            if data:
                payload, data = "\n".join(data), []
                if payload.strip() == "[DONE]":
                    return
                yield payload
        elif line.startswith("data:"):
            data.append(line[5:].removeprefix(" "))
    if data and "\n".join(data).strip() != "[DONE]":
        yield "\n".join(data)


def _finish(reason: Any, stop_reason: Any) -> FinishReason:
    if reason == "length":
        return "length"
    if reason == "stop" and isinstance(stop_reason, str):
        return "stop"
    return "eos" if reason in ("stop", "tool_calls", "eos") else "stop"


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


OWN_FINISH = ("eos", "stop", "length", "context", "cancelled", "error")


class ReplyState:
    """One streaming reply's state: the chunks read so far, turned into StepEvents."""

    def __init__(
        self,
        pair_name: str,
        server: str,
        t0: float,
        notice: str | None,
        max_new_tokens: int,
        *,
        predicted: bool = False,
        clean: Callable[[str], str] = terminal_safe,
    ) -> None:
        self.clean = clean  # every text of the server passes here: terminal-safe, the pair's secrets masked
        self.pair_name, self.server, self.t0, self.notice = pair_name, server, t0, notice
        self.predicted = predicted  # a prediction was sent: its usage counts are kept (OpenAI reports 0s always)
        self.max_new_tokens = max_new_tokens
        self.figures: dict[str, Any] = {}
        self.counted = 0  # token ids seen
        self.emitted = 0  # tokens emitted: ids, else one per chunk with text
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.finish: FinishReason | None = None
        self.failed: str | None = None
        self.over = False  # the server sent more than max_new_tokens: cut here
        self.drafter = "server"
        self.since_token = 0  # bytes read since the last token

    def watch(self, lines: Iterator[str]) -> Iterator[str]:
        """``lines``, counting the bytes between tokens: TooLarge past :data:`MAX_BYTES_WITHOUT_TOKEN`."""
        for line in lines:
            self.since_token += len(line) + 1
            if self.since_token > MAX_BYTES_WITHOUT_TOKEN:
                raise TooLarge(f"{MAX_BYTES_WITHOUT_TOKEN:,} bytes without a token")
            yield line

    def stats(self) -> RequestStats:
        wall = (self.t_last or time.perf_counter()) - self.t0
        ttft = None if self.t_first is None else self.t_first - self.t0
        figures = self.figures
        if self.over:  # the server's own count includes what was cut
            figures = {k: v for k, v in figures.items() if k != "new_tokens"}
        if not self.predicted:
            figures = {k: v for k, v in figures.items() if k not in PREDICTION_FIELDS}
        figures = {k: one_line(self.clean(v), 80) if isinstance(v, str) else v for k, v in figures.items()}
        return remote_stats(
            figures,
            wall_s=wall,
            ttft_s=ttft,
            counted_tokens=self.counted,
            drafter=one_line(self.clean(str(figures.get("drafter", self.drafter))), 40),
        )

    @property
    def done(self) -> bool:
        """No more chunks are wanted: the reply failed or reached its token limit."""
        return self.failed is not None or self.over

    def chunk(self, data: str) -> StepEvent | None:
        try:
            chunk = json.loads(data)
        except (json.JSONDecodeError, RecursionError):
            self.failed = f"{self.server} sent a chunk that is not JSON: {one_line(self.clean(repr(data[:120])), 140)}"
            return None
        if not isinstance(chunk, dict):
            return None
        if "error" in chunk:  # vLLM and others report a failure mid-stream as a chunk
            error = chunk["error"]
            text = one_line(self.clean(str(error.get("message", error) if isinstance(error, Mapping) else error)))
            self.failed = f"{self.server} reported an error: {text}"
            return None
        self.figures.update(server_figures(chunk))
        own: Mapping[str, Any] = _mapping(chunk.get("specchat"))
        choices = chunk.get("choices")
        choice: Mapping[str, Any] = _mapping(choices[0] if isinstance(choices, list) and choices else None)
        content = _mapping(choice.get("delta")).get("content")
        if content is None:  # a whole (non-streamed) completion answered to a stream request
            content = _mapping(choice.get("message")).get("content")
        text = self.clean(content) if isinstance(content, str) else ""
        raw_ids = choice.get("token_ids")
        ids = [t for t in raw_ids if type(t) is int] if isinstance(raw_ids, list) else []
        if choice.get("finish_reason") is not None:
            reason = own.get("finish_reason")
            if reason not in OWN_FINISH:
                reason = _finish(choice.get("finish_reason"), choice.get("stop_reason"))
            self.finish = reason
        if not text and not ids:
            return None
        room = self.max_new_tokens - self.emitted
        if room <= 0:
            self.over = True
            return None
        if len(ids) > room:
            ids, text = ids[:room], ""  # the text of the cut tokens is not known apart: keep none of it
            self.over = True
        self.emitted += len(ids) or 1
        self.since_token = 0
        event = self._event(own, ids, text)
        event.logprobs = read_logprobs(choice, ids)
        return event

    def _event(self, own: Mapping[str, Any], ids: list[int], text: str) -> StepEvent:
        now = time.perf_counter()
        first = self.t_first is None
        if first:
            self.t_first = now
        self.t_last = now
        self.counted += len(ids)
        sources, texts = self._tokens(own, ids, text)
        message, self.notice = self.notice, None
        policy, gamma, accepted = own.get("policy"), own.get("gamma"), own.get("accepted")
        return StepEvent(
            token_ids=ids,
            sources=sources,
            token_texts=texts,
            text=text,
            gamma=gamma if isinstance(gamma, int) else 0,
            accepted=accepted if isinstance(accepted, int) else 0,
            draft_s=0.0,
            verify_s=0.0,
            overhead_s=0.0,
            policy=PolicyState(policy) if policy in ("speculating", "paused", "off") else PolicyState.OFF,
            drafter=one_line(self.clean(str(self.figures.get("drafter", self.drafter))), 40),
            is_prefill=first,
            message=message,
            stats=self.stats(),
        )

    def _tokens(self, own: Mapping[str, Any], ids: list[int], text: str) -> tuple[list[TokenSource], list[str]]:
        sources, texts = own.get("sources"), own.get("token_texts")
        if (
            isinstance(sources, list)
            and isinstance(texts, list)
            and len(sources) == len(texts) == len(ids)
            and all(s in (0, 1, 2, 3) for s in sources)
            and all(isinstance(t, str) for t in texts)
            and "".join(self.clean(t) for t in texts) == text
        ):
            return [TokenSource(s) for s in sources], [self.clean(t) for t in texts]
        return [TokenSource.TARGET] * len(ids), [""] * (len(ids) - 1) + [text] if ids else []

    def broken(self, what: str) -> None:
        self.failed = f"{self.server} {what} mid-reply"

    def last(self, cancelled: bool) -> StepEvent:
        server = self.server
        reason: FinishReason
        message: str | None = None
        if cancelled:
            reason = "cancelled"
        elif self.failed is not None:
            reason, message = "error", f"pair '{self.pair_name}': {self.failed}; the partial reply is kept"
        elif self.over:
            reason = "length"
            message = (
                f"pair '{self.pair_name}': {server} sent more than the {self.max_new_tokens} tokens asked for; "
                "the reply was cut there"
            )
        elif self.finish is None:
            reason = "error"
            message = (
                f"pair '{self.pair_name}': {server} ended the stream without finishing the reply (the "
                "server may have stopped); the partial reply is kept"
            )
        else:
            reason = self.finish
        return StepEvent(
            token_ids=[],
            sources=[],
            token_texts=[],
            text="",
            gamma=0,
            accepted=0,
            draft_s=0.0,
            verify_s=0.0,
            overhead_s=0.0,
            policy=PolicyState.OFF,
            drafter=one_line(self.clean(str(self.figures.get("drafter", self.drafter))), 40),
            finish_reason=reason,
            message=message,
            stats=self.stats(),
        )
