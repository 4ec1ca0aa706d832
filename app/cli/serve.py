"""`specchat serve`: the local engine of one pair behind an OpenAI-compatible API (app/serve/).

Contract: ``run(args)`` (``args.pair``, ``models``, ``device``, ``host``, ``port``, ``api_key_env``, ``queue``,
``max_tokens``, ``max_body_bytes``) loads the pair's engine, binds ``host:port`` (127.0.0.1 by default: only this
machine can connect) and serves until Ctrl+C, then closes the engine and returns 0. A remote pair cannot be
served (RequestError: it already is, by its server). Binding another address without an API key is allowed but
warned about. The API key is read from the environment variable ``--api-key-env`` names, never from the command
line (which other users of the machine can read).
"""

from __future__ import annotations

import argparse
import os
import sys

from specchat.backend.errors import RequestError

LOOPBACK = ("127.0.0.1", "localhost", "::1")


def api_key_from(env: str | None) -> str | None:
    if env is None:
        return None
    key = os.environ.get(env)
    if not key:
        raise RequestError(f"--api-key-env {env}: the variable is not set (or empty); export {env}=<a key>")
    return key


def run(args: argparse.Namespace) -> int:
    from specchat.app.cli.generate import _confirm_download, _progress
    from specchat.app.serve.boundary import Limits
    from specchat.app.serve.server import ServeConfig, make_server
    from specchat.backend.engine.engine import load_engine
    from specchat.backend.limits import DEFAULT_PAIR
    from specchat.backend.models.capture import capture_library_output
    from specchat.backend.models.config import get_pair, load_pairs

    pair = get_pair(load_pairs(args.models), args.pair or DEFAULT_PAIR)
    if pair.remote is not None:
        raise RequestError(
            f"pair '{pair.name}' is a remote pair ({pair.remote.server}): it is already served "
            "there; serve a local pair"
        )
    key = api_key_from(args.api_key_env)
    if args.host not in LOOPBACK and key is None:
        print(
            f"specchat: warning: serving on {args.host} without an API key: anyone who can reach this machine "
            "can use the model (set --api-key-env VAR)",
            file=sys.stderr,
        )
    with capture_library_output(progress=_progress):
        engine = load_engine(pair, device=args.device, progress=_progress, confirm_download=_confirm_download)
    limits = Limits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens)
    blocks = getattr(engine, "blocks_in_use", None)
    config = ServeConfig(model=pair.name, limits=limits, queue_size=args.queue, api_key=key, blocks_in_use=blocks)
    try:
        server = make_server(engine, config, host=args.host, port=args.port)
    except OSError as error:
        engine.close()
        raise RequestError(
            f"cannot listen on {args.host}:{args.port} ({error.strerror or error}); pick another --port or --host"
        ) from None
    address = server.server_address  # the socket's name after the bind: the host is a str (typeshed allows bytes)
    host, port = str(address[0]), address[1]
    print(
        f"specchat serve: pair {pair.name} on http://{host}:{port}/v1 (model id '{pair.name}'; queue "
        f"{args.queue}; Ctrl+C stops)",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        engine.close()
    return 0
