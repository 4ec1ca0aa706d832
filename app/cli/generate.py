"""`specchat generate`: headless generation for scripts, benchmarks and checks.

With ``--json`` stdout carries one JSON object per sample and nothing else; progress, notices and library
output go to stderr. Without it, the reply text streams to stdout and a one-line summary goes to stderr. Both
report the seed the reply was sampled with (``--seed``, else one drawn per sample): the same command with
``--seed`` set to it replays the reply, whatever ``--drafter`` and ``--gamma``.
Whatever stdout's encoding (ascii, cp1252, latin-1, ...), nothing is lost to a UnicodeEncodeError: JSON is
written ASCII-only (``\\u`` escapes, exact) unless stdout is UTF-8, and text characters the encoding lacks are
written as ``?`` with one notice on stderr.

``read_prompts`` is the ``--prompts`` file's input boundary: every line is parsed with bounded size, depth and
numbers (``backend/inputs.py``) and checked; anything else raises :class:`RequestError` naming the file, the
line and what a line must look like, before any model loads.

A remote pair (its target is a server) streams from that server through ``specchat.backend.remote``; its "stats"
hold the same fields, null where the server does not report one. A reply that ended in an error (a server that
broke off) is still printed, and the exit code is 1.
"""

from __future__ import annotations

import argparse
import codecs
import json
import re
import sys
from typing import Any

from specchat.app.cli.generate_batch import run_batched, show_reply
from specchat.app.tui.bridge import step_name
from specchat.backend.api import EngineAPI
from specchat.backend.errors import RequestError, SpecchatError
from specchat.backend.inputs import InputError, parse_json, shown
from specchat.backend.redact import terminal_safe

_C1 = re.compile("[\x7f-\x9f]")  # not escaped by json.dumps(ensure_ascii=False); a terminal may act on them

MAX_LINE_CHARS = 64 << 20  # one --prompts line: more text than any context holds
MAX_FILE_BYTES = 1 << 30
_LINE_FORM = '{"id": ..., "messages": [{"role": ..., "content": ...}]}'


def read_prompts(path: str) -> list[tuple[str, list[dict]]]:
    """Parse a --prompts file; errors name the file, the line and what is wrong."""
    from specchat.backend.engine.prompting import validate_messages

    name = path if path.isprintable() and len(path) <= 300 else shown(path)  # as messages show it
    try:
        with open(path, "rb") as handle:  # a pipe works too (--prompts <(...))
            data = handle.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise RequestError(f"--prompts file {name} does not exist") from None
    except (OSError, ValueError) as error:  # ValueError: a NUL byte in the path
        reason = getattr(error, "strerror", None) or error
        raise RequestError(f"cannot read --prompts file {name}: {reason}; check the path and its permissions") from None
    if len(data) > MAX_FILE_BYTES:
        raise RequestError(
            f"--prompts file {name} is larger than {MAX_FILE_BYTES >> 20} MiB; split it into several files"
        )
    raw_lines = data.splitlines()
    prompts = []
    for number, raw in enumerate(raw_lines, 1):
        where = f"{name}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise RequestError(
                f"{where}: not UTF-8 text (byte {raw[error.start]:#04x} at column {error.start + 1}); "
                "save the file as UTF-8"
            ) from None
        if not line.strip():
            continue
        try:
            item = parse_json(line, max_chars=MAX_LINE_CHARS)
        except InputError as error:
            at = f" at column {error.column}" if error.column is not None else ""
            raise RequestError(
                f"{where}: not valid JSON ({error.reason}{at}); each line must be {_LINE_FORM}"
            ) from None
        if not isinstance(item, dict) or not isinstance(item.get("messages"), list) or not item["messages"]:
            raise RequestError(f'{where}: needs a non-empty "messages" list of {{"role", "content"}} objects')
        try:
            messages = validate_messages(item["messages"])
        except RequestError as error:
            raise RequestError(f"{where}: {error}") from None
        # Lone surrogates (JSON "\ud800") cannot be printed as UTF-8: the id is echoed in the output.
        pid = str(item.get("id", number)).encode("utf-8", "replace").decode("utf-8")
        prompts.append((pid, messages))
    if not prompts:
        raise RequestError(f"--prompts file {name} has no prompts")
    return prompts


