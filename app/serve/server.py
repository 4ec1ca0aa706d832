"""`specchat serve`'s HTTP server: the routes (app/serve/routes.py, Starlette) on uvicorn, one event loop for
every connection, the engine in one owner thread (app/serve/owner.py).

Why this stack: it is what vLLM's and SGLang's OpenAI-compatible servers run, and it brings HTTP/1.1 parsing
(h11), keep-alive, flow control, streaming and graceful shutdown; a slow or idle client costs a socket and a
few kilobytes, not a thread. The guards a public service needs on top (a connection cap, head, body and write
timeouts, JSON refusals, half-closed clients, graceful closing) are app/serve/protocol.py's.

Contract: :class:`ServeConfig` holds the limits; :func:`make_server` binds the socket (127.0.0.1 by default;
``OSError`` when it cannot) and returns a :class:`SpecchatServer` whose :meth:`~SpecchatServer.serve_forever`
runs until :meth:`~SpecchatServer.shutdown` (from another thread) or Ctrl+C / SIGTERM (in the main thread:
uvicorn re-raises the signal after the graceful stop, so the CLI sees KeyboardInterrupt). Stopping cancels
the engine's running and waiting jobs first, so streams end at once, then waits up to
``config.shutdown_timeout_s`` for the answers to go out. :meth:`~SpecchatServer.close` stops the owner. Unless
``config.share_state``, the engine forgets what a request taught it before the next one runs
(``Engine.forget_requests``, and no memory of replies): no client's reply depends on, or shows, another's.
"""

from __future__ import annotations

import dataclasses
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence

import uvicorn

from specchat.app.serve import access
from specchat.app.serve.config import ServeConfig as ServeConfig
from specchat.app.serve.owner import EngineOwner, Metrics
from specchat.app.serve.protocol import Guard, guarded_protocol
from specchat.app.serve.routes import build_app
from specchat.backend.api import EngineAPI

log = logging.getLogger("specchat.serve")
BACKLOG = 128
# uvicorn's warnings about a client's fault (a malformed request is answered and logged by protocol.py).
_CLIENT_FAULTS = ("Invalid HTTP request received.", "Unsupported upgrade request.", "No supported WebSocket")


class _ClientFaults(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_CLIENT_FAULTS)


def _quiet_uvicorn() -> None:
    """uvicorn's loggers: its start and stop lines are the CLI's to print; a client's fault is not a warning."""
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logger = logging.getLogger(name)
        if not any(isinstance(f, _ClientFaults) for f in logger.filters):
            logger.addFilter(_ClientFaults())
    logging.getLogger("uvicorn.error").setLevel(logging.WARNING)
    logging.getLogger("uvicorn.access").disabled = True


class _Uvicorn(uvicorn.Server):
    """uvicorn's server, cancelling the engine's work before it waits for the connections to finish."""

    def __init__(self, config: uvicorn.Config, on_stop: Callable[[], None]) -> None:
        super().__init__(config)
        self.on_stop = on_stop

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        self.on_stop()
        await super().shutdown(sockets)


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(BACKLOG)
        sock.set_inheritable(True)
    except BaseException:
        sock.close()
        raise
    return sock


class SpecchatServer:
    """One bound server (see the module docstring)."""

    def __init__(self, sock: socket.socket, engine: EngineAPI, config: ServeConfig) -> None:
        self.config, self.socket = config, sock
        before_job = None
        if not config.share_state:
            forget = getattr(engine, "forget_requests", None)
            use_memory = getattr(engine, "use_reply_memory", None)
            if use_memory is not None:
                use_memory(False)  # no reply is remembered for another request's drafts
            before_job = forget
        self.owner = EngineOwner(engine, queue_size=config.queue_size, before_job=before_job, batch=config.batch)
        self.metrics: Metrics = self.owner.metrics
        self.started = int(time.time())
        guard = config.guard if config.guard.refused is not None else _with_log(config.guard)
        _quiet_uvicorn()
        uv_config = uvicorn.Config(
            build_app(self),
            http=guarded_protocol(guard),
            lifespan="off",
            log_config=None,
            access_log=False,
            timeout_keep_alive=config.keep_alive_s,
            timeout_graceful_shutdown=config.shutdown_timeout_s,
            h11_max_incomplete_event_size=guard.max_head_bytes,
            backlog=BACKLOG,
            server_header=False,
            ws="none",
        )
        self._uvicorn = _Uvicorn(uv_config, self.owner.cancel_all)
        self._stopped = threading.Event()
        self._serving = False

    @property
    def server_address(self) -> tuple[str, int]:
        return self.socket.getsockname()[:2]

    @property
    def served(self) -> Sequence[str]:
        return (self.config.model,)

    def serve_forever(self, poll_interval: float | None = None) -> None:
        """Serve until :meth:`shutdown` or a signal (``poll_interval`` is ignored: kept for the callers of
        the standard library's server)."""
        self._serving = True
        try:
            self._uvicorn.run(sockets=[self.socket])
        finally:
            self._stopped.set()

    def shutdown(self, timeout_s: float | None = None) -> None:
        """Stop serving (from another thread) and wait until :meth:`serve_forever` has returned."""
        self.owner.cancel_all()
        self._uvicorn.should_exit = True
        if self._serving:
            self._stopped.wait(timeout_s if timeout_s is not None else self.config.shutdown_timeout_s + 5)

    def close(self) -> None:
        self.socket.close()
        self.owner.close()


def _with_log(guard: Guard) -> Guard:
    return dataclasses.replace(guard, refused=access.refused)


def make_server(engine: EngineAPI, config: ServeConfig, *, host: str = "127.0.0.1", port: int = 8000) -> SpecchatServer:
    """Bind the server (``port`` 0: a free one; read ``server.server_address``); OSError when it cannot."""
    return SpecchatServer(_bind(host, port), engine, config)
