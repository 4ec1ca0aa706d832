"""`specchat bench`: suite selection, equality checks, aggregation and reports from synthetic rows, the
transformers baselines on tiny random models, and a tiny bench end to end (every mode produces tokens; the
table, JSON and PNG are written).
"""

from __future__ import annotations

import argparse
import ast
import io
import json
import re

import pytest
import torch
from rich.console import Console
from tiny_models import build_tiny, random_ids

from specchat.backend.bench.hf import hf_generate, sdpa_twin
from specchat.backend.bench.report import (
    aggregate_with_overall,
    build_tables,
    notes,
    print_report,
    write_chart,
    write_json,
)
from specchat.backend.bench.runner import Mode, default_modes, parse_modes
from specchat.backend.bench.stats import Row, aggregate, compare_tokens, mark_equality
from specchat.backend.bench.suites import (
    CODE_EDIT_FAMILY,
    MT_BENCH_CATEGORIES,
    MULTI_EDIT_FAMILY,
    SPEC_BENCH_FAMILIES,
    BenchPrompt,
    load_code_edit,
    load_spec_bench,
    load_suite,
    select,
)
from specchat.backend.errors import ConfigError, RequestError
from specchat.backend.speculative.stats import StepCounts

# -- suites -------------------------------------------------------------------------------------------------


def test_spec_bench_has_six_families_and_first_turns_only():
    prompts = load_spec_bench()
    assert len(prompts) == 480
    assert list(dict.fromkeys(p.family for p in prompts)) == list(SPEC_BENCH_FAMILIES)
    assert all(len(p.messages) == 1 and p.messages[0][0] == "user" for p in prompts)
    assert sum(p.family == "mt-bench" for p in prompts) == 80


def test_limit_spreads_mt_bench_over_its_categories():
    picked = select(load_spec_bench(), 8)
    mt = [p for p in picked if p.family == "mt-bench"]
    assert [p.category for p in mt] == list(MT_BENCH_CATEGORIES)  # round-robin: one per category
    assert {p.family for p in picked} == set(SPEC_BENCH_FAMILIES)
    assert all(sum(p.family == f for p in picked) == 8 for f in SPEC_BENCH_FAMILIES)
    twenty = [p for p in select(load_spec_bench(), 20) if p.family == "mt-bench"]
    counts = [sum(p.category == c for p in twenty) for c in MT_BENCH_CATEGORIES]
    assert sum(counts) == 20 and max(counts) - min(counts) <= 1


def test_limit_spreads_within_a_category_not_first_n_and_is_deterministic():
    qa = [p for p in load_spec_bench() if p.family == "qa"]
    picked = [p for p in select(load_spec_bench(), 4) if p.family == "qa"]
    assert [p.id for p in picked] == [qa[i].id for i in (0, 20, 40, 60)]
    assert select(load_spec_bench(), 4) == select(load_spec_bench(), 4)


def test_select_small_families_and_bad_limit():
    prompts = [BenchPrompt(f"p{i}", "f", "a" if i < 2 else "b", (("user", "x"),)) for i in range(5)]
    assert [p.id for p in select(prompts, 3)] == ["p0", "p2", "p1"]  # a, b, a
    assert [p.id for p in select(prompts, None)] == ["p0", "p2", "p1", "p3", "p4"]
    with pytest.raises(ConfigError, match="--limit"):
        select(prompts, 0)


def test_suite_all_has_eight_families_and_unknown_suite_is_an_error():
    prompts = load_suite("all", 2)
    assert len(prompts) == 16
    assert {p.family for p in prompts} == set(SPEC_BENCH_FAMILIES) | {CODE_EDIT_FAMILY, MULTI_EDIT_FAMILY}
    assert {p.family for p in load_suite("edit", None)} == {CODE_EDIT_FAMILY, MULTI_EDIT_FAMILY}
    assert {p.family for p in load_suite("code-edit", None)} == {CODE_EDIT_FAMILY}
    mt_bench = load_suite("mt-bench", 8)
    assert len(mt_bench) == 8 and {p.family for p in mt_bench} == {"mt-bench"}
    assert len({p.category for p in mt_bench}) == 8  # one per MT-bench category, round-robin
    with pytest.raises(ConfigError, match="unknown suite 'nope'"):
        load_suite("nope", 1)


