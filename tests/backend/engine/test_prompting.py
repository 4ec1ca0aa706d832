"""Fitting a long conversation into the context (backend/engine/prompting.py, issue 20 item 6): the binary search
drops exactly the messages the one-at-a-time search dropped, with about log2(turns) renders instead of one per
dropped turn. Fails on the code before issue 20: 801 messages took ~380 renders (quadratic: 40 s of CPU with a
real tokenizer, minutes for a 1 MB chat)."""

from __future__ import annotations

import math

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from specchat.backend.engine.prompting import fit_to_context, render
from specchat.backend.errors import RequestError


class CountingTokenizer:
    """A chat template of one token per word plus 4 per message; counts renders and the characters rendered."""

    chat_template = "counting"

    def __init__(self) -> None:
        self.calls = self.chars = 0

    def apply_chat_template(self, messages, add_generation_prompt: bool, tokenize: bool) -> list[int]:
        self.calls += 1
        self.chars += sum(len(m["content"]) for m in messages)
        return [0] * sum(len(m["content"].split()) + 4 for m in messages)


def one_at_a_time(tokenizer, messages, *, budget: int, already_dropped: int = 0):
    """The search before issue 20: drop one turn, render everything again, until half the budget is reached."""
    system = [m for m in messages if m["role"] == "system"][:1]
    rest = [m for m in messages if m["role"] != "system"]
    dropped = min(already_dropped, max(len(rest) - 1, 0))
    ids = render(tokenizer, system + rest[dropped:])
    if len(ids) <= budget:
        return ids, dropped
    while len(rest) - dropped > 1:
        dropped += 1
        while len(rest) - dropped > 1 and rest[dropped]["role"] != "user":
            dropped += 1
        ids = render(tokenizer, system + rest[dropped:])
        if len(ids) <= budget // 2:
            break
    return ids, dropped


def conversation(turns: int, words: int = 50, system: bool = True) -> list[dict[str, str]]:
    messages = [{"role": "system", "content": "be brief"}] if system else []
    for turn in range(turns):
        role = "user" if turn % 2 == 0 else "assistant"
        messages.append({"role": role, "content": " ".join(f"w{turn}.{i}" for i in range(words))})
    return messages


def test_801_messages_take_a_logarithmic_number_of_renders() -> None:
    messages = conversation(801)
    tokenizer = CountingTokenizer()
    ids, dropped, notice = fit_to_context(tokenizer, messages, budget=4096)
    assert len(ids) <= 2048 and notice is not None and dropped % 2 == 0  # starts on a user message
    assert tokenizer.calls <= math.ceil(math.log2(801)) + 2, tokenizer.calls
    total = sum(len(m["content"]) for m in messages)
    assert tokenizer.chars <= 12 * total, (tokenizer.chars, total)  # linear in the conversation, not quadratic
    reference = CountingTokenizer()
    assert one_at_a_time(reference, messages, budget=4096) == (ids, dropped)
    assert reference.calls > 300 and reference.chars > 100 * total  # what the old search cost


@settings(max_examples=60, deadline=None)
@given(
    turns=st.integers(min_value=1, max_value=60),
    words=st.integers(min_value=1, max_value=40),
    budget=st.integers(min_value=8, max_value=800),
    already=st.integers(min_value=0, max_value=70),
    system=st.booleans(),
    last_role=st.sampled_from(["user", "assistant"]),
)
def test_the_binary_search_drops_what_the_linear_one_dropped(turns, words, budget, already, system, last_role):
    messages = conversation(turns, words, system)
    if messages[-1]["role"] != last_role:
        messages.append({"role": last_role, "content": "last"})
    try:
        ids, dropped, _ = fit_to_context(CountingTokenizer(), messages, budget=budget, already_dropped=already)
    except RequestError as error:
        assert "too long for the context" in str(error)
        assert len(one_at_a_time(CountingTokenizer(), messages, budget=budget, already_dropped=already)[0]) > budget
        return
    assert (ids, dropped) == one_at_a_time(CountingTokenizer(), messages, budget=budget, already_dropped=already)


def test_the_last_message_alone_too_long_is_refused_by_name() -> None:
    with pytest.raises(RequestError, match="too long for the context: 510 tokens"):
        fit_to_context(CountingTokenizer(), conversation(3, words=500), budget=100)
