"""The engine of a remote pair: an :class:`~specchat.backend.api.EngineAPI` over a server's OpenAI-compatible
chat completions API (vLLM, SGLang, llama-server, `specchat serve`, any OpenAI API), streamed with httpx.

Contract:

- :class:`RemoteEngine` ``(pair)`` builds no model; ``generate(request, cancel)`` posts one streaming request
  (``stream_options.include_usage`` so the last chunk carries the totals) and yields a :class:`StepEvent` per
  chunk that carries text or token ids, then one last event with ``finish_reason`` and the totals. Statistics
  are the server's (``specchat.backend.remote.stats``: absent figures stay None) plus tok/s and time to first
  token measured here, from the request's start, as the local engine measures them.
- The server is not asked to do what it cannot: a pair's ``kind`` only adds the request fields that ask that
  server for its statistics (vLLM and specchat ``return_token_ids``, SGLang ``return_spec_tokens_details``,
  llama-server ``timings_per_token``; specchat also the request's drafter and γ), and a request's ``prediction``
  goes to the kinds that take one (:data:`PREDICTION_KINDS`; others get a notice). The answer is read by what it
  contains, whatever the kind.
- Errors before the reply starts (host unreachable, TLS or DNS failure, wrong API key, unknown model, server
  busy, a bad request, an HTML page or anything but an event stream) raise :class:`RemoteError`: one line naming
  the server (its URL with any password masked: ``faults.shown_url``) and what to check, never an httpx
  traceback. A reply that breaks off (the server died, the connection dropped or was reset, a read timeout, a
  wrong Content-Length, a body that does not decompress, a line or an answer over its cap) ends with a last
  event ``finish_reason="error"`` whose message says so: the text streamed so far stays with the caller.
- Limits: an error answer is read up to :data:`MAX_ERROR_BYTES`, a stream line up to
  ``reply.MAX_LINE_BYTES``, a whole answer up to :data:`MAX_ANSWER_BYTES`; the reply ends at the request's
  ``max_new_tokens`` (else the pair's, else the engine's default) whatever the server sends (``reply.py``).
  Server text reaching the caller (the reply, error messages, names) has terminal control characters stripped
  and the pair's secrets (its API key, its URL's password and query values) masked, whatever the server echoes.
- Deadlines (``watchdog.py``): a reply ends with an error naming the server and the field to change when no new
  token came for the pair's ``no_progress_s`` (the first token included; keep-alive comments, empty chunks and a
  lying Content-Length's silence do not count as progress) or it has not finished within its ``deadline_s``
  (models.yaml, defaults in ``backend/limits.py``): before the first token a RemoteError, after it a last event
  ``finish_reason="error"`` keeping the partial reply. ``GET /models`` and ``/metrics`` get
  :data:`LIST_DEADLINE_FACTOR` times their timeout in all. Connect :data:`CONNECT_TIMEOUT_S`; a failed connect
  is retried :data:`CONNECT_RETRIES` times, nothing else is. The server is addressed directly: proxy settings
  from the environment are not used.
- ``cancel.set()`` closes the stream within :data:`CANCEL_POLL_S` even while a chunk is awaited (the socket is
  shut down), and the reply ends with ``finish_reason="cancelled"``.
"""

from __future__ import annotations

import json
import math
import os
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx

from specchat.backend.api import GenerationRequest, StepEvent
from specchat.backend.engine.prompting import validate_messages
from specchat.backend.errors import RemoteError, RequestError
from specchat.backend.limits import DEFAULT_MAX_NEW_TOKENS
from specchat.backend.models.catalog.config import PREDICTION_KINDS, PairConfig, RemoteSpec
from specchat.backend.redact import terminal_safe
from specchat.backend.remote.faults import (
    describe,
    error_text,
    http_error,
    network_error,
    one_line,
    pair_secrets,
    redact,
    shown_url,
)
from specchat.backend.remote.passthrough import structured_fields
from specchat.backend.remote.reply import MAX_LINE_BYTES, ReplyState, TooLarge, capped_lines, sse_data
from specchat.backend.remote.watchdog import POLL_S, Reason, Watchdog

