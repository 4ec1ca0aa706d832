"""`specchat serve`'s HTTP server: the local engine behind the OpenAI chat completions API, standard library only
(``http.server.ThreadingHTTPServer``; a thread per connection, the engine in one owner thread).

Routes: ``POST /v1/chat/completions`` (streaming as server-sent events, or one JSON object), ``GET /v1/models``
(the served pair), ``GET /metrics`` (Prometheus text: requests by outcome, tokens, queue, per-position
acceptance; a reply's counts are added when it ends, from its RequestStats), ``GET /health``. Anything else is
a 404 JSON error; every error is an OpenAI-style JSON object naming the problem (app/serve/boundary.py), never
a traceback.

Contract: :class:`ServeConfig` holds the limits; :func:`make_server` binds (127.0.0.1 by default) and returns a
:class:`SpecchatServer` whose ``serve_forever()`` runs until ``shutdown()``; ``close()`` then stops the engine's
owner. With an API key every route asks for ``Authorization: Bearer KEY`` (401 otherwise). A request beyond the
queue gets 503 at once. A client that goes away (disconnect, a write that fails or times out) cancels its reply;
the engine stops at its next step. The engine is never touched outside its owner thread.
"""

from __future__ import annotations

import hmac
import logging
import select
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from specchat.app.serve import wire
from specchat.app.serve.boundary import DEFAULT_QUEUE, ApiError, ChatCall, Limits, parse_chat_request
from specchat.app.serve.owner import END, Busy, EngineOwner, Job, Metrics
from specchat.backend.api import EngineAPI, StepEvent
from specchat.backend.errors import SpecchatError

log = logging.getLogger(__name__)
POLL_S = 0.25  # how often a waiting request checks that its client is still there
SOCKET_TIMEOUT_S = 60.0  # a client that neither sends its request nor reads the reply for this long is dropped


@dataclass(frozen=True)
class ServeConfig:
    model: str  # the served pair's name: the only model id
    limits: Limits = field(default_factory=Limits)
    queue_size: int = DEFAULT_QUEUE
    api_key: str | None = None
    blocks_in_use: Any = None  # () -> int, the engine's KV blocks in use (shown in /metrics) when known


class SpecchatServer(ThreadingHTTPServer):
    daemon_threads = True
    allow_reuse_address = True
    # The listen backlog. socketserver's default, 5, is exceeded when many clients connect at once while the
    # accepting thread waits for the GIL behind decoding: the kernel then drops completed handshakes and a
    # client may see its connection reset instead of an answer (20 clients at once on a busy 2-core CPU).
    request_queue_size = 128

    def __init__(self, address: tuple[str, int], engine: EngineAPI, config: ServeConfig) -> None:
        self.config = config
        self.owner = EngineOwner(engine, queue_size=config.queue_size)
        self.metrics: Metrics = self.owner.metrics
        self.started = int(time.time())
        super().__init__(address, Handler)

    @property
    def served(self) -> Sequence[str]:
        return (self.config.model,)

    def close(self) -> None:
        self.server_close()
        self.owner.close()


def make_server(engine: EngineAPI, config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000) -> SpecchatServer:
    """Bind the server (``port`` 0: a free one; read ``server.server_address``)."""
    return SpecchatServer((host, port), engine, config)


