"""The `specchat` command line's option types (each refuses a bad value with a message naming what it expected)
and the options shared by subcommands; ``serve``'s options are defined here too, to keep app/cli/main.py short.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Sequence

from specchat.backend.inputs import shown
from specchat.backend.limits import DEFAULT_PARALLEL, MAX_GAMMA, SERVE_MAX_TOKENS, SERVE_PREFIX_CACHE_BYTES, is_gamma


def add_global_options(parser: argparse.ArgumentParser, *, suppress_defaults: bool) -> None:
    # The same options work before and after the subcommand name; in the subparsers they default to
    # SUPPRESS so that a value given before the subcommand is not overwritten by the subparser's default.
    default = argparse.SUPPRESS if suppress_defaults else None
    parser.add_argument(
        "--models",
        metavar="FILE",
        default=default,
        help="models.yaml to use instead of the packaged one (user overrides still apply)",
    )
    parser.add_argument(
        "--device", metavar="DEV", default=default, help="cuda, cuda:N or cpu (default: cuda when available, else cpu)"
    )


def positive_int(text: str) -> int:
    if not (text.isascii() and text.strip().isdigit() and len(text.strip()) <= 18):
        raise argparse.ArgumentTypeError(f"expected a whole number >= 1 written in digits 0-9, got {shown(text)}")
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def whole(text: str) -> int:
    """An integer option (--top-k, --seed): ranges are checked where the value is used, naming the option."""
    stripped = text.strip().removeprefix("-")
    if not (stripped.isascii() and stripped.isdigit() and len(stripped) <= 40):
        raise argparse.ArgumentTypeError(f"expected a whole number written in digits 0-9, got {shown(text)}")
    return int(text)


def megabytes(text: str) -> int:
    """A size in MiB, 0 or more (0: off)."""
    if not (text.isascii() and text.strip().isdigit() and len(text.strip()) <= 9):
        raise argparse.ArgumentTypeError(
            f"expected a number of MiB (0 or more) written in digits 0-9, got {shown(text)}"
        )
    return int(text)


def number(text: str) -> float:
    """A float option (--temperature, --top-p, ...): NaN and infinities pass here and are refused by range."""
    try:
        return float(text) if len(text) <= 100 else float("nan")
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {shown(text)}") from None


def one_of(choices: Sequence[str]) -> Callable[[str], str]:
    def check(text: str) -> str:
        if text not in choices:
            raise argparse.ArgumentTypeError(f"{shown(text)} is not one of {', '.join(choices)}")
        return text

    return check


def pair_name(text: str) -> str:
    if not text.strip():
        raise argparse.ArgumentTypeError("expected a pair name (see `specchat models`), got an empty name")
    return text


def port(text: str) -> int:
    if not (text.isascii() and text.strip().isdigit()) or not 0 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"expected a port from 0 to 65535, got {text!r}")
    return int(text)


def gamma(text: str) -> int | str:
    if text == "auto":
        return text
    if not (text.isascii() and text.strip().isdigit() and len(text.strip()) <= 18):
        raise argparse.ArgumentTypeError(f"expected a number of draft tokens or 'auto', got {shown(text)}")
    value = int(text)
    if not is_gamma(value):
        raise argparse.ArgumentTypeError(f"gamma must be between 1 and {MAX_GAMMA} (or 'auto'), got {value}")
    return value


def add_serve_parser(sub: argparse._SubParsersAction) -> None:
    """``specchat serve``'s options (app/cli/serve.py reads them)."""
    from specchat.app.serve.boundary import (
        DEFAULT_MAX_BODY_BYTES,
        DEFAULT_MAX_CONNECTIONS,
        DEFAULT_MAX_MESSAGES,
        DEFAULT_QUEUE,
    )

    serve = sub.add_parser(
        "serve",
        help="serve a pair over an OpenAI-compatible API",
        description="Serve one local pair over the OpenAI chat completions API (streaming, "
        "/v1/models, /metrics), with its speculation statistics per request.",
    )
    add_global_options(serve, suppress_defaults=True)
    serve.add_argument("--pair", metavar="NAME", type=pair_name, default=argparse.SUPPRESS, help="the pair to serve")
    serve.add_argument(
        "--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1: this machine only)"
    )
    serve.add_argument("--port", type=port, default=8000, help="port (default 8000; 0 picks a free one)")
    serve.add_argument(
        "--api-key-env",
        metavar="VAR",
        default=None,
        help="require the API key held in environment variable VAR (Authorization: Bearer KEY; default: "
        "SPECCHAT_API_KEY when set); required for a --host other than loopback",
    )
    serve.add_argument(
        "--queue",
        type=positive_int,
        default=DEFAULT_QUEUE,
        metavar="N",
        help=f"requests that may wait for the engine; more get 429 (default {DEFAULT_QUEUE})",
    )
    serve.add_argument(
        "--parallel",
        type=positive_int,
        default=DEFAULT_PARALLEL,
        metavar="N",
        help=f"requests decoded at once, their tokens in one pass of the model (continuous batching; default "
        f"{DEFAULT_PARALLEL}; 1: one at a time); more wait in the queue",
    )
    serve.add_argument(
        "--max-tokens",
        type=positive_int,
        default=SERVE_MAX_TOKENS,
        metavar="N",
        help=f"largest max_tokens a request may ask for (default {SERVE_MAX_TOKENS})",
    )
    serve.add_argument(
        "--max-body-bytes",
        type=positive_int,
        default=DEFAULT_MAX_BODY_BYTES,
        metavar="N",
        help=f"largest request body (default {DEFAULT_MAX_BODY_BYTES})",
    )
    serve.add_argument(
        "--max-messages",
        type=positive_int,
        default=DEFAULT_MAX_MESSAGES,
        metavar="N",
        help=f"most messages in one request; more get 413 (default {DEFAULT_MAX_MESSAGES})",
    )
    serve.add_argument(
        "--max-connections",
        type=positive_int,
        default=DEFAULT_MAX_CONNECTIONS,
        metavar="N",
        help=f"connections open at once; more get 503 (default {DEFAULT_MAX_CONNECTIONS})",
    )
    serve.add_argument(
        "--log",
        default="-",
        metavar="FILE",
        help="where the access log goes, one line per request: '-' stderr (default), a file, or 'off'",
    )
    serve.add_argument(
        "--log-prompts",
        action="store_true",
        help="add each request's last user message to its access-log line (off: no prompt text is logged)",
    )
    serve.add_argument(
        "--prefix-cache-mb",
        type=megabytes,
        default=SERVE_PREFIX_CACHE_BYTES >> 20,
        metavar="MB",
        help="K/V memory for each client's recent prompts, so a request resending a conversation reads only what "
        f"is new (default {SERVE_PREFIX_CACHE_BYTES >> 20}; 0: off)",
    )
    serve.add_argument(
        "--share-state",
        action="store_true",
        help="let requests learn from each other (reply memory, acceptance estimates, draft cache): faster "
        "for one trusted user; off by default, so no client's reply depends on or shows another's",
    )