def test_code_edit_prompts_are_whole_python_functions_with_a_request():
    prompts = load_code_edit()
    assert 12 <= len(prompts) <= 16
    assert {p.category for p in prompts} == {"rename", "type-hints", "docstring"}
    for p in prompts:
        text = p.messages[0][1]
        code = re.search(r"```python\n(.*?)```", text, re.S).group(1)
        assert 15 <= code.count("\n") <= 40, p.id
        tree = ast.parse(code)
        function = tree.body[0]
        assert isinstance(function, ast.FunctionDef)
        assert "return the whole function" in text
        if p.category == "rename":
            old = re.search(r"parameter `(\w+)`", text).group(1)
            assert old in [a.arg for a in function.args.args], p.id


# -- equality, tallies, aggregation ----------------------------------------------------------------------------


def test_compare_tokens():
    assert compare_tokens([1, 2, 3], [1, 2, 3]) == "same"
    assert compare_tokens([1, 5, 3], [1, 2, 3]) == "differs at 1"
    assert compare_tokens([1, 2], [1, 2, 3]) == "stopped early (2 vs 3 tokens)"
    assert compare_tokens([1, 2, 3, 4], [1, 2, 3]) == "ran longer (4 vs 3 tokens)"


def _row(mode, prompt, tokens, wall, *, family="qa", ttft=0.1, tally=None):
    return Row(
        pair="p",
        family=family,
        category="c",
        prompt_id=prompt,
        mode=mode,
        order=0,
        prompt_tokens=10,
        token_ids=list(tokens),
        wall_s=wall,
        ttft_s=ttft,
        finish_reason="length",
        tally=tally,
    )


def _synthetic_rows():
    pl = StepCounts()
    pl.observe(drafter="prompt-lookup", gamma=3, accepted=3, emitted=4, draft_s=0.001, verify_s=0.12)
    plain = StepCounts()
    plain.observe(drafter="none", gamma=0, accepted=0, emitted=1, draft_s=0.0, verify_s=0.1)
    rows = []
    for prompt, n in (("a", 10), ("b", 30)):
        ids = list(range(n))
        rows += [
            _row("plain", prompt, ids, n / 10, tally=plain),
            _row("prompt-lookup", prompt, ids, n / 20, tally=pl),
            _row("auto", prompt, ids, n / 25, tally=pl),
            _row("hf-plain", prompt, ids, n / 8),
            _row("hf-prompt-lookup", prompt, ids, n / 16),
        ]
    # Prompt c: prompt-lookup's tokens differ from plain (same length), hf stopped early (not comparable).
    rows += [
        _row("plain", "c", [1, 2, 3, 4], 1.0),
        _row("prompt-lookup", "c", [1, 2, 9, 4], 0.1),
        _row("auto", "c", [1, 2, 3, 4], 1.0),
        _row("hf-plain", "c", [1, 2, 3], 1.0),
        _row("hf-prompt-lookup", "c", [1, 2, 3], 1.0),
    ]
    mark_equality(rows, greedy=True)
    return rows


