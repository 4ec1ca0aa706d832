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
- Errors before the reply starts (host unreachable, wrong API key, unknown model, server busy, a bad request)
  raise :class:`RemoteError` naming the server and what to do. A reply that breaks off (the server died, the
  connection dropped, a read timeout) ends with a last event ``finish_reason="error"`` whose message says so:
  the text streamed so far stays with the caller.
- Timeouts: connect :data:`CONNECT_TIMEOUT_S`, then :data:`READ_TIMEOUT_S` between two chunks (a large model's
  first token may take long); a failed connect is retried :data:`CONNECT_RETRIES` times, nothing else is. The
  server is addressed directly: proxy settings from the environment are not used.
- ``cancel.set()`` closes the stream within :data:`CANCEL_POLL_S` even while a chunk is awaited (the socket is
  shut down), and the reply ends with ``finish_reason="cancelled"``.
"""

from __future__ import annotations

import json
import os
import socket
import threading
import time
from collections.abc import Iterator, Mapping
from typing import Any

import httpx

from specchat.backend.api import FinishReason, GenerationRequest, PolicyState, RequestStats, StepEvent, TokenSource
from specchat.backend.engine.prompting import validate_messages
from specchat.backend.errors import RemoteError, RequestError
from specchat.backend.models.config import PREDICTION_KINDS, PairConfig, RemoteSpec
from specchat.backend.remote.stats import PREDICTION_FIELDS, remote_stats, server_figures

CONNECT_TIMEOUT_S = 5.0
READ_TIMEOUT_S = 600.0  # between two chunks: a 70B model's prefill of a long prompt may take minutes
WRITE_TIMEOUT_S = 60.0
CONNECT_RETRIES = 2
CANCEL_POLL_S = 0.05
MAX_ERROR_BODY = 4096  # characters of an error response shown


def _finish(reason: Any, stop_reason: Any) -> FinishReason:
    if reason == "length":
        return "length"
    if reason == "stop" and isinstance(stop_reason, str):
        return "stop"
    return "eos" if reason in ("stop", "tool_calls", "eos") else "stop"


def _error_text(response: httpx.Response) -> str:
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError, ValueError):
        return response.text[:MAX_ERROR_BODY].strip() or response.reason_phrase
    if isinstance(body, Mapping):
        error = body.get("error", body.get("detail", body.get("message")))
        if isinstance(error, Mapping):
            error = error.get("message", error)
        if error is not None:
            return str(error)[:MAX_ERROR_BODY]
    return str(body)[:MAX_ERROR_BODY]


def api_key(spec: RemoteSpec, pair_name: str) -> str | None:
    """The pair's API key from its ``api_key_env`` variable; RemoteError when that variable is not set."""
    if spec.api_key_env is None:
        return None
    key = os.environ.get(spec.api_key_env)
    if not key:
        raise RemoteError(
            f"pair '{pair_name}': api_key_env {spec.api_key_env} is not set; export "
            f"{spec.api_key_env}=<the API key of {spec.server}>"
        )
    return key


def make_client(spec: RemoteSpec, pair_name: str, *, read_timeout_s: float = READ_TIMEOUT_S) -> httpx.Client:
    key = api_key(spec, pair_name)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    timeout = httpx.Timeout(
        connect=CONNECT_TIMEOUT_S, read=read_timeout_s, write=WRITE_TIMEOUT_S, pool=CONNECT_TIMEOUT_S
    )
    return httpx.Client(
        base_url=spec.server + "/",
        headers=headers,
        timeout=timeout,
        trust_env=False,
        transport=httpx.HTTPTransport(retries=CONNECT_RETRIES),
    )


def http_error(spec: RemoteSpec, pair_name: str, response: httpx.Response) -> RemoteError:
    """A RemoteError for a non-2xx answer, saying what to do about each common status."""
    text, status = _error_text(response), response.status_code
    where = f"pair '{pair_name}': {spec.server} answered {status}"
    if status == 401 or status == 403:
        env = spec.api_key_env
        fix = f"check the key in {env}" if env else "set api_key_env: VAR in the pair and export VAR=<the key>"
        return RemoteError(f"{where} (API key refused: {text}); {fix}")
    if status == 404:
        return RemoteError(
            f"{where} ({text}); check the pair's server URL (it ends in /v1) and model "
            f"'{spec.model}' against GET {spec.server}/models"
        )
    if status in (429, 503):
        return RemoteError(f"{where} (busy: {text}); try again in a moment")
    return RemoteError(f"{where}: {text}")


