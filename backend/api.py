"""The engine API: what a request asks for and what each decoding step reports (limits: ``backend/limits.py``).

Every consumer (the Textual UI, `specchat generate`, `specchat bench`, and any other engine that implements
:class:`EngineAPI`, such as a client of a remote server) reads only these types. Pure dataclasses: no torch, no
Textual. Settings validate themselves when they are built, so a value that passed here never fails deeper down.

Vocabulary: the *target* keeps its distribution; a *drafter* proposes γ tokens; a *step* is one target forward
pass after prefill. Each emitted token has a :class:`TokenSource`:

- ``TARGET``: a plain target token (no draft was verified in that step), or a token of a remote server that
  does not say how each token was produced (``specchat.backend.remote``);
- ``ACCEPTED``: a draft token the target accepted;
- ``RECOVERED``: the target's own token at the first rejected draft position;
- ``BONUS``: the extra target token when every draft was accepted.
"""

from __future__ import annotations

import enum
import threading
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any, Literal, Protocol

from specchat.backend.constraint_spec import ConstraintSpec as ConstraintSpec
from specchat.backend.constraint_spec import check_logprobs
from specchat.backend.errors import RequestError
from specchat.backend.limits import (
    DRAFTERS,
    MAX_PREDICTION_CHARS,
    SAMPLING_LIMITS,
    DrafterName,
    Gamma,
    check_gamma,
    check_sampling_value,
    is_int,
    is_number,
)
from specchat.backend.stats_fields import JSON_STATS_FIELDS as JSON_STATS_FIELDS
from specchat.backend.stats_fields import OPTIONAL_NUMBERS


class TokenSource(enum.IntEnum):
    TARGET = 0
    ACCEPTED = 1
    RECOVERED = 2
    BONUS = 3


class PolicyState(str, enum.Enum):
    """Whether the step used speculation."""

    SPECULATING = "speculating"  # a draft was proposed and verified this step
    PAUSED = "paused"  # a drafter is configured but the policy switched speculation off (it did not pay)
    NO_DRAFT = "no-draft"  # a drafter is on but this pass verified no draft (none found, the last token, no room
    #                        in the KV cache, the drafter failed, the policy's calibration step; the prefill)
    OFF = "off"  # no drafter (plain decoding was asked for)


FinishReason = Literal["eos", "stop", "length", "context", "cancelled", "error"]


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """Sampling settings of one request, checked when built (:class:`RequestError` names a bad field).

    ``temperature == 0`` means greedy. ``None`` fields take the pair's defaults, else the model's
    generation_config (resolved by the engine, and checked against the same limits).
    """

    temperature: float | None = None
    top_k: int | None = None  # 0 or None: no top-k
    top_p: float | None = None  # 1.0 or None: no top-p
    repetition_penalty: float | None = None  # 1.0 or None: none
    max_new_tokens: int | None = None  # None: the pair's, else DEFAULT_MAX_NEW_TOKENS
    seed: int | None = None  # None: a fresh seed per request
    stop: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in SAMPLING_LIMITS:
            check_sampling_value(name, getattr(self, name))
        if not isinstance(self.stop, tuple) or not all(isinstance(s, str) for s in self.stop):
            raise RequestError(f"sampling setting stop={self.stop!r} is invalid: use a tuple of strings")