def test_aggregate_is_total_tokens_over_total_time_on_comparable_prompts():
    rows = _synthetic_rows()
    aggs = {a.mode: a for a in aggregate(rows)}
    # Prompt c is not comparable (lengths differ): left out. Totals: 40 tokens over 4 s (plain).
    assert aggs["plain"].prompts == 2 and aggs["plain"].prompts_total == 3
    assert aggs["plain"].tok_s == pytest.approx(40 / 4.0)
    assert aggs["hf-plain"].tok_s == pytest.approx(40 / 5.0)
    assert aggs["prompt-lookup"].x_hf_plain == pytest.approx(20 / 8)
    assert aggs["prompt-lookup"].match == "hf-prompt-lookup" and aggs["prompt-lookup"].x_match == pytest.approx(20 / 16)
    assert aggs["plain"].match == "hf-plain"
    assert aggs["auto"].match == "hf-prompt-lookup"  # the fastest transformers mode
    assert aggs["prompt-lookup"].mismatches == 1 and aggs["plain"].mismatches == 1  # c: vs hf-plain
    auto_c = next(r for r in rows if r.prompt_id == "c" and r.mode == "auto")
    assert auto_c.vs_plain == "same" and auto_c.vs_hf_plain == "ran longer (4 vs 3 tokens)"
    assert aggs["prompt-lookup"].acceptance_rate == 1.0 and aggs["prompt-lookup"].mean_accepted_length == 4.0
    # Expected: 4 tokens per 0.121 s step vs 0.1 s per plain token.
    assert aggs["prompt-lookup"].x_plain_expected == pytest.approx(4 / 0.121 * 0.1)
    # Measured decode ratio: (tokens - 1) / (wall - ttft), prefill excluded.
    pl_decode = (9 + 29) / ((0.5 - 0.1) + (1.5 - 0.1))
    plain_decode = (9 + 29) / ((1.0 - 0.1) + (3.0 - 0.1))
    assert aggs["prompt-lookup"].x_plain_measured == pytest.approx(pl_decode / plain_decode)
    row_c = next(r for r in rows if r.prompt_id == "c" and r.mode == "prompt-lookup")
    assert row_c.vs_plain == "differs at 2" and not row_c.comparable


def test_sampled_runs_are_not_compared():
    rows = [_row("plain", "a", [1, 2], 1.0), _row("auto", "a", [3], 1.0)]
    mark_equality(rows, greedy=False)
    assert all(r.vs_plain is None and r.comparable and not r.mismatch for r in rows)


