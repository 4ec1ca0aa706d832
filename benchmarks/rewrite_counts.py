"""Counts only (deterministic, greedy; no clock): on the first N prompts of the bench's rewrite family, the embedded
default's reply with the file as prediction, as the bench asks and with a clearer instruction (copy every other
line exactly): reply tokens, target passes, tokens per pass, predicted tokens accepted / rejected.

    python benchmarks/rewrite_counts.py 3
"""

import json
import sys
from pathlib import Path

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import load_engine
from specchat.backend.models.catalog.config import get_pair, load_pairs

rows = [json.loads(line) for line in open(Path(__file__).resolve().parents[1] / "backend/bench/data/rewrite.jsonl")]
engine = load_engine(get_pair(load_pairs(None), "smollm2-135m"))
tok = engine.tokenizer
CLEAR = (
    "\n\nOutput the complete file in one ```python block. Change only what is asked; copy every other line "
    "exactly as it is, comments and blank lines included."
)
for row in rows[: int(sys.argv[1])]:
    for label, extra in (("as in the bench", ""), ("clearer", CLEAR)):
        msgs = [dict(m) for m in row["messages"]]
        msgs[-1]["content"] += extra
        ids = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=True)
        ids = list(ids["input_ids"] if isinstance(ids, dict) else ids) + tok.encode(
            row["assistant_prefix"], add_special_tokens=False
        )
        req = GenerationRequest(
            prompt_ids=ids,
            prediction=row["prediction"],
            sampling=SamplingParams(temperature=0, max_new_tokens=row["max_new_tokens"], stop=tuple(row["stop"])),
        )
        ev = list(engine.generate(req))
        s = ev[-1].stats
        text = "".join(e.text for e in ev)
        print(
            f"{row['id']:34s} {label:16s} reply {s.new_tokens:4d} tok, passes {s.steps + 1:4d} "
            f"({s.new_tokens / (s.steps + 1):.2f} tok/pass), prediction {s.prediction_tokens} tok: accepted "
            f"{s.accepted_prediction_tokens} rejected {s.rejected_prediction_tokens}; finish {ev[-1].finish_reason}; "
            f"file lines {len(row['prediction'].splitlines())} reply lines {len(text.splitlines())}",
            flush=True,
        )
