"""The prefix cache on the embedded default (issue 35 item 5): a ~1,600-token conversation (a review of
backend/engine/request.py), then the same conversation with the reply and one more message, from the cache
(scope = one client) and cold (no scope); prints the prefill counts and whether the two replies are the same,
greedy and seeded. The counts are deterministic; the prefill seconds are only figures under cpu-exclusive.

    python benchmarks/prefix_cache_real.py
"""

import time
from pathlib import Path

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import load_engine
from specchat.backend.models.catalog.config import get_pair, load_pairs

pair = get_pair(load_pairs(None), "smollm2-135m")
engine = load_engine(pair, prefix_cache_bytes=256 << 20)
print(engine.start_line, flush=True)
text = (Path(__file__).resolve().parents[1] / "backend/engine/request.py").read_text()
conv = [
    {"role": "system", "content": "You are a careful code reviewer."},
    {"role": "user", "content": "Review this module:\n```python\n" + text[:6000] + "\n```"},
]


def run(messages, sampling, scope):
    t = time.perf_counter()
    ev = list(engine.generate(GenerationRequest(messages=messages, sampling=sampling, prefix_cache=scope)))
    s = ev[-1].stats
    return [x for e in ev for x in e.token_ids], "".join(e.text for e in ev), s, time.perf_counter() - t


for name, sampling in (
    ("greedy", SamplingParams(temperature=0, max_new_tokens=48)),
    ("seeded", SamplingParams(temperature=0.8, top_p=0.95, max_new_tokens=48, seed=11)),
):
    scope = "client-" + name
    _, reply, s1, t1 = run(conv, sampling, scope)
    turn = conv + [
        {"role": "assistant", "content": reply.strip()},
        {"role": "user", "content": "Now list three concrete fixes."},
    ]
    ids_w, _, s2, t2 = run(turn, sampling, scope)
    ids_c, _, s3, t3 = run(turn, sampling, None)
    print(
        f"{name}: turn1 prompt {s1.prompt_tokens} prefilled {s1.prefill_tokens}; turn2 prompt {s2.prompt_tokens} "
        f"prefilled warm {s2.prefill_tokens} cold {s3.prefill_tokens}; identical {ids_w == ids_c} "
        f"({len(ids_w)} tokens); prefill_s warm {s2.prefill_s:.3f} cold {s3.prefill_s:.3f}",
        flush=True,
    )
engine.close()