def test_report_table_json_and_png(tmp_path):
    rows = _synthetic_rows() + [_row(m, "d", [1, 2], 0.5, family="rag") for m in ("plain", "hf-plain")]
    mark_equality(rows, greedy=True)
    aggs = aggregate_with_overall(rows)
    assert {a.family for a in aggs} == {"qa", "rag", "all families"}
    assert len(build_tables(aggs, greedy=True)) == 3
    console = Console(file=io.StringIO(), width=200, record=True)
    print_report(console, aggs, rows, greedy=True)
    text = console.export_text()
    assert "p · qa · 2/3 prompts" in text and "hf-prompt-lookup" in text and "1/3 differ" in text
    assert "p qa c [prompt-lookup] tokens differ: vs plain: differs at 2" in text  # not eaten as markup
    assert any("not comparable" in line for line in notes(rows, greedy=True))
    write_json(tmp_path / "bench.json", meta={"x": 1}, runs=[], rows=rows, aggs=aggs)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert len(data["rows"]) == len(rows) and data["rows"][0]["tok_s"] > 0
    assert {a["mode"] for a in data["aggregates"]} >= {"plain", "auto", "hf-plain"}
    write_chart(tmp_path / "speedup.png", aggs)
    assert (tmp_path / "speedup.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _chart(tmp_path, aggs, monkeypatch):
    import matplotlib.pyplot as plt

    figures = []
    monkeypatch.setattr(plt, "close", figures.append)
    write_chart(tmp_path / "speedup.png", aggs)
    ax = figures[0].axes[0]
    return [t.get_text() for t in ax.get_legend().get_texts()], [t.get_text() for t in ax.texts], ax.get_title()


def test_chart_shows_absolute_speeds_and_a_hatching_entry_only_when_drawn(tmp_path, monkeypatch):
    """Fails on the old chart: ratios only, and a hatching caption with no hatched bar."""
    same = [_row(m, "a", [1, 2, 3], w) for m, w in (("plain", 1.0), ("prompt-lookup", 0.5), ("hf-plain", 2.0))]
    mark_equality(same, greedy=True)
    legend, labels, title = _chart(tmp_path, aggregate(same), monkeypatch)
    assert not any("differ" in t or "hatch" in t for t in legend + [title])
    assert "2.00×\n3.0" in labels and "6.0" in labels[1]  # plain: 3 tok/s, 2× hf-plain's 1.5; lookup 6 tok/s
    assert "transformers plain qa 1.5 tok/s" in title  # the baseline's own tok/s
    differ = [
        _row("plain", "a", [1, 2, 3], 1.0),
        _row("prompt-lookup", "a", [1, 9, 3], 0.5),
        _row("hf-plain", "a", [1, 2, 3], 2.0),
    ]
    mark_equality(differ, greedy=True)
    legend, _, _ = _chart(tmp_path, aggregate(differ), monkeypatch)
    assert "tokens differ from plain" in legend


def test_bench_help_shows_the_defaults():
    from specchat.app.cli import bench as cmd_bench
    from specchat.app.cli.main import build_parser
    from specchat.backend.limits import BENCH_MAX_NEW_TOKENS

    parser = build_parser()
    sub = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
    text = " ".join(sub.choices["bench"].format_help().split())
    for option, default in (
        ("--limit", cmd_bench.DEFAULT_LIMIT),
        ("--max-new-tokens", BENCH_MAX_NEW_TOKENS),
        ("--repeats", cmd_bench.DEFAULT_REPEATS),
        ("--suite", "all"),
        ("--out", "bench_out"),
        ("--temperature", 0),
        ("--seed", 0),
    ):
        assert re.search(re.escape(option) + r" .*?\(default: " + re.escape(str(default)) + r"\)", text), option


# -- modes ------------------------------------------------------------------------------------------------------


def test_modes_default_and_parsing():
    assert default_modes(False) == ["plain", "prompt-lookup", "suffix", "auto", "hf-plain", "hf-prompt-lookup"]
    assert parse_modes(["suffix:8"], has_draft=False, pair_name="x") == [Mode("suffix:8", "specchat", "suffix", 8)]
    assert "hf-assisted" in default_modes(True) and "draft-model" in default_modes(True)
    modes = parse_modes(["plain", "prompt-lookup:4", "auto", "hf-assisted"], has_draft=True, pair_name="x")
    assert modes == [
        Mode("plain", "specchat", "none"),
        Mode("prompt-lookup:4", "specchat", "prompt-lookup", 4),
        Mode("auto", "specchat", "auto", "auto"),
        Mode("hf-assisted", "hf", "assisted"),
    ]
    with pytest.raises(RequestError, match="needs a draft model, and pair 'x' has none"):
        parse_modes(["draft-model"], has_draft=False, pair_name="x")
    with pytest.raises(RequestError, match="unknown bench mode 'fast'"):
        parse_modes(["fast"], has_draft=False, pair_name="x")
    with pytest.raises(RequestError, match="gamma must be"):
        parse_modes(["prompt-lookup:0"], has_draft=False, pair_name="x")
    with pytest.raises(RequestError, match="twice"):
        parse_modes(["plain", "plain"], has_draft=False, pair_name="x")


# -- transformers baselines -------------------------------------------------------------------------------------


def test_sdpa_twin_shares_weights_and_matches_the_original():
    model = build_tiny("llama")
    twin = sdpa_twin(model)
    assert twin.config._attn_implementation == "sdpa" and model.config._attn_implementation == "eager"
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(model.parameters(), twin.parameters()))
    ids = torch.tensor([random_ids(20)])
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, model(ids).logits, atol=1e-5, rtol=1e-5)


