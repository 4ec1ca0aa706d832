"""`specchat serve`: the local engine of one pair behind an OpenAI-compatible API (app/serve/).

Contract: ``run(args)`` (``args.pair``, ``models``, ``device``, ``host``, ``port``, ``api_key_env``, ``queue``,
``max_tokens``, ``max_body_bytes``, ``max_messages``, ``max_connections``, ``log``, ``log_prompts``,
``share_state``, ``prefix_cache_mb``, ``parallel``: streams batched at once) loads the pair's engine (its target's
pool holding that much more K/V for the prompts kept per client: backend/engine/prefix_cache.py), binds
``host:port`` (127.0.0.1 by default: only this machine can connect) and serves until Ctrl+C (then returns 0) or
SIGTERM, closing the engine. A remote pair cannot be served (RequestError: it already is, by its server). The API
key is read from the environment variable ``--api-key-env`` names, else from ``SPECCHAT_API_KEY``, never from the
command line (which other users of the machine can read); binding an address other than loopback without a key is
refused before the model loads. The access log (one line per request, app/serve/access.py) goes to stderr, to the
file ``--log`` names, or nowhere (``--log off``).
"""

from __future__ import annotations

import argparse
import ipaddress
import logging
import os
import sys
from typing import Any

from specchat.backend.errors import RequestError

DEFAULT_KEY_ENV = "SPECCHAT_API_KEY"


def is_loopback(host: str) -> bool:
    """Only this machine can reach ``host`` (127.0.0.0/8, ::1, localhost)."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def api_key_from(env: str | None) -> str | None:
    """The key in the variable ``env`` names (RequestError when it is unset or empty), else in
    ``SPECCHAT_API_KEY`` when that is set, else None."""
    if env is None:
        return os.environ.get(DEFAULT_KEY_ENV) or None
    key = os.environ.get(env)
    if not key:
        raise RequestError(f"--api-key-env {env}: the variable is not set (or empty); export {env}=<a key>")
    return key


def _access_log(destination: str) -> None:
    """Send the access log (logger ``specchat.serve.access``) and the server's errors to their places."""
    access = logging.getLogger("specchat.serve.access")
    access.propagate = False
    access.setLevel(logging.INFO)
    for handler in list(access.handlers):
        access.removeHandler(handler)
    if destination == "off":
        access.disabled = True
    else:
        try:
            handler = logging.StreamHandler(sys.stderr) if destination == "-" else logging.FileHandler(destination)
        except OSError as error:
            raise RequestError(
                f"--log {destination}: cannot open it ({error.strerror or error}); name a file you can write, "
                "'-' (stderr) or 'off'"
            ) from None
        handler.setFormatter(logging.Formatter("%(message)s"))
        access.addHandler(handler)
    errors = logging.getLogger("specchat.serve")
    if not errors.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("specchat serve: %(levelname)s: %(message)s"))
        errors.addHandler(handler)
        errors.propagate = False


def run(args: argparse.Namespace) -> int:
    from specchat.app.cli.generate import _confirm_download, _progress
    from specchat.app.serve.boundary import Limits
    from specchat.app.serve.protocol import Guard
    from specchat.app.serve.server import ServeConfig, make_server
    from specchat.backend.engine.engine import load_engine
    from specchat.backend.limits import DEFAULT_PAIR
    from specchat.backend.models.catalog.config import get_pair, load_pairs
    from specchat.backend.models.loading.capture import capture_library_output

    pair = get_pair(load_pairs(args.models), args.pair or DEFAULT_PAIR)
    if pair.remote is not None:
        raise RequestError(
            f"pair '{pair.name}' is a remote pair ({pair.target.source}): it is already served "
            "there; serve a local pair"
        )
    key = api_key_from(args.api_key_env)
    if not is_loopback(args.host) and key is None:
        raise RequestError(
            f"--host {args.host} lets other machines connect, so an API key is required: export "
            f"{DEFAULT_KEY_ENV}=<a key> (or name another variable with --api-key-env VAR); clients send "
            "'Authorization: Bearer <key>'"
        )
    _access_log(args.log)
    with capture_library_output(progress=_progress):
        engine = load_engine(
            pair,
            device=args.device,
            progress=_progress,
            confirm_download=_confirm_download,
            prefix_cache_bytes=args.prefix_cache_mb << 20,
            parallel=args.parallel,
        )
    from specchat.app.cli.wiring import start_line

    print(start_line(pair.name, engine), file=sys.stderr, flush=True)
    batch = None
    if args.parallel > 1:  # continuous batching: the requests' tokens in one pass (backend/engine/batch.py)
        from specchat.backend.engine.batch import BatchScheduler

        batch = BatchScheduler(engine, args.parallel, share=args.share_state).start()
    limits = Limits(max_body_bytes=args.max_body_bytes, max_tokens=args.max_tokens, max_messages=args.max_messages)
    config = ServeConfig(
        model=pair.name,
        limits=limits,
        queue_size=args.queue,
        api_key=key,
        blocks_in_use=getattr(engine, "blocks_in_use", None),
        guard=Guard(max_connections=args.max_connections),
        share_state=args.share_state,
        log_prompts=args.log_prompts,
        batch=batch,
        spec_tokens=spec_tokens(pair),
    )
    try:
        server = make_server(engine, config, host=args.host, port=args.port)
    except OSError as error:
        engine.close()
        raise RequestError(
            f"cannot listen on {args.host}:{args.port} ({error.strerror or error}); pick another --port or --host"
        ) from None
    address = server.server_address  # the socket's name after the bind: the host is a str (typeshed allows bytes)
    host, port = str(address[0]), address[1]
    shown = f"[{host}]" if ":" in host else host
    sharing = "; requests share what they learn (--share-state)" if args.share_state else ""
    print(
        f"specchat serve: pair {pair.name} on http://{shown}:{port}/v1 (model id '{pair.name}'; "
        f"{args.parallel} at once, queue {args.queue}; {'API key required' if key else 'no API key'}{sharing}; "
        "Ctrl+C stops)",
        file=sys.stderr,
        flush=True,
    )
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.close()
        engine.close()
    return 0


def spec_tokens(pair: Any) -> int:
    """The pair's configured γ as vLLM's ``num_spec_tokens`` says it: its gamma, or for auto the most the γ policy
    may draft (limits.MAX_GAMMA); 0 when the pair does not speculate."""
    from specchat.backend.limits import MAX_GAMMA

    if pair.drafter == "none":
        return 0
    return MAX_GAMMA if pair.gamma == "auto" else int(pair.gamma)
