"""`specchat` without a subcommand: the chat UI. The composition root of the app: it loads the pairs, opens the
history and builds the :class:`~specchat.app.tui.app.SpecchatApp` with the real backend's engine factory and
pair estimates (wiring.py), so the UI itself reaches the backend only through its API and these callables.

Contract: ``run(args)`` (``args.models``, ``args.device``, ``args.pair``, ``args.no_history``) returns the app's
exit code. With ``--no-history`` no history is opened (nothing read, nothing saved) and the suffix drafter
matches only the open conversation; otherwise each loaded pair's suffix drafter is seeded with the newest
earlier replies (when the "earlier replies" setting is on). An unknown
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
from collections.abc import Callable

from specchat.app.chat.history.store import ChatStore
from specchat.app.chat.settings import load_settings, settings_path
from specchat.app.cli.wiring import (
    LOG_FILE,
    REPLY_MEMORY_CHARS,
    default_engine_factory,
    default_pair_info,
    route_library_output,
)
from specchat.app.tui.app import SpecchatApp
from specchat.backend.errors import SpecchatError
from specchat.backend.models.catalog.config import get_pair, load_pairs
from specchat.backend.paths import log_dir


def earlier_replies(store: ChatStore) -> Callable[[], list[str] | None]:
    """What seeds a loaded pair's suffix drafter: the newest replies in the history (read at each load, so a
    pair chosen later also knows this session's replies), or None while the "earlier replies" setting is off."""

    def replies() -> list[str] | None:
        if not load_settings(settings_path())[0].draft_from_history:
            return None
        try:
            return store.recent_replies(REPLY_MEMORY_CHARS)
        except SpecchatError:
            return []  # an unreadable history drafts from the conversation only; the app reports the history

    return replies


def run(args: argparse.Namespace) -> int:
    """The `specchat` chat UI: loads the pairs and the history, runs the app, returns the exit code."""
    pairs = load_pairs(getattr(args, "models", None))
    if getattr(args, "pair", None):
        get_pair(pairs, args.pair)  # unknown: the error `specchat generate --pair` gives, before the UI starts
    device = getattr(args, "device", None)
    notices: list[str] = []
    store: ChatStore | None = None
    if getattr(args, "no_history", False):
        notices.append(
            "History is off (--no-history): this session's chats are not saved, and earlier replies "
            "are not used for drafting."
        )
    else:
        try:
            store = ChatStore()
        except SpecchatError as error:
            notices.append(f"History is disabled for this session: {error}")
        else:
            notices.extend(m for m in (store.recovery_message, store.read_only_message) if m)
    log_path = log_dir() / LOG_FILE
    with route_library_output(log_path):
        factory = default_engine_factory(device, None if store is None else earlier_replies(store))
        app = SpecchatApp(
            pairs,
            engine_factory=factory,
            pair_info=default_pair_info(device),
            store=store,
            initial_pair=getattr(args, "pair", None),
            log_path=log_path,
            startup_notices=notices,
        )
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