def test_hf_modes_produce_tokens_and_greedy_lookup_equals_plain():
    target = sdpa_twin(build_tiny("llama"))
    draft = sdpa_twin(build_tiny("llama", seed=1))
    prompt = random_ids(12) * 3
    common = dict(max_new_tokens=12, temperature=0.0, seed=0, eos_token_ids=[2], pad_token_id=0)
    plain = hf_generate(target, prompt, method="plain", **common)
    assert 1 <= len(plain.token_ids) <= 12 and plain.wall_s > 0 and 0 < plain.ttft_s <= plain.wall_s
    for method in ("prompt-lookup", "assisted"):
        assert hf_generate(target, prompt, method=method, assistant=draft, **common).token_ids == plain.token_ids
    sampled = hf_generate(target, prompt, method="plain", **{**common, "temperature": 1.0, "seed": 3})
    again = hf_generate(target, prompt, method="plain", **{**common, "temperature": 1.0, "seed": 3})
    assert sampled.token_ids == again.token_ids


# -- end to end -------------------------------------------------------------------------------------------------


def test_tiny_bench_end_to_end(tmp_path, monkeypatch):
    import engine_fixtures

    from specchat.app.cli import bench as cmd_bench

    monkeypatch.setattr(cmd_bench, "_llamacpp_missing", lambda spec: "not installed")  # tested on its own below
    engines = [
        engine_fixtures.tiny_engine("llama", drafter="prompt-lookup", context_length=2048),
        engine_fixtures.tiny_engine(
            "llama", drafter="draft-model", draft_family="llama", draft_seed=1, context_length=2048
        ),
    ]
    # The code-edit family (2 prompts): suite selection over every family is tested above without models.
    args = argparse.Namespace(
        pair=None,
        suite="code-edit",
        limit=2,
        max_new_tokens=6,
        modes=None,
        out=str(tmp_path),
        temperature=0.0,
        seed=0,
        models=None,
        device=None,
        synthetic=None,
    )
    out = Console(file=io.StringIO(), width=200, record=True)
    err = Console(file=io.StringIO(), width=200)
    assert cmd_bench.execute(args, len(engines), lambda i: engines[i], err=err, out=out) == 0
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = data["rows"]
    expected_modes = {"tiny-prompt-lookup": set(default_modes(False)), "tiny-draft-model": set(default_modes(True))}
    for pair, modes in expected_modes.items():
        every = [r for r in rows if r["pair"] == pair]
        assert len(every) == 2 * 2 * len(modes)  # the default 2 repeats × every prompt × every mode
        pair_rows = [r for r in every if r["repeat"] == 0]
        assert {r["mode"] for r in pair_rows} == modes
        assert len(pair_rows) == 2 * len(modes)
        for prompt in ("edit-rename-1", "edit-type-hints-1"):  # interleaved: each prompt's modes in a row
            orders = [r["order"] for r in pair_rows if r["prompt_id"] == prompt]
            assert sorted(orders) == list(range(len(modes)))
        run_order = [r["mode"] for r in pair_rows if r["prompt_id"] == "edit-type-hints-1"]
        assert run_order[0] == [r["mode"] for r in pair_rows][1]  # the second prompt starts one mode later
        assert all(r["new_tokens"] >= 1 for r in pair_rows)
    drafted = [r for r in rows if r["mode"] in ("prompt-lookup", "draft-model") and r["tally"]["drafted"]]
    assert drafted, "no speculative mode drafted anything"
    # Greedy decoding is lossless: every mode gave plain's tokens, and plain gave transformers' tokens.
    assert not [(r["pair"], r["prompt_id"], r["mode"]) for r in rows if r["mismatch"]]
    assert "Estimated time" in err.file.getvalue()
    assert re.search(r"took \d+\.\d min \(estimated \d+\.\d min", err.file.getvalue())
    assert data["meta"]["repeats"] == 2 and data["meta"]["estimated_s"] > 0
    spreads = [a for a in data["aggregates"] if a["tok_s_min"] is not None]
    assert spreads and all(
        a["tok_s_min"] <= a["tok_s"] * 1.0001 and a["tok_s"] <= a["tok_s_max"] * 1.0001 for a in spreads
    )
    text = (tmp_path / "bench.txt").read_text()
    assert "spread" in text and "ttft s" in text
    assert "tiny-draft-model · code-edit" in text and "hf-assisted" in text
    assert (tmp_path / "speedup.png").read_bytes()[:4] == b"\x89PNG"


