"""Rendering chats to token ids, fitting them into the context, and finding what the cache already holds.

Every turn renders the whole conversation with the chat template afresh (templates re-render earlier turns:
SmolLM2 adds a newline after ``<|im_end|>`` that was never generated, some drop reasoning blocks), so the
engine reuses the longest common token prefix with what is cached rather than trusting its own record of
the previous turn.

When the conversation no longer fits, the oldest turns are dropped in large chunks (down to about half the
context) and the number dropped is remembered, so the following turns drop the same turns and keep
reusing the cache: one re-prefill per overflow, not one per turn. How many to drop is found by a binary search
over the turns (a render is linear in the conversation's length, so a search that drops one turn per render
would be quadratic): about log2(turns) + 2 renders, whatever the conversation's length.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from specchat.backend.errors import RequestError
from specchat.backend.inputs import shown
from specchat.backend.tool_calls import prepare, syntax_of

if TYPE_CHECKING:
    from specchat.backend.api import GenerationRequest
    from specchat.backend.engine.parts import Conversation

_ROLES = ("system", "user", "assistant", "tool")


def validate_messages(messages: Sequence[dict]) -> list[dict[str, Any]]:
    """Check roles and contents; returns clean copies. Control characters are kept (the tokenizer copes). An
    assistant's OpenAI ``tool_calls`` (a list) and a tool result's ``tool_call_id`` (a text) are kept."""
    clean: list[dict[str, Any]] = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or "role" not in message or "content" not in message:
            raise RequestError(f"message {i} must be an object with 'role' and 'content', got {shown(message)}")
        role, content = message["role"], message["content"]
        if not isinstance(role, str) or role not in _ROLES:
            raise RequestError(f"message {i} has role {shown(role)}; use one of {', '.join(_ROLES)}")
        if not isinstance(content, str):
            raise RequestError(f"message {i} content must be text, got {type(content).__name__}")
        # Lone surrogates (from invalid UTF-8 decoded with surrogateescape) cannot be tokenised: replace them.
        content = content.encode("utf-8", "replace").decode("utf-8")
        item: dict[str, Any] = {"role": role, "content": content}
        if role == "assistant" and isinstance(message.get("tool_calls"), list) and message["tool_calls"]:
            item["tool_calls"] = message["tool_calls"]
        if role == "tool" and isinstance(message.get("tool_call_id"), str):
            item["tool_call_id"] = message["tool_call_id"]
        clean.append(item)
    if not any(m["role"] == "user" for m in clean):
        raise RequestError("the conversation has no user message: type something to send")
    if clean[-1]["role"] == "user" and not clean[-1]["content"].strip():
        raise RequestError(f"message {len(clean) - 1} (the last user message) is empty: type something to send")
    return clean


def render(tokenizer, messages: Sequence[dict[str, Any]], tools: list[dict[str, Any]] | None = None) -> list[int]:
    """The chat template applied to ``messages`` (and ``tools``, when given) with the generation prompt, as ids."""
    if getattr(tokenizer, "chat_template", None):
        extra = {"tools": tools} if tools else {}
        out = tokenizer.apply_chat_template(list(messages), add_generation_prompt=True, tokenize=True, **extra)
        if isinstance(out, dict) or hasattr(out, "keys"):  # BatchEncoding in newer transformers
            out = out["input_ids"]
        return [int(t) for t in out]
    # A base model without a template: plain concatenation of the contents.
    text = "\n\n".join(m["content"] for m in messages)
    return [int(t) for t in tokenizer(text)["input_ids"]]


def fit_to_context(
    tokenizer,
    messages: list[dict[str, Any]],
    *,
    budget: int,
    already_dropped: int = 0,
) -> tuple[list[int], int, str | None]:
    """Render ``messages`` so the prompt fits in ``budget`` tokens.

    Returns ``(ids, dropped, notice)``: ``dropped`` is how many of the oldest non-system messages were left
    out (never fewer than ``already_dropped``, so earlier turns stay stable); ``notice`` says so when this
    call had to drop more. Raises RequestError when even the last user message alone does not fit.
    """
    system = [m for m in messages if m["role"] == "system"][:1]
    rest = [m for m in messages if m["role"] != "system"]
    dropped = min(already_dropped, max(len(rest) - 1, 0))
    ids = render(tokenizer, system + rest[dropped:])
    if len(ids) <= budget:
        return ids, dropped, None
    # Drop in large chunks: aim for half the budget so that the next several turns fit again. A conversation
    # may only start on a user message (alternation kept), or be cut down to its last message.
    target, last = budget // 2, len(rest) - 1
    starts = [d for d in range(dropped + 1, last) if rest[d]["role"] == "user"] + ([last] if last > dropped else [])
    renders: dict[int, list[int]] = {}

    def rendered(index: int) -> list[int]:
        if index not in renders:
            renders[index] = render(tokenizer, system + rest[starts[index] :])
        return renders[index]

    # The first start whose rendering fits in the target (fewer messages never render longer), else the last.
    low, high = 0, len(starts) - 1
    while low < high:
        middle = (low + high) // 2
        if len(rendered(middle)) <= target:
            high = middle
        else:
            low = middle + 1
    if starts:
        dropped, ids = starts[low], rendered(low)
    if len(ids) > budget:
        raise RequestError(
            f"the message is too long for the context: {len(ids)} tokens, the pair allows {budget} for the "
            "prompt; shorten it, or pick a pair with a longer context_length"
        )
    notice = (
        f"The conversation outgrew the context ({budget} tokens): the oldest {dropped} message(s) are no "
        "longer seen by the model."
    )
    return ids, dropped, notice


def prompt_ids(
    tokenizer, pair_name: str, context_length: int, request: GenerationRequest, conv: Conversation | None, budget: int
) -> tuple[list[int], str | None]:
    """A request's prompt as token ids, at most ``budget`` of them (older messages left out where they do not fit,
    unless the request keeps them all), and a notice of what was left out."""
    if request.prompt_ids is not None:
        ids = [int(t) for t in request.prompt_ids]
        if not ids:
            raise RequestError("the prompt is empty: give at least one token")
        if len(ids) > budget:
            raise RequestError(
                f"the prompt has {len(ids)} tokens but the context allows {budget}; "
                "shorten it or raise the pair's context_length"
            )
        return ids, None
    if not request.messages:
        raise RequestError("the request has no messages: type something to send")
    messages = validate_messages(request.messages)
    messages, tools = prepare(messages, request.tools, syntax_of(getattr(tokenizer, "chat_template", None)))
    if request.keep_all_messages:
        ids = render(tokenizer, messages, tools)
        if len(ids) > budget:
            raise RequestError(
                f"the messages come to {len(ids)} tokens; the context holds {budget} for the prompt "
                f"(pair {pair_name!r}, context_length {context_length}): send fewer or shorter messages"
            )
        return ids, None
    ids, dropped, notice = fit_to_context(
        tokenizer, messages, budget=budget, already_dropped=conv.dropped if conv else 0
    )
    if conv is not None:
        conv.dropped = dropped
    return ids, notice