@dataclass(frozen=True, slots=True)
class GenerationRequest:
    """One reply to produce, checked when built.

    Give either ``messages`` (rendered with the tokenizer's chat template, ``add_generation_prompt=True``) or
    ``prompt_ids`` (used as they are). ``conversation`` names a cache slot: requests with the same key reuse
    the longest common token prefix already in the paged cache (multi-turn chat); ``None`` uses a scratch
    sequence freed at the end. ``prefill_progress`` asks for progress events while the prompt is read (see
    :class:`StepEvent`); a consumer that does not ask never sees one, and an engine may not send any.
    ``prediction`` is the reply's expected text (OpenAI's Predicted Outputs, e.g. a file to rewrite): drafted from
    whatever ``drafter`` says (that drafter serves where it does not match), never changing the reply.
    ``prefix_cache`` names a scope (`specchat serve`: a client) whose recently kept prompts this request may start
    from and adds its own to (backend/engine/prefix_cache.py); not with ``conversation``.
    """

    messages: list[dict[str, str]] | None = None
    prompt_ids: list[int] | None = None
    sampling: SamplingParams = field(default_factory=SamplingParams)
    drafter: DrafterName | None = None  # None: the pair's drafter
    gamma: Gamma | None = None  # None: the pair's gamma
    conversation: str | None = None
    prefill_progress: bool = False  # yield prefill progress events (StepEvent.prefill_done)
    # Messages that do not fit the context: False drops the oldest (a chat), True refuses the request with a
    # RequestError naming the token counts (an API client's history is never cut behind its back).
    keep_all_messages: bool = False
    prediction: str | None = None
    prefix_cache: str | None = None
    constraint: ConstraintSpec | None = None  # what the reply must match (None: free text)
    tools: list[dict[str, Any]] | None = None  # OpenAI tools (tool_calls.py); messages: tool_calls, tool_call_id
    logprobs: int | None = None  # None: none; k (0-20): each token's log-probability and the k likeliest (StepEvent)

    def __post_init__(self) -> None:
        check_logprobs(self.logprobs)
        if self.prefix_cache is not None and (not isinstance(self.prefix_cache, str) or self.conversation is not None):
            raise RequestError("prefix_cache must be a scope name (text), and a request with a conversation has none")
        if self.prediction is not None and (
            not isinstance(self.prediction, str) or len(self.prediction) > MAX_PREDICTION_CHARS
        ):
            raise RequestError(f"prediction must be a text of at most {MAX_PREDICTION_CHARS} characters")
        if self.drafter is not None and self.drafter not in DRAFTERS:
            raise RequestError(f"unknown drafter {self.drafter!r}; use {', '.join(DRAFTERS[:-1])} or {DRAFTERS[-1]}")
        if self.gamma is not None:
            check_gamma(self.gamma)
        if not isinstance(self.sampling, SamplingParams):
            raise RequestError(f"sampling must be SamplingParams, got {type(self.sampling).__name__}")


@dataclass(frozen=True, slots=True)
class GammaSummary:
    """The drafted length over speculating steps: mode (smallest on ties), mean and max; None without any."""

    mode: int | None = None
    mean: float | None = None
    max: int | None = None