class _InterruptedAfter:
    """An engine whose generate() raises KeyboardInterrupt (Ctrl-C) after ``calls`` requests."""

    def __init__(self, engine, calls: int) -> None:
        self._engine, self._left = engine, calls

    def __getattr__(self, name):
        return getattr(self._engine, name)

    def generate(self, request, cancel=None):
        if self._left == 0:
            raise KeyboardInterrupt
        self._left -= 1
        return self._engine.generate(request, cancel)


def test_ctrl_c_keeps_the_rows_measured_so_far(tmp_path):
    import engine_fixtures

    from specchat.app.cli import bench as cmd_bench

    # 2 warm-ups, then prompt 1 in both modes; Ctrl-C during prompt 2.
    engine = _InterruptedAfter(engine_fixtures.tiny_engine("llama", context_length=2048), 4)
    args = argparse.Namespace(
        pair=None,
        suite="code-edit",
        limit=2,
        max_new_tokens=4,
        modes=["plain", "prompt-lookup"],
        out=str(tmp_path),
        temperature=0.0,
        seed=0,
        models=None,
        device=None,
        synthetic=None,
    )
    quiet = Console(file=io.StringIO())
    with pytest.raises(KeyboardInterrupt):
        cmd_bench.execute(args, 1, lambda i: engine, err=quiet, out=quiet)
    data = json.loads((tmp_path / "bench.json").read_text())
    assert data["meta"]["interrupted"] and data["runs"][0]["interrupted"]
    assert [(r["prompt_id"], r["mode"]) for r in data["rows"]] == [
        ("edit-rename-1", "plain"),
        ("edit-rename-1", "prompt-lookup"),
    ]
    assert data["rows"][1]["vs_plain"] == "same"


@pytest.mark.slow
def test_bench_on_the_embedded_default(tmp_path):
    """The whole command on the real default pair: GGUF weights shared with the transformers twin, greedy
    tokens identical across specchat and transformers on a code-edit prompt."""
    from specchat.app.cli import bench as cmd_bench

    args = argparse.Namespace(
        pair=None,
        suite="code-edit",
        limit=1,
        max_new_tokens=12,
        modes=["plain", "prompt-lookup", "hf-plain", "hf-prompt-lookup"],
        out=str(tmp_path),
        temperature=0.0,
        seed=0,
        models=None,
        device="cpu",
        synthetic=None,
        repeats=1,
    )
    assert cmd_bench.run(args) == 0
    rows = json.loads((tmp_path / "bench.json").read_text())["rows"]
    assert [r["mode"] for r in rows] == args.modes
    assert all(r["new_tokens"] == 12 and r["tok_s"] > 0 for r in rows)
    assert not [r["mode"] for r in rows if r["mismatch"]]
    assert (tmp_path / "speedup.png").exists() and "smollm2-135m · code-edit" in (tmp_path / "bench.txt").read_text()


def test_multi_turn_edits_are_one_conversation_per_mode():
    """Each later turn follows the mode's own reply in the same conversation: the cache is reused between
    turns, the row sums the turns, and greedy modes agree token for token."""
    import engine_fixtures

    from specchat.backend.bench.runner import BenchRunner, parse_modes

    prompts = load_suite(MULTI_EDIT_FAMILY, 1)
    (prompt,) = prompts
    assert prompt.turns and "type hints" in prompt.turns[0] and "docstring" in prompt.turns[1]
    engine = engine_fixtures.tiny_engine("llama", drafter="prompt-lookup", context_length=2048)
    runner = BenchRunner(
        engine, parse_modes(["plain", "prompt-lookup", "suffix"], has_draft=False, pair_name="tiny"), max_new_tokens=8
    )
    rows = runner.run(prompts)
    assert len(rows) == 3 and not [r.mode for r in rows if r.mismatch]
    first_turn = len(runner.prompt_ids(prompt))
    for row in rows:
        assert row.new_tokens > 8  # three turns of up to 8 tokens each
        assert row.prompt_tokens > 3 * first_turn  # the later turns carry the conversation
        assert row.engine_stats.prefill_tokens < row.prompt_tokens - 2 * first_turn  # the last turn reused it
    assert engine.blocks_in_use() == 0  # each mode's conversation is forgotten after its row
    assert engine.reply_memory.num_tokens == 0  # the bench measures every prompt alone


