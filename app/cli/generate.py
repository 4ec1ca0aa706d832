"""`specchat generate`: headless generation for scripts, benchmarks and checks.

With ``--json`` stdout carries one JSON object per sample and nothing else; progress, notices and library
output go to stderr. Without it, the reply text streams to stdout and a one-line summary goes to stderr. Both
report the seed the reply was sampled with (``--seed``, else one drawn per sample): the same command with
``--seed`` set to it replays the reply, whatever ``--drafter`` and ``--gamma``.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specchat.backend.api import RequestStats
from specchat.backend.errors import RequestError, SpecchatError


def read_prompts(path: str) -> list[tuple[str, list[dict]]]:
    """Parse a --prompts file; errors name the file, the line and what is wrong."""
    from specchat.backend.engine.prompting import validate_messages

    try:
        raw_lines = Path(path).read_bytes().splitlines()
    except FileNotFoundError:
        raise RequestError(f"--prompts file {path} does not exist") from None
    except OSError as error:
        raise RequestError(f"cannot read --prompts file {path}: {error.strerror or error}; check the path and "
                           "its permissions") from None
    prompts = []
    for number, raw in enumerate(raw_lines, 1):
        where = f"{path}:{number}"
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError as error:
            raise RequestError(f"{where}: not UTF-8 text (byte {raw[error.start]:#04x} at column {error.start + 1}); "
                               "save the file as UTF-8") from None
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except (json.JSONDecodeError, RecursionError) as error:
            reason = error.msg if isinstance(error, json.JSONDecodeError) else "nested too deeply"
            raise RequestError(f"{where}: not valid JSON ({reason}); each line must be "
                               '{"id": ..., "messages": [{"role": ..., "content": ...}]}') from None
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
        raise RequestError(f"--prompts file {path} has no prompts")
    return prompts


def _progress(message: str, fraction: float | None) -> None:
    suffix = f" {fraction:4.0%}" if fraction is not None else ""
    print(f"\r\x1b[2K{message}{suffix}", end="" if fraction is not None and fraction < 1 else "\n",
          file=sys.stderr, flush=True)


def _confirm_download(num_bytes: int) -> bool:
    if not sys.stdin.isatty():
        print(f"specchat: the pair needs a download of {num_bytes / 1e9:.1f} GB; run interactively to confirm, "
              "or download it first with `huggingface-cli download`", file=sys.stderr)
        return False
    answer = input(f"Download {num_bytes / 1e9:.1f} GB from the Hugging Face hub? [y/N] ")
    return answer.strip().lower() in ("y", "yes")


def run(args: argparse.Namespace) -> int:
    from specchat.backend.api import DEFAULT_PAIR, GenerationRequest, SamplingParams
    from specchat.backend.engine.engine import load_engine
    from specchat.backend.models.config import get_pair, load_pairs
    from specchat.backend.models.loading import capture_library_output

    pair = get_pair(load_pairs(args.models), args.pair or DEFAULT_PAIR)
    prompts = read_prompts(args.prompts) if args.prompts else [("prompt", [{"role": "user", "content": args.prompt}])]
    if args.system is not None:
        prompts = [(pid, [{"role": "system", "content": args.system}] + [m for m in msgs if m.get("role") != "system"])
                   for pid, msgs in prompts]
    with capture_library_output(progress=_progress):
        engine = load_engine(pair, device=args.device, progress=_progress, confirm_download=_confirm_download)
    try:
        for pid, messages in prompts:
            for sample in range(args.samples):
                seed = None if args.seed is None else args.seed + sample
                sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                                          repetition_penalty=args.repetition_penalty, seed=seed,
                                          max_new_tokens=args.max_new_tokens, stop=tuple(args.stop or ()))
                request = GenerationRequest(messages=messages, sampling=sampling, drafter=args.drafter,
                                            gamma=args.gamma, conversation=f"generate:{pid}")
                try:
                    _one(engine, request, pid, sample, args.json)
                except SpecchatError as error:  # name the prompt that failed (a file may hold thousands)
                    if not args.prompts:
                        raise
                    raise type(error)(f"{args.prompts}: prompt {pid!r}: {error}") from None
            engine.forget(f"generate:{pid}")
    finally:
        engine.close()
    return 0


def _one(engine, request, pid: str, sample: int, as_json: bool) -> None:
    token_ids: list[int] = []
    text: list[str] = []
    last = None
    for event in engine.generate(request):
        token_ids.extend(event.token_ids)
        text.append(event.text)
        if event.message:
            print(f"specchat: {event.message}", file=sys.stderr)
        if not as_json and event.text:
            sys.stdout.write(event.text)
            sys.stdout.flush()
        last = event
    stats = last.stats or RequestStats()
    if as_json:
        record = {
            "id": pid, "sample": sample, "seed": stats.seed, "text": "".join(text), "token_ids": token_ids,
            "prompt_tokens": stats.prompt_tokens, "finish_reason": last.finish_reason,
            "drafter": stats.drafter, "stats": stats.to_json_stats(),
        }
        print(json.dumps(record, ensure_ascii=False), flush=True)
    else:
        print(file=sys.stdout)
        rate = stats.acceptance_rate
        print(f"[{last.finish_reason}] {stats.new_tokens} tokens, {stats.tok_s or 0:.1f} tok/s, "
              f"drafter {stats.drafter}, acceptance "
              f"{'n/a' if rate is None else f'{rate:.0%}'}, τ {stats.mean_accepted_length or 0:.2f}, seed {stats.seed}",
              file=sys.stderr)
