"""`specchat bench --replay`: the same seed gives the same reply whatever the drafter, γ, settings and --samples.

For each prompt × sampling setting × seed, plain decoding (drafter none) in a fresh request gives the reference
reply of seeds S, S+1, ... S+samples-1. Then every (drafter, γ) of the grid decodes the same seeds the way
``specchat generate --samples`` does: one conversation whose prompt was read once and is reused (prefilled by the
first run of the block, and every later run reuses it). Every reply must equal its seed's reference token for
token. The drafters are the engine's registered ones (``Engine.drafters``: prompt-lookup, suffix, the draft model
where the pair has one, and any a newer engine registers) plus "none" and "auto"; γ 1, 4, 16 and auto.

A difference is printed with the prompt, the settings, the seed, drafter, γ and sample, the first differing
reply position and both runs' logits rows there (the processed rows the tokens were decided from, recorded
through ``Engine.trace``): the top candidates with their logits, the margin between the first two, and whether
the rows were bit-identical. Nothing here decides a token: it only runs requests and compares.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.limits import MIN_TEMPERATURE, MIN_TOP_P, Gamma, check_seed_range

GAMMAS: tuple[Gamma, ...] = (1, 4, 16, "auto")
TOP_CANDIDATES = 5  # candidates shown per row of a difference


@dataclass(frozen=True, slots=True)
class Setting:
    """One sampling setting of the grid (None: off)."""

    temperature: float
    top_k: int | None = None
    top_p: float | None = None
    repetition_penalty: float | None = None

    def label(self) -> str:
        parts = [f"T={self.temperature:g}"]
        parts += [f"{name}={value:g}" for name, value in self._filters() if value is not None]
        return " ".join(parts)

    def _filters(self) -> tuple[tuple[str, float | None], ...]:
        return (("top_k", self.top_k), ("top_p", self.top_p), ("penalty", self.repetition_penalty))

    def params(self, seed: int, max_new_tokens: int) -> SamplingParams:
        return SamplingParams(
            temperature=self.temperature,
            top_k=self.top_k or 0,
            top_p=self.top_p or 1.0,
            repetition_penalty=self.repetition_penalty or 1.0,
            seed=seed,
            max_new_tokens=max_new_tokens,
        )


# Greedy, the pair's own defaults, the common sampled settings (top-p 0.9 and 0.5, top-k, penalties) and the
# settings that reduce to one token (a tiny temperature, top-k 1, a tiny top-p): every cut the rule defines.
SETTINGS: tuple[Setting, ...] = (
    Setting(0.0),
    Setting(0.0, repetition_penalty=1.3),
    Setting(0.2, top_p=0.9),
    Setting(1.0, top_p=0.9),
    Setting(1.0, top_k=40, top_p=0.5),
    Setting(0.7, top_k=40, repetition_penalty=1.1),
    Setting(1.3, top_p=0.9, repetition_penalty=1.1),
    Setting(MIN_TEMPERATURE),
    Setting(0.8, top_k=1),
    Setting(0.8, top_p=MIN_TOP_P),
)


@dataclass(frozen=True, slots=True)
class ReplayPrompt:
    id: str
    ids: tuple[int, ...]  # the rendered prompt


@dataclass(slots=True)
class Row:
    """What a run decided one reply position from: its processed logits row, summarised."""

    top: list[tuple[int, float]]  # the best candidates (id, logit), highest first
    digest: str  # of the row's bytes: equal digests, bit-identical rows

    @property
    def margin(self) -> float | None:
        return self.top[0][1] - self.top[1][1] if len(self.top) > 1 else None


class Probe:
    """``Engine.trace``: the rows of the current request by reply position (a later row for a position replaces
    an earlier one: the step that emitted a token is the last to decide its position)."""

    def __init__(self) -> None:
        self.rows: dict[int, Row] = {}

    def __call__(self, positions: range | list[int], logits: torch.Tensor) -> None:
        count = min(TOP_CANDIDATES, logits.shape[-1])
        values, ids = logits.topk(count, dim=-1)
        for i, position in enumerate(positions):
            data = logits[i].detach().to("cpu", torch.float32).contiguous().numpy().tobytes()
            digest = hashlib.blake2b(data, digest_size=8).hexdigest()
            self.rows[int(position)] = Row(list(zip(ids[i].tolist(), values[i].tolist())), digest)

    def take(self) -> dict[int, Row]:
        rows, self.rows = self.rows, {}
        return rows


@dataclass(slots=True)
class Run:
    tokens: list[int]
    rows: dict[int, Row]
    finish_reason: str | None
    stats: dict[str, Any]


@dataclass(slots=True)
class Difference:
    prompt: ReplayPrompt
    setting: Setting
    seed: int
    drafter: str
    gamma: Gamma | None
    sample: int
    position: int
    expected: Run
    got: Run

    def describe(self, decode: Callable[[list[int]], str] | None = None) -> str:
        """Several lines: where, what each run emitted, and both rows at the position."""
        text = decode or (lambda ids: " ".join(map(str, ids)))
        p, ref, run = self.position, self.expected.tokens, self.got.tokens
        lines = [
            f"DIFFERENCE prompt {self.prompt.id} ({len(self.prompt.ids)} tokens) {self.setting.label()} seed "
            f"{self.seed} drafter {self.drafter} γ {self.gamma} sample {self.sample}: reply position {p}",
            f"  plain: {_token(ref, p, text)} ({len(ref)} tokens, {self.expected.finish_reason})",
            f"  run:   {_token(run, p, text)} ({len(run)} tokens, {self.got.finish_reason})",
        ]
        for name, probe in (("plain", self.expected), ("run", self.got)):
            for q in (p - 1, p, p + 1):
                row = probe.rows.get(q)
                if row is not None:
                    lines.append(f"  {name} row {q}: {_row(row, text)}")
        same = _same_row(self.expected, self.got, p)
        lines.append(f"  rows at {p} bit-identical: {'unknown' if same is None else same}")
        return "\n".join(lines)


def _token(ids: list[int], position: int, text: Callable[[list[int]], str]) -> str:
    if position >= len(ids):
        return "(ended)"
    return f"{ids[position]} {text([ids[position]])!r}"


def _row(row: Row, text: Callable[[list[int]], str]) -> str:
    top = ", ".join(f"{token} {text([token])!r} {value:.6g}" for token, value in row.top)
    margin = row.margin
    return f"{top}; margin {'—' if margin is None else f'{margin:.3g}'}"


def _same_row(a: Run, b: Run, position: int) -> bool | None:
    ra, rb = a.rows.get(position), b.rows.get(position)
    return None if ra is None or rb is None else ra.digest == rb.digest


@dataclass(slots=True)
class ReplayResult:
    runs: int = 0  # seeded runs compared with their reference
    references: int = 0  # plain reference runs
    tokens: int = 0  # tokens compared
    differences: list[Difference] = field(default_factory=list)
    by_drafter: dict[str, int] = field(default_factory=dict)  # runs per drafter
    elapsed_s: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "runs": self.runs,
            "references": self.references,
            "tokens": self.tokens,
            "differences": len(self.differences),
            "by_drafter": dict(self.by_drafter),
            "elapsed_s": round(self.elapsed_s, 1),
            "difference_details": [d.describe() for d in self.differences],
        }


def grid_drafters(engine: Any) -> list[str]:
    """ "none", every drafter the engine registered (in its order), "auto"."""
    return ["none", *engine.drafters, "auto"]


def combinations(drafters: Sequence[str], gammas: Sequence[Gamma]) -> list[tuple[str, Gamma | None]]:
    """(drafter, γ) pairs: "none" once when listed (γ means nothing to it), every other drafter with every γ."""
    plain: list[tuple[str, Gamma | None]] = [("none", None)] if "none" in drafters else []
    return plain + [(d, g) for d in drafters if d != "none" for g in gammas]


def count_runs(prompts: int, settings: int, seeds: int, samples: int, combos: int) -> tuple[int, int]:
    """(compared runs, reference runs) a grid makes."""
    blocks = prompts * settings * seeds
    return blocks * samples * combos, blocks * samples


def _generate(engine: Any, probe: Probe, request: GenerationRequest) -> Run:
    tokens: list[int] = []
    last = None
    for event in engine.generate(request):
        tokens.extend(event.token_ids)
        last = event
    if last is None:  # generate() always ends with the event that carries finish_reason
        raise RuntimeError("the engine ended a request without a final event")
    stats = last.stats.to_json_stats() if last.stats is not None else {}
    return Run(tokens, probe.take(), last.finish_reason, stats)


def first_difference(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def replay(
    engine: Any,
    prompts: Sequence[ReplayPrompt],
    *,
    settings: Sequence[Setting] = SETTINGS,
    seeds: Sequence[int] = (0,),
    samples: int = 2,
    gammas: Sequence[Gamma] = GAMMAS,
    max_new_tokens: int = 48,
    drafters: Sequence[str] | None = None,
    on_run: Callable[[ReplayResult], None] | None = None,
    on_difference: Callable[[Difference], None] | None = None,
) -> ReplayResult:
    """Run the grid on ``engine`` (module docstring; ``drafters``: a subset of :func:`grid_drafters`); ``on_run``
    after every compared run, ``on_difference`` for each difference as it is found. Leaves ``engine.trace`` as
    it found it."""
    for seed in seeds:
        check_seed_range(seed, samples, "seed")
    combos = combinations(grid_drafters(engine) if drafters is None else drafters, gammas)
    result = ReplayResult()
    started = time.perf_counter()
    probe, before = Probe(), engine.trace
    engine.trace = probe
    try:
        for prompt in prompts:
            ids = list(prompt.ids)
            for setting in settings:
                for seed in seeds:
                    refs = []
                    for i in range(samples):
                        params = setting.params(seed + i, max_new_tokens)
                        refs.append(
                            _generate(engine, probe, GenerationRequest(prompt_ids=ids, sampling=params, drafter="none"))
                        )
                        result.references += 1
                    key = f"replay:{prompt.id}"  # one conversation per block: its prompt is read once
                    try:
                        for drafter, gamma in combos:
                            for i, ref in enumerate(refs):
                                request = GenerationRequest(
                                    prompt_ids=ids,
                                    sampling=setting.params(seed + i, max_new_tokens),
                                    drafter=drafter,  # type: ignore[arg-type]  # a registered drafter's name
                                    gamma=gamma,
                                    conversation=key,
                                )
                                run = _generate(engine, probe, request)
                                result.runs += 1
                                result.tokens += len(ref.tokens)
                                result.by_drafter[drafter] = result.by_drafter.get(drafter, 0) + 1
                                at = first_difference(ref.tokens, run.tokens)
                                if at is not None:
                                    found = Difference(prompt, setting, seed + i, drafter, gamma, i, at, ref, run)
                                    result.differences.append(found)
                                    if on_difference is not None:
                                        on_difference(found)
                                if on_run is not None:
                                    result.elapsed_s = time.perf_counter() - started
                                    on_run(result)
                    finally:
                        engine.forget(key)
    finally:
        engine.trace = before
        result.elapsed_s = time.perf_counter() - started
    return result
