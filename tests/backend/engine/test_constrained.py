"""Constrained decoding in the engine (issue 46) on tiny random-weight models with a character-level tokenizer:

- every reply matches its JSON schema (parsed and validated) when it ends with EOS; EOS comes only where the grammar
  accepts;
- seeded replay under a constraint: the same tokens for every drafter (none, prompt lookup, suffix, a draft model,
  auto), γ 1, 4, 16 and auto, with and without jump-forward, greedy and sampled, over several schemas and seeds;
- jump-forward drafts the grammar's forced tokens (counted, accepted), and drafts the grammar refuses are cut;
- a schema the grammar engine cannot take is a RequestError naming it, before anything is decoded.
"""

from __future__ import annotations

import json

import jsonschema
import pytest
from char_tokenizer import char_engine
from tiny_models import one_thread  # noqa: F401  (autouse)

from specchat.backend.api import ConstraintSpec, GenerationRequest, SamplingParams
from specchat.backend.engine.engine import Engine
from specchat.backend.errors import RequestError

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "ok": {"type": "boolean"},
            "tags": {"type": "array", "items": {"enum": ["red", "green"]}, "maxItems": 3},
            "kind": {"enum": ["a", "b", "c"]},
        },
        "required": ["ok", "tags", "kind"],
        "additionalProperties": False,
    },
    {
        "type": "object",
        "properties": {
            "user": {
                "type": "object",
                "properties": {"id": {"type": "string", "pattern": "^[a-f0-9]{4}$"}, "admin": {"type": "boolean"}},
                "required": ["id", "admin"],
                "additionalProperties": False,
            },
            "note": {"type": "null"},
        },
        "required": ["user", "note"],
        "additionalProperties": False,
    },
]
SETTINGS = [
    {"temperature": 0},
    {"temperature": 0.9, "top_p": 0.95, "seed": 5},
    {"temperature": 1.3, "top_k": 20, "repetition_penalty": 1.2, "seed": 11},
    {"temperature": 0.7, "seed": 2**63 + 5},
]
MESSAGES = [{"role": "user", "content": 'Give me {"name": "ab", "age": 10} as JSON {"name": "ab", "age": 10}'}]


def reply(engine: Engine, schema, *, drafter=None, gamma=None, jump=True, **sampling):
    spec = ConstraintSpec("json_schema", json.dumps(schema), jump_forward=jump)
    request = GenerationRequest(
        messages=MESSAGES,
        sampling=SamplingParams(max_new_tokens=60, **sampling),
        drafter=drafter,
        gamma=gamma,
        constraint=spec,
    )
    events = list(engine.generate(request))
    return [t for e in events for t in e.token_ids], events


@pytest.fixture(scope="module")
def engine() -> Engine:
    return char_engine(draft=True)


@pytest.mark.parametrize("schema", SCHEMAS, ids=range(len(SCHEMAS)))
@pytest.mark.parametrize("seed", [0, 1, 2])
def test_replies_match_their_schema(engine, schema, seed):
    ids, events = reply(engine, schema, temperature=1.0, seed=seed)
    last = events[-1]
    assert last.finish_reason == "eos", last.finish_reason
    text = "".join(e.text for e in events)
    jsonschema.validate(json.loads(text), schema)
    assert ids[-1] == 2 and 2 not in ids[:-1]
    assert last.stats.masks >= len(ids) and last.stats.mask_s > 0


def test_jump_forward_drafts_the_forced_tokens(engine):
    _, events = reply(engine, SCHEMAS[0], drafter="none", temperature=0)
    stats = events[-1].stats
    assert stats.forced_tokens > 0 and stats.accepted > 0
    assert {e.drafter for e in events if e.gamma} == {"jump-forward"}
    _, plain = reply(engine, SCHEMAS[0], drafter="none", temperature=0, jump=False)
    assert plain[-1].stats.forced_tokens == 0 and plain[-1].stats.drafted == 0
    assert plain[-1].stats.steps > stats.steps  # the forced tokens cost no pass of their own


def test_seeded_replay_under_constraints_on_a_grid():
    """252 runs: (5 drafters x 4 γ + jump-forward off) x 3 schemas x (greedy + 3 sampled settings and seeds), each
    against plain constrained decoding without jump-forward: 0 differences."""
    engines = {"draft-model": char_engine(draft=True, gamma=4)}
    engines["other"] = char_engine(drafter="prompt-lookup")
    runs = differences = 0
    for schema in SCHEMAS:
        for sampling in SETTINGS:
            plain, _ = reply(engines["other"], schema, drafter="none", jump=False, **sampling)
            for drafter in ("none", "prompt-lookup", "suffix", "draft-model", "auto"):
                engine = engines["draft-model" if drafter in ("draft-model", "auto") else "other"]
                for gamma in (1, 4, 16, "auto"):
                    ids, _ = reply(engine, schema, drafter=drafter, gamma=gamma, **sampling)
                    runs += 1
                    differences += ids != plain
            ids, _ = reply(engines["draft-model"], schema, drafter="draft-model", gamma=4, jump=False, **sampling)
            runs += 1
            differences += ids != plain
    assert runs == 252 and differences == 0


def test_a_schema_the_engine_cannot_take_is_refused():
    engine = char_engine(drafter="none")
    with pytest.raises(RequestError, match="json schema"):
        reply(engine, {"type": "object", "properties": {"a": {"type": "strin"}}})
