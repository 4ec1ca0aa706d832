"""`specchat` without a subcommand: the chat UI. The composition root of the app: it loads the pairs, opens the
history and builds the :class:`~specchat.app.tui.app.SpecchatApp` with the real backend's engine factory and
pair estimates (wiring.py), so the UI itself reaches the backend only through its API and these callables.

Contract: ``run(args)`` (``args.models``, ``args.device``, ``args.pair``) returns the app's exit code. An unknown
``--pair`` is refused before anything opens, with the same ConfigError as `specchat generate --pair`. A history
that cannot be opened disables history for the session (a notification says why) instead of stopping the app;
a damaged one that was moved aside, or a read-only one, is reported the same way. Logging and warnings go to
``<log dir>/specchat.log`` while the app runs. Quitting during a load (maybe a multi-GB download) leaves at once
instead of waiting for it.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from specchat.app.chat.history.store import ChatStore
from specchat.app.cli.wiring import LOG_FILE, default_engine_factory, default_pair_info, route_library_output
from specchat.app.tui.app import SpecchatApp
from specchat.backend.errors import SpecchatError
from specchat.backend.models.config import get_pair, load_pairs
from specchat.backend.paths import log_dir


def run(args: argparse.Namespace) -> int:
    """The `specchat` chat UI: loads the pairs and the history, runs the app, returns the exit code."""
    pairs = load_pairs(getattr(args, "models", None))
    if getattr(args, "pair", None):
        get_pair(pairs, args.pair)  # unknown: the error `specchat generate --pair` gives, before the UI starts
    device = getattr(args, "device", None)
    notices: list[str] = []
    store: ChatStore | None
    try:
        store = ChatStore()
    except SpecchatError as error:
        store = None
        notices.append(f"History is disabled for this session: {error}")
    else:
        notices.extend(m for m in (store.recovery_message, store.read_only_message) if m)
    log_path = log_dir() / LOG_FILE
    with route_library_output(log_path):
        app = SpecchatApp(pairs, engine_factory=default_engine_factory(device), pair_info=default_pair_info(device),
                          store=store, initial_pair=getattr(args, "pair", None), log_path=log_path,
                          startup_notices=notices)
        result = app.run()
    if store is not None:
        store.close()
    if app.loading_pair is not None:
        # A load (maybe a multi-GB download) is still running in a worker thread, which the interpreter would
        # wait for at exit. History is closed and hub downloads resume later, so leave at once.
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(int(result or 0))
    return int(result or 0)
