"""logprobs on the embedded default (native CPU path) with and without speculation: the same tokens and bit-identical
log-probabilities for drafters none, prompt lookup at γ 4 and 12, suffix at auto, free and under a JSON schema (issue 46).

    python benchmarks/logprobs_native.py
"""

import json

from specchat.backend.api import ConstraintSpec, GenerationRequest, SamplingParams
from specchat.backend.engine.engine import load_engine
from specchat.backend.models.catalog.config import load_pairs

engine = load_engine(load_pairs()["smollm2-135m"])
msgs = [{"role": "user", "content": "Write a Python function that adds two numbers, then repeat it exactly."}]
schema = json.dumps(
    {
        "type": "object",
        "properties": {"name": {"type": "string"}, "age": {"type": "integer"}},
        "required": ["name", "age"],
    }
)
for constraint in (None, ConstraintSpec("json_schema", schema)):
    out = {}
    for drafter, gamma in (("none", None), ("prompt-lookup", 4), ("prompt-lookup", 12), ("suffix", "auto")):
        r = GenerationRequest(
            messages=msgs,
            sampling=SamplingParams(temperature=0.7, seed=11, max_new_tokens=80),
            drafter=drafter,
            gamma=gamma,
            logprobs=3,
            constraint=constraint,
        )
        ev = list(engine.generate(r))
        out[(drafter, gamma)] = (
            [t for e in ev for t in e.token_ids],
            [x for e in ev for x in e.logprobs or []],
            sum(e.gamma for e in ev),
        )
    base = out[("none", None)]
    for k, v in out.items():
        print(
            constraint is not None,
            k,
            "tokens same",
            v[0] == base[0],
            "logprobs bit-identical",
            v[1] == base[1],
            "drafted",
            v[2],
        )
