"""How fast a reply went, said apart: reading the prompt (prefill), writing the reply (decode), and what speculation
gained against plain decoding on this machine. Presenters over the engine's :class:`RequestStats` only (no
counting here), shared by the stats bar, a reply's totals line and the details panel.

- :func:`decode_rate`: tokens after the first over the time after the first, so a long prompt read first no longer
  makes a reply read a fraction of the rate it was written at (``RequestStats.tok_s`` counts the whole request;
  the case seen: ``benchmarks/RESULTS.md``, "Figures moved out of the code");
  :func:`prefill_rate`: prompt tokens read per second of prefill.
- :func:`speedup`: speculation against plain decoding, measured by the engine in this reply on this machine:
  tokens/s of speculating steps over tokens/s of plain steps (``spec_tok_s / plain_tok_s``) when the reply had
  at least :data:`MIN_STEPS` of each, else the γ policy's expected speed-up (its formula over the pass costs
  it measured here and the acceptance it saw; ``expected_speedup``). None for plain decoding or without
  either. τ says how many tokens a step gave; this says whether those steps paid.
"""

from __future__ import annotations

from specchat.backend.api import RequestStats

MIN_STEPS = 8  # speculating and plain steps a reply needs before their speed ratio is shown
SLOW_PREFILL_S = 1.0  # a prefill this long is named in the totals line (a short one is noise there)


def step_counts(stats: RequestStats) -> tuple[int, int]:
    """(speculating steps, plain steps) of the reply; a remote server that reports no steps counts none."""
    speculating = sum(stats.accepted_length_histogram)
    return speculating, max(0, (stats.steps or 0) - speculating)


def measured_speedup(stats: RequestStats) -> float | None:
    """Tokens/s of speculating steps over plain steps; None unless each kind has ``MIN_STEPS`` steps."""
    speculating, plain = step_counts(stats)
    if stats.spec_tok_s and stats.plain_tok_s and min(speculating, plain) >= MIN_STEPS:
        return stats.spec_tok_s / stats.plain_tok_s
    return None


def decode_rate(stats: RequestStats) -> float | None:
    """Tokens per second after the first token (None before a second token, or without its times)."""
    if stats.ttft_s is None or stats.new_tokens < 2 or stats.wall_s <= stats.ttft_s:
        return None
    return (stats.new_tokens - 1) / (stats.wall_s - stats.ttft_s)


def prefill_rate(stats: RequestStats) -> float | None:
    """Prompt tokens read per second of prefill (None when nothing was read or its time is unknown)."""
    if not stats.prefill_tokens or not stats.prefill_s:
        return None
    return stats.prefill_tokens / stats.prefill_s


def speedup(stats: RequestStats) -> tuple[float, bool] | None:
    """(speculation ÷ plain decoding, whether measured in this reply's steps rather than expected by the policy);
    None for plain decoding or when neither figure exists (see the module docstring)."""
    if not stats.drafter or stats.drafter == "none":
        return None
    measured = measured_speedup(stats)
    if measured is not None:
        return measured, True
    if stats.expected_speedup:
        return stats.expected_speedup, False
    return None


def speedup_text(stats: RequestStats) -> str:
    """ "×1.42 vs plain", "×1.3 vs plain (expected)", "×0.62 vs plain: slower here", or ""."""
    found = speedup(stats)
    if found is None:
        return ""
    value, measured = found
    text = f"×{value:.2f} vs plain" + ("" if measured else " (expected)")
    return text + (": slower here" if value < 1.0 else "")


def rates_text(stats: RequestStats, *, prefill_always: bool = False) -> str:
    """ "13.0 tok/s", and "prefill 2,692 tokens in 31.9 s (84 tok/s)" before it when the prompt took long to
    read (``prefill_always``: whenever it is known)."""
    decode = decode_rate(stats)
    rate = decode if decode is not None else stats.tok_s
    parts = [f"{rate:.1f} tok/s" if rate is not None else "— tok/s"]
    read = prefill_rate(stats)
    if read is not None and (prefill_always or (stats.prefill_s or 0.0) >= SLOW_PREFILL_S):
        parts.insert(0, f"prefill {stats.prefill_tokens:,} tokens in {stats.prefill_s:.1f} s ({read:,.0f} tok/s)")
    return " · ".join(parts)
