"""`python fake_llama_server.py ARGS...`: a stand-in for llama.cpp's ``llama-server`` in the bench's tests (CI has no
llama.cpp binary). It takes llama-server's arguments, serves ``/health`` (503 for the first two calls, as a
server still loading) and ``/completion`` on ``--host``/``--port``, and appends what it was given (its argv,
then each request's JSON body) to the file named by ``FAKE_LLAMA_SERVER_LOG``, one JSON line each.

A completion is deterministic: token ``(last prompt id + i) % 100 + 3`` for i = 1 .. ``n_predict``, ended early
when the text of those tokens ("t<id>" words) contains a stop string (``stop_type`` "word"); its ``timings`` hold
prompt_n/prompt_ms/predicted_n/predicted_ms, and draft_n/draft_n_accepted (half of them accepted) when it was
started with ``--spec-type``. ``FAKE_LLAMA_SERVER_FAIL=start`` makes it exit at once with a message on stderr.
"""

from __future__ import annotations

import json
import os
import sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


def _arg(argv: list[str], name: str, default: str | None = None) -> str | None:
    return argv[argv.index(name) + 1] if name in argv else default


def _log(record: dict) -> None:
    path = os.environ.get("FAKE_LLAMA_SERVER_LOG")
    if path:
        with open(path, "a", encoding="utf-8") as handle:
            handle.write(json.dumps(record) + "\n")


def main(argv: list[str]) -> None:
    if os.environ.get("FAKE_LLAMA_SERVER_FAIL") == "start":
        print("error: failed to load model 'x.gguf'", file=sys.stderr)
        raise SystemExit(1)
    _log({"argv": argv, "ld_library_path": os.environ.get("LD_LIBRARY_PATH", "")})
    spec_type = _arg(argv, "--spec-type")
    health_calls = [0]

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:  # quiet
            pass

        def _send(self, status: int, body: dict) -> None:
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def do_GET(self) -> None:
            if self.path == "/health":
                health_calls[0] += 1
                ready = health_calls[0] > 2
                self._send(200 if ready else 503, {"status": "ok" if ready else "loading model"})
            else:
                self._send(404, {"error": "not found"})

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            _log({"request": body})
            prompt = body["prompt"]
            tokens, text, stop_type = [], "", "limit"
            for i in range(1, int(body["n_predict"]) + 1):
                token = (prompt[-1] + i) % 100 + 3
                tokens.append(token)
                text += f" t{token}"
                if any(stop in text for stop in body.get("stop", [])):
                    stop_type = "word"
                    break
            timings = {"prompt_n": len(prompt), "prompt_ms": 5.0, "predicted_n": len(tokens), "predicted_ms": 10.0}
            if spec_type:
                timings.update(draft_n=2 * len(tokens), draft_n_accepted=len(tokens))
            self._send(200, {"content": text, "tokens": tokens, "stop_type": stop_type, "timings": timings})

    host, port = _arg(argv, "--host", "127.0.0.1"), int(_arg(argv, "--port", "8080") or 8080)
    ThreadingHTTPServer((host or "127.0.0.1", port), Handler).serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main(sys.argv[1:])
