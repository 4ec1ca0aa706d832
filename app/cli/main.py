"""The `specchat` command: the chat UI by default, and the subcommands `generate`, `bench`, `models`, `serve` and
`doctor`.

Only argument parsing and dispatch live here; each command's body is in its own module and is imported
lazily, so `specchat --help` answers without importing torch. User errors (:class:`SpecchatError`) are
printed as one line on stderr with exit code 2 and no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from types import ModuleType

from specchat import __version__
from specchat.app.cli.options import add_global_options as _add_global_options
from specchat.app.cli.options import add_serve_parser
from specchat.app.cli.options import gamma as _gamma
from specchat.app.cli.options import number as _number
from specchat.app.cli.options import one_of as _one_of
from specchat.app.cli.options import pair_name as _pair_name
from specchat.app.cli.options import positive_int as _positive_int
from specchat.app.cli.options import whole as _whole
from specchat.backend.bench.suites import SUITES
from specchat.backend.limits import BENCH_MAX_NEW_TOKENS, BENCH_SEED, BENCH_TEMPERATURE, DRAFTERS

EPILOG = """\
commands:
  (none)      open the chat UI on the last used pair (first time: the embedded default smollm2-135m)
  generate    headless generation; --json prints one JSON object per sample on stdout
  bench       measure every decoding mode against transformers in one run
  models      list the model pairs of models.yaml with memory estimates (remote pairs: reachable?)
  add         add a model (a .gguf file, a folder, a hub id or hf:ORG/NAME/FILE.gguf) to your models.yaml
  serve       the local engine behind an OpenAI-compatible API (for editors, agents, remote pairs)
  doctor      the state of this machine's CPU kernels; --rebuild-native builds them again
  train-head  train an EAGLE-3 draft head for a pair's target from its own replies

