"""What a server reports about one reply, mapped into :class:`~specchat.backend.api.RequestStats` fields.

Contract: each ``from_*`` function takes one parsed stream chunk (a dict from the server's JSON) and returns a
dict of RequestStats field names to values for the figures that chunk carries, and nothing else. A figure the
server does not give is absent from the dict (it becomes None in :func:`remote_stats`), never a guess; figures
derived from given ones are derived only where the derivation is exact (noted at each). Values of the wrong type
or out of range are dropped, never raised: a server's answer is untrusted input. Pure Python: no HTTP here.

Sources of the field names (read in the servers' own code):

- vLLM (``--per-request-spec-decode-metrics summary|detailed``, ``stream_options.include_usage``): the final
  chunk's ``metrics.speculative_decoding`` (vllm/entrypoints/generate/base/protocol.py
  ``SpeculativeDecodingMetrics``, filled by vllm/v1/metrics/stats.py ``RequestSpecDecodeMetrics.to_dict``):
  ``mean_acceptance_length`` (bonus token included), ``draft_acceptance_rate``, ``acceptance_histogram``
  (index j: verify steps that accepted exactly j drafts), ``num_spec_steps``, ``num_accepted_draft_tokens``,
  ``num_draft_tokens``, ``num_spec_tokens`` (k), and with ``detailed`` ``per_step_accepted`` /
  ``per_step_drafted``. Chunks carry ``choices[].token_ids`` with ``return_token_ids``
  (vllm/entrypoints/openai/chat_completion/protocol.py).
- llama-server: ``timings`` (tools/server/server-common.cpp ``server_slot_stats::to_json``): ``prompt_n``
  (prompt tokens processed, cache hits excluded), ``prompt_ms``, ``predicted_n``, ``predicted_ms``, ``cache_n``,
  and ``draft_n`` / ``draft_n_accepted`` only when the slot drafted; on the last chunk, or on every chunk with
  ``timings_per_token`` (tools/server/server-task.cpp). The number of verify steps is not reported.
- SGLang: ``meta_info`` of the native ``/generate``, or ``sglext.spec_tokens_details`` of the OpenAI API with
  ``return_spec_tokens_details`` (python/sglang/srt/managers/tokenizer_manager.py
  ``_calculate_spec_decoding_metrics``, srt/entrypoints/openai/protocol.py ``SpecTokensDetails``):
  ``spec_verify_ct``, ``spec_num_proposed_drafts`` (= verify_ct × (num_draft_tokens − 1)),
  ``spec_num_correct_drafts``, ``spec_accept_rate`` (drafts only), ``spec_accept_length`` (completion tokens /
  verify_ct), ``spec_correct_drafts_histogram``.
- `specchat serve` (app/serve/): a ``specchat`` block on every chunk with the engine's own RequestStats.
- Every OpenAI-compatible server: ``usage.prompt_tokens`` / ``usage.completion_tokens``, and with a prediction
  ``usage.completion_tokens_details.accepted_prediction_tokens`` / ``rejected_prediction_tokens``.

vLLM's Prometheus ``/metrics`` (:func:`vllm_counters`) counts over the whole server; `specchat bench` reads it
before and after a run for the run's per-position acceptance (:func:`vllm_per_position_between`), never a reply's.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Mapping, Sequence
from typing import Any

from specchat.backend.api import GammaSummary, PolicyState, RequestStats
from specchat.backend.stats_fields import SERVER_FIELDS


def _count(value: Any) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value >= 0 else None


def _real(value: Any, high: float = math.inf) -> float | None:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value) and 0 <= value <= high:
        return float(value)
    return None


def _counts(value: Any) -> list[int] | None:
    if isinstance(value, Sequence) and not isinstance(value, str) and len(value) <= 1 << 20:
        items = [_count(v) for v in value]
        if all(v is not None for v in items):
            return [int(v) for v in items if v is not None]
    return None


def _put(out: dict[str, Any], name: str, value: Any) -> None:
    if value is not None:
        out[name] = value


def _positions(steps: list[tuple[int, int]]) -> tuple[float | None, ...]:
    """Per-position acceptance from (drafted, accepted) per verify step: position j is reached when the step
    drafted more than j tokens and accepted the j before it; accepted when more than j were accepted."""
    longest = max((d for d, _ in steps), default=0)
    rates: list[float | None] = []
    for j in range(longest):
        reached = sum(1 for d, a in steps if d > j and a >= j)
        took = sum(1 for _, a in steps if a > j)
        rates.append(round(took / reached, 4) if reached else None)
    return tuple(rates)


def _gamma(drafted: list[int]) -> GammaSummary:
    spec = [d for d in drafted if d > 0]
    if not spec:
        return GammaSummary()
    counts = Counter(spec)
    mode = min(counts, key=lambda g: (-counts[g], g))
    return GammaSummary(mode=mode, mean=round(sum(spec) / len(spec), 4), max=max(spec))


# A prediction's usage counts (OpenAI's names); read only for a request that sent one (the client drops them
# otherwise: OpenAI reports zeros for every request).
PREDICTION_FIELDS = ("accepted_prediction_tokens", "rejected_prediction_tokens")


def from_usage(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """``usage``: prompt and completion token counts (any OpenAI-compatible server)."""
    usage = chunk.get("usage")
    out: dict[str, Any] = {}
    if isinstance(usage, Mapping):
        _put(out, "prompt_tokens", _count(usage.get("prompt_tokens")))
        _put(out, "new_tokens", _count(usage.get("completion_tokens")))
        details = usage.get("completion_tokens_details")  # OpenAI's Predicted Outputs counts
        if isinstance(details, Mapping):
            for name in PREDICTION_FIELDS:
                _put(out, name, _count(details.get(name)))
    return out


def from_vllm(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """vLLM's ``metrics.speculative_decoding`` (see the module docstring)."""
    metrics = chunk.get("metrics")
    spec = metrics.get("speculative_decoding") if isinstance(metrics, Mapping) else None
    out: dict[str, Any] = {}
    if not isinstance(spec, Mapping):
        return out
    drafted, accepted = _count(spec.get("num_draft_tokens")), _count(spec.get("num_accepted_draft_tokens"))
    steps, k = _count(spec.get("num_spec_steps")), _count(spec.get("num_spec_tokens"))
    _put(out, "drafted", drafted)
    _put(out, "accepted", accepted)
    _put(out, "acceptance_rate", _real(spec.get("draft_acceptance_rate"), 1.0))
    _put(out, "mean_accepted_length", _real(spec.get("mean_acceptance_length")))
    histogram = _counts(spec.get("acceptance_histogram"))
    if histogram is not None:
        out["accepted_length_histogram"] = tuple(histogram)
    per_acc, per_draft = _counts(spec.get("per_step_accepted")), _counts(spec.get("per_step_drafted"))
    if per_acc is not None and per_draft is not None and len(per_acc) == len(per_draft) and per_acc:
        pairs = list(zip(per_draft, per_acc))  # `detailed`: exact per step
        out["per_position_acceptance"] = _positions(pairs)
        out["gamma"] = _gamma(per_draft)
        out["last_gamma"] = per_draft[-1]
    elif histogram and steps and k and drafted == steps * k and len(histogram) == k + 1:
        # `summary`, every step drafted k tokens: a step reached position j iff it accepted >= j drafts.
        out["per_position_acceptance"] = tuple(
            round(sum(histogram[j + 1 :]) / sum(histogram[j:]), 4) if sum(histogram[j:]) else None for j in range(k)
        )
        out["gamma"] = GammaSummary(mode=k, mean=float(k), max=k)
        out["last_gamma"] = k
    return out