CONNECT_TIMEOUT_S = 5.0
WRITE_TIMEOUT_S = 60.0
CONNECT_RETRIES = 2
CANCEL_POLL_S = POLL_S
MAX_ERROR_BYTES = 64 << 10  # of an error answer (or a JSON one): the rest is not read
MAX_ANSWER_BYTES = 64 << 20  # of one streamed answer (specchat's chunks carry ~2 kB of statistics per step)
MAX_LIST_BYTES = 4 << 20  # of GET /models and /metrics
LIST_DEADLINE_FACTOR = 3  # GET /models and /metrics end after this many of their timeouts in all


def api_key(spec: RemoteSpec, pair_name: str) -> str | None:
    """The pair's API key from its ``api_key_env`` variable; RemoteError when that variable is not set."""
    if spec.api_key_env is None:
        return None
    key = os.environ.get(spec.api_key_env)
    if not key:
        raise RemoteError(
            f"pair '{pair_name}': api_key_env {spec.api_key_env} is not set; export "
            f"{spec.api_key_env}=<the API key of {shown_url(spec.server)}>"
        )
    return key


def make_client(spec: RemoteSpec, pair_name: str) -> httpx.Client:
    key = api_key(spec, pair_name)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    # The watchdog ends a silent request after no_progress_s; the read timeout, a little later, is its fallback.
    timeout = httpx.Timeout(
        connect=CONNECT_TIMEOUT_S, read=spec.no_progress_s + 1.0, write=WRITE_TIMEOUT_S, pool=CONNECT_TIMEOUT_S
    )
    return httpx.Client(
        base_url=spec.server + "/",
        headers=headers,
        timeout=timeout,
        trust_env=False,
        transport=httpx.HTTPTransport(retries=CONNECT_RETRIES),
    )


