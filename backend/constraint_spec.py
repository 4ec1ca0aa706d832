"""What a reply must match: the request-side half of constrained decoding (``backend/speculative/constraint.py`` is
the decoding half): the spec, its grammar text and its check (llguidance, loaded only when a grammar is built), and
the check of a request's ``logprobs``. ``ConstraintSpec`` is re-exported by ``backend/api.py``; no torch."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from specchat.backend.errors import RequestError

ConstraintKind = Literal["json_schema", "json_object", "grammar", "regex"]
CONSTRAINT_KINDS: tuple[str, ...] = ("json_schema", "json_object", "grammar", "regex")
MAX_CONSTRAINT_CHARS = 1 << 20  # a schema or grammar longer than this is refused
# JSON is written compactly but with the separators models saw most (", " and ": "), no free whitespace: a model
# cannot loop on blanks, and more of each reply is forced (jump-forward).
JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True, slots=True)
class ConstraintSpec:
    """What a reply must match (``backend/speculative/constraint.py``): a JSON schema (its text), any JSON object,
    a grammar (Lark or llama.cpp's GBNF) or a regular expression. ``jump_forward``: tokens the grammar forces are
    drafted without a drafter (never changes the reply; off only to measure it)."""

    kind: ConstraintKind
    text: str = ""
    jump_forward: bool = True

    def __post_init__(self) -> None:
        if self.kind not in CONSTRAINT_KINDS:
            raise RequestError(f"unknown constraint kind {self.kind!r}; use one of {', '.join(CONSTRAINT_KINDS)}")
        if not isinstance(self.text, str) or len(self.text) > MAX_CONSTRAINT_CHARS:
            raise RequestError(f"a constraint's text must be a text of at most {MAX_CONSTRAINT_CHARS} characters")
        if self.kind != "json_object" and not self.text.strip():
            raise RequestError(f"the {self.kind.replace('_', ' ')} is empty")


MAX_TOP_LOGPROBS = 20  # OpenAI's limit on top_logprobs


def check_logprobs(value: object) -> None:
    """A request's ``logprobs``: None, or the number of likeliest alternatives to report per token (0-20)."""
    if value is not None and (type(value) is not int or not 0 <= value <= MAX_TOP_LOGPROBS):
        raise RequestError(f"logprobs must be a whole number from 0 to {MAX_TOP_LOGPROBS}, got {value!r}")


def grammar_text(spec: ConstraintSpec) -> str:
    """llguidance's grammar for ``spec``, before any tokenizer is known (RequestError for an unreadable one)."""
    import llguidance  # here: the API's other users (the UI) never load the grammar engine

    try:
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, JSON_OPTIONS)
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.text, JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.text)
        return llguidance.grammar_from("grammar", spec.text)  # Lark, or llama.cpp's GBNF (converted to Lark)
    except (ValueError, TypeError) as error:
        raise RequestError(f"the {spec.kind.replace('_', ' ')} cannot be read: {error}") from None


def check_grammar(spec: ConstraintSpec) -> str:
    """The grammar text for ``spec``, validated without a tokenizer (a client's bad schema is refused before it
    queues); RequestError naming llguidance's reason."""
    import llguidance

    grammar = grammar_text(spec)
    is_error, messages = llguidance.LLMatcher.validate_grammar_with_warnings(grammar)
    if is_error:
        raise RequestError(f"the {spec.kind.replace('_', ' ')} is not supported: {messages[0] if messages else '?'}")
    return grammar