@dataclass(frozen=True, slots=True)
class RequestStats:
    """One request's statistics so far (on every StepEvent) or in total (on the last one).

    Computed in one place (``specchat.backend.speculative.stats``); the UI, `specchat generate --json` and the history
    all show these numbers. Rates with nothing to count are None (JSON null), never NaN. Definitions:

    - ``steps``: target passes after prefill; ``spec_paused_steps``: those run plain because the policy paused;
      ``no_draft_steps``: those that verified no draft for another reason (:class:`PolicyState` NO_DRAFT); a
      speculating step drafted at least one token;
    - ``draft_prefill_tokens`` / ``draft_reused_tokens``: context ids the draft model fed to its cache / found
      already there (a conversation's earlier turns) at its first draft of the request;
    - ``seed``: the seed the reply was sampled with (the request's, or one drawn for it): the same request
      with this seed replays the reply, whatever the drafter and γ;
    - every drafted token is exactly one of ``accepted`` (the target accepted it and the reply holds it),
      ``rejected`` (the target did not accept it) or ``discarded`` (accepted, but past the reply's end: an EOS, a
      stop string or the length limit came first in its step): drafted = accepted + rejected + discarded;
    - ``acceptance_rate`` = accepted / drafted; ``mean_accepted_length`` τ = accepted + 1 per speculating step,
      over the speculating steps (= 1 + accepted / speculating steps; plain steps are not counted);
    - ``per_position_acceptance[i]`` = steps that accepted draft position i / steps that reached it (inside the
      reply); for tree drafts (the suffix drafter, draft heads) position i is depth i+1 along the path the target
      followed, so this is the per-depth acceptance;
    - ``step_counts``: the counts every figure above is computed from (``StepCounts.to_dict()``: steps and
      times by drafter and γ; per drafter, the steps that reached and that accepted each draft position; ...):
      figures over many requests (`specchat serve`'s /metrics, the bench) add these up rather than recount;
    - ``wall_s`` from the request's start to its last token, ``ttft_s`` to its first; ``tok_s`` = new_tokens /
      wall_s (prefill included); ``spec_tok_s`` / ``plain_tok_s``: tokens per second of step time over
      speculating / plain steps;
    - ``expected_speedup``: S(γ) from the policy's estimates, else from this request's own counts;
    - ``last_gamma``, ``last_policy``: the latest step's drafted length and state (the live view);
    - ``drafter``: the drafter that ran most speculating steps ("none" without any); for a tree draft
      ``drafted`` counts the nodes verified and ``tree_*`` describe the latest tree;
    - with a prediction (None without): ``prediction_tokens`` its length; ``accepted_prediction_tokens`` its drafted
      tokens that are in the reply, ``rejected_prediction_tokens`` those the target rejected or a stop cut off
      (OpenAI's usage counts of the same names; both come from the step counts, not a comparison of texts).

    The fields typed ``... | None`` besides the rates are None when the engine cannot know them: a remote
    server (``specchat.backend.remote``) that does not report a figure leaves it None (JSON null), never a guess.
    """

    new_tokens: int = 0
    wall_s: float = 0.0
    prefill_s: float | None = 0.0
    ttft_s: float | None = None
    prefill_tokens: int | None = 0
    tok_s: float | None = None
    steps: int | None = 0
    spec_paused_steps: int | None = 0
    drafted: int | None = 0
    accepted: int | None = 0
    rejected: int | None = 0
    discarded: int | None = 0
    acceptance_rate: float | None = None
    mean_accepted_length: float | None = None
    per_position_acceptance: tuple[float | None, ...] = ()
    gamma: GammaSummary = field(default_factory=GammaSummary)
    prompt_tokens: int = 0
    drafter: str = "none"
    draft_s: float | None = 0.0
    verify_s: float | None = 0.0
    overhead_s: float | None = 0.0
    tokens_per_step: float | None = None
    alpha_hat: float | None = None
    expected_speedup: float | None = None
    accepted_length_histogram: tuple[int, ...] = ()
    spec_tok_s: float | None = None
    plain_tok_s: float | None = None
    last_gamma: int | None = 0
    last_policy: PolicyState | None = None
    policy: Mapping[str, Any] | None = None  # the γ policy's estimates (a single drafter), for diagnostics
    step_counts: Mapping[str, Any] | None = None  # None: the engine cannot know them (a remote server's reply)
    no_draft_steps: int = 0
    draft_prefill_tokens: int = 0
    draft_reused_tokens: int = 0
    seed: int | None = None
    # The latest tree draft (the suffix drafter, a draft head): its nodes, depth, leaves (width), how deep the
    # target's path went into it and through which child of the pending token (1 = the drafter's most likely); 0
    # without one.
    tree_nodes: int = 0
    tree_depth: int = 0
    tree_width: int = 0
    # False: a remote server reported neither a token count nor token ids, so new_tokens is not a count: the views
    # show "—" for it (never a guessed 0).
    tokens_counted: bool = True
    tree_accepted: int = 0
    tree_branch: int = 0
    prediction_tokens: int | None = None
    accepted_prediction_tokens: int | None = None
    rejected_prediction_tokens: int | None = None
    mask_s: float | None = None  # with a constraint (else None): seconds on masks, masks, forced drafts (jump-forward)
    masks: int | None = None
    forced_tokens: int | None = None
    # In a batch (backend/engine/batch.py): streams in its latest pass, its γ cap (None: its own policy's choice).
    batch_streams: int | None = None
    batch_gamma_cap: int | None = None

    def to_json_stats(self) -> dict[str, Any]:
        """The `specchat generate --json` "stats" object (:data:`JSON_STATS_FIELDS`)."""
        full = self.to_dict()
        return {name: full[name] for name in JSON_STATS_FIELDS}

    def to_dict(self) -> dict[str, Any]:
        """Every field as JSON-ready values (what the history stores with a reply)."""
        out = asdict(self)
        out["per_position_acceptance"] = list(self.per_position_acceptance)
        out["accepted_length_histogram"] = list(self.accepted_length_histogram)
        out["last_policy"] = self.last_policy.value if self.last_policy is not None else None
        out["policy"] = dict(self.policy) if self.policy is not None else None
        out["step_counts"] = dict(self.step_counts) if self.step_counts is not None else None
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> RequestStats:
        """Stats read back from the history (or any dict of these fields): fields that are missing, of the wrong
        type or unknown are left at their defaults, so an older or damaged row never raises."""
        values: dict[str, Any] = {}
        defaults = cls()
        for f in fields(cls):
            if f.name not in data:
                continue
            value, default = data[f.name], getattr(defaults, f.name)
            try:
                values[f.name] = _coerce(f.name, value, default)
            except (TypeError, ValueError):
                continue
        return cls(**values)


