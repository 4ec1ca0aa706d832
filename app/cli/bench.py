"""`specchat bench`: every decoding mode against transformers, in one run, on the pair(s) asked for.

A remote pair (its target is a server) runs mode ``server`` (and, on `specchat serve`, the specchat drafter
modes) through backend/bench/remote.py; transformers modes are refused for it by name.

Contract: ``run(args) -> int`` with the namespace of app/cli/main.py's bench parser (pair: list | None, suite,
limit, max_new_tokens, modes, out, temperature, seed, models, device, synthetic, kernels, threads). Prints an
estimate of the run's time after the warm-up, a progress bar over prompts × modes on stderr, then one table per
family on stdout; writes bench.json, bench.txt and speedup.png to ``--out``. Returns 0. ``--kernels`` times the
GGUF block kernels instead (backend/bench/kernels.py) and loads no pair.

Defaults: suite all = 7 families × ``DEFAULT_LIMIT`` 2 prompts × the pair's modes × ``BENCH_MAX_NEW_TOKENS``
128 tokens (backend/limits.py, with the temperature and seed), each run ``DEFAULT_REPEATS`` 2 times so the
tables show how much a figure moves between runs (the spread column) instead of one number that noise alone
can halve. The estimate printed after the warm-up covers the whole run (repeats included); the final line says
how long it took against it.
"""

from __future__ import annotations

import io
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

DEFAULT_LIMIT = 2
DEFAULT_REPEATS = 2


def run(args) -> int:
    _check_args(args)  # the bench arguments' boundary: before anything loads
    # Figures are the native path's: a bench that must build the CPU kernels waits for them (docs/native.md).
    os.environ.setdefault("SPECCHAT_NATIVE_BUILD", "wait")
    if getattr(args, "kernels", False):
        # The GGUF block kernels alone, on random weights of every type (issue 31): no pair is loaded.
        from specchat.backend.bench.kernels import run_kernels

        return run_kernels(args)
    if getattr(args, "replay", False):
        # Seed replay across drafters, γ, settings and --samples (issue 32): its own report, no timing tables.
        from specchat.app.cli.bench_replay import run as run_replay

        return run_replay(args)
    if getattr(args, "structured", False):
        # Constrained decoding on JSON schemas and tool calls (issue 46): its own report.
        from specchat.app.cli.bench_structured import run as run_structured

        return run_structured(args)
    if getattr(args, "synthetic", None):
        # Random-weight models with real shapes on the device (issue 8): a separate measurement, its own table.
        from specchat.backend.bench.synthetic import run_synthetic

        return run_synthetic(args)
    from specchat.backend.bench.runner import parse_modes
    from specchat.backend.models.catalog.config import default_pair_name, get_pair, load_pairs

    pairs = load_pairs(args.models)
    names = list(args.pair or [default_pair_name(pairs)])
    configs = [get_pair(pairs, name) for name in names]  # unknown names fail before anything loads
    if getattr(args, "profile", False):
        return _profile(args, configs)
    for config in configs:  # so do modes a pair cannot run (draft-model without a draft, hf-* on a remote, typos)
        remote_kind = config.remote.server_kind if config.remote is not None else None
        parse_modes(
            args.modes,
            has_draft=config.draft is not None,
            pair_name=config.name,
            remote_kind=remote_kind,
            llamacpp_missing=_llamacpp_missing(config.target) if remote_kind is None else None,
            llama_server_missing=_llama_server_missing(args, config.target) if remote_kind is None else None,
            rewrite=_rewrite(args),
        )
    err = Console(stderr=True)

    def load(index: int):
        config = configs[index]
        if config.remote is not None:
            from rich.markup import escape

            from specchat.backend.redact import mask_url
            from specchat.backend.remote.client import RemoteEngine

            err.print(f"Pair [bold]{config.name}[/bold] runs on {escape(mask_url(config.remote.server))}")
            return RemoteEngine(config)
        from specchat.app.cli.generate import _progress  # one line per step off a terminal, as generate's
        from specchat.backend.engine.engine import load_engine

        err.print(f"Loading pair [bold]{config.name}[/bold] ...")
        return load_engine(config, device=args.device, progress=_progress)

    return execute(args, len(configs), load, err=err)


