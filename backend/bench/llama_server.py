"""llama.cpp's HTTP server (``llama-server``) on the pair's GGUF: the baseline users run for speculative decoding.

Modes ``llama-server`` (plain) and ``llama-server-ngram`` (``--spec-type ngram-mod``, or the type after a colon;
``modes.py``) run in `specchat bench`'s interleaved protocol beside specchat's modes (``runner.py``).

Contract: :func:`find_binary` takes ``--llama-server PATH`` or looks ``llama-server`` up on PATH; :func:`unavailable`
says why the modes cannot run (no binary, a target that is not a GGUF). :class:`LlamaServer` starts one server
per mode when the runner is built: the binary with ``LD_LIBRARY_PATH`` led by its own folder (a build tree keeps
its shared libraries beside it), on the GGUF, ``-t``/``-tb`` the bench's threads, the pair's context, one slot,
listening on a free loopback port, logging to a file; it waits for ``/health`` (a server that exits or stays
unready for ``startup_s`` raises :class:`RequestError` with the end of its log). :meth:`LlamaServer.generate`
sends specchat's rendered prompt ids to ``/completion`` (the GGUF's vocabulary: the same ids) with the same
``n_predict``, seed and stop strings, greedy or at the bench's temperature, ``cache_prompt`` off so every run
prefills its whole prompt, and times the whole request as the bench times specchat (prefill included); the
server's own ``timings`` (prefill and decode milliseconds, drafted and accepted tokens) are kept beside.
:meth:`LlamaServer.close` stops the process (terminate, then kill) and is idempotent.
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from specchat.backend.errors import RequestError

BINARY = "llama-server"
STARTUP_S = 120.0  # loading a GGUF of a few GB from a cold disk
REQUEST_S = 1800.0  # one completion: a few thousand tokens on two slow cores
INSTALL_HINT = (
    "build llama.cpp (cmake -B build && cmake --build build --target llama-server) and pass --llama-server "
    "PATH/TO/llama-server, or put llama-server on PATH"
)


def find_binary(given: str | None) -> Path | None:
    """``given`` (a path, or a name looked up on PATH), else ``llama-server`` on PATH; None when not found."""
    if given:
        path = Path(given).expanduser()
        if path.is_file():
            return path.resolve()
        found = shutil.which(given)
        return Path(found) if found else None
    found = shutil.which(BINARY)
    return Path(found) if found else None


def unavailable(given: str | None, gguf: Path | None) -> str | None:
    """Why the llama-server modes cannot run (None when they can)."""
    binary = find_binary(given)
    if binary is None:
        where = f"--llama-server {given!r} is not a file or a command on PATH" if given else "no llama-server on PATH"
        return f"{where}; {INSTALL_HINT}"
    if not os.access(binary, os.X_OK):
        return f"{binary} is not executable (chmod +x it)"
    if gguf is None:
        return "the pair's target is not a GGUF file (packaged or a .gguf path), which llama-server needs"
    return None


@dataclass(slots=True)
class Generation:
    token_ids: list[int]
    wall_s: float
    ttft_s: float | None  # the server's prompt processing time (it does not stream here)
    finish_reason: str  # "eos" | "stop" | "length"
    timings: dict[str, Any] = field(default_factory=dict)  # the server's: prompt_ms, predicted_ms, draft_n, ...


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        probe.bind(("127.0.0.1", 0))
        return int(probe.getsockname()[1])


class LlamaServer:
    """One llama-server process (see the module docstring); ``spec_type`` None: plain decoding; ``extra``: more of
    llama-server's arguments (the benchmarks': embeddings, batch sizes, cache types)."""

    def __init__(
        self,
        binary: Path,
        gguf: Path,
        *,
        spec_type: str | None,
        threads: int,
        context_length: int,
        startup_s: float = STARTUP_S,
        port: int | None = None,
        extra: Sequence[str] = (),
    ) -> None:
        self.binary, self.gguf, self.spec_type = binary, gguf, spec_type
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.command = (
            [
                str(binary),
                "-m",
                str(gguf),
                "-t",
                str(threads),
                "-tb",
                str(threads),
                "-c",
                str(context_length),
                "-np",
                "1",
                "--host",
                "127.0.0.1",
                "--port",
                str(self.port),
                "--no-webui",
            ]
            + (["--spec-type", spec_type] if spec_type else [])
            + list(extra)
        )
        self._log = tempfile.NamedTemporaryFile(prefix="specchat-llama-server-", suffix=".log", delete=False)
        env = dict(os.environ)
        env["LD_LIBRARY_PATH"] = os.pathsep.join(filter(None, [str(binary.parent), env.get("LD_LIBRARY_PATH")]))
        self.process: subprocess.Popen[bytes] | None = subprocess.Popen(
            self.command, stdout=self._log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, env=env
        )
        try:
            self._wait_ready(startup_s)
        except BaseException:
            self.close()
            raise

    def _log_tail(self, lines: int = 12) -> str:
        try:
            text = Path(self._log.name).read_text(encoding="utf-8", errors="replace")
        except OSError:
            return ""
        return "\n".join(text.strip().splitlines()[-lines:])

    def _wait_ready(self, startup_s: float) -> None:
        deadline = time.monotonic() + startup_s
        while time.monotonic() < deadline:
            if self.process is None or self.process.poll() is not None:
                code = self.process.returncode if self.process is not None else None
                raise RequestError(
                    f"llama-server ({' '.join(self.command[:3])} ...) exited with code {code} while starting; "
                    f"its log ends:\n{self._log_tail()}"
                )
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as reply:
                    if reply.status == 200:
                        return
            except (urllib.error.URLError, OSError, ValueError):
                pass
            time.sleep(0.2)
        raise RequestError(f"llama-server was not ready after {startup_s:.0f} s; its log ends:\n{self._log_tail()}")

    def generate(
        self,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        stop: tuple[str, ...] = (),
        eos_ids: frozenset[int] = frozenset(),
    ) -> Generation:
        """One completion of ``prompt_ids`` (see the module docstring)."""
        body = {
            "prompt": [int(t) for t in prompt_ids],
            "n_predict": int(max_new_tokens),
            "temperature": float(temperature),
            "top_k": 1 if temperature <= 0 else 0,
            "top_p": 1.0,
            "min_p": 0.0,
            "repeat_penalty": 1.0,
            "seed": int(seed) & 0xFFFFFFFF,
            "stop": list(stop),
            "cache_prompt": False,
            "return_tokens": True,
            "stream": False,
        }
        request = urllib.request.Request(
            self.url + "/completion",
            data=json.dumps(body).encode("utf-8"),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        start = time.perf_counter()
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_S) as reply:
                data = json.loads(reply.read().decode("utf-8"))
        except (urllib.error.URLError, OSError, ValueError) as error:
            raise RequestError(
                f"llama-server at {self.url} failed a completion ({error}); its log ends:\n{self._log_tail()}"
            ) from None
        wall = time.perf_counter() - start
        tokens = [int(t) for t in data.get("tokens") or []]
        timings = data.get("timings") if isinstance(data.get("timings"), dict) else {}
        prompt_ms = timings.get("prompt_ms")
        if data.get("stop_type") == "word":
            reason = "stop"
        elif data.get("stop_type") == "eos" or (tokens and tokens[-1] in eos_ids):
            reason = "eos"
        else:
            reason = "length"
        ttft = float(prompt_ms) / 1000 if isinstance(prompt_ms, (int, float)) else None
        return Generation(tokens, wall, ttft, reason, dict(timings))

    def close(self) -> None:
        process, self.process = self.process, None
        if process is not None and process.poll() is None:
            process.terminate()
            try:
                process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait(timeout=10)
        if not self._log.closed:
            self._log.close()
            Path(self._log.name).unlink(missing_ok=True)


def llama_servers(engine, modes, given: str | None) -> dict[str, LlamaServer]:
    """A started server per llama-server mode's drafter ("none" or an n-gram type), on ``engine``'s GGUF, context
    and thread count; {} without such modes. RequestError says why they cannot run."""
    kinds = list(dict.fromkeys(m.drafter for m in modes if m.runner == "llama-server"))
    if not kinds:
        return {}
    import torch

    from specchat.backend.models.loading.pair import gguf_path

    gguf = gguf_path(engine.target.spec)
    reason = unavailable(given, gguf)
    binary = find_binary(given)
    if reason is not None or binary is None or gguf is None:
        raise RequestError(f"llama-server modes cannot run: {reason}")
    servers: dict[str, LlamaServer] = {}
    try:
        for kind in kinds:
            servers[kind] = LlamaServer(
                binary,
                gguf,
                spec_type=None if kind == "none" else kind,
                threads=torch.get_num_threads(),
                context_length=engine.context_length,
            )
    except BaseException:
        for server in servers.values():
            server.close()
        raise
    return servers
