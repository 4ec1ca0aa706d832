"""`specchat serve`'s routes (a Starlette app): the OpenAI chat completions API over the engine's one owner.

Routes: ``POST /v1/chat/completions`` (also ``/chat/completions``: server-sent events or one JSON object) and
``POST /v1/completions`` (also ``/completions``: a prompt continued, app/serve/completions.py),
``GET /v1/models`` (also ``/models``), ``GET /metrics`` (Prometheus text; a reply's counts are added when it
ends, from its RequestStats), ``GET /health``; any other path or method is a JSON 404 / 405. Every error is the
OpenAI-style JSON object (app/serve/boundary.py), never a traceback; a bug is answered 500 and logged once.

Contract of one chat request: the API key (when set) is checked first (401); the body is read within
``config.body_timeout_s`` (408) up to ``limits.max_body_bytes`` (413, from ``Content-Length`` or counted); then
checked (boundary.py); then queued (429 when full). Nothing is written until the engine's first event: an error
the engine raises for the request is a JSON 400. The handler waits on the event loop, never in a thread (the
owner calls ``notify`` after each event). A client that goes away (app/serve/protocol.py) cancels its job,
waiting or running; a half-closed client is not gone. Each request fills its access-log entry (access.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hmac
import logging
import queue
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from typing import Any, Protocol

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect, Request
from starlette.responses import Response
from starlette.routing import Route

from specchat.app.serve import structured, wire
from specchat.app.serve.access import ENTRY, AccessLog, Entry
from specchat.app.serve.boundary import ApiError, ChatCall
from specchat.app.serve.completions import parse_call
from specchat.app.serve.config import ServeConfig
from specchat.app.serve.owner import END, Busy, EngineOwner, Job, Metrics
from specchat.backend.api import StepEvent
from specchat.backend.errors import InsufficientMemoryError, SpecchatError

log = logging.getLogger("specchat.serve")
OUTCOMES = ("ok", "error", "cancelled", "rejected", "invalid", "unauthorised")


class SpecchatServer(Protocol):
    """What the routes read of the server that runs them (app/serve/server.py's; a protocol, so that this module
    does not import the one that imports it)."""

    @property
    def config(self) -> ServeConfig: ...

    @property
    def owner(self) -> EngineOwner: ...

    @property
    def metrics(self) -> Metrics: ...

    @property
    def started(self) -> int: ...  # when it started serving, in seconds since the epoch

    @property
    def served(self) -> Sequence[str]: ...  # the model ids


def cache_scope(request: Request, call: ChatCall, shared: bool) -> str:
    """The prefix-cache scope of a request (backend/engine/prefix_cache.py): its client's address with the body's
    ``prompt_cache_key`` (or ``user``), so no client starts from another's prompts; one scope for all when the
    operator shares state (``--share-state``)."""
    if shared:
        return "shared"
    host = request.client.host if request.client is not None else "-"
    return f"{host}\n{call.cache_key}"


class _JSON(Response):
    media_type = "application/json"

    def render(self, content: Any) -> bytes:
        return wire.encode(content)


def _error(error: ApiError, headers: dict[str, str] | None = None) -> Response:
    return _JSON(error.body(), status_code=error.status, headers=headers)


def _entry(request: Request) -> Entry:
    entry = request.scope.get(ENTRY)
    return entry if isinstance(entry, Entry) else Entry("-", request.method, request.url.path)


class _Reply:
    """One queued job seen from the event loop: its events, and the watch that cancels it when the client
    leaves."""

    def __init__(self, server: SpecchatServer, request: Request, call: ChatCall) -> None:
        loop = asyncio.get_running_loop()
        self.wake = asyncio.Event()

        def notify() -> None:  # the owner's worker thread
            try:
                loop.call_soon_threadsafe(self.wake.set)
            except RuntimeError:
                pass  # the loop is closed: the server stopped

        # Busy: the caller answers 429. A whole reply is read once it has ended: no wake per step meanwhile.
        self.job: Job = server.owner.submit(call.request, notify, wake_each=call.stream)
        self.left = False
        self._watch = asyncio.ensure_future(self._watch_client(request.receive))

    async def _watch_client(self, receive: Callable[[], Awaitable[Any]]) -> None:
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                self.left = True
                self.job.cancel.set()
                self.wake.set()
                return

    async def next(self) -> Any:
        """The job's next item (a StepEvent, an exception, or END); END at once after the client left."""
        while True:
            self.wake.clear()
            try:
                return self.job.events.get_nowait()
            except queue.Empty:
                pass
            await self.wake.wait()

    def close(self) -> None:
        self.job.cancel.set()  # whatever happened, the engine stops working for this request
        self._watch.cancel()


