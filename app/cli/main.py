"""The `specchat` command: the chat UI by default, and the subcommands `generate`, `bench` and `models`.

Only argument parsing and dispatch live here; each command's body is in its own module and is imported
lazily, so `specchat --help` answers without importing torch. User errors (:class:`SpecchatError`) are
printed as one line on stderr with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence

from specchat import __version__
from specchat.backend.bench.suites import SUITES

EPILOG = """\
commands:
  (none)      open the chat UI on the last used pair (first time: the embedded default smollm2-135m)
  generate    headless generation; --json prints one JSON object per sample on stdout
  bench       measure every decoding mode against transformers in one run
  models      list the model pairs of models.yaml with memory estimates

Run `specchat COMMAND --help` for a command's options.
"""


def _add_global_options(parser: argparse.ArgumentParser, *, suppress_defaults: bool) -> None:
    # The same options work before and after the subcommand name; in the subparsers they default to
    # SUPPRESS so that a value given before the subcommand is not overwritten by the subparser's default.
    default = argparse.SUPPRESS if suppress_defaults else None
    parser.add_argument("--models", metavar="FILE", default=default,
                        help="models.yaml to use instead of the packaged one (user overrides still apply)")
    parser.add_argument("--device", metavar="DEV", default=default,
                        help="cuda, cuda:N or cpu (default: cuda when available, else cpu)")


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a number >= 1, got {value}")
    return value


def _gamma(text: str) -> int | str:
    from specchat.backend.api import MAX_GAMMA

    if text == "auto":
        return text
    if not (text.isascii() and text.strip().isdigit()):
        raise argparse.ArgumentTypeError(f"expected a number of draft tokens or 'auto', got {text!r}")
    value = int(text)
    if not 1 <= value <= MAX_GAMMA:
        raise argparse.ArgumentTypeError(f"gamma must be between 1 and {MAX_GAMMA} (or 'auto'), got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specchat",
        description="Chat with local LLMs in the terminal, faster, with lossless speculative decoding.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"specchat {__version__}")
    _add_global_options(parser, suppress_defaults=False)
    parser.add_argument("--pair", metavar="NAME", default=None, help="model pair to open (see `specchat models`)")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser("generate", help="generate replies without the UI",
                         description="Generate replies headlessly (scripts, benchmarks, checks).")
    _add_global_options(gen, suppress_defaults=True)
    gen.add_argument("--pair", metavar="NAME", default=argparse.SUPPRESS)
    gen.add_argument("--drafter", choices=["none", "prompt-lookup", "draft-model", "auto"], default=None,
                     help="override the pair's drafter (auto: pick drafter and gamma for you)")
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="one user message")
    src.add_argument("--prompts", metavar="FILE.jsonl",
                     help='one {"id": ..., "messages": [{"role": ..., "content": ...}]} per line')
    gen.add_argument("--system", metavar="TEXT", default=None, help="a system prompt (none is added otherwise)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=None, metavar="N")
    gen.add_argument("--temperature", type=float, default=None, metavar="T", help="0 is greedy")
    gen.add_argument("--top-k", type=int, default=None, metavar="K")
    gen.add_argument("--top-p", type=float, default=None, metavar="P")
    gen.add_argument("--repetition-penalty", type=float, default=None, metavar="R")
    gen.add_argument("--seed", type=int, default=None, metavar="S")
    gen.add_argument("--samples", type=_positive_int, default=1, metavar="N",
                     help="samples per prompt (the prompt is prefilled once and reused)")
    gen.add_argument("--gamma", type=_gamma, default=None, metavar="N|auto",
                     help="draft tokens per step; a number fixes it and keeps speculation on")
    gen.add_argument("--json", action="store_true", help="one JSON object per sample on stdout, nothing else")

    from specchat.app.cli.bench import DEFAULT_LIMIT, DEFAULT_MAX_NEW_TOKENS, DEFAULT_REPEATS

    bench = sub.add_parser("bench", help="benchmark decoding modes against transformers (and llama.cpp)",
                           description="Measure specchat's modes against transformers generate() (and llama.cpp "
                                       "on the pair's GGUF when llama-cpp-python is installed) in one run.")
    _add_global_options(bench, suppress_defaults=True)
    bench.add_argument("--pair", metavar="NAME", action="append", default=argparse.SUPPRESS,
                       help="pair to measure (repeatable; default: smollm2-135m)")
    bench.add_argument("--suite", choices=list(SUITES), default="all",
                       help="prompt set: spec-bench, edit (code edits), all, or one family such as mt-bench "
                            "(default: all)")
    bench.add_argument("--limit", type=_positive_int, default=None, metavar="N",
                       help=f"prompts per family (default: {DEFAULT_LIMIT})")
    bench.add_argument("--max-new-tokens", type=_positive_int, default=None, metavar="N",
                       help=f"new tokens per reply (default: {DEFAULT_MAX_NEW_TOKENS})")
    bench.add_argument("--repeats", type=_positive_int, default=None, metavar="N",
                       help=f"runs of every prompt in every mode; the tables show the spread (default: "
                            f"{DEFAULT_REPEATS})")
    bench.add_argument("--modes", nargs="+", default=None, metavar="MODE",
                       help="subset of modes (e.g. plain prompt-lookup auto hf-plain hf-prompt-lookup "
                            "llamacpp-plain; default: every mode the pair allows)")
    bench.add_argument("--out", metavar="DIR", default="bench_out",
                       help="where the JSON and PNG go (default: bench_out)")
    bench.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 is greedy (default: 0)")
    bench.add_argument("--seed", type=int, default=0, metavar="S", help="(default: 0)")
    bench.add_argument("--synthetic", metavar="NAME", default=None,
                       help="random-weight models with real shapes on the device (GPU speed check)")

    models = sub.add_parser("models", help="list model pairs", description="List the pairs of models.yaml.")
    _add_global_options(models, suppress_defaults=True)
    models.add_argument("--pair", metavar="NAME", default=argparse.SUPPRESS, help="show only this pair")
    return parser


def _normalise(args: argparse.Namespace) -> argparse.Namespace:
    for name in ("models", "device", "pair"):
        if not hasattr(args, name):
            setattr(args, name, None)
    if args.command == "bench" and isinstance(args.pair, str):
        args.pair = [args.pair]
    return args


def main(argv: Sequence[str] | None = None) -> int:
    args = _normalise(build_parser().parse_args(argv))
    from specchat.backend.errors import SpecchatError

    try:
        if args.command == "generate":
            from specchat.app.cli import generate as command
        elif args.command == "bench":
            from specchat.app.cli import bench as command
        elif args.command == "models":
            from specchat.app.cli import models as command
        else:
            from specchat.app.cli import chat as command
        return command.run(args)
    except SpecchatError as error:
        print(f"specchat: error: {error}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("specchat: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `specchat generate ... | head`: the reader left; not an error worth a traceback
        try:
            sys.stdout = open(os.devnull, "w")  # noqa: SIM115 - Python flushes stdout at exit; keep it quiet
        except OSError:
            pass
        return 141
    except OSError as error:  # a file or folder specchat needed (cache, data, output) could not be used
        where = f"{error.filename}: " if error.filename else ""
        print(f"specchat: error: {where}{error.strerror or error}; check the path, its permissions and the free "
              "disk space", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
