"""`python tiny_server.py STEP_S`: serve a tiny random-weight engine (tests/support/engine_fixtures.py) as model
"tiny" on 127.0.0.1:<free port>, each step slowed by STEP_S seconds; prints the base URL on stdout, then serves
until killed. The tests that need a server process they can kill mid-reply start it (serve_fixtures.py)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_fixtures import tiny_engine  # noqa: E402
from serve_fixtures import SlowEngine  # noqa: E402

from specchat.app.serve.server import ServeConfig, make_server  # noqa: E402


def main() -> None:
    step_s = float(sys.argv[1]) if len(sys.argv) > 1 else 0.0
    engine = SlowEngine(tiny_engine(), step_s=step_s)
    server = make_server(engine, ServeConfig(model="tiny"), host="127.0.0.1", port=0)
    print(f"http://127.0.0.1:{server.server_address[1]}/v1", flush=True)
    server.serve_forever(poll_interval=0.05)


if __name__ == "__main__":
    main()