class RemoteEngine:
    """A remote pair's engine (see the module docstring)."""

    def __init__(self, pair: PairConfig) -> None:
        spec = pair.remote
        if spec is None:
            raise RequestError(f"pair '{pair.name}' is not a remote pair")
        self.pair, self.spec = pair, spec
        self.draft = None
        self.context_length: int | None = None  # the server's; not known here
        self._client = make_client(spec, pair.name)
        self._secrets = pair_secrets(spec)

    # -- EngineAPI --------------------------------------------------------------------------------------

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[StepEvent]:
        """Stream one reply (see the module docstring). RequestError before any network use for a request a
        remote pair cannot take (token ids instead of messages)."""
        if request.prompt_ids is not None or not request.messages:
            raise RequestError(
                f"pair '{self.pair.name}' runs on {shown_url(self.spec.server)}: send messages (the server "
                "applies its own chat template), not token ids"
            )
        body = self.request_body(request)
        return self._stream(body, request, cancel or threading.Event())

    def forget(self, conversation: str) -> None:
        """Nothing to drop here: the server keeps (or not) its own prefix cache."""

    def close(self) -> None:
        self._client.close()

    def metrics_text(self) -> str | None:
        """The server's Prometheus ``/metrics`` (at the root beside ``/v1``), or None when it has none."""
        root = self.spec.server.removesuffix("/v1")
        watchdog = Watchdog(threading.Event(), math.inf, CONNECT_TIMEOUT_S * LIST_DEADLINE_FACTOR)
        try:
            with self._client.stream(
                "GET", root + "/metrics", timeout=CONNECT_TIMEOUT_S, extensions={"trace": watchdog.trace}
            ) as response:
                watchdog.watch_response(response)
                if response.status_code != 200:
                    return None
                return read_capped(response, MAX_LIST_BYTES).decode("utf-8", "replace")
        except (httpx.HTTPError, httpx.StreamError, OSError, TooLarge):
            return None
        finally:
            watchdog.stop()

    # -- internals --------------------------------------------------------------------------------------

    def request_body(self, request: GenerationRequest) -> dict[str, Any]:
        """The JSON body of one chat completions request: the request's sampling, else the pair's defaults."""
        messages = validate_messages(request.messages or [])
        body: dict[str, Any] = {
            "model": self.spec.model,
            "messages": messages,
            "stream": True,
            "stream_options": {"include_usage": True},
        }
        s, defaults = request.sampling, self.pair.sampling
        value = lambda name: getattr(s, name) if getattr(s, name) is not None else defaults.get(name)  # noqa: E731
        for ours, theirs in (
            ("temperature", "temperature"),
            ("top_p", "top_p"),
            ("max_new_tokens", "max_tokens"),
            ("seed", "seed"),
        ):
            if value(ours) is not None:
                body[theirs] = value(ours)
        if s.stop:
            body["stop"] = list(s.stop)
        kind = self.spec.server_kind
        if kind != "openai":  # top_k and repetition_penalty are not in the OpenAI API; these servers take them
            for name in ("top_k", "repetition_penalty"):
                if value(name) is not None:
                    body[name] = value(name)
        if kind in ("vllm", "specchat"):
            body["return_token_ids"] = True
        if kind == "sglang":
            body["return_spec_tokens_details"] = True
        if kind == "llama-server":
            body["timings_per_token"] = True
        if request.prediction is not None and kind in PREDICTION_KINDS:
            body["prediction"] = {"type": "content", "content": request.prediction}
        body.update(structured_fields(request, kind, self.pair.name))  # constraints, logprobs: passthrough.py
        if kind == "specchat" and (request.drafter is not None or request.gamma is not None):
            body["specchat"] = {
                k: v for k, v in (("drafter", request.drafter), ("gamma", request.gamma)) if v is not None
            }
        return body

    def _notice(self, request: GenerationRequest) -> str | None:
        if request.prediction is not None and self.spec.server_kind not in PREDICTION_KINDS:
            return (
                f"pair '{self.pair.name}' runs on a {self.spec.server_kind} server, which takes no prediction: the "
                "reply is decoded without it"
            )
        if self.spec.server_kind != "specchat" and (
            request.drafter not in (None, "auto") or request.gamma not in (None, "auto")
        ):
            return (
                f"pair '{self.pair.name}' runs on its server, which speculates as it was started: the drafter "
                "and γ settings do not apply"
            )
        return None

    def _max_new_tokens(self, request: GenerationRequest) -> int:
        asked = request.sampling.max_new_tokens or self.pair.sampling.get("max_new_tokens")
        return asked if isinstance(asked, int) and asked > 0 else DEFAULT_MAX_NEW_TOKENS

    def _stream(self, body: dict[str, Any], request: GenerationRequest, cancel: threading.Event) -> Iterator[StepEvent]:
        t0 = time.perf_counter()
        server = shown_url(self.spec.server)
        state = ReplyState(
            self.pair.name,
            server,
            t0,
            self._notice(request),
            self._max_new_tokens(request),
            predicted="prediction" in body,
            clean=self._clean,
        )
        watchdog = Watchdog(cancel, self.spec.no_progress_s, self.spec.deadline_s)
        try:
            with self._client.stream(
                "POST", "chat/completions", json=body, extensions={"trace": watchdog.trace}
            ) as response:
                watchdog.watch_response(response)
                chunks = self._answer(response)
                try:
                    lines = capped_lines(chunks, max_line=MAX_LINE_BYTES, max_total=MAX_ANSWER_BYTES)
                    for data in sse_data(state.watch(lines)):
                        if cancel.is_set():
                            break
                        event = state.chunk(data)
                        if event is not None:
                            watchdog.progress()
                            yield event
                            watchdog.progress()  # the wait for the next token starts now
                        if state.done:
                            break
                except TooLarge as error:
                    state.broken(f"sent too much ({error})")
                except (httpx.HTTPError, httpx.StreamError, OSError, ValueError) as error:
                    if watchdog.reason is None and not cancel.is_set():
                        state.broken(describe(error))
                if watchdog.reason in ("deadline", "no_progress"):  # the shut socket ended the stream
                    if state.t_first is None:
                        raise self._expired_error(watchdog.reason)
                    state.broken(self._expired(watchdog.reason))
        except RemoteError:
            if watchdog.reason not in ("deadline", "no_progress"):
                raise
            raise self._expired_error(watchdog.reason) from None
        except (httpx.HTTPError, httpx.StreamError, OSError, ValueError) as error:
            if watchdog.reason == "cancelled":
                yield state.last(True)
                return
            if watchdog.reason is not None:
                raise self._expired_error(watchdog.reason) from None
            raise network_error(self.spec, self.pair.name, error) from None
        finally:
            watchdog.stop()
        yield state.last(cancel.is_set())

    def _expired(self, reason: Reason) -> str:
        """What a passed deadline was, naming the field that sets it."""
        field = "target.no_progress_s" if reason == "no_progress" else "target.deadline_s"
        where = f"{field} of pair '{self.pair.name}'" + (
            f" in {self.pair.source_file}" if self.pair.source_file else ""
        )
        if reason == "no_progress":
            return f"sent no new token for {self.spec.no_progress_s:g} s ({where})"
        return f"did not finish the reply within {self.spec.deadline_s:g} s ({where})"

    def _expired_error(self, reason: Reason) -> RemoteError:
        return RemoteError(
            f"pair '{self.pair.name}': {shown_url(self.spec.server)} {self._expired(reason)}; check that the server "
            "is up and not overloaded, or raise that value for a slow server"
        )

    def _clean(self, text: str) -> str:
        """A server's text as shown: terminal-safe, the pair's secrets masked."""
        return self._secrets.mask(terminal_safe(text))

    def _answer(self, response: httpx.Response) -> Iterator[bytes]:
        """The answer's body as an event stream's bytes; RemoteError for an error answer or one that is not a
        stream (an HTML page, a JSON error); a whole JSON completion is taken as a stream of one event."""
        kind = response.headers.get("content-type", "").lower()
        if response.status_code != 200 or "html" in kind or "json" in kind:
            body = read_capped(response, MAX_ERROR_BYTES, truncate=True)
            text = error_text(body, kind, response.reason_phrase)
            if response.status_code != 200:
                raise http_error(self.spec, self.pair.name, response.status_code, text)
            if "json" in kind and b'"choices"' in body:
                return iter([b"data: " + body.replace(b"\n", b" ") + b"\n\n"])
            said, kind = one_line(redact(text, self.spec), 200), one_line(kind, 60) or "no type"
            raise RemoteError(
                f"pair '{self.pair.name}': {shown_url(self.spec.server)} answered {said} ({kind}) "
                "instead of an event stream; check that the pair's server URL is the API's, ending in /v1, and "
                "that no proxy or login page is in between"
            )
        return response.iter_bytes()


