"""What `specchat serve` writes: OpenAI chat completion objects built from the engine's StepEvents, with the
reply's speculation under the field names other servers use, so any of their clients can read it.

Contract:

- :func:`chunk` is one ``chat.completion.chunk`` per StepEvent that carries text or tokens (and the last one,
  whose ``finish_reason`` is OpenAI's ``stop`` or ``length``); ``choices[0].token_ids`` (vLLM's name) when
  asked for; a ``specchat`` block with the step's token sources and texts, γ, accepted, policy, drafter and the
  request's :class:`RequestStats` so far (``RequestStats.to_dict``), and the engine's own finish reason. The
  stats' ``step_counts`` (the raw counts behind every figure, up to ~6 KB) go only on the chunk that finishes the
  reply: the figures a live view reads (drafted, accepted, rejected, discarded, τ, ...) are on every chunk.
- :func:`speculation_fields` are the totals in the other servers' shapes, always all three: ``usage`` (with
  OpenAI's ``prompt_tokens_details.cached_tokens``: the prompt tokens whose K/V the prefix cache held, so the
  request did not prefill them);
  llama-server's ``timings`` (``prompt_n``, ``prompt_ms``, ``predicted_n``, ``predicted_ms``, ``draft_n``,
  ``draft_n_accepted``: tools/server/server-common.cpp's names; the draft counts are 0 when the reply drafted
  nothing); vLLM's ``metrics.speculative_decoding`` (``mean_acceptance_length``, ``draft_acceptance_rate``,
  ``acceptance_histogram``, ``num_spec_steps``, ``num_accepted_draft_tokens``, ``num_draft_tokens``,
  ``num_spec_tokens``: vllm/v1/metrics/stats.py, the configured γ as vLLM means it (``spec_tokens``: the
  request's, else the pair's; auto is the most the γ policy drafts); counts 0 and the rates null when nothing was
  drafted). A
  stream sends them on a last chunk with empty ``choices`` when ``include_usage`` is asked; a non-streaming
  reply always carries them in its object.
"""

from __future__ import annotations

import json
import math
import time
import uuid
from typing import Any

from specchat.backend.api import GenerationRequest, RequestStats, StepEvent
from specchat.backend.limits import MAX_GAMMA

OPENAI_FINISH = {
    "eos": "stop",
    "stop": "stop",
    "length": "length",
    "context": "length",
    "cancelled": "stop",
    "error": "stop",
}


def new_id() -> str:
    return f"chatcmpl-{uuid.uuid4().hex}"


def _own(event: StepEvent, finish: str | None) -> dict[str, Any]:
    stats = event.stats.to_dict() if event.stats is not None else None
    if stats is not None and finish is None:
        del stats["step_counts"]  # the reply's last chunk carries them (module docstring)
    block: dict[str, Any] = {
        "sources": [int(s) for s in event.sources],
        "token_texts": event.token_texts,
        "gamma": event.gamma,
        "accepted": event.accepted,
        "policy": event.policy.value,
        "drafter": event.drafter,
        "stats": stats,
    }
    if finish is not None:
        block["finish_reason"] = finish
    if event.message:
        block["message"] = event.message
    return block


def chunk(call_id: str, model: str, created: int, event: StepEvent, *, token_ids: bool, first: bool) -> dict[str, Any]:
    """One chat.completion.chunk for ``event``."""
    delta: dict[str, Any] = {"content": event.text}
    if first:
        delta["role"] = "assistant"
    finish = event.finish_reason
    choice: dict[str, Any] = {
        "index": 0,
        "delta": delta,
        "logprobs": None,
        "finish_reason": OPENAI_FINISH[finish] if finish is not None else None,
    }
    if token_ids:
        choice["token_ids"] = list(event.token_ids)
    return {
        "id": call_id,
        "object": "chat.completion.chunk",
        "created": created,
        "model": model,
        "choices": [choice],
        "specchat": _own(event, finish),
    }