# -- llama.cpp modes ----------------------------------------------------------------------------------------


class _FakeLlama:
    """Stands in for llama_cpp.Llama: emits 50, 51, ... until stopped; records its settings."""

    made: list[dict] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.resets = 0
        _FakeLlama.made.append(kwargs)

    def reset(self) -> None:
        self.resets += 1

    def set_seed(self, seed: int) -> None:
        self.seed = seed

    def generate(self, tokens, **kwargs):
        assert self.resets > 0 and kwargs["top_k"] == 1 and kwargs["temp"] == 0.0
        yield from range(50, 10**6)


@pytest.fixture
def fake_llama_cpp(monkeypatch):
    import sys
    import types

    from specchat.backend.bench import llamacpp

    module = types.ModuleType("llama_cpp")
    module.Llama = _FakeLlama
    module.llama_speculative = types.SimpleNamespace(
        LlamaPromptLookupDecoding=lambda num_pred_tokens: ("pld", num_pred_tokens)
    )
    monkeypatch.setitem(sys.modules, "llama_cpp", module)
    monkeypatch.setattr(llamacpp, "unavailable", lambda gguf: None)
    _FakeLlama.made = []
    return module


def test_llamacpp_modes_run_interleaved_on_the_pairs_gguf(tmp_path, fake_llama_cpp, monkeypatch):
    import engine_fixtures

    from specchat.app.cli import bench as cmd_bench
    from specchat.backend.models.loading.pair import packaged_gguf_path

    monkeypatch.setattr(cmd_bench, "_llamacpp_missing", lambda spec: None)
    engine = engine_fixtures.tiny_engine("llama", context_length=2048)
    args = argparse.Namespace(
        pair=None,
        suite="code-edit",
        limit=1,
        max_new_tokens=5,
        modes=["plain", "llamacpp-plain", "llamacpp-prompt-lookup"],
        out=str(tmp_path),
        temperature=0.0,
        seed=0,
        models=None,
        device=None,
        synthetic=None,
    )
    out = Console(file=io.StringIO(), width=220, record=True)
    err = Console(file=io.StringIO(), width=220)
    assert cmd_bench.execute(args, 1, lambda i: engine, err=err, out=out) == 0
    assert [m["model_path"] for m in _FakeLlama.made] == [str(packaged_gguf_path())] * 2
    assert [m["draft_model"] for m in _FakeLlama.made] == [None, ("pld", 10)]
    # llama-cpp-python 0.3.36 sizes its logits array from logits_all even when a drafter forces it on: without
    # it, a prompt past 512 tokens failed in its prompt-lookup mode (found on the code-edit suite)
    assert [m["logits_all"] for m in _FakeLlama.made] == [False, True]
    assert all(m["n_threads"] == torch.get_num_threads() for m in _FakeLlama.made)
    data = json.loads((tmp_path / "bench.json").read_text())
    rows = {r["mode"]: r for r in data["rows"]}
    assert rows["llamacpp-plain"]["new_tokens"] == 5 and rows["llamacpp-plain"]["ttft_s"] is not None
    assert rows["llamacpp-prompt-lookup"]["vs_plain"] == "same"  # checked against llama.cpp's own plain
    assert rows["plain"]["comparable"]  # llama.cpp's lengths do not decide specchat's comparability
    bound = data["runs"][0]["bandwidth_bound"]
    assert bound["read_bandwidth_GBps"] > 0 and bound["llamacpp"]["bytes_per_token"] > 0
    assert "bandwidth bound" in err.file.getvalue()
    assert "×llama.cpp" in (tmp_path / "bench.txt").read_text()
    aggs = {a["mode"]: a for a in data["aggregates"] if a["family"] == "code-edit"}
    assert aggs["llamacpp-plain"]["x_llamacpp_plain"] == pytest.approx(1.0)