def read_capped(response: httpx.Response, most: int, *, truncate: bool = False) -> bytes:
    """At most ``most`` bytes of a streamed answer's body: TooLarge past them, or (``truncate``) the first
    ``most`` only; the rest is never read."""
    out = bytearray()
    for chunk in response.iter_bytes():
        out += chunk
        if len(out) > most:
            if truncate:
                return bytes(out[:most])
            raise TooLarge(f"the answer passed {most:,} bytes")
    return bytes(out)


def check_server(spec: RemoteSpec, pair_name: str, *, timeout_s: float = 3.0) -> dict[str, Any]:
    """Whether the server answers ``GET {server}/models`` and lists the pair's model: ``{"reachable": bool,
    "model_listed": bool | None, "error": str | None}``. Never raises (a missing API key is an error here)."""
    try:
        key = api_key(spec, pair_name)
    except RemoteError as error:
        return {"reachable": False, "model_listed": None, "error": str(error)}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    watchdog = Watchdog(threading.Event(), math.inf, timeout_s * LIST_DEADLINE_FACTOR)
    try:
        with (
            httpx.Client(timeout=timeout_s, trust_env=False, headers=headers) as client,
            client.stream("GET", spec.server + "/models", extensions={"trace": watchdog.trace}) as response,
        ):
            status, kind = response.status_code, response.headers.get("content-type", "")
            body = read_capped(response, MAX_LIST_BYTES, truncate=status != 200)
    except TooLarge:
        return {"reachable": True, "model_listed": None, "error": "GET /models answered more than 4 MiB"}
    except (httpx.HTTPError, httpx.StreamError, OSError, ValueError) as error:
        if watchdog.reason == "deadline":
            late = f"GET {shown_url(spec.server)}/models did not finish within {timeout_s * LIST_DEADLINE_FACTOR:g} s"
            return {"reachable": False, "model_listed": None, "error": late}
        return {"reachable": False, "model_listed": None, "error": str(network_error(spec, pair_name, error))}
    finally:
        watchdog.stop()
    if status != 200:
        text = error_text(body, kind, "")
        return {"reachable": True, "model_listed": None, "error": str(http_error(spec, pair_name, status, text))}
    try:
        data = json.loads(body).get("data", [])
        ids = {m.get("id") for m in data if isinstance(m, Mapping)}
    except (ValueError, AttributeError, TypeError, RecursionError):
        return {"reachable": True, "model_listed": None, "error": "GET /models did not answer a model list"}
    listed = spec.model in ids
    names = one_line(redact(", ".join(map(str, list(ids)[:20])), spec), 300)
    problem = None if listed else f"model '{one_line(spec.model, 80)}' is not listed (the server has: {names})"
    return {"reachable": True, "model_listed": listed, "error": problem}