def speculation_fields(stats: RequestStats, spec_tokens: int | None = None) -> dict[str, Any]:
    """usage, llama-server's timings and vLLM's metrics.speculative_decoding for a finished reply."""
    prompt, new = stats.prompt_tokens, stats.new_tokens
    out: dict[str, Any] = {"usage": {"prompt_tokens": prompt, "completion_tokens": new, "total_tokens": prompt + new}}
    if stats.prefill_tokens is not None:  # OpenAI's count of prompt tokens read from the cache, not computed
        out["usage"]["prompt_tokens_details"] = {"cached_tokens": max(prompt - stats.prefill_tokens, 0)}
    if stats.accepted_prediction_tokens is not None:  # a prediction was sent: OpenAI's two counts
        out["usage"]["completion_tokens_details"] = {
            "accepted_prediction_tokens": stats.accepted_prediction_tokens,
            "rejected_prediction_tokens": stats.rejected_prediction_tokens or 0,
        }
    prefill_s = stats.prefill_s or 0.0
    timings: dict[str, Any] = {
        "prompt_n": stats.prefill_tokens,
        "prompt_ms": round(prefill_s * 1000, 3),
        "predicted_n": new,
        "predicted_ms": round(max(stats.wall_s - prefill_s, 0.0) * 1000, 3),
    }
    drafted, accepted = stats.drafted or 0, stats.accepted or 0
    timings.update(draft_n=drafted, draft_n_accepted=accepted)
    out["timings"] = timings
    histogram: list[int] = []
    used = (stats.gamma.max or 0) if drafted else 0
    k = spec_tokens if spec_tokens is not None else used  # vLLM's num_spec_tokens: the configured γ
    if drafted:  # steps by accepted length, 0 .. the larger of the configured and the largest used γ
        histogram = list(stats.accepted_length_histogram)
        histogram += [0] * (max(k, used) + 1 - len(histogram))
    out["metrics"] = {
        "speculative_decoding": {
            "mean_acceptance_length": stats.mean_accepted_length if drafted else None,
            "draft_acceptance_rate": stats.acceptance_rate if drafted else None,
            "acceptance_histogram": histogram,
            "num_spec_steps": sum(histogram),
            "num_accepted_draft_tokens": accepted,
            "num_draft_tokens": drafted,
            "num_spec_tokens": k,
        }
    }
    return out


def usage_chunk(
    call_id: str, model: str, created: int, last: StepEvent, spec_tokens: int | None = None
) -> dict[str, Any]:
    """The stream's last chunk (``include_usage``): empty choices, the totals in every server's shape."""
    stats = last.stats or RequestStats()
    out = {"id": call_id, "object": "chat.completion.chunk", "created": created, "model": model, "choices": []}
    out.update(speculation_fields(stats, spec_tokens))
    out["specchat"] = {"stats": stats.to_dict(), "finish_reason": last.finish_reason}
    return out


def completion(
    call_id: str, model: str, text: str, token_ids: list[int] | None, last: StepEvent, spec_tokens: int | None = None
) -> dict[str, Any]:
    """A whole (non-streaming) chat.completion."""
    stats = last.stats or RequestStats()
    choice: dict[str, Any] = {
        "index": 0,
        "message": {"role": "assistant", "content": text},
        "logprobs": None,
        "finish_reason": OPENAI_FINISH.get(last.finish_reason or "eos", "stop"),
    }
    if token_ids is not None:
        choice["token_ids"] = token_ids
    out: dict[str, Any] = {
        "id": call_id,
        "object": "chat.completion",
        "created": int(time.time()),
        "model": model,
        "choices": [choice],
    }
    out.update(speculation_fields(stats, spec_tokens))
    out["specchat"] = {"stats": stats.to_dict(), "finish_reason": last.finish_reason}
    return out


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_finite(v) for v in value]
    return value


def dumps(payload: Any) -> str:
    """JSON without NaN or Infinity (not JSON; a diagnostic estimate may be infinite): those become null."""
    try:
        return json.dumps(payload, ensure_ascii=False, allow_nan=False)
    except ValueError:
        return json.dumps(_finite(payload), ensure_ascii=False, allow_nan=False)


def encode(payload: Any) -> bytes:
    """:func:`dumps` as UTF-8. A lone surrogate (JSON's ``"\\ud800"`` decodes to one, and an error may echo it)
    has no UTF-8 form: it is written back as that same JSON escape, so every body encodes whatever came in."""
    return dumps(payload).encode("utf-8", "backslashreplace")


def sse(payload: dict[str, Any] | str) -> bytes:
    """One server-sent event."""
    data = payload if isinstance(payload, str) else dumps(payload)
    return f"data: {data}\n\n".encode("utf-8", "backslashreplace")


def configured_gamma(request: GenerationRequest, pair_gamma: int | None) -> int | None:
    """vLLM's ``num_spec_tokens``: the γ a request was configured with (its own, else the pair's ``pair_gamma``;
    auto: the most the γ policy may draft; 0 without a drafter), not the largest it used. None: not known."""
    if request.drafter == "none":
        return 0
    if request.gamma is not None:
        return MAX_GAMMA if request.gamma == "auto" else int(request.gamma)
    return pair_gamma
