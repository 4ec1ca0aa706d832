"""Constrained requests in a batch (backend/engine/batch.py with issue 46's constraints): each stream's grammar lives
in its own request, so a batched constrained reply is its solo run's, token for token, beside other streams with
other schemas, drafters and samplings."""

from __future__ import annotations

import json
import threading

from batch_fixtures import Collector
from char_tokenizer import char_engine
from tiny_models import one_thread  # noqa: F401  (autouse)

from specchat.backend.api import ConstraintSpec, GenerationRequest, SamplingParams
from specchat.backend.engine.batch import BatchScheduler

SCHEMAS = [
    {
        "type": "object",
        "properties": {"name": {"type": "string", "maxLength": 6}, "age": {"type": "integer", "maximum": 99}},
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    {"type": "object", "properties": {"ok": {"type": "boolean"}, "kind": {"enum": ["a", "b"]}}, "required": ["ok"]},
]
SETTINGS = [{"temperature": 0}, {"temperature": 0.9, "top_p": 0.95, "seed": 5}, {"temperature": 0.7, "seed": 11}]
MESSAGES = [{"role": "user", "content": 'Give me {"name": "ab", "age": 10} as JSON {"name": "ab", "age": 10}'}]


def test_constrained_streams_equal_their_solo_runs():
    engine = char_engine(draft=True)
    requests = [
        GenerationRequest(
            messages=MESSAGES,
            sampling=SamplingParams(max_new_tokens=40, **SETTINGS[i % len(SETTINGS)]),
            drafter=("none", "prompt-lookup", "draft-model")[i % 3],
            gamma=(None, 4)[i % 2],
            constraint=ConstraintSpec("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)]), jump_forward=i % 2 == 0),
        )
        for i in range(9)
    ]
    alone = [[t for e in engine.generate(r) for t in e.token_ids] for r in requests]
    scheduler = BatchScheduler(engine, 4).start()
    out = [Collector() for _ in requests]
    try:
        for request, collector in zip(requests, out, strict=True):
            scheduler.submit(request, threading.Event(), collector)
        assert all(c.ended.wait(300) for c in out)
    finally:
        scheduler.close()
    assert [c.errors for c in out] == [[]] * len(requests)
    assert [c.tokens for c in out] == alone
