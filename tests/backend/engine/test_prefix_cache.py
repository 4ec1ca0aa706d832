"""The prefix cache across requests (issue 35 item 5; backend/engine/prefix_cache.py): a request resending a kept
conversation plus one message prefills only the new tokens, replies as a cold request does (greedy and seeded),
entries stay within the budget (least recently used evicted), and one scope never reads, shortens or frees
another's entries. Counts come from the engine's own prefill (the rows its prefill passes read), not timing."""

from __future__ import annotations

import pytest
from engine_fixtures import tiny_engine
from tiny_models import one_thread, random_ids  # noqa: F401  (one_thread: autouse)

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.errors import RequestError
from specchat.backend.kv.kv_cache import kv_bytes_per_token
from specchat.backend.limits import KV_BLOCK_SIZE

GREEDY = SamplingParams(temperature=0.0, max_new_tokens=16)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, max_new_tokens=16, seed=1234)
CONTEXT = 4096


def words(n: int, seed: int) -> str:
    return " ".join(f"w{i}" for i in random_ids(n, seed=seed, low=6))  # w3..w5 are the template's role words


def conversation(tokens: int, seed: int = 0) -> list[dict[str, str]]:
    """A system prompt and turns of about ``tokens`` tokens in all, ending with a user message."""
    out = [{"role": "system", "content": words(300, seed)}]
    turn = 0
    while sum(len(m["content"].split()) + 4 for m in out) < tokens - 100:
        role = "user" if turn % 2 == 0 else "assistant"
        out.append({"role": role, "content": words(150, seed + 1 + turn)})
        turn += 1
    if out[-1]["role"] == "user":
        out.append({"role": "assistant", "content": words(100, seed + 99)})
    out.append({"role": "user", "content": words(40, seed + 100)})
    return out


def engine_with(budget_tokens: int, context: int = CONTEXT):
    probe = tiny_engine(context_length=context)
    per_token = kv_bytes_per_token(probe.target.model.config, probe.target.dtype)
    return tiny_engine(context_length=context, prefix_cache_bytes=budget_tokens * per_token)


class PrefillSpy:
    """Counts the rows of the engine's prefill passes (the passes that may be cancelled between layers)."""

    def __init__(self, engine) -> None:
        self.rows = 0
        forward = engine.runner.forward

        def spy(seq, ids, **kw):
            if kw.get("cancel") is not None:
                self.rows += len(ids)
            return forward(seq, ids, **kw)

        engine.runner.forward = spy


def run(engine, messages, sampling=GREEDY, scope: str | None = "a"):
    events = list(engine.generate(GenerationRequest(messages=messages, sampling=sampling, prefix_cache=scope)))
    ids = [t for e in events for t in e.token_ids]
    return ids, "".join(e.text for e in events).strip(), events[-1].stats


def cold(messages, sampling=GREEDY) -> list[int]:
    return run(tiny_engine(context_length=CONTEXT), messages, sampling, scope=None)[0]


