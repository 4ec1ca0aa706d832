"""A bench row's step counts are the engine's own (its RequestStats' ``step_counts``), not a recount of the
StepEvents: the per-position acceptance and the expected speed-up the tables show are the ones the engine
reported for the same reply."""

from __future__ import annotations

import engine_fixtures

from specchat.backend.bench.runner import BenchRunner, parse_modes
from specchat.backend.bench.suites import BenchPrompt
from specchat.backend.speculative.stats import StepCounts

PROMPT = BenchPrompt("repeat-1", "qa", "repeat", (("user", "w7 w8 w9 w7 w8 w9 w7 w8"),))


def test_a_rows_tally_is_the_engines_step_counts() -> None:
    engine = engine_fixtures.tiny_engine("llama", drafter="suffix", context_length=2048)
    modes = parse_modes(["plain", "suffix:4", "prompt-lookup:4"], has_draft=False, pair_name="tiny")
    runner = BenchRunner(engine, modes, max_new_tokens=40)
    for mode in modes:
        row = runner.run_one(mode, PROMPT, order=0, seed=0)
        stats = row.engine_stats
        assert stats is not None and row.tally == StepCounts.from_dict(stats.step_counts)
        assert row.tally.per_position_acceptance() == list(stats.per_position_acceptance)
        assert row.tally.drafted == stats.drafted and row.tally.total_steps == stats.steps
        assert (row.tally.drafted > 0) == (mode.name != "plain"), mode.name
    assert engine.blocks_in_use() == 0