Run `specchat COMMAND --help` for a command's options.
"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="specchat",
        description="Chat with local LLMs in the terminal, faster, with lossless speculative decoding.",
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--version", action="version", version=f"specchat {__version__}")
    _add_global_options(parser, suppress_defaults=False)
    parser.add_argument(
        "--pair", metavar="NAME", type=_pair_name, default=None, help="model pair to open (see `specchat models`)"
    )
    parser.add_argument(
        "--no-history",
        action="store_true",
        help="neither read nor save chats this session; the suffix drafter drafts from the conversation only",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    gen = sub.add_parser(
        "generate",
        help="generate replies without the UI",
        description="Generate replies headlessly (scripts, benchmarks, checks).",
    )
    _add_global_options(gen, suppress_defaults=True)
    gen.add_argument("--pair", metavar="NAME", type=_pair_name, default=argparse.SUPPRESS)
    drafters = list(DRAFTERS)
    gen.add_argument(
        "--drafter",
        type=_one_of(drafters),
        choices=drafters,
        default=None,
        help="override the pair's drafter (suffix: trees of continuations seen in the conversation "
        "and in earlier replies; eagle3, medusa: the pair's draft head; auto: pick drafter and gamma for you)",
    )
    gen.add_argument(
        "--no-history",
        action="store_true",
        help="do not read the chat history (the suffix drafter then drafts from the conversation only)",
    )
    src = gen.add_mutually_exclusive_group(required=True)
    src.add_argument("--prompt", metavar="TEXT", help="one user message")
    src.add_argument(
        "--prompts", metavar="FILE.jsonl", help='one {"id": ..., "messages": [{"role": ..., "content": ...}]} per line'
    )
    gen.add_argument("--system", metavar="TEXT", default=None, help="a system prompt (none is added otherwise)")
    gen.add_argument("--max-new-tokens", type=_positive_int, default=None, metavar="N")
    gen.add_argument("--temperature", type=_number, default=None, metavar="T", help="0 is greedy")
    gen.add_argument("--top-k", type=_whole, default=None, metavar="K")
    gen.add_argument("--top-p", type=_number, default=None, metavar="P")
    gen.add_argument("--repetition-penalty", type=_number, default=None, metavar="R")
    gen.add_argument("--seed", type=_whole, default=None, metavar="S")
    gen.add_argument(
        "--stop",
        action="append",
        default=None,
        metavar="TEXT",
        help="end the reply where TEXT appears (repeatable; the text is cut there)",
    )
    gen.add_argument(
        "--parallel",
        type=_positive_int,
        default=1,
        metavar="N",
        help="decode N replies at once (--prompts, --samples): their tokens in one pass of the model; each reply "
        "is the one it gets alone (default 1)",
    )
    gen.add_argument(
        "--samples",
        type=_positive_int,
        default=1,
        metavar="N",
        help="samples per prompt (the prompt is prefilled once and reused)",
    )
    gen.add_argument(
        "--gamma",
        type=_gamma,
        default=None,
        metavar="N|auto",
        help="draft tokens per step; a number fixes it and keeps speculation on",
    )
    gen.add_argument(
        "--prediction-file",
        metavar="PATH",
        default=None,
        help="the expected reply (e.g. a file to rewrite): drafted from, the reply is still the model's own; "
        "--json reports accepted/rejected prediction tokens",
    )
    shape = gen.add_mutually_exclusive_group()
    shape.add_argument(
        "--json-schema",
        metavar="FILE",
        default=None,
        help="constrain the reply to JSON matching this JSON schema (every reply that ends parses and validates)",
    )
    shape.add_argument(
        "--grammar",
        metavar="FILE",
        default=None,
        help="constrain the reply to this grammar (Lark, or llama.cpp's GBNF)",
    )
    gen.add_argument(
        "--no-jump-forward",
        action="store_true",
        help="with --json-schema / --grammar: do not draft the tokens the grammar forces (to measure it)",
    )
    gen.add_argument("--json", action="store_true", help="one JSON object per sample on stdout, nothing else")

    from specchat.app.cli.bench import DEFAULT_LIMIT, DEFAULT_REPEATS

    bench = sub.add_parser(
        "bench",
        help="benchmark decoding modes against transformers (and llama.cpp)",
        description="Measure specchat's modes against transformers generate() (and llama.cpp "
        "on the pair's GGUF when llama-cpp-python is installed) in one run.",
    )
    _add_global_options(bench, suppress_defaults=True)
    bench.add_argument(
        "--pair",
        metavar="NAME",
        type=_pair_name,
        action="append",
        default=argparse.SUPPRESS,
        help="pair to measure (repeatable; default: smollm2-135m)",
    )
    bench.add_argument(
        "--suite",
        type=_one_of(list(SUITES)),
        choices=list(SUITES),
        default="all",
        help="prompt set: spec-bench, edit (code edits), all, rewrite (whole files with a small change, each with "
        "its file as prediction), or one family such as mt-bench (default: all)",
    )
    bench.add_argument(
        "--limit", type=_positive_int, default=None, metavar="N", help=f"prompts per family (default: {DEFAULT_LIMIT})"
    )
    bench.add_argument(
        "--prompts",
        metavar="FILE.jsonl",
        default=None,
        help="your own prompts instead of --suite, in generate's --prompts format (family 'custom'; --limit "
        "defaults to every prompt in the file)",
    )
    bench.add_argument(
        "--max-new-tokens",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"new tokens per reply (default: {BENCH_MAX_NEW_TOKENS})",
    )
    bench.add_argument(
        "--repeats",
        type=_positive_int,
        default=None,
        metavar="N",
        help=f"runs of every prompt in every mode; the tables show the spread (default: {DEFAULT_REPEATS})",
    )
    bench.add_argument(
        "--modes",
        nargs="+",
        default=None,
        metavar="MODE",
        help="subset of modes (e.g. plain prompt-lookup auto prediction hf-plain hf-prompt-lookup "
        "llamacpp-plain llama-server llama-server-ngram; default: every mode the pair allows)",
    )
    bench.add_argument(
        "--out", metavar="DIR", default="bench_out", help="where the JSON and PNG go (default: bench_out)"
    )
    bench.add_argument(
        "--temperature",
        type=_number,
        default=BENCH_TEMPERATURE,
        metavar="T",
        help=f"0 is greedy (default: {BENCH_TEMPERATURE:g})",
    )
    bench.add_argument("--seed", type=_whole, default=BENCH_SEED, metavar="S", help=f"(default: {BENCH_SEED})")
    bench.add_argument(
        "--profile",
        action="store_true",
        help="instead of the modes: where a decoding step's time goes (kernels, attention, norms and other "
        "elementwise steps, Python, sampling), plain and with the pair's drafter, on one chat and one edit prompt",
    )
    bench.add_argument(
        "--llama-server",
        metavar="PATH",
        default=None,
        help="the llama-server binary of the llama-server modes (default: llama-server on PATH)",
    )
    bench.add_argument(
        "--synthetic",
        metavar="NAME",
        default=None,
        help="random-weight models with real shapes on the device (GPU speed check)",
    )
    bench.add_argument(
        "--kernels",
        action="store_true",
        help="time the GGUF block kernels per weight type at 1/4/16/64 rows, beside the memory bound",
    )
    bench.add_argument(
        "--threads",
        type=_positive_int,
        default=None,
        metavar="N",
        help="CPU threads for --kernels (default: torch's current count)",
    )
    from specchat.app.cli import bench_replay

    bench_replay.add_options(bench, _positive_int)
    from specchat.app.cli import bench_structured

    bench_structured.add_options(bench)

    models = sub.add_parser("models", help="list model pairs", description="List the pairs of models.yaml.")
    _add_global_options(models, suppress_defaults=True)
    models.add_argument(
        "--pair", metavar="NAME", type=_pair_name, default=argparse.SUPPRESS, help="show only this pair"
    )

    add = sub.add_parser(
        "add",
        help="add a model pair to your models.yaml",
        description="Add a pair to your models.yaml from a model source alone (sizes are read from its files); "
        "with --draft, the draft's tokenizer must match the target's.",
    )
    _add_global_options(add, suppress_defaults=True)
    add.add_argument("source", help="a .gguf file, a model folder, a hub id org/name, or hf:ORG/NAME/FILE.gguf")
    add.add_argument("--draft", metavar="SOURCE", default=None, help="a smaller model of the same family")
    add.add_argument("--name", metavar="NAME", type=_pair_name, default=None, help="the pair's name")
    add.add_argument(
        "--replace",
        action="store_true",
        help="let the new pair replace a packaged pair of the same name (else that name is refused)",
    )

    add_serve_parser(sub)
    doctor = sub.add_parser(
        "doctor",
        help="check this machine's CPU kernels",
        description="Show whether this machine's CPU kernels (the native library) are built and check out.",
    )
    doctor.add_argument(
        "--rebuild-native",
        action="store_true",
        help="remove the cached CPU kernels (and a noted build failure) and build them again now",
    )
    from specchat.app.cli import train_head

    train_head.add_parser(sub, _positive_int, _number, _pair_name)
    return parser


def _normalise(args: argparse.Namespace) -> argparse.Namespace:
    for name in ("models", "device", "pair"):
        if not hasattr(args, name):
            setattr(args, name, None)
    if args.command == "bench" and isinstance(args.pair, str):
        args.pair = [args.pair]
    return args


MAX_ERROR_CHARS = 1000


def one_line(text: str) -> str:
    """``text`` as one printable line in any terminal encoding: control and line-break characters (a path or a
    value may hold them) and lone surrogates (undecodable bytes of a command-line argument) are escaped."""
    text = "".join(c if c.isprintable() or c == " " else repr(c)[1:-1] for c in text)
    if len(text) > MAX_ERROR_CHARS:  # a value no message abbreviated (a 5,000-character path): keep both ends
        text = (
            f"{text[: MAX_ERROR_CHARS // 2]} ...({len(text) - MAX_ERROR_CHARS:,} characters)... "
            f"{text[-MAX_ERROR_CHARS // 2 :]}"
        )
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _single_value_actions(parser: argparse.ArgumentParser) -> list[argparse.Action]:
    """The options of ``parser`` and its subcommands that take exactly one value."""
    found: list[argparse.Action] = []
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for sub in action.choices.values():
                found += _single_value_actions(sub)
        elif action.option_strings and action.nargs is None and isinstance(action, argparse._StoreAction):
            found.append(action)
    return found


def _parse(argv: Sequence[str] | None) -> argparse.Namespace:
    """Parse, refusing an option whose value argparse dropped: ``--models=--`` parses as an empty list (argparse
    strips a ``--`` value), which no one-value option can use."""
    parser = build_parser()
    args = parser.parse_args(argv)
    for action in _single_value_actions(parser):
        if getattr(args, action.dest, None) == []:
            parser.error(f"{action.option_strings[0]} needs a value: '--' is not one")
    return _normalise(args)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse(argv)
    from specchat.backend.engine.heap import one_arena
    from specchat.backend.errors import SpecchatError

    one_arena()  # before any thread starts: one that allocated first would keep an arena of its own, and hand it on

    command: ModuleType  # the subcommand's module: each has run(args) -> int
    try:
        if args.command == "generate":
            from specchat.app.cli import generate as command
        elif args.command == "bench":
            from specchat.app.cli import bench as command
        elif args.command == "models":
            from specchat.app.cli import models as command
        elif args.command == "add":
            from specchat.app.cli import add as command
        elif args.command == "serve":
            from specchat.app.cli import serve as command
        elif args.command == "doctor":
            from specchat.app.cli import doctor as command
        elif args.command == "train-head":
            from specchat.app.cli import train_head as command
        else:
            from specchat.app.cli import chat as command
        return command.run(args)
    except SpecchatError as error:
        print(f"specchat: error: {one_line(str(error))}", file=sys.stderr)
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
        print(
            one_line(
                f"specchat: error: {where}{error.strerror or error}; check the path, its permissions and "
                "the free disk space"
            ),
            file=sys.stderr,
        )
        return 2


if __name__ == "__main__":
    sys.exit(main())
