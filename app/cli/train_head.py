"""`specchat train-head`: train an EAGLE-3 draft head for a pair's target from the target's own replies.

    specchat train-head --pair NAME --prompts FILE.jsonl [--out DIR] [--steps N] [--resume] [--eval FILE.jsonl]

The prompts file has the `specchat generate --prompts` format. Progress lines go to stderr; the head lands in
``DIR/head`` (config.json + model.safetensors: give the pair ``head: DIR/head`` and ``drafter: eagle3`` or
``auto`` in your models.yaml) and the acceptance report in ``DIR/report.json`` (also printed). ``--resume``
continues a run stopped at any point (replies, features and checkpoints are kept in ``DIR``). The stages and
their formats: ``backend/training/pipeline.py``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path


def add_parser(sub, positive_int, number, pair_name) -> None:
    """The subcommand's options (``main.py`` passes its argument types)."""
    p = sub.add_parser(
        "train-head",
        help="train an EAGLE-3 draft head for a pair's target",
        description="Self-distillation: the target answers the prompts, an EAGLE-3 head learns from its hidden "
        "states (with the training-time test), then drafts for it. Resumable (--resume).",
    )
    p.add_argument("--pair", metavar="NAME", type=pair_name, default=argparse.SUPPRESS, help="the pair whose target")
    p.add_argument("--prompts", metavar="FILE.jsonl", required=True, help="training prompts (generate's format)")
    p.add_argument("--out", metavar="DIR", default="head_out", help="work folder and result (default: head_out)")
    p.add_argument("--steps", type=positive_int, default=2000, metavar="N", help="optimizer steps (default 2000)")
    p.add_argument("--resume", action="store_true", help="continue the run in --out")
    p.add_argument("--eval", metavar="FILE.jsonl", default=None, help="held-out prompts for the report")
    p.add_argument("--batch", type=positive_int, default=8, metavar="N", help="windows per step (default 8)")
    p.add_argument("--lr", type=number, default=3e-4, metavar="LR", help="peak learning rate (default 3e-4)")
    p.add_argument("--draft-vocab", type=positive_int, default=8192, metavar="N", help="draft ids (default 8192)")
    p.add_argument("--max-new-tokens", type=positive_int, default=256, metavar="N", help="reply length (default 256)")
    p.add_argument("--temperature", type=number, default=0.0, metavar="T", help="replies' temperature (0: greedy)")
    p.add_argument("--ttt-steps", type=positive_int, default=5, metavar="N", help="training-time test depth (5)")
    p.add_argument("--seed", type=int, default=0, metavar="S")
    p.add_argument(
        "--max-minutes", type=number, default=None, metavar="M", help="stop training after M minutes (resumable)"
    )


_last: list[str] = []


def _progress(message: str, *_: object) -> None:
    """One line per message on stderr, with the time (a message repeated with a new fraction: once)."""
    if _last[-1:] == [message]:
        return
    _last[:] = [message]
    print(f"[{time.strftime('%H:%M:%S')}] {message}", file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> int:
    from specchat.app.cli.generate import _confirm_download, read_prompts
    from specchat.backend.errors import RequestError
    from specchat.backend.limits import DEFAULT_PAIR, check_sampling_value
    from specchat.backend.models.catalog.config import get_pair, load_pairs

    pair = get_pair(load_pairs(args.models), DEFAULT_PAIR if args.pair is None else args.pair)
    if pair.remote is not None:
        raise RequestError(f"pair {pair.name!r} runs on a server: train-head needs the target in this process")
    check_sampling_value("temperature", args.temperature)
    if args.max_minutes is not None and not args.max_minutes > 0:
        raise RequestError(f"--max-minutes {args.max_minutes!r}: use a number of minutes above 0")
    if not 0 < args.lr < 1:
        raise RequestError(f"--lr {args.lr!r}: use a learning rate between 0 and 1, e.g. 3e-4")
    prompts = read_prompts(args.prompts)
    eval_prompts = read_prompts(args.eval) if args.eval else None
    if len(prompts) < 2 and eval_prompts is None:
        raise RequestError(f"--prompts {args.prompts}: give at least 2 prompts (one is held out for the report)")
    out = Path(args.out)
    if not args.resume and (out / "replies.jsonl").exists():
        raise RequestError(f"--out {out} holds an earlier run: add --resume to continue it, or pick another folder")
    from specchat.backend.models.loading.pair import capture_library_output, user_callback
    from specchat.backend.training.pipeline import Options
    from specchat.backend.training.pipeline import run as run_pipeline

    options = Options(
        steps=args.steps,
        batch=args.batch,
        lr=args.lr,
        ttt_steps=args.ttt_steps,
        draft_vocab=args.draft_vocab,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        seed=args.seed,
        resume=args.resume,
        max_minutes=args.max_minutes,
    )
    progress = user_callback(_progress)  # its lines reach the terminal through the capture
    assert progress is not None  # noqa: S101 - a callback was given
    with capture_library_output(progress=progress):
        report = run_pipeline(
            pair,
            prompts,
            out,
            options,
            eval_prompts=eval_prompts,
            device=args.device,
            progress=progress,
            confirm_download=_confirm_download,
        )
    print(json.dumps(report, indent=2))
    return 0
