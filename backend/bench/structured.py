"""The structured bench (issue 46): JSON schemas of varied shapes and tool calls, decoded under their constraint in
four modes, interleaved per prompt: validity, constrained tok/s with and without speculation and jump-forward, and
the mask's share of the decoding time.

Contract: :func:`load_cases` reads ``data/structured.jsonl`` (one ``{"id", "shape", "messages", "schema"}`` a line;
56 schemas: flat, nested, arrays of objects, enums, patterns, formats, optional fields, unions, tool calls).
:func:`run_structured` decodes every case in every mode of :data:`MODES` with one seed (so every mode must give the
same reply: counted as ``replay_differences``) and returns the report: per mode the replies that ended, parsed and
validated, tokens, decoding seconds (the reply's wall time less its prefill), tok/s over those, the seconds spent
on masks (and their share of the decoding time), µs per mask, steps, drafted / accepted and the forced drafts.
The prompt names the schema in a system message, as clients do when they ask for JSON.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import jsonschema

from specchat.backend.api import ConstraintSpec, EngineAPI, GenerationRequest, SamplingParams

DATA = Path(__file__).parent / "data" / "structured.jsonl"
# mode -> (drafter: None for the pair's own, jump-forward)
MODES: dict[str, tuple[str | None, bool]] = {
    "plain": ("none", False),
    "jump-forward": ("none", True),
    "speculative": (None, False),
    "spec+jump-forward": (None, True),
}
SYSTEM = "Reply with one JSON value that matches this JSON schema, and nothing else.\nSchema: {schema}"


@dataclass(frozen=True, slots=True)
class Case:
    id: str
    shape: str
    messages: list[dict[str, str]]
    schema: dict[str, Any]


def load_cases(path: Path = DATA, limit: int | None = None) -> list[Case]:
    cases = []
    for line in path.read_text(encoding="utf-8").splitlines():
        if line.strip():
            item = json.loads(line)
            cases.append(Case(item["id"], item["shape"], item["messages"], item["schema"]))
    return cases[:limit] if limit is not None else cases


def valid(text: str, schema: dict[str, Any]) -> tuple[bool, bool]:
    """(parses as JSON, validates against the schema)."""
    try:
        value = json.loads(text)
    except ValueError:
        return False, False
    try:
        jsonschema.validate(value, schema)
    except jsonschema.ValidationError:
        return True, False
    return True, True


def _request(case: Case, mode: str, max_new_tokens: int, temperature: float, seed: int) -> GenerationRequest:
    drafter, jump = MODES[mode]
    system = {"role": "system", "content": SYSTEM.format(schema=json.dumps(case.schema))}
    return GenerationRequest(
        messages=[system, *case.messages],
        sampling=SamplingParams(temperature=temperature, seed=seed, max_new_tokens=max_new_tokens),
        drafter=drafter,  # type: ignore[arg-type]
        constraint=ConstraintSpec("json_schema", json.dumps(case.schema), jump_forward=jump),
    )


def _empty() -> dict[str, Any]:
    keys = ("replies", "ended", "parsed", "validated", "tokens", "decode_s", "mask_s", "masks", "steps")
    return dict.fromkeys(keys + ("drafted", "accepted", "forced"), 0)


def run_structured(
    engine: EngineAPI,
    cases: list[Case],
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    modes: tuple[str, ...] = tuple(MODES),
    progress: Callable[[str], None] | None = None,
) -> dict[str, Any]:
    totals = {mode: _empty() for mode in modes}
    rows: list[dict[str, Any]] = []
    differences = 0
    started = time.perf_counter()
    for case in cases:
        first: list[int] | None = None
        for mode in modes:
            events = list(engine.generate(_request(case, mode, max_new_tokens, temperature, seed)))
            last, ids = events[-1], [t for e in events for t in e.token_ids]
            text = "".join(e.text for e in events)
            stats = last.stats
            assert stats is not None
            parsed, validated = valid(text, case.schema)
            decode_s = max(stats.wall_s - (stats.prefill_s or 0.0), 1e-9)
            t = totals[mode]
            for key, value in (
                ("replies", 1),
                ("ended", last.finish_reason == "eos"),
                ("parsed", parsed),
                ("validated", validated),
                ("tokens", stats.new_tokens),
                ("decode_s", decode_s),
                ("mask_s", stats.mask_s or 0.0),
                ("masks", stats.masks or 0),
                ("steps", (stats.steps or 0) + 1),
                ("drafted", stats.drafted or 0),
                ("accepted", stats.accepted or 0),
                ("forced", stats.forced_tokens or 0),
            ):
                t[key] += value
            first = ids if first is None else first
            differences += ids != first
            rows.append(
                {
                    "id": case.id,
                    "shape": case.shape,
                    "mode": mode,
                    "finish_reason": last.finish_reason,
                    "parsed": parsed,
                    "validated": validated,
                    "tokens": stats.new_tokens,
                    "decode_s": round(decode_s, 6),
                    "mask_s": stats.mask_s,
                    "text": text,
                }
            )
            if progress is not None:
                progress(f"{case.id} {mode}: {stats.new_tokens} tokens, {'valid' if validated else 'INVALID'}")
    summary = {}
    for mode, t in totals.items():
        summary[mode] = dict(
            t,
            tok_s=round(t["tokens"] / t["decode_s"], 2) if t["decode_s"] else None,
            mask_share=round(t["mask_s"] / t["decode_s"], 4) if t["decode_s"] else None,
            mask_us=round(1e6 * t["mask_s"] / t["masks"], 1) if t["masks"] else None,
            tokens_per_step=round(t["tokens"] / t["steps"], 3) if t["steps"] else None,
        )
    base = summary.get("plain", {}).get("tok_s")
    for mode in summary:
        tok_s = summary[mode]["tok_s"]
        summary[mode]["speedup"] = round(tok_s / base, 3) if base and tok_s else None
    return {
        "cases": len(cases),
        "modes": list(modes),
        "temperature": temperature,
        "seed": seed,
        "max_new_tokens": max_new_tokens,
        "replay_differences": differences,
        "seconds": round(time.perf_counter() - started, 1),
        "summary": summary,
        "rows": rows,
    }


def table(report: dict[str, Any]) -> str:
    """The report's summary as a text table."""
    head = f"{'mode':<18} {'valid':>9} {'tok/s':>7} {'speedup':>7} {'tok/step':>8} {'mask µs':>8} {'mask %':>7}"
    lines = [head]
    for mode, s in report["summary"].items():
        share = f"{100 * s['mask_share']:.1f}" if s["mask_share"] is not None else "-"
        lines.append(
            f"{mode:<18} {s['validated']:>4}/{s['replies']:<4} {s['tok_s'] or 0:>7.2f} {s['speedup'] or 0:>7.2f} "
            f"{s['tokens_per_step'] or 0:>8.2f} {s['mask_us'] or 0:>8.1f} {share:>7}"
        )
    lines.append(f"replies that differ from the first mode's (same seed): {report['replay_differences']}")
    return "\n".join(lines)