class _CancelWatch:
    """Shuts the response's socket down when ``cancel`` is set, so a blocked read returns at once."""

    def __init__(self, cancel: threading.Event, response: httpx.Response) -> None:
        self._cancel, self._done = cancel, threading.Event()
        stream = response.extensions.get("network_stream")
        self._socket = stream.get_extra_info("socket") if stream is not None else None
        self._thread = threading.Thread(target=self._watch, name="specchat-remote-cancel", daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._done.is_set():
            if self._cancel.wait(CANCEL_POLL_S):
                if not self._done.is_set() and self._socket is not None:
                    try:
                        self._socket.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
                return

    def stop(self) -> None:
        self._done.set()


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


class RemoteEngine:
    """A remote pair's engine (see the module docstring). ``read_timeout_s`` is for tests."""

    def __init__(self, pair: PairConfig, *, read_timeout_s: float = READ_TIMEOUT_S) -> None:
        spec = pair.remote
        if spec is None:
            raise RequestError(f"pair '{pair.name}' is not a remote pair")
        self.pair, self.spec = pair, spec
        self.draft = None
        self.context_length: int | None = None  # the server's; not known here
        self._client = make_client(spec, pair.name, read_timeout_s=read_timeout_s)

    # -- EngineAPI --------------------------------------------------------------------------------------

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[StepEvent]:
        """Stream one reply (see the module docstring). RequestError before any network use for a request a
        remote pair cannot take (token ids instead of messages)."""
        if request.prompt_ids is not None or not request.messages:
            raise RequestError(
                f"pair '{self.pair.name}' runs on {self.spec.server}: send messages (the server "
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
        try:
            response = self._client.get(root + "/metrics", timeout=CONNECT_TIMEOUT_S)
        except httpx.HTTPError:
            return None
        return response.text if response.status_code == 200 else None

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

    def _stream(self, body: dict[str, Any], request: GenerationRequest, cancel: threading.Event) -> Iterator[StepEvent]:
        t0 = time.perf_counter()
        state = _Reply(self.pair.name, t0, self._notice(request), predicted="prediction" in body)
        try:
            with self._client.stream("POST", "chat/completions", json=body) as response:
                if response.status_code != 200:
                    response.read()
                    raise http_error(self.spec, self.pair.name, response)
                watch = _CancelWatch(cancel, response)
                try:
                    for data in sse_data(response.iter_lines()):
                        if cancel.is_set():
                            break
                        event = state.chunk(data)
                        if event is not None:
                            yield event
                        if state.failed:
                            break
                except (httpx.ReadError, httpx.RemoteProtocolError, httpx.ReadTimeout) as error:
                    if not cancel.is_set():
                        state.broken(self.spec.server, error)
                finally:
                    watch.stop()
        except httpx.ConnectError as error:
            raise RemoteError(
                f"pair '{self.pair.name}': cannot reach {self.spec.server} ({error}); is the server "
                "running and the URL right?"
            ) from None
        except httpx.TimeoutException as error:
            raise RemoteError(
                f"pair '{self.pair.name}': {self.spec.server} did not answer in time "
                f"({type(error).__name__}); check the server"
            ) from None
        yield state.last(cancel.is_set(), self.spec.server)


def _mapping(value: Any) -> Mapping[str, Any]:
    return value if isinstance(value, Mapping) else {}


class _Reply:
    """One streaming reply's state: the chunks read so far, turned into StepEvents."""

    def __init__(self, pair_name: str, t0: float, notice: str | None, *, predicted: bool = False) -> None:
        self.pair_name, self.t0, self.notice, self.predicted = pair_name, t0, notice, predicted
        self.figures: dict[str, Any] = {}
        self.counted = 0
        self.t_first: float | None = None
        self.t_last: float | None = None
        self.finish: FinishReason | None = None
        self.failed: str | None = None
        self.drafter = "server"

    def stats(self) -> RequestStats:
        wall = (self.t_last or time.perf_counter()) - self.t0
        ttft = None if self.t_first is None else self.t_first - self.t0
        return remote_stats(
            self.figures if self.predicted else {k: v for k, v in self.figures.items() if k not in PREDICTION_FIELDS},
            wall_s=wall,
            ttft_s=ttft,
            counted_tokens=self.counted,
            drafter=str(self.figures.get("drafter", self.drafter)),
        )

    def chunk(self, data: str) -> StepEvent | None:
        try:
            chunk = json.loads(data)
        except (json.JSONDecodeError, RecursionError):
            self.failed = f"the server sent a chunk that is not JSON: {data[:120]!r}"
            return None
        if not isinstance(chunk, dict):
            return None
        if "error" in chunk:  # vLLM and others report a failure mid-stream as a chunk
            error = chunk["error"]
            self.failed = str(error.get("message", error) if isinstance(error, Mapping) else error)[:MAX_ERROR_BODY]
            return None
        self.figures.update(server_figures(chunk))
        own: Mapping[str, Any] = _mapping(chunk.get("specchat"))
        choices = chunk.get("choices")
        choice: Mapping[str, Any] = _mapping(choices[0] if isinstance(choices, list) and choices else None)
        content = _mapping(choice.get("delta")).get("content")
        text: str = content if isinstance(content, str) else ""
        raw_ids = choice.get("token_ids")
        ids = [int(t) for t in raw_ids if isinstance(t, int)] if isinstance(raw_ids, list) else []
        if choice.get("finish_reason") is not None:
            self.finish = (
                own.get("finish_reason")
                if own.get("finish_reason") in ("eos", "stop", "length", "context", "cancelled", "error")
                else _finish(choice.get("finish_reason"), choice.get("stop_reason"))
            )
        if not text and not ids:
            return None
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
            drafter=str(self.figures.get("drafter", self.drafter)),
            is_prefill=first,
            message=message,
            stats=self.stats(),
        )

    @staticmethod
    def _tokens(own: Mapping[str, Any], ids: list[int], text: str) -> tuple[list[TokenSource], list[str]]:
        sources, texts = own.get("sources"), own.get("token_texts")
        if (
            isinstance(sources, list)
            and isinstance(texts, list)
            and len(sources) == len(texts) == len(ids)
            and all(s in (0, 1, 2, 3) for s in sources)
            and all(isinstance(t, str) for t in texts)
            and "".join(texts) == text
        ):
            return [TokenSource(s) for s in sources], list(texts)
        return [TokenSource.TARGET] * len(ids), [""] * (len(ids) - 1) + [text] if ids else []

    def broken(self, server: str, error: Exception) -> None:
        what = "stopped answering" if isinstance(error, httpx.ReadTimeout) else "closed the connection"
        self.failed = f"{server} {what} mid-reply ({type(error).__name__})"

    def last(self, cancelled: bool, server: str) -> StepEvent:
        reason: FinishReason
        message: str | None
        if cancelled:
            reason, message = "cancelled", None
        elif self.failed is not None:
            reason, message = "error", f"pair '{self.pair_name}': {self.failed}; the partial reply is kept"
        elif self.finish is None:
            reason = "error"
            message = (
                f"pair '{self.pair_name}': {server} ended the stream without finishing the reply (the "
                "server may have stopped); the partial reply is kept"
            )
        else:
            reason, message = self.finish, None
        stats = self.stats()
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
            drafter=str(self.figures.get("drafter", self.drafter)),
            finish_reason=reason,
            message=message,
            stats=stats,
        )