def _llamacpp_missing(spec) -> str | None:
    """Why llama.cpp modes cannot run on this target (None: they can)."""
    from specchat.backend.bench.llamacpp import unavailable
    from specchat.backend.models.loading.pair import gguf_path

    return unavailable(gguf_path(spec))


def _profile(args, configs) -> int:
    """``specchat bench --profile``: backend/bench/profile.py's table for each local pair, plain and with its
    drafter, on the first chat (mt-bench) and code-edit prompts."""
    from specchat.app.cli.generate import _progress
    from specchat.backend.bench.profile import profile_engine, table
    from specchat.backend.bench.suites import load_suite
    from specchat.backend.engine.engine import load_engine
    from specchat.backend.errors import RequestError

    _, max_new, _, _ = _check_args(args)
    prompts = load_suite("mt-bench", 1) + load_suite("code-edit", 1)
    for config in configs:
        if config.remote is not None:
            raise RequestError(f"--profile measures a local engine; pair '{config.name}' runs on a server")
        engine = load_engine(config, device=args.device, progress=_progress)
        try:
            for prompt in prompts:
                for drafter in dict.fromkeys(("none", config.drafter)):
                    print(f"[{prompt.family}: {prompt.id}]")
                    print(table(profile_engine(engine, prompt.message_dicts(), drafter, max_new)), flush=True)
        finally:
            engine.close()
    return 0


def _llama_server_missing(args, spec) -> str | None:
    """Why the llama-server modes cannot run on this target (None: they can)."""
    from specchat.backend.bench.llama_server import unavailable
    from specchat.backend.models.loading.pair import gguf_path

    return unavailable(getattr(args, "llama_server", None), gguf_path(spec))


def _rewrite(args) -> bool:
    """The rewrite family (its own default modes: backend/bench/modes.py)."""
    from specchat.backend.bench.suites import REWRITE_FAMILY

    return args.suite == REWRITE_FAMILY and getattr(args, "prompts", None) is None


def _repeats(args) -> int:
    value = getattr(args, "repeats", None)
    return int(value) if value is not None else DEFAULT_REPEATS


def _check_args(args) -> tuple[int, int, float, int]:
    """(limit, max new tokens, temperature, seed); RequestError naming the option for a value the run cannot use.
    The temperature and seed arrive with their defaults (main.py's parser: backend/limits.py's BENCH_*) and are
    checked here once, against the engine's own limits, before anything loads."""
    from specchat.backend.errors import RequestError
    from specchat.backend.limits import BENCH_MAX_NEW_TOKENS, SAMPLING_LIMITS

    limit = args.limit if args.limit is not None else DEFAULT_LIMIT
    max_new = args.max_new_tokens if args.max_new_tokens is not None else BENCH_MAX_NEW_TOKENS
    temperature, seed = float(args.temperature), args.seed
    for name, value in (("max_new_tokens", max_new), ("temperature", temperature), ("seed", seed)):
        ok, what = SAMPLING_LIMITS[name]
        if not ok(value):
            raise RequestError(f"--{name.replace('_', '-')} must be {what}, got {value}")
    out = Path(getattr(args, "out", None) or "bench_out")
    try:
        os.fsencode(out)
    except UnicodeEncodeError:
        raise RequestError(f"--out {str(out)!r}: not a usable folder name; name a folder for bench.json") from None
    if out.exists() and not out.is_dir():
        raise RequestError(f"--out {out} is a file, not a folder; name a folder for bench.json and the chart")
    return limit, max_new, temperature, seed


