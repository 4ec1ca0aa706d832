"""logprobs on the embedded default (native CPU path) with and without speculation (issue 46): the same tokens and
bit-identical log-probabilities for drafters none, prompt lookup at γ 4 and 12 and suffix at auto, free and under
a JSON schema.

    python benchmarks/logprobs_native.py
"""

from __future__ import annotations

import json

from specchat.backend.api import ConstraintSpec, GenerationRequest, SamplingParams
from specchat.backend.engine.engine import load_engine
from specchat.backend.models.catalog.config import load_pairs

MESSAGES = [{"role": "user", "content": "Write a Python function that adds two numbers, then repeat it exactly."}]
SCHEMA = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer"}}}
RUNS = (("none", None), ("prompt-lookup", 4), ("prompt-lookup", 12), ("suffix", "auto"))


def main() -> None:
    engine = load_engine(load_pairs()["smollm2-135m"])
    for constraint in (None, ConstraintSpec("json_schema", json.dumps(SCHEMA | {"required": ["name", "age"]}))):
        out = {}
        for drafter, gamma in RUNS:
            sampling = SamplingParams(temperature=0.7, seed=11, max_new_tokens=80)
            request = GenerationRequest(
                messages=MESSAGES, sampling=sampling, drafter=drafter, gamma=gamma, logprobs=3, constraint=constraint
            )
            events = list(engine.generate(request))
            ids = [t for e in events for t in e.token_ids]
            out[(drafter, gamma)] = (ids, [x for e in events for x in e.logprobs or []], sum(e.gamma for e in events))
        base = out[RUNS[0]]
        for key, (ids, logprobs, drafted) in out.items():
            print(
                f"constrained={constraint is not None} {key}: tokens same {ids == base[0]}, logprobs bit-identical "
                f"{logprobs == base[1]}, drafted {drafted}"
            )


if __name__ == "__main__":
    main()