def from_llama_server(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """llama-server's ``timings`` (see the module docstring)."""
    timings = chunk.get("timings")
    out: dict[str, Any] = {}
    if not isinstance(timings, Mapping):
        return out
    _put(out, "prefill_tokens", _count(timings.get("prompt_n")))
    prompt_ms = _real(timings.get("prompt_ms"))
    _put(out, "prefill_s", None if prompt_ms is None else round(prompt_ms / 1000, 6))
    _put(out, "new_tokens", _count(timings.get("predicted_n")))
    drafted, accepted = _count(timings.get("draft_n")), _count(timings.get("draft_n_accepted"))
    if drafted is not None and accepted is not None and accepted <= drafted:
        out["drafted"], out["accepted"] = drafted, accepted
        out["acceptance_rate"] = round(accepted / drafted, 4) if drafted else None
    return out


def from_sglang(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """SGLang's speculative metrics: ``sglext.spec_tokens_details`` (OpenAI API) or ``meta_info`` (/generate)."""
    details: Any = None
    sglext = chunk.get("sglext")
    if isinstance(sglext, Mapping):
        details = sglext.get("spec_tokens_details")
        if isinstance(details, list):  # n > 1: one per choice; specchat asks for one
            details = details[0] if details else None
    if details is None:
        details = chunk.get("meta_info")
    out: dict[str, Any] = {}
    if not isinstance(details, Mapping):
        return out
    steps = _count(details.get("spec_verify_ct"))
    if not steps:  # SGLang reports zeros when it did not speculate: nothing to say
        return out
    proposed, correct = _count(details.get("spec_num_proposed_drafts")), _count(details.get("spec_num_correct_drafts"))
    out["steps"] = steps
    _put(out, "drafted", proposed)
    _put(out, "accepted", correct)
    _put(out, "acceptance_rate", _real(details.get("spec_accept_rate"), 1.0))
    _put(out, "mean_accepted_length", _real(details.get("spec_accept_length")))
    histogram = _counts(details.get("spec_correct_drafts_histogram"))
    if histogram:
        out["accepted_length_histogram"] = tuple(histogram)
    if proposed and proposed % steps == 0:  # every verify step proposed num_draft_tokens - 1 drafts
        k = proposed // steps
        out["gamma"] = GammaSummary(mode=k, mean=float(k), max=k)
        out["last_gamma"] = k
    return out


def from_specchat(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """`specchat serve`'s own statistics (the ``specchat.stats`` block): every field as the engine counted it."""
    block = chunk.get("specchat")
    stats = block.get("stats") if isinstance(block, Mapping) else None
    if not isinstance(stats, Mapping):
        return {}
    parsed, default = RequestStats.from_dict(stats), RequestStats()
    out: dict[str, Any] = {}
    for name, raw in stats.items():
        if name not in RequestStats.__dataclass_fields__:
            continue
        value = getattr(parsed, name)
        if value == getattr(default, name) and raw != value and not (name == "gamma" and isinstance(raw, Mapping)):
            continue  # a damaged value from_dict left at its default: dropped, not reported as the default
        out[name] = value
    return out


MAPPINGS = (from_usage, from_llama_server, from_vllm, from_sglang, from_specchat)


def server_figures(chunk: Mapping[str, Any]) -> dict[str, Any]:
    """Every figure one chunk carries, from whichever server's format it is in (later formats win)."""
    out: dict[str, Any] = {}
    for mapping in MAPPINGS:
        out.update(mapping(chunk))
    return out


# The client measures these itself (like the local engine does); a server's own figures never replace them.
CLIENT_FIELDS = ("wall_s", "ttft_s", "tok_s")


def remote_stats(
    figures: Mapping[str, Any], *, wall_s: float, ttft_s: float | None, counted_tokens: int, drafter: str
) -> RequestStats:
    """The RequestStats of a remote reply: ``figures`` (from :func:`server_figures`) plus the client's own clock.
    ``counted_tokens``: tokens the client saw ids of (used when the server gave no count)."""
    values: dict[str, Any] = {name: None for name in SERVER_FIELDS}
    values["drafter"] = drafter
    values.update({k: v for k, v in figures.items() if k not in CLIENT_FIELDS})
    new_tokens = values.get("new_tokens")
    values["tokens_counted"] = new_tokens is not None or counted_tokens > 0  # else "—", never a guessed 0
    new_tokens = counted_tokens if new_tokens is None else max(int(new_tokens), counted_tokens)
    values["new_tokens"] = new_tokens
    values["wall_s"] = round(wall_s, 6)
    values["ttft_s"] = None if ttft_s is None else round(ttft_s, 6)
    values["tok_s"] = round(new_tokens / wall_s, 2) if new_tokens and wall_s > 0 else None
    if values.get("last_policy") is not None and not isinstance(values["last_policy"], PolicyState):
        values["last_policy"] = None
    return RequestStats(**values)


VLLM_COUNTERS = (
    "vllm:spec_decode_num_drafts_total",
    "vllm:spec_decode_num_draft_tokens_total",
    "vllm:spec_decode_num_accepted_tokens_total",
)
VLLM_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"


def vllm_counters(text: str) -> dict[str, Any]:
    """vLLM's speculation counters from its Prometheus ``/metrics`` text (vllm/v1/spec_decode/metrics.py): each of
    :data:`VLLM_COUNTERS` summed over its label sets, and ``per_position`` {position: accepted tokens}."""
    out: dict[str, Any] = {name: 0.0 for name in VLLM_COUNTERS}
    positions: dict[int, float] = {}
    for line in text.splitlines():
        if not line.startswith("vllm:spec_decode_num_"):
            continue
        name, _, rest = line.partition("{")
        labels, value_text = rest.rsplit("}", 1) if rest else ("", line.split()[-1])
        name = name.split()[0]
        try:
            value = float(value_text.split()[0])
        except (ValueError, IndexError):
            continue
        if not math.isfinite(value):
            continue
        if name == VLLM_PER_POSITION:
            label = dict(part.split("=", 1) for part in labels.split(",") if "=" in part)
            position = label.get("position", "").strip('"')
            if position.isdigit():
                positions[int(position)] = positions.get(int(position), 0.0) + value
        elif name in out:
            out[name] += value
    out["per_position"] = positions
    return out


def vllm_per_position_between(before: Mapping[str, Any], after: Mapping[str, Any]) -> tuple[float | None, ...]:
    """Per-position acceptance over the requests between two :func:`vllm_counters` readings, as vLLM's docs compute
    it (accepted per position / drafts). Server-wide: exact only when no other client used the server meanwhile."""
    drafts = after[VLLM_COUNTERS[0]] - before[VLLM_COUNTERS[0]]
    if drafts <= 0:
        return ()
    last = max(after["per_position"], default=-1)
    return tuple(
        round((after["per_position"].get(j, 0.0) - before["per_position"].get(j, 0.0)) / drafts, 4)
        for j in range(last + 1)
    )