def check_server(spec: RemoteSpec, pair_name: str, *, timeout_s: float = 3.0) -> dict[str, Any]:
    """Whether the server answers ``GET {server}/models`` and lists the pair's model: ``{"reachable": bool,
    "model_listed": bool | None, "error": str | None}``. Never raises (a missing API key is an error here)."""
    try:
        key = api_key(spec, pair_name)
    except RemoteError as error:
        return {"reachable": False, "model_listed": None, "error": str(error)}
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    try:
        with httpx.Client(timeout=timeout_s, trust_env=False, headers=headers) as client:
            response = client.get(spec.server + "/models")
    except httpx.HTTPError as error:
        return {"reachable": False, "model_listed": None, "error": f"{type(error).__name__}: {error}"}
    if response.status_code != 200:
        return {"reachable": True, "model_listed": None, "error": str(http_error(spec, pair_name, response))}
    try:
        data = response.json().get("data", [])
        ids = {m.get("id") for m in data if isinstance(m, Mapping)}
    except (ValueError, AttributeError, TypeError):
        return {"reachable": True, "model_listed": None, "error": "GET /models did not answer a model list"}
    listed = spec.model in ids
    problem = None if listed else f"model '{spec.model}' is not listed (the server has: {', '.join(map(str, ids))})"
    return {"reachable": True, "model_listed": listed, "error": problem}