def _server_positions(runner, before) -> dict:
    """vLLM's per-position acceptance over this run, from its /metrics before and after (remote vLLM pairs)."""
    after = runner.server_counters() if before is not None else None
    if after is None:
        return {}
    from specchat.backend.remote.stats import vllm_per_position_between

    return {"server_per_position_acceptance": list(vllm_per_position_between(before, after))}


def execute(
    args, num_pairs: int, load: Callable[[int], Any], *, err: Console | None = None, out: Console | None = None
) -> int:
    """The bench over ``num_pairs`` engines made by ``load(i)`` (one at a time, closed after its run): an
    in-process ``Engine`` or a remote pair's ``RemoteEngine``, whichever the pair needs."""
    from specchat.app.cli.bench_prompts import load_prompts
    from specchat.backend.bench.bounds import bandwidth_bounds, describe
    from specchat.backend.bench.remote import RemoteBenchRunner
    from specchat.backend.bench.report import aggregate_with_overall, print_report, write_chart, write_json
    from specchat.backend.bench.runner import BenchRunner, environment, parse_modes, release_memory
    from specchat.backend.bench.stats import mark_equality

    err = err or Console(stderr=True)
    if out is None:
        out = Console()
        if not out.is_terminal:  # piped to a file: no terminal width to respect, keep the tables whole
            out = Console(width=170)
    limit, max_new, temperature, seed = _check_args(args)
    prompts = load_prompts(args, limit)
    out_dir = Path(args.out or "bench_out")
    out_dir.mkdir(parents=True, exist_ok=True)
    meta = {
        "suite": args.suite if getattr(args, "prompts", None) is None else f"prompts:{args.prompts}",
        "limit_per_family": limit,
        "max_new_tokens": max_new,
        "temperature": temperature,
        "greedy": temperature <= 0,
        "seed": seed,
        "modes": args.modes,
        "device": args.device,
        **environment(),
    }
    rows, runs = [], []
    estimated_s = 0.0
    started = time.perf_counter()
    interrupted = False
    sources: dict[str, str] = {}  # pair -> target source, for the measured speeds the listings show
    for index in range(num_pairs):
        engine = load(index)
        runner: BenchRunner | RemoteBenchRunner | None = None
        sources[engine.pair.name] = engine.pair.target.source
        try:
            remote = engine.pair.remote
            missing = _llamacpp_missing(engine.target.spec) if remote is None else None
            server_missing = _llama_server_missing(args, engine.target.spec) if remote is None else None
            modes = parse_modes(
                args.modes,
                has_draft=engine.draft is not None,
                pair_name=engine.pair.name,
                remote_kind=remote.server_kind if remote is not None else None,
                llamacpp_missing=missing,
                llama_server_missing=server_missing,
                rewrite=_rewrite(args),
            )
            if missing is not None and not args.modes and not _rewrite(args):
                err.print(f"[yellow]llama.cpp modes left out: {escape(missing)}[/yellow]", highlight=False)
            if server_missing is not None and not args.modes and _rewrite(args):
                err.print(f"[yellow]llama-server modes left out: {escape(server_missing)}[/yellow]", highlight=False)
            if remote is not None:
                runner = RemoteBenchRunner(engine, modes, max_new_tokens=max_new, temperature=temperature, seed=seed)
            else:
                runner = BenchRunner(
                    engine,
                    modes,
                    max_new_tokens=max_new,
                    temperature=temperature,
                    seed=seed,
                    llama_server=getattr(args, "llama_server", None),
                )
            fitting = [p for p in prompts if runner.fits(p)]
            skipped = [p.id for p in prompts if p not in fitting]
            if skipped:
                err.print(
                    f"[yellow]Skipping {len(skipped)} prompt(s) longer than {engine.pair.name}'s context "
                    f"({engine.context_length} tokens): {', '.join(skipped)}[/yellow]"
                )
            if not fitting:
                continue
            bounds = None
            if remote is None:
                llamacpp = getattr(runner, "llamacpp", None)
                bounds = bandwidth_bounds(engine, llamacpp.gguf if llamacpp is not None else None)
                err.print(describe(bounds), highlight=False)
                path = getattr(engine, "start_line", None)
                if path:
                    meta.setdefault("paths", {})[engine.pair.name] = path
                    err.print(f"Runs on: {path}", highlight=False)
            lengths = sorted(fitting, key=runner.prompt_length)
            err.print(f"Warming up {len(modes)} modes on {engine.pair.name} ...")
            warm = runner.warm_up(lengths[len(lengths) // 2])
            estimate = {mode: seconds * _repeats(args) for mode, seconds in runner.estimate_s(fitting, warm).items()}
            estimated_s += sum(estimate.values())
            speeds = ", ".join(f"{w.mode} {w.decode_tok_s:.1f}" for w in warm)
            err.print(
                f"Estimated time for {engine.pair.name}: ~{sum(estimate.values()) / 60:.1f} min "
                f"({len(fitting)} prompts × {len(modes)} modes × {_repeats(args)} runs, up to {max_new} new "
                "tokens each; "
                f"warm-up decode tok/s: {speeds})",
                highlight=False,
            )
            counters = runner.server_counters() if isinstance(runner, RemoteBenchRunner) else None
            run_start = time.perf_counter()
            pair_rows: list = []
            progress = Progress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=err,
                transient=True,
            )
            with progress:
                task = progress.add_task(engine.pair.name, total=len(fitting) * len(modes) * _repeats(args))

                def start(prompt, mode, _progress=progress, _task=task):
                    _progress.update(_task, description=escape(f"{prompt.family} {prompt.id} · {mode.name}"))

                def done(row, _rows=pair_rows, _progress=progress, _task=task):
                    _rows.append(row)
                    _progress.advance(_task)

                try:
                    runner.run(fitting, on_start=start, on_row=done, repeats=_repeats(args))
                except KeyboardInterrupt:
                    interrupted = True
                    mark_equality(pair_rows, greedy=temperature <= 0)
            rows += pair_rows
            runs.append(
                {
                    "pair": engine.pair.name,
                    "modes": [m.name for m in modes],
                    "prompts": len(fitting),
                    "skipped_prompts": skipped,
                    "warmup": [w.to_dict() for w in warm],
                    "estimate_s": estimate,
                    "elapsed_s": time.perf_counter() - run_start,
                    "bandwidth_bound": bounds,
                    "interrupted": interrupted,
                    **_server_positions(runner, counters),
                }
            )
        finally:
            if runner is not None:
                runner.close()  # llama-server processes
            engine.close()
            # Drop this pair's models (and their transformers twins) before the next pair loads.
            engine = runner = None
            release_memory()
        if interrupted:
            break
    meta["elapsed_s"] = time.perf_counter() - started
    meta["estimated_s"] = estimated_s
    meta["repeats"] = _repeats(args)
    meta["interrupted"] = interrupted
    aggs = aggregate_with_overall(rows)
    if not interrupted:
        from specchat.backend.bench.measured import record

        record(aggs, {**meta, "threads": meta.get("torch_threads")}, sources)
    greedy = temperature <= 0
    print_report(out, aggs, rows, greedy=greedy)
    text = Console(file=io.StringIO(), width=170, record=True)
    print_report(text, aggs, rows, greedy=greedy)
    (out_dir / "bench.txt").write_text(text.export_text(), encoding="utf-8")
    write_json(out_dir / "bench.json", meta=meta, runs=runs, rows=rows, aggs=aggs)
    if aggs:
        write_chart(out_dir / "speedup.png", aggs)
    err.print(
        f"Wrote {out_dir / 'bench.json'}, {out_dir / 'bench.txt'}"
        + (f", {out_dir / 'speedup.png'}" if aggs else "")
        + f"; took {meta['elapsed_s'] / 60:.1f} min "
        f"(estimated {estimated_s / 60:.1f} min after the warm-up, which it does not count)"
    )
    if interrupted:
        raise KeyboardInterrupt
    return 0