@pytest.mark.parametrize("sampling", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_a_resent_2000_token_conversation_prefills_only_the_new_message(sampling) -> None:
    engine = engine_with(budget_tokens=8192)
    spy = PrefillSpy(engine)
    first = conversation(2000)
    _, reply, stats = run(engine, first, sampling)
    assert stats.prompt_tokens >= 2000 and stats.prefill_tokens == stats.prompt_tokens  # nothing kept yet
    second = first + [{"role": "assistant", "content": reply}, {"role": "user", "content": words(12, 7)}]
    spy.rows = 0
    ids, _, stats = run(engine, second, sampling)
    assert stats.prompt_tokens > 2000
    assert stats.prefill_tokens <= 100 and spy.rows == stats.prefill_tokens  # the engine's own count
    assert ids == cold(second, sampling)  # the same reply as a request that reads everything


def test_two_scopes_never_read_or_spoil_each_others_entries() -> None:
    engine = engine_with(budget_tokens=8192)
    x = conversation(600, seed=1)
    _, reply_a, _ = run(engine, x, scope="a")
    ids_b, reply_b, stats_b = run(engine, x, scope="b")
    assert stats_b.prefill_tokens == stats_b.prompt_tokens  # b does not start from a's entry
    assert engine.prefix.scopes() == {"a", "b"}
    # Each scope's next turn starts from its own entry and replies as a cold request does.
    for scope, reply in (("a", reply_a), ("b", reply_b), ("a", reply_a)):
        turn = x + [{"role": "assistant", "content": reply}, {"role": "user", "content": words(10, ord(scope))}]
        ids, _, stats = run(engine, turn, scope=scope)
        assert stats.prefill_tokens <= 40, scope
        assert ids == cold(turn), scope


def test_entries_stay_within_the_budget_least_recently_used_first() -> None:
    budget = 512
    engine = engine_with(budget_tokens=budget)
    prompts = {scope: conversation(400, seed=seed) for seed, scope in enumerate("abc")}
    for scope in "abc":
        run(engine, prompts[scope], scope=scope)
        assert engine.prefix.held_blocks() <= engine.prefix.budget_blocks == budget // KV_BLOCK_SIZE
        assert engine.blocks_in_use() == engine.prefix.held_blocks()  # nothing else is held between requests
    assert "a" not in engine.prefix.scopes() and "c" in engine.prefix.scopes()  # a was the least recently used
    _, _, stats = run(engine, prompts["a"], scope="a")
    assert stats.prefill_tokens == stats.prompt_tokens  # evicted: read again
    _, _, stats = run(engine, prompts["a"], scope="a")
    assert stats.prefill_tokens == 0  # the whole prompt and its last row were kept


def test_one_entry_larger_than_the_budget_keeps_its_first_blocks() -> None:
    engine = engine_with(budget_tokens=256)
    long = conversation(700, seed=3)
    run(engine, long)
    (entry,) = engine.prefix.entries("a")
    assert len(entry.cached) == 256 and engine.prefix.held_blocks() == 256 // KV_BLOCK_SIZE
    ids, _, stats = run(engine, long)
    assert stats.prefill_tokens == stats.prompt_tokens - 256
    assert ids == cold(long)


def test_a_branch_forks_the_entry_so_both_branches_keep_their_history() -> None:
    engine = engine_with(budget_tokens=8192)
    shared = conversation(500, seed=5)[:-1]  # the system prompt and turns: what both branches start with
    branch_1 = shared + [{"role": "user", "content": words(200, 11)}]
    branch_2 = shared + [{"role": "user", "content": words(200, 12)}]
    _, reply_1, _ = run(engine, branch_1)
    _, _, stats = run(engine, branch_2)
    assert stats.prefill_tokens <= 210  # branch 2 read only its own message
    assert len(engine.prefix.entries("a")) == 2
    turn = branch_1 + [{"role": "assistant", "content": reply_1}, {"role": "user", "content": words(8, 13)}]
    ids, _, stats = run(engine, turn)
    assert stats.prefill_tokens <= 20  # branch 1's entry was not cut back to the shared part
    assert ids == cold(turn)


def test_no_budget_keeps_nothing_and_a_scope_excludes_a_conversation_key() -> None:
    engine = engine_with(budget_tokens=0)
    x = conversation(300, seed=8)
    run(engine, x)
    _, _, stats = run(engine, x)
    assert stats.prefill_tokens == stats.prompt_tokens and engine.blocks_in_use() == 0
    with pytest.raises(RequestError, match="prefix_cache"):
        GenerationRequest(messages=x, prefix_cache="a", conversation="c")


def test_a_new_request_is_not_split_by_the_blocks_of_kept_prompts() -> None:
    """A short kept prompt evicted for a longer one leaves a hole at the lowest blocks, too small for the next
    request: that request starts after the kept blocks (one run: every pass reads its keys as a slice), not in
    the hole (split around them: every pass gathers), and replies as a cold request does."""
    engine = engine_with(budget_tokens=512)
    short, longer, nxt = conversation(120, seed=5), conversation(400, seed=6), conversation(400, seed=7)
    run(engine, short, scope="a")
    run(engine, longer, scope="b")
    assert "a" not in engine.prefix.scopes() and engine.cache.pool.first_run(1) == 0  # the hole at block 0
    tables: list[list[int]] = []
    forward = engine.runner.forward

    def spy(seq, ids, **kw):
        out = forward(seq, ids, **kw)
        tables.append(list(seq.block_table))  # as the pass read it (it reserves its own slots)
        return out

    engine.runner.forward = spy
    ids, _, _ = run(engine, nxt, scope="c")
    assert tables and all(t == list(range(t[0], t[0] + len(t))) for t in tables)
    assert tables[0][0] > 0
    assert ids == cold(nxt)
