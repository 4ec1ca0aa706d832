"""`specchat serve` started by a test on 127.0.0.1 (a real HTTP server on a free port, in a thread of the test
process or in a child process), and remote pairs that point at it. Tests address nothing but loopback.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from specchat.app.serve.boundary import Limits
from specchat.app.serve.server import ServeConfig, SpecchatServer, make_server
from specchat.backend.api import GenerationRequest, StepEvent
from specchat.backend.models.catalog.config import PairConfig, load_pairs_file

SUPPORT = Path(__file__).resolve().parent


@contextlib.contextmanager
def running_server(
    engine: Any,
    *,
    model: str = "tiny",
    api_key: str | None = None,
    queue_size: int = 8,
    limits: Limits | None = None,
    **config: Any,
) -> Iterator[tuple[SpecchatServer, str]]:
    """Serve ``engine`` on 127.0.0.1:<free port> in a thread; yields (server, base URL ending /v1). ``config``:
    more ServeConfig fields (guard, timeouts, share_state, log_prompts)."""
    config = ServeConfig(
        model=model,
        limits=limits or Limits(),
        queue_size=queue_size,
        api_key=api_key,
        blocks_in_use=getattr(engine, "blocks_in_use", None),
        **config,
    )
    server = make_server(engine, config, host="127.0.0.1", port=0)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield server, f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        server.shutdown()
        server.close()
        thread.join(10)


def closed_port() -> int:
    """A port on 127.0.0.1 that nothing listens on (bound, then released)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def remote_pair(
    tmp_path: Path,
    url: str,
    model: str = "tiny",
    *,
    kind: str | None = "specchat",
    api_key_env: str | None = None,
    name: str = "remote",
    extra: str = "",
    **target: Any,
) -> PairConfig:
    """A remote pair parsed from a real models.yaml entry (the same path as a user's file); ``target``: more
    fields of its target block (no_progress_s=1.0 ...)."""
    fields = [f"server: {url}", f"model: {model}", *(f"{k}: {v}" for k, v in target.items())]
    if kind is not None:
        fields.append(f"kind: {kind}")
    if api_key_env is not None:
        fields.append(f"api_key_env: {api_key_env}")
    path = tmp_path / f"{name}.yaml"
    path.write_text(f"pairs:\n  - name: {name}\n    target: {{{', '.join(fields)}}}\n{extra}", encoding="utf-8")
    return load_pairs_file(path)[name]


class SlowEngine:
    """An EngineAPI around another that waits ``first_s`` before the first event and ``step_s`` before each
    later one (a slow server: a large model's prefill, a slow step)."""

    def __init__(self, engine: Any, *, first_s: float = 0.0, step_s: float = 0.0) -> None:
        self.engine, self.first_s, self.step_s = engine, first_s, step_s
        self.blocks_in_use = getattr(engine, "blocks_in_use", None)

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[StepEvent]:
        cancel = cancel or threading.Event()
        for index, event in enumerate(self.engine.generate(request, cancel)):
            if cancel.wait(self.first_s if index == 0 else self.step_s):
                pass  # cancelled while waiting: the engine sees it at its next step
            yield event

    def forget(self, conversation: str) -> None:
        self.engine.forget(conversation)

    def close(self) -> None:
        self.engine.close()


@contextlib.contextmanager
def server_process(*, step_s: float = 0.0) -> Iterator[tuple[subprocess.Popen, str]]:
    """`specchat serve` of a tiny random-weight engine in a child process (tiny_server.py); yields (process, base
    URL). The process is killed at the end if still alive."""
    proc = subprocess.Popen(
        [sys.executable, str(SUPPORT / "tiny_server.py"), str(step_s)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and not line.startswith("http://"):
            line = proc.stdout.readline().strip() if proc.stdout else ""
            if proc.poll() is not None:
                raise RuntimeError(f"tiny server exited: {proc.stderr.read() if proc.stderr else ''}")
        yield proc, line
    finally:
        if proc.poll() is None:
            proc.kill()
        proc.wait(30)
