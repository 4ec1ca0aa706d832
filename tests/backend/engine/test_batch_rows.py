"""A row's logits are (nearly) the same whether the target computes it alone or among γ+1 rows (issue 14).

A seed replays the same reply whatever the drafter and γ only if a position's logits do not depend on how many
rows its pass held: kernels may round differently by batch shape, and a token flips when two candidates'
perturbed logits are closer than that difference. This measures, through the engine's runner, the largest
|difference| between rows computed one pass per token and the same rows in one pass of γ+1 = 5 and 17 tokens,
on every tiny family and the embedded default, and bounds it relative to the logits' size (benchmarks/RESULTS.md
states the measured values).
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import tiny_loaded
from tiny_models import FAMILIES, one_thread, random_ids  # noqa: F401  (one_thread: autouse)

from specchat.backend.engine.runner import ModelRunner

RELATIVE_BOUND = 1e-5  # 5x above the largest measured (benchmarks/RESULTS.md, "Determinism measurements")


def batch_vs_alone(runner: ModelRunner, ids: list[int], context: int, gamma: int) -> tuple[float, float]:
    """max |rows in one pass - the same rows one pass each|, and max |logit|, for rows context..context+gamma."""
    seq = runner.cache.new_sequence()
    try:
        runner.forward(seq, ids[:context], logits_to_keep=1)
        seq.commit(context)
        batch = runner.forward(seq, ids[context : context + gamma + 1], logits_to_keep=gamma + 1).logits.float()
        seq.truncate(context)
        alone = []
        for token in ids[context : context + gamma + 1]:
            alone.append(runner.forward(seq, [token], logits_to_keep=1).logits.float()[0])
            seq.commit(1)
        rows = torch.stack(alone)
        return float((batch - rows).abs().max()), float(rows.abs().max())
    finally:
        seq.free()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("gamma", [4, 16])
def test_rows_alone_and_among_gamma_plus_one_agree_on_every_family(family, gamma):
    runner = ModelRunner(tiny_loaded(family), kv_tokens=256)
    difference, scale = batch_vs_alone(runner, random_ids(81, seed=1), 64, gamma)
    assert difference <= RELATIVE_BOUND * scale, (difference, scale)


@pytest.mark.slow
def test_rows_alone_and_among_gamma_plus_one_agree_on_the_embedded_default():
    from specchat.backend.engine.engine import load_engine
    from specchat.backend.models.catalog.config import load_pairs

    engine = load_engine(load_pairs()["smollm2-135m"], device="cpu")
    try:
        tok = engine.tokenizer
        messages = [
            {
                "role": "user",
                "content": "Write a Python function `fib(n)` that returns the n-th Fibonacci "
                "number, with a docstring and a test.",
            }
        ]
        ids = tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=True, return_dict=True)[
            "input_ids"
        ]
        ids += tok(
            'def fib(n):\n    """Return the n-th Fibonacci number."""\n    if n < 2:\n        return n\n'
            "    return fib(n - 1) + fib(n - 2)\n"
        )["input_ids"]
        for gamma in (4, 16):
            difference, scale = batch_vs_alone(engine.runner, ids, len(ids) - 17, gamma)
            assert difference <= RELATIVE_BOUND * scale, (gamma, difference, scale)
    finally:
        engine.close()