def _coerce(name: str, value: Any, default: Any) -> Any:
    if name == "gamma":
        if not isinstance(value, Mapping):
            raise TypeError(name)
        return GammaSummary(*(value.get(k) if is_number(value.get(k)) else None for k in ("mode", "mean", "max")))
    if name == "last_policy":
        return None if value is None else PolicyState(value)
    if name in ("per_position_acceptance", "accepted_length_histogram"):
        if not isinstance(value, (list, tuple)) or not all(v is None or is_number(v) for v in value):
            raise TypeError(name)
        return tuple(value)
    if name in ("seed", "masks", "forced_tokens") or name.endswith("prediction_tokens"):  # whole (JSON: exact < 2**53)
        if value is not None and not is_int(value):
            raise TypeError(name)
        return value
    if name in ("policy", "step_counts"):
        if value is not None and not isinstance(value, Mapping):
            raise TypeError(name)
        return value
    if isinstance(default, str) or name == "drafter":
        if not isinstance(value, str):
            raise TypeError(name)
        return value
    if isinstance(default, bool):
        if not isinstance(value, bool):
            raise TypeError(name)
        return value
    if value is None:
        if default is not None and name not in OPTIONAL_NUMBERS:
            raise TypeError(name)
        return None
    if not is_number(value):
        raise TypeError(name)
    return int(value) if isinstance(default, int) and not isinstance(default, bool) else float(value)


@dataclass(slots=True)
class StepEvent:
    """What one decoding step produced. The first event follows prefill (``is_prefill`` True, one token).

    ``token_ids``, ``sources`` and ``token_texts`` have the same length; ``text`` is the detokenised text those
    tokens completed (never a split UTF-8 character; may be "" when a token is held back for a stop string or
    an incomplete character). Times are seconds of this step. ``stats`` is the request's statistics after this
    step; the last event of a request has ``finish_reason`` set and ``stats`` holds the totals.
    A *prefill progress event* (only for a request with ``prefill_progress``) comes before each prefill pass:
    ``prefill_done`` prompt tokens read so far of ``prefill_tokens``, no tokens, ``stats`` None. It is not a
    step: it changes no statistics.
    """

    token_ids: list[int]
    sources: list[TokenSource]
    token_texts: list[str]  # per token, the text it completed ("" when held back); "".join == text
    text: str
    gamma: int  # tokens drafted in this step (0 when not speculating)
    accepted: int  # of those, how many the target accepted that the reply holds (RequestStats' ``accepted``)
    draft_s: float
    verify_s: float  # the target forward pass (prefill for the first event)
    overhead_s: float  # everything else: sampling, verification bookkeeping, detokenisation
    policy: PolicyState
    drafter: str  # the drafter in use: "none", "prompt-lookup", "suffix" or "draft-model"
    is_prefill: bool = False
    prefill_tokens: int = 0  # tokens actually prefilled (after prefix reuse), first event only
    finish_reason: FinishReason | None = None
    message: str | None = None  # a user-facing notice (context full, drafter failed and was switched off, ...)
    stats: RequestStats | None = None
    prefill_done: int | None = None  # a prefill progress event: prompt tokens read so far (None otherwise)
    logprobs: list[dict[str, Any]] | None = None  # per token {token, id, logprob, top}: backend/engine/target_pass.py

    @classmethod
    def empty(cls, policy: PolicyState, drafter: str, **fields: Any) -> StepEvent:
        """An event without tokens: a prefill progress event, or the closing event of a request that ended
        between steps (``fields``: any other field, such as ``prefill_done``)."""
        return cls([], [], [], "", 0, 0, 0.0, 0.0, 0.0, policy, drafter, **fields)


class EngineAPI(Protocol):
    """What the UI and the CLI need of an engine: the in-process one, or a client of a remote server."""

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[StepEvent]:
        """Stream one reply; RequestError for an invalid request before anything is computed."""
        ...

    def forget(self, conversation: str) -> None:
        """Drop a conversation's cached prefix."""
        ...

    def close(self) -> None:
        """Release every resource (models, caches, connections)."""
        ...
