"""The engine's public vocabulary: what a request asks for and what each decoding step reports.

Every consumer (the Textual UI, `specchat generate`, `specchat bench`) reads only these types, so no UI code
invents its own engine API. Pure dataclasses: no torch, no Textual.

Vocabulary (see design.md): the *target* keeps its distribution; a *drafter* proposes γ tokens; a *step* is
one target forward pass after prefill. Each emitted token has a :class:`TokenSource`:

- ``TARGET``: a plain target token (no draft was verified in that step);
- ``ACCEPTED``: a draft token the target accepted;
- ``RECOVERED``: sampled from the residual max(0, p - q) at the first rejection (greedy: the target's argmax);
- ``BONUS``: the extra target token when all γ drafts were accepted.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Literal


class TokenSource(enum.IntEnum):
    TARGET = 0
    ACCEPTED = 1
    RECOVERED = 2
    BONUS = 3


class PolicyState(str, enum.Enum):
    """Whether the step used speculation."""

    SPECULATING = "speculating"  # a draft was proposed and verified this step
    PAUSED = "paused"  # a drafter is configured but the policy switched speculation off (it did not pay)
    OFF = "off"  # no drafter (plain decoding was asked for)


FinishReason = Literal["eos", "stop", "length", "context", "cancelled", "error"]
DrafterName = Literal["none", "prompt-lookup", "draft-model", "auto"]


@dataclass(slots=True)
class SamplingParams:
    """Sampling settings of one request. ``temperature == 0`` means greedy.

    ``None`` fields take the pair's defaults, else the model's generation_config (resolved by the engine).
    """

    temperature: float | None = None
    top_k: int | None = None  # 0 or None: no top-k
    top_p: float | None = None  # 1.0 or None: no top-p
    repetition_penalty: float | None = None  # 1.0 or None: none
    max_new_tokens: int = 512
    seed: int | None = None
    stop: tuple[str, ...] = ()


@dataclass(slots=True)
class GenerationRequest:
    """One reply to produce.

    Give either ``messages`` (rendered with the tokenizer's chat template, ``add_generation_prompt=True``) or
    ``prompt_ids`` (used as they are). ``conversation`` names a cache slot: requests with the same key reuse
    the longest common token prefix already in the paged cache (multi-turn chat); ``None`` uses a scratch
    sequence freed at the end.
    """

    messages: list[dict[str, str]] | None = None
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    drafter: DrafterName | None = None  # None: the pair's drafter
    gamma: int | Literal["auto"] | None = None  # None: the pair's gamma
    conversation: str | None = None


@dataclass(slots=True)
class StepEvent:
    """What one decoding step produced. The first event follows prefill (``is_prefill`` True, one token).

    ``token_ids``, ``sources`` and ``token_texts`` have the same length; ``text`` is the detokenised text those tokens
    completed (never a split UTF-8 character; may be "" when a token is held back for a stop string or an
    incomplete character). Times are seconds of this step. The last event of a request has ``finish_reason``
    set and ``stats`` filled (the request's totals, the `specchat generate --json` "stats" object).
    """

    token_ids: list[int]
    sources: list[TokenSource]
    token_texts: list[str]  # per token, the text it completed ("" when held back); "".join == text
    text: str
    gamma: int  # tokens drafted in this step (0 when not speculating)
    accepted: int  # of those, how many the target accepted
    draft_s: float
    verify_s: float  # the target forward pass (prefill for the first event)
    overhead_s: float  # everything else: sampling, verification bookkeeping, detokenisation
    policy: PolicyState
    drafter: str  # the drafter in use: "none", "prompt-lookup" or "draft-model"
    is_prefill: bool = False
    prefill_tokens: int = 0  # tokens actually prefilled (after prefix reuse), first event only
    finish_reason: FinishReason | None = None
    message: str | None = None  # a user-facing notice (context full, drafter failed and was switched off, ...)
    stats: dict[str, Any] | None = None  # request totals, on the last event only