class Routes:
    """The handlers, bound to one :class:`SpecchatServer`."""

    def __init__(self, server: SpecchatServer) -> None:
        self.server = server

    @property
    def metrics(self) -> Any:
        return self.server.metrics

    def _denied(self, request: Request) -> Response | None:
        key = self.server.config.api_key
        if key is None:
            return None
        scheme, _, given = request.headers.get("authorization", "").strip().partition(" ")
        # An auth scheme is case-insensitive (RFC 9110 11.1): "bearer" and "BEARER" are Bearer.
        if scheme.lower() == "bearer" and hmac.compare_digest(given.strip().encode(), key.encode()):
            return None
        self.metrics.count("unauthorised")
        _entry(request).outcome = "unauthorised"
        message = (
            "missing or wrong API key: send the header 'Authorization: Bearer <key>' with the key the server "
            "was started with"
        )
        return _error(ApiError(401, message, "Authorization", "authentication_error"), {"WWW-Authenticate": "Bearer"})

    # -- small routes -------------------------------------------------------------------------------------

    async def models(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        data = [
            {"id": m, "object": "model", "created": self.server.started, "owned_by": "specchat"}
            for m in self.server.served
        ]
        return _JSON({"object": "list", "data": data})

    async def health(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        return _JSON({"status": "ok", "waiting": self.server.owner.waiting})

    async def prometheus(self, request: Request) -> Response:
        if denied := self._denied(request):
            return denied
        return Response(self.metrics_text(), media_type="text/plain; version=0.0.4")

    async def http_error(self, request: Request, exc: Exception) -> Response:
        """Starlette's own 404 / 405 as JSON."""
        status = exc.status_code if isinstance(exc, HTTPException) else 500
        path = request.url.path[:100]
        if status == 405:
            kind = "invalid_request_error"
            message = f"{request.method[:16]} is not allowed on {path}; use GET or POST as listed"
        else:
            routes = "POST /v1/chat/completions, GET /v1/models, /metrics or /health"
            message, kind = f"no route {request.method[:16]} {path}; use {routes}", "not_found"
        _entry(request).outcome = "invalid"
        headers = dict(exc.headers or {}) if isinstance(exc, HTTPException) else None
        return _error(ApiError(status, message, "path", kind), headers)

    # -- chat ---------------------------------------------------------------------------------------------

    async def _body(self, request: Request) -> bytes:
        limit = self.server.config.limits.max_body_bytes
        length = request.headers.get("content-length")
        if length is None and "chunked" not in request.headers.get("transfer-encoding", "").lower():
            raise ApiError(411, "the request needs a Content-Length header (or a chunked body)", "Content-Length")
        if length is not None and int(length) > limit:  # h11 let through only digits
            raise ApiError(
                413, f"the request body has {length} bytes; this server takes at most {limit} (--max-body-bytes)"
            )
        chunks: list[bytes] = []
        size = 0
        timeout = self.server.config.body_timeout_s
        try:
            async with asyncio.timeout(timeout):
                async for chunk in request.stream():
                    size += len(chunk)
                    if size > limit:
                        raise ApiError(
                            413, f"the request body is over {limit} bytes, this server's limit (--max-body-bytes)"
                        )
                    chunks.append(chunk)
        except TimeoutError:
            raise ApiError(
                408, f"the request body did not arrive within {timeout:g} s ({size} bytes came); send it at once"
            ) from None
        return b"".join(chunks)

    async def chat(self, request: Request, text: bool = False) -> Response:
        entry = _entry(request)
        if denied := self._denied(request):
            return denied
        try:
            body, limits = await self._body(request), self.server.config.limits
            call = parse_call(body, self.server.served, limits, self.server.owner.engine, text)
        except ClientDisconnect:
            entry.status, entry.outcome = 499, "client-left"
            return Response(status_code=400)  # never sent: the client is gone
        except ApiError as error:
            self.metrics.count("invalid")
            entry.outcome = "invalid"
            closing = {"Connection": "close"} if error.status in (408, 413) else None
            return _error(error, closing)
        if self.server.config.log_prompts:
            users = [m["content"] for m in call.request.messages or [] if m["role"] == "user"]
            entry.prompt = users[-1] if users else ""
        scope = cache_scope(request, call, self.server.config.share_state)
        call = dataclasses.replace(call, request=dataclasses.replace(call.request, prefix_cache=scope))
        try:
            reply = _Reply(self.server, request, call)
        except Busy:
            self.metrics.count("rejected")
            entry.outcome = "rejected"
            size = self.server.config.queue_size
            message = (
                f"the server is busy: {size} requests are already waiting for the engine (its queue holds "
                f"{size}, --queue); retry in a moment"
            )
            return _error(ApiError(429, message, None, "server_busy"), {"Retry-After": "1"})
        try:
            first = await reply.next()
        except BaseException:
            reply.close()
            raise
        if first is END or isinstance(first, BaseException):
            reply.close()
            return self._failed(entry, reply, first if isinstance(first, BaseException) else None)
        if call.stream:
            return _Stream(self, call, reply, first, entry)
        try:
            return await self._whole(call, reply, first, entry)
        finally:
            reply.close()

    async def text(self, request: Request) -> Response:
        return await self.chat(request, text=True)

    def _failed(self, entry: Entry, reply: _Reply, error: BaseException | None) -> Response:
        if reply.left or error is None:
            self.metrics.finished(None, "cancelled")
            entry.status, entry.outcome = 499, "client-left"
            return Response(status_code=400)  # never sent
        self.metrics.finished(None, "error")
        entry.outcome = "error"
        return _error(self.engine_error(error))

    def engine_error(self, error: BaseException) -> ApiError:
        """The engine's exception as an API error: the user's (SpecchatError) 400, a bug 500 (logged)."""
        if isinstance(error, InsufficientMemoryError):  # no memory for the request's K/V now: retry later
            return ApiError(503, str(error), None, "server_busy")
        if isinstance(error, SpecchatError):
            return ApiError(400, str(error), None)
        log.error("unexpected error in a reply", exc_info=error)
        return ApiError(500, f"internal error ({type(error).__name__}); see the server's log", None, "server_error")

    async def _whole(self, call: ChatCall, reply: _Reply, first: StepEvent, entry: Entry) -> Response:
        events: list[StepEvent] = []
        last, item = None, first
        while item is not END:
            if isinstance(item, BaseException):
                return self._failed(entry, reply, item)
            events.append(item)
            last = item if item.finish_reason is not None else last
            item = await reply.next()
        if last is None or reply.left:
            return self._failed(entry, reply, None if reply.left else SpecchatError("the engine stopped early"))
        self.finish(entry, last)
        return _JSON(structured.completion(wire.new_id(), call, events, last, self.spec_tokens(call)))

    def spec_tokens(self, call: ChatCall) -> int | None:
        """vLLM's ``num_spec_tokens`` for ``call`` (``wire.configured_gamma``)."""
        return wire.configured_gamma(call.request, self.server.config.spec_tokens)

    def finish(self, entry: Entry, last: StepEvent) -> None:
        stats = last.stats
        outcome = "ok" if last.finish_reason not in ("error", "cancelled") else last.finish_reason
        self.metrics.finished(stats, "ok" if outcome != "error" else "error")
        entry.outcome = outcome
        if stats is not None:
            entry.prompt_tokens, entry.completion_tokens = stats.prompt_tokens, stats.new_tokens

    def metrics_text(self) -> str:
        snap = self.metrics.snapshot()
        lines = ["# TYPE specchat_requests_total counter"]
        for outcome in OUTCOMES:
            lines.append(f'specchat_requests_total{{outcome="{outcome}"}} {snap["requests"].get(outcome, 0)}')
        lines.append("# TYPE specchat_tokens_total counter")
        for kind, value in snap["tokens"].items():
            lines.append(f'specchat_tokens_total{{kind="{kind}"}} {value}')
        owner = self.server.owner
        lines += [
            "# TYPE specchat_queue_waiting gauge",
            f"specchat_queue_waiting {owner.waiting}",
            "# TYPE specchat_requests_running gauge",
            f"specchat_requests_running {owner.running}",
        ]
        for name, key in (("accepted_tokens", "accepted_per_position"), ("reached", "reached_per_position")):
            lines.append(f"# TYPE specchat_spec_decode_num_{name}_per_pos_total counter")
            for pos, value in sorted(snap[key].items()):
                lines.append(f'specchat_spec_decode_num_{name}_per_pos_total{{position="{pos}"}} {value}')
        lines += owner.metrics_lines()
        blocks = self.server.config.blocks_in_use
        if blocks is not None:
            lines += ["# TYPE specchat_kv_blocks_in_use gauge", f"specchat_kv_blocks_in_use {blocks()}"]
        return "\n".join(lines) + "\n"


class _Stream(Response):
    """A reply as server-sent events: a chunk per event with text or tokens, the totals when asked, ``[DONE]``.
    An engine error after the first event is one more ``data:`` event holding the error object (no [DONE])."""

    def __init__(self, routes: Routes, call: ChatCall, reply: _Reply, first: StepEvent, entry: Entry) -> None:
        super().__init__(status_code=200, headers={"Cache-Control": "no-cache", "Content-Type": "text/event-stream"})
        self.routes, self.call, self.reply, self.first, self.entry = routes, call, reply, first, entry
        del self.headers["content-length"]

    async def _events(self) -> AsyncIterator[bytes]:
        call, reply, routes = self.call, self.reply, self.routes
        call_id, created, first, last, item = wire.new_id(), int(time.time()), True, None, self.first
        out = structured.Chunks(call.tools, call.text)  # tool calls read back, logprobs
        while item is not END:
            if isinstance(item, BaseException):
                routes.metrics.finished(None, "error")
                self.entry.outcome = "error"
                yield wire.sse(routes.engine_error(item).body())
                return
            event: StepEvent = item
            last = event if event.finish_reason is not None else last
            if event.text or event.token_ids or event.finish_reason is not None:
                payload = out.chunk(call_id, call.model, created, event, token_ids=call.return_token_ids, first=first)
                first = False
                yield wire.sse(payload)
            item = await reply.next()
        if reply.left or last is None:
            routes.metrics.finished(last.stats if last else None, "cancelled")
            self.entry.status, self.entry.outcome = 499, "client-left"
            return
        if call.include_usage:
            yield wire.sse(out.usage(call_id, call.model, created, last, routes.spec_tokens(call)))
        yield wire.sse("[DONE]")
        routes.finish(self.entry, last)

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await send({"type": "http.response.start", "status": self.status_code, "headers": self.raw_headers})
            async for data in self._events():
                await send({"type": "http.response.body", "body": data, "more_body": True})
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        finally:
            self.reply.close()


def build_app(server: SpecchatServer) -> AccessLog:
    """The ASGI app of ``server``: the routes behind the access log."""
    routes = Routes(server)
    chat = ("/v1/chat/completions", "/chat/completions")
    table = [Route(path, routes.chat, methods=["POST"]) for path in chat]
    table += [Route(path, routes.text, methods=["POST"]) for path in ("/v1/completions", "/completions")]
    table += [Route(path, routes.models, methods=["GET"]) for path in ("/v1/models", "/models")]
    table += [Route("/metrics", routes.prometheus, methods=["GET"]), Route("/health", routes.health, methods=["GET"])]
    app = Starlette(routes=table, exception_handlers={HTTPException: routes.http_error})
    return AccessLog(app)