def test_llamacpp_modes_say_how_to_install_when_missing(monkeypatch):
    from specchat.backend.bench import llamacpp

    monkeypatch.setattr(llamacpp.importlib.util, "find_spec", lambda name: None)
    reason = llamacpp.unavailable(None)
    assert "pip install 'specchat[bench]'" in reason
    with pytest.raises(RequestError, match="specchat\\[bench\\]"):
        parse_modes(["llamacpp-plain"], has_draft=False, pair_name="p", llamacpp_missing=reason)
    assert "llamacpp-plain" not in [
        m.name for m in parse_modes(None, has_draft=False, pair_name="p", llamacpp_missing=reason)
    ]


@pytest.mark.slow
def test_llamacpp_on_the_embedded_gguf(tmp_path):
    """The real llama.cpp on the embedded default's GGUF, on a summary (a prompt past 512 tokens, which its
    prompt-lookup mode once failed on): both modes decode the tokens asked for, and the bench reports whether
    llama.cpp's prompt lookup kept its own plain decoding's tokens (its batched verification need not: on the
    full suite 13 of 16 prompts differed somewhere)."""
    pytest.importorskip("llama_cpp", reason="llama-cpp-python is not installed (optional extra: specchat[bench])")
    from specchat.app.cli import bench as cmd_bench

    args = argparse.Namespace(
        pair=None,
        suite="summarization",
        limit=1,
        max_new_tokens=16,
        modes=["plain", "llamacpp-plain", "llamacpp-prompt-lookup"],
        out=str(tmp_path),
        temperature=0.0,
        seed=0,
        models=None,
        device="cpu",
        synthetic=None,
    )
    assert cmd_bench.run(args) == 0
    rows = {r["mode"]: r for r in json.loads((tmp_path / "bench.json").read_text())["rows"]}
    assert rows["plain"]["prompt_tokens"] > 512
    assert rows["llamacpp-plain"]["new_tokens"] == rows["llamacpp-prompt-lookup"]["new_tokens"] == 16
    compared = rows["llamacpp-prompt-lookup"]["vs_plain"]
    assert compared == "same" or compared.startswith("differs at ")


def test_loading_progress_off_a_terminal_is_one_line_per_step(monkeypatch, capsys):
    """`specchat bench > log 2>&1` printed the loader's every update ("Loading ... as int4-torch" 30 times);
    like generate, it prints one plain line per step when stderr is not a terminal."""
    from specchat.app.cli import bench as cmd_bench
    from specchat.backend.engine import engine as engine_module
    from specchat.backend.errors import ModelLoadError

    def fake_load(config, *, device=None, progress=None, confirm_download=None):
        for fraction in (0.0, 0.25, 0.5, 0.75, 1.0):
            progress("Loading tiny.gguf as int4-torch", fraction)
        progress("Packing the int4 weights: 3/30", 0.1)
        progress("Packing the int4 weights: 30/30", 1.0)
        raise ModelLoadError("stop here (test)")

    monkeypatch.setattr(engine_module, "load_engine", fake_load)
    args = argparse.Namespace(
        pair=None,
        suite="mt-bench",
        limit=1,
        max_new_tokens=4,
        modes=["plain"],
        out=None,
        temperature=0.0,
        seed=0,
        models=None,
        device="cpu",
        synthetic=None,
    )
    with pytest.raises(ModelLoadError):  # main() turns it into "specchat: error: ..."
        cmd_bench.run(args)
    err = capsys.readouterr().err
    assert err.count("Loading tiny.gguf as int4-torch") == 1 and err.count("Packing the int4 weights") == 1, err
    assert "\r" not in err and "\x1b" not in err