class Handler(BaseHTTPRequestHandler):
    server: SpecchatServer
    protocol_version = "HTTP/1.1"
    # A request line http.server cannot parse is taken as HTTP/0.9, which gets no status line or headers:
    # answer such refusals as HTTP/1.1, so every client sees the status and the JSON error.
    default_request_version = "HTTP/1.1"
    timeout = SOCKET_TIMEOUT_S
    server_version = "specchat-serve"

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's signature
        log.info("%s %s", self.address_string(), format % args)

    # -- responses ----------------------------------------------------------------------------------------

    def _send_json(self, status: int, payload: Any, headers: dict[str, str] | None = None) -> None:
        body = wire.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.send_header("Connection", "close")
        for key, value in (headers or {}).items():
            self.send_header(key, value)
        self.end_headers()
        self.wfile.write(body)
        self.close_connection = True

    def send_error(self, code: int, message: str | None = None, explain: str | None = None) -> None:
        """http.server's own refusals (a malformed request line, an unknown method, too many headers) as JSON."""
        text = message or self.responses.get(code, ("error",))[0]
        try:
            self._send_json(code, ApiError(code, f"{text}; send an HTTP/1.1 GET or POST to /v1/...", None).body())
        except OSError:
            self.close_connection = True

    def _send_error(self, error: ApiError, headers: dict[str, str] | None = None) -> None:
        self._send_json(error.status, error.body(), headers)

    def _authorised(self) -> bool:
        key = self.server.config.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization", "")
        if given.startswith("Bearer ") and hmac.compare_digest(given[7:].strip().encode(), key.encode()):
            return True
        self.server.metrics.count("unauthorised")
        self._send_error(
            ApiError(
                401,
                "missing or wrong API key: send the header 'Authorization: Bearer <key>' "
                "with the key the server was started with",
                "Authorization",
                "authentication_error",
            ),
            {"WWW-Authenticate": "Bearer"},
        )
        return False

    # -- routes -------------------------------------------------------------------------------------------

    def do_GET(self) -> None:  # noqa: N802 - http.server's name
        if not self._authorised():
            return
        path = self.path.split("?", 1)[0]
        if path in ("/v1/models", "/models"):
            data = [
                {"id": m, "object": "model", "created": self.server.started, "owned_by": "specchat"}
                for m in self.server.served
            ]
            self._send_json(200, {"object": "list", "data": data})
        elif path == "/metrics":
            body = self._metrics().encode()
            self.send_response(200)
            self.send_header("Content-Type", "text/plain; version=0.0.4")
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Connection", "close")
            self.end_headers()
            self.wfile.write(body)
            self.close_connection = True
        elif path == "/health":
            self._send_json(200, {"status": "ok", "waiting": self.server.owner.waiting})
        else:
            self._send_error(
                ApiError(404, f"no route GET {path[:100]}; use /v1/models, /metrics or /health", "path", "not_found")
            )

    def do_POST(self) -> None:  # noqa: N802 - http.server's name
        if not self._authorised():
            return
        path = self.path.split("?", 1)[0]
        if path not in ("/v1/chat/completions", "/chat/completions"):
            self._send_error(
                ApiError(404, f"no route POST {path[:100]}; use /v1/chat/completions", "path", "not_found")
            )
            return
        try:
            call = parse_chat_request(self._body(), self.server.served, self.server.config.limits)
        except ApiError as error:
            self.server.metrics.count("invalid")
            self._send_error(error)
            return
        try:
            job = self.server.owner.submit(call.request)
        except Busy:
            self.server.metrics.count("rejected")
            size = self.server.config.queue_size
            self._send_error(
                ApiError(
                    503,
                    f"the server is busy: {size} requests are already waiting for the "
                    f"engine (its queue holds {size}); retry in a moment",
                    None,
                    "server_busy",
                ),
                {"Retry-After": "1"},
            )
            return
        try:
            self._answer(call, job)
        finally:
            job.cancel.set()  # whatever happened here, the engine stops working for this request

    def _body(self) -> bytes:
        if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
            raise ApiError(411, "chunked request bodies are not accepted; send Content-Length", "Content-Length")
        length_text = self.headers.get("Content-Length")
        if length_text is None or not length_text.strip().isdigit():
            raise ApiError(411, "the request needs a Content-Length header", "Content-Length")
        length, limit = int(length_text), self.server.config.limits.max_body_bytes
        if length > limit:
            self._discard(length)  # read it, so that the client gets the answer and not a reset connection
            raise ApiError(
                413,
                f"the request body has {length} bytes; this server takes at most {limit} (--max-body-bytes)",
                "body",
            )
        return self.rfile.read(length)

    def _discard(self, length: int, most: int = 16 << 20) -> None:
        left = min(length, most)
        while left > 0:
            chunk = self.rfile.read(min(left, 1 << 16))
            if not chunk:
                return
            left -= len(chunk)

    # -- one reply ----------------------------------------------------------------------------------------

    def _client_gone(self) -> bool:
        try:
            readable, _, _ = select.select([self.connection], [], [], 0)
            return bool(readable) and self.connection.recv(1, socket.MSG_PEEK) == b""
        except (OSError, ValueError):
            return True

    def _next(self, job: Job) -> Any:
        while True:
            try:
                return job.events.get(timeout=POLL_S)
            except Exception:  # noqa: BLE001 - queue.Empty: check the client, then wait on
                if self._client_gone():
                    job.cancel.set()
                    return None

    def _answer(self, call: ChatCall, job: Job) -> None:
        call_id, created = wire.new_id(), int(time.time())
        stream_started, first = False, True
        text: list[str] = []
        ids: list[int] = []
        last: StepEvent | None = None
        try:
            while True:
                item = self._next(job)
                if item is None:  # the client left while waiting
                    self.server.metrics.finished(None, "cancelled")
                    return
                if item is END:
                    break
                if isinstance(item, Exception):
                    raise item
                event: StepEvent = item
                last = event if event.finish_reason is not None else last
                if call.stream:
                    if not stream_started:
                        self._start_stream()
                        stream_started = True
                    if event.text or event.token_ids or event.finish_reason is not None:
                        payload = wire.chunk(
                            call_id, call.model, created, event, token_ids=call.return_token_ids, first=first
                        )
                        first = False
                        self.wfile.write(wire.sse(payload))
                        self.wfile.flush()
                text.append(event.text)
                ids.extend(event.token_ids)
            if last is None:  # the engine ended without a last event: report it as an error
                raise SpecchatError("the engine stopped without finishing the reply")
            if call.stream:
                if not stream_started:
                    self._start_stream()
                if call.include_usage:
                    self.wfile.write(wire.sse(wire.usage_chunk(call_id, call.model, created, last)))
                self.wfile.write(wire.sse("[DONE]"))
                self.wfile.flush()
            else:
                self._send_json(
                    200,
                    wire.completion(call_id, call.model, "".join(text), ids if call.return_token_ids else None, last),
                )
            self.server.metrics.finished(last.stats, "ok" if last.finish_reason != "error" else "error")
        except (BrokenPipeError, ConnectionResetError, TimeoutError):
            job.cancel.set()
            self.server.metrics.finished(last.stats if last else None, "cancelled")
            self.close_connection = True
        except Exception as error:  # noqa: BLE001 - the engine's error, answered as JSON (logged when a bug)
            self.server.metrics.finished(None, "error")
            user = isinstance(error, SpecchatError)
            if not user:
                log.error("unexpected error in a reply", exc_info=error)
            message = str(error) if user else f"internal error ({type(error).__name__}); see the server's log"
            api_error = ApiError(
                400 if user else 500, message, None, "invalid_request_error" if user else "server_error"
            )
            try:
                if stream_started:
                    self.wfile.write(wire.sse(api_error.body()))
                    self.wfile.flush()
                else:
                    self._send_error(api_error)
            except OSError:
                pass
            self.close_connection = True

    def _start_stream(self) -> None:
        self.send_response(200)
        self.send_header("Content-Type", "text/event-stream")
        self.send_header("Cache-Control", "no-cache")
        self.send_header("Connection", "close")
        self.end_headers()
        self.close_connection = True

    def _metrics(self) -> str:
        snap = self.server.metrics.snapshot()
        lines = ["# TYPE specchat_requests_total counter"]
        for outcome in ("ok", "error", "cancelled", "rejected", "invalid", "unauthorised"):
            lines.append(f'specchat_requests_total{{outcome="{outcome}"}} {snap["requests"].get(outcome, 0)}')
        lines.append("# TYPE specchat_tokens_total counter")
        for kind, value in snap["tokens"].items():
            lines.append(f'specchat_tokens_total{{kind="{kind}"}} {value}')
        lines += [
            "# TYPE specchat_queue_waiting gauge",
            f"specchat_queue_waiting {self.server.owner.waiting}",
            "# TYPE specchat_requests_running gauge",
            f"specchat_requests_running {self.server.owner.running}",
        ]
        lines.append("# TYPE specchat_spec_decode_num_accepted_tokens_per_pos_total counter")
        for pos, value in sorted(snap["accepted_per_position"].items()):
            lines.append(f'specchat_spec_decode_num_accepted_tokens_per_pos_total{{position="{pos}"}} {value}')
        lines.append("# TYPE specchat_spec_decode_num_reached_per_pos_total counter")
        for pos, value in sorted(snap["reached_per_position"].items()):
            lines.append(f'specchat_spec_decode_num_reached_per_pos_total{{position="{pos}"}} {value}')
        blocks = self.server.config.blocks_in_use
        if blocks is not None:
            lines += ["# TYPE specchat_kv_blocks_in_use gauge", f"specchat_kv_blocks_in_use {blocks()}"]
        return "\n".join(lines) + "\n"