def read_prediction(path: str) -> str:
    """The ``--prediction-file``'s text (UTF-8); RequestError naming the file and what to do otherwise."""
    from specchat.backend.limits import MAX_PREDICTION_CHARS

    name = path if path.isprintable() and len(path) <= 300 else shown(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(4 * MAX_PREDICTION_CHARS + 1)
    except FileNotFoundError:
        raise RequestError(f"--prediction-file {name} does not exist") from None
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or error
        raise RequestError(f"cannot read --prediction-file {name}: {reason}; check the path") from None
    try:
        text = data.decode("utf-8-sig")
    except UnicodeDecodeError as error:
        raise RequestError(
            f"--prediction-file {name} is not UTF-8 text (byte {data[error.start]:#04x} at offset {error.start}); "
            "save it as UTF-8"
        ) from None
    if len(text) > MAX_PREDICTION_CHARS:
        raise RequestError(
            f"--prediction-file {name} has {len(text)} characters, more than {MAX_PREDICTION_CHARS}; a prediction "
            "longer than any context cannot be drafted from"
        )
    return text


class _Stdout:
    """Writes to ``sys.stdout`` what its encoding can take (see the module docstring); ``replaced`` says whether
    a character had to become ``?``."""

    def __init__(self) -> None:
        self.encoding = getattr(sys.stdout, "encoding", None) or "utf-8"
        try:
            self.utf = codecs.lookup(self.encoding).name.startswith("utf")
        except LookupError:
            self.encoding, self.utf = "ascii", False
        self.replaced = False
        self.terminal = sys.stdout.isatty()

    def write(self, text: str, *, exact: bool = False) -> None:
        # A reply may echo escapes (from a prompt file, a model's output): none reaches a terminal; a pipe gets all.
        if self.terminal and not exact:
            text = terminal_safe(text)
        try:
            text.encode(self.encoding)
        except UnicodeEncodeError:
            text = text.encode(self.encoding, "replace").decode(self.encoding)
            self.replaced = True
        sys.stdout.write(text)
        sys.stdout.flush()

    def json_line(self, record: dict) -> None:
        line = json.dumps(record, ensure_ascii=not self.utf)  # escapes C0 controls; DEL and C1 too, below
        self.write(_C1.sub(lambda m: f"\\u{ord(m.group()):04x}", line) + "\n", exact=True)

    def notice(self) -> None:
        if self.replaced:
            print(
                f"specchat: stdout's encoding ({self.encoding}) cannot show some characters of the reply; they "
                "were written as '?'. Set PYTHONIOENCODING=utf-8, or use --json (exact \\u escapes).",
                file=sys.stderr,
            )


_last_step: list[str] = []  # the step last printed when stderr is not a terminal


def _progress(message: str, fraction: float | None) -> None:
    """Loading progress on stderr: one line redrawn in place on a terminal; to a file or a pipe, one plain line
    per step (no carriage returns or escape sequences, which only a terminal understands)."""
    suffix = f" {fraction:4.0%}" if fraction is not None else ""
    if sys.stderr.isatty():
        print(
            f"\r\x1b[2K{message}{suffix}",
            end="" if fraction is not None and fraction < 1 else "\n",
            file=sys.stderr,
            flush=True,
        )
        return
    step = step_name(message)
    if _last_step[-1:] != [step]:
        _last_step[:] = [step]
        print(message, file=sys.stderr, flush=True)


def _confirm_download(num_bytes: int) -> bool:
    from specchat.backend.models.facts.memory import format_bytes

    if not sys.stdin.isatty():
        print(
            f"specchat: the pair needs a download of {format_bytes(num_bytes)}; run interactively to confirm, "
            "or download it first with `huggingface-cli download`",
            file=sys.stderr,
        )
        return False
    answer = input(f"Download {format_bytes(num_bytes)} from the Hugging Face hub? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def _history_replies() -> list[str] | None:
    """The newest replies of the chat history (an existing one only: generate never creates it), or None when
    the "earlier replies" setting is off. A history that cannot be read gives none (the reply is the same)."""
    from specchat.app.chat.history.store import DB_NAME, ChatStore
    from specchat.app.chat.settings import load_settings
    from specchat.app.cli.wiring import REPLY_MEMORY_CHARS
    from specchat.backend.paths import data_dir

    if not load_settings()[0].draft_from_history:
        return None
    if not (data_dir() / DB_NAME).is_file():
        return []
    try:
        with ChatStore() as store:
            return store.recent_replies(REPLY_MEMORY_CHARS)
    except SpecchatError as error:
        print(f"specchat: earlier replies are not used for drafting: {error}", file=sys.stderr)
        return []


def read_constraint(schema_path: str | None, grammar_path: str | None, jump_forward: bool = True) -> Any:
    """The ``--json-schema`` / ``--grammar`` file as a checked ConstraintSpec (None without either); RequestError
    naming the file and what is wrong (not UTF-8, not JSON, a schema or grammar the engine cannot take)."""
    from specchat.backend.api import ConstraintSpec
    from specchat.backend.constraint_spec import check_grammar

    path, flag = (schema_path, "--json-schema") if schema_path is not None else (grammar_path, "--grammar")
    if path is None:
        return None
    name = path if path.isprintable() and len(path) <= 300 else shown(path)
    try:
        with open(path, "rb") as handle:
            data = handle.read(MAX_CONSTRAINT_BYTES + 1)
    except FileNotFoundError:
        raise RequestError(f"{flag} file {name} does not exist") from None
    except (OSError, ValueError) as error:
        reason = getattr(error, "strerror", None) or error
        raise RequestError(f"cannot read {flag} file {name}: {reason}; check the path") from None
    if len(data) > MAX_CONSTRAINT_BYTES:
        raise RequestError(f"{flag} file {name} is larger than {MAX_CONSTRAINT_BYTES >> 20} MiB")
    try:
        text = data.decode("utf-8")
    except UnicodeDecodeError as error:
        raise RequestError(
            f"{flag} file {name} is not UTF-8 text (byte offset {error.start}); save it as UTF-8"
        ) from None
    if schema_path is not None:
        try:
            schema = parse_json(text, max_chars=MAX_CONSTRAINT_BYTES)
        except InputError as error:
            raise RequestError(f"{flag} file {name} is not valid JSON ({error.reason}); give a JSON schema") from None
        if not isinstance(schema, (dict, bool)):
            raise RequestError(f"{flag} file {name} holds a JSON {type(schema).__name__}; a JSON schema is an object")
        text = json.dumps(schema)
    try:
        spec = ConstraintSpec("json_schema" if schema_path is not None else "grammar", text, jump_forward)
        check_grammar(spec)
    except RequestError as error:
        raise RequestError(f"{flag} file {name}: {error}") from None
    return spec


MAX_CONSTRAINT_BYTES = 1 << 20


def run(args: argparse.Namespace) -> int:
    from specchat.backend.api import GenerationRequest, SamplingParams
    from specchat.backend.limits import DEFAULT_PAIR, check_seed_range
    from specchat.backend.models.catalog.config import PREDICTION_KINDS, get_pair, load_pairs

    check_seed_range(args.seed, args.samples)  # sample i uses seed + i: refused before anything loads
    SamplingParams(  # the sampling options' ranges (backend/limits.py), checked before the model loads
        temperature=args.temperature,
        top_k=args.top_k,
        top_p=args.top_p,
        repetition_penalty=args.repetition_penalty,
        seed=args.seed,
        max_new_tokens=args.max_new_tokens,
    )

    pair = get_pair(load_pairs(args.models), DEFAULT_PAIR if args.pair is None else args.pair)
    prompts = read_prompts(args.prompts) if args.prompts else [("prompt", [{"role": "user", "content": args.prompt}])]
    given = getattr(args, "prediction_file", None)
    prediction = read_prediction(given) if given is not None else None
    constraint = read_constraint(
        getattr(args, "json_schema", None), getattr(args, "grammar", None), not getattr(args, "no_jump_forward", False)
    )
    if prediction is not None and pair.remote is not None and pair.remote.server_kind not in PREDICTION_KINDS:
        raise RequestError(
            f"--prediction-file: pair {pair.name!r} runs on a {pair.remote.server_kind} server, which takes no "
            f"prediction (kinds {' and '.join(PREDICTION_KINDS)} do); leave --prediction-file out or pick another pair"
        )
    if args.system is not None:
        prompts = [
            (pid, [{"role": "system", "content": args.system}] + [m for m in msgs if m.get("role") != "system"])
            for pid, msgs in prompts
        ]
    engine: EngineAPI
    if pair.remote is not None:
        from specchat.backend.remote.client import RemoteEngine

        engine = RemoteEngine(pair)
    else:  # torch is imported only here
        from specchat.backend.engine.engine import load_engine
        from specchat.backend.models.loading.pair import capture_library_output

        with capture_library_output(progress=_progress):
            engine = load_engine(
                pair,
                device=args.device,
                progress=_progress,
                confirm_download=_confirm_download,
                parallel=getattr(args, "parallel", 1),
            )
        from specchat.app.cli.wiring import seed_reply_memory, start_line

        print(start_line(pair.name, engine), file=sys.stderr, flush=True)

        seed_reply_memory(engine, None if getattr(args, "no_history", False) else _history_replies, _progress)
    failed = False
    out = _Stdout()
    batch: list[tuple[str, int, GenerationRequest]] = []  # --parallel: run together once all are built
    parallel = getattr(args, "parallel", 1)
    try:
        for pid, messages in prompts:
            for sample in range(args.samples):
                seed = None if args.seed is None else args.seed + sample
                sampling = SamplingParams(
                    temperature=args.temperature,
                    top_k=args.top_k,
                    top_p=args.top_p,
                    repetition_penalty=args.repetition_penalty,
                    seed=seed,
                    max_new_tokens=args.max_new_tokens,
                    stop=tuple(args.stop or ()),
                )
                request = GenerationRequest(
                    messages=messages,
                    sampling=sampling,
                    drafter=args.drafter,
                    gamma=args.gamma,
                    # Batched replies run side by side: none shares a conversation's cache with another.
                    conversation=f"generate:{pid}" if parallel == 1 else None,
                    prediction=prediction,
                    constraint=constraint,
                )
                if parallel > 1 and pair.remote is None:
                    batch.append((pid, sample, request))
                    continue
                try:
                    failed = _one(engine, request, pid, sample, args.json, out) or failed
                except SpecchatError as error:  # name the prompt that failed (a file may hold thousands)
                    if not args.prompts:
                        raise
                    raise type(error)(f"{args.prompts}: prompt {shown(pid)}: {error}") from None
            engine.forget(f"generate:{pid}")
        if batch:
            failed = run_batched(
                engine, batch, parallel, args.prompts, lambda ev, pid, n: show_reply(ev, pid, n, args.json, out)
            )
    finally:
        engine.close()
        out.notice()
    return 1 if failed else 0


def _one(engine, request, pid: str, sample: int, as_json: bool, out: _Stdout) -> bool:
    """Run and print one reply; returns whether it ended in an error."""
    return show_reply(engine.generate(request), pid, sample, as_json, out)
