"""Unit tests of the app's pure parts: settings, the worker bridge and its statistics, presenters, conversation."""

from __future__ import annotations

import json
import threading

import pytest
from fake_engine import CANNED_REPLY, FakeEngine, fake_pairs

from specchat.app.chat.conversation import Conversation, Turn, title_for
from specchat.app.chat.settings import Settings, SettingsError, load_settings, save_settings, validate_settings
from specchat.app.tui.bridge import ReplyBuffer, ThrottledProgress, run_generation
from specchat.app.tui.screens.reply_controller import STATS_INTERVAL_S, TEXT_INTERVAL_S, UI_CPU_BUDGET, adapt_intervals
from specchat.app.tui.widgets.details_panel import measured_speedup
from specchat.app.tui.widgets.message_view import CopyableFence, warm_highlighting
from specchat.app.tui.widgets.stats_bar import SPARK_BARS, reply_totals, sparkline, stored_totals
from specchat.backend.api import GenerationRequest, PolicyState, RequestStats, StepEvent, TokenSource
from specchat.backend.errors import SpecchatError


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def step(
    n: int, *, gamma: int, accepted: int, prefill: bool = False, paused: bool = False, stats: RequestStats | None = None
) -> StepEvent:
    sources = [TokenSource.ACCEPTED] * accepted + [TokenSource.BONUS if accepted == gamma else TokenSource.RECOVERED]
    if gamma == 0:
        sources = [TokenSource.TARGET] * n
    policy = PolicyState.PAUSED if paused else PolicyState.SPECULATING
    return StepEvent(
        token_ids=[0] * len(sources),
        sources=sources,
        token_texts=["x"] * len(sources),
        text="x" * len(sources),
        gamma=gamma,
        accepted=accepted,
        draft_s=0.01,
        verify_s=0.04,
        overhead_s=0.0,
        policy=policy,
        drafter="prompt-lookup",
        is_prefill=prefill,
        stats=stats,
    )


# -- settings -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    "field, value, words",
    [
        ("temperature", -0.1, "out of range: use 0 (greedy) or a number from 1e-05 to 10"),
        ("temperature", 1e-320, "out of range: use 0 (greedy)"),
        ("temperature", "hot", "expected a number"),
        ("top_p", 0.0, "from 1e-05 to 1"),
        ("top_k", -1, "a whole number from 0"),
        ("top_k", 2**30, "to 16777216"),
        ("top_k", 2.5, "whole number"),
        ("max_new_tokens", 0, "1 .. 32768"),
        ("drafters", {"smollm2-135m": "fast"}, "not one of"),
        ("drafters", ["none"], "expected an object"),
        ("gamma", 0, "1 .. 31"),
        ("gamma", "fast", "expected a number"),
        ("system_prompt", 3, "expected text"),
    ],
)
def test_validate_settings_names_the_field_and_the_range(field, value, words):
    with pytest.raises(SettingsError) as error:
        validate_settings(Settings(**{field: value}))
    assert field in str(error.value) and words in str(error.value)


def test_settings_round_trip_and_bad_files(tmp_path):
    path = tmp_path / "cfg" / "settings.json"
    assert load_settings(path) == (Settings(), None)  # missing: defaults, no warning
    saved = Settings(
        temperature=0.7, top_k=20, gamma="auto", drafters={"plain": "none"}, system_prompt="hi", theme="nord"
    )
    save_settings(saved, path)
    assert load_settings(path) == (saved, None)
    raw = json.loads(path.read_text())
    raw["from_a_newer_version"] = 1
    path.write_text(json.dumps(raw))
    assert load_settings(path)[0] == saved  # unknown keys are ignored
    path.write_text('{"max_new_tokens": -5}')
    settings, warning = load_settings(path)
    assert settings == Settings() and "max_new_tokens" in warning and str(path) in warning
    path.write_text("[1, 2]")
    assert "JSON object" in load_settings(path)[1]
    assert Settings(temperature=0.0).sampling().temperature == 0.0
    assert Settings().request_drafter("plain") is None
    assert Settings(drafters={"plain": "none"}).request_drafter("plain") == "none"
    assert Settings(drafters={"plain": "none"}).request_drafter("smollm2-135m") is None  # per pair, never global


def test_save_settings_where_no_folder_can_be_made_raises_a_clear_error(tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("a file where the config folder should be")  # fails even for root, unlike chmod
    with pytest.raises(SettingsError, match="SPECCHAT_CONFIG_DIR") as error:
        save_settings(Settings(), blocker / "settings.json")
    assert str(blocker) in str(error.value)


@pytest.mark.parametrize("failing", ["write", "replace"])
def test_a_failed_save_keeps_the_old_settings_and_leaves_no_temporary_file(tmp_path, monkeypatch, failing):
    path = tmp_path / "settings.json"
    save_settings(Settings(temperature=0.5), path)
    assert path.stat().st_mode & 0o777 == 0o600  # owner-only: it holds the system prompt

    def boom(*args):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(f"os.{failing}", boom)
    with pytest.raises(SettingsError, match=rf"could not save the settings to {path}: .*No space left"):
        save_settings(Settings(temperature=0.9), path)
    monkeypatch.undo()
    assert load_settings(path) == (Settings(temperature=0.5), None)
    assert [p.name for p in tmp_path.iterdir()] == ["settings.json"]


# -- statistics -----------------------------------------------------------------------------------------------
def test_the_live_view_is_the_engines_latest_stats_plus_a_one_second_rate():
    clock = Clock()
    buffer = ReplyBuffer(clock)
    events = [
        step(1, gamma=0, accepted=0, prefill=True, stats=RequestStats(new_tokens=1)),
        step(0, gamma=4, accepted=4, stats=RequestStats(new_tokens=6, drafted=4, accepted=4)),
        step(0, gamma=4, accepted=1),
        step(1, gamma=0, accepted=0, paused=True, stats=RequestStats(new_tokens=9, drafted=8, accepted=5)),
    ]
    for event in events:
        clock.now += 0.25
        buffer.push(event)
    live = buffer.drain().live
    assert live.stats == RequestStats(new_tokens=9, drafted=8, accepted=5)  # the engine's, never recounted
    assert live.drafter == "prompt-lookup"
    assert live.window_tok_s == pytest.approx((5 + 2 + 1) / 0.75)  # tokens after the first event, over 0.75 s
    clock.now += 2.0
    buffer.push(step(1, gamma=0, accepted=0, paused=True))  # an event without stats keeps the last ones
    later = buffer.drain().live
    assert later.stats == live.stats and later.window_tok_s is None  # one event in the last second


def test_totals_lines_and_the_measured_speedup():
    stats = RequestStats(
        new_tokens=7,
        wall_s=0.5,
        tok_s=14.0,
        drafted=4,
        acceptance_rate=0.75,
        mean_accepted_length=2.5,
        drafter="prompt-lookup",
        spec_tok_s=30.0,
        plain_tok_s=20.0,
        steps=16,
        accepted_length_histogram=(2, 3, 3),
    )
    line = reply_totals(stats, "cancelled")
    # no first-token time: the engine's tok/s; the speed-up beside τ (16 steps: 8 speculating, 8 plain, measured)
    assert line == "7 tokens · 0.50 s · 14.0 tok/s · acceptance 75% · τ 2.50 · ×1.50 vs plain · prompt-lookup · stopped"
    assert stored_totals(None) == "" and "max tokens reached" in stored_totals({"finish_reason": "length"})
    assert stored_totals(stats.to_dict() | {"finish_reason": "cancelled"}) == line  # as the history keeps it
    assert stored_totals({"new_tokens": "garbled", "finish_reason": "eos"}).startswith("0 tokens")
    assert measured_speedup(stats) == pytest.approx(1.5) and measured_speedup(RequestStats()) is None


# -- the worker bridge ------------------------------------------------------------------------------------------
def test_run_generation_streams_everything_and_throttles_nudges():
    clock = Clock()
    engine = FakeEngine(fake_pairs()["smollm2-135m"])
    original = engine._event

    def timed_event(*args, **kwargs):  # each step "takes" 20 ms of the fake clock
        clock.now += 0.02
        return original(*args, **kwargs)

    engine._event = timed_event
    buffer, nudges = ReplyBuffer(clock), []
    run_generation(
        engine,
        GenerationRequest(messages=[]),
        threading.Event(),
        buffer,
        lambda: nudges.append(1),
        interval_s=0.1,
        clock=clock,
    )
    delta = buffer.drain()
    assert delta.text == CANNED_REPLY and "".join(t for t, _ in delta.tokens) == CANNED_REPLY
    assert delta.outcome.finish_reason == "eos" and delta.outcome.stats.new_tokens == 79
    assert 5 <= len(nudges) <= 8  # 27 events over 0.54 s at ≤ 10 Hz, plus the final nudge
    again = buffer.drain()
    assert again.text == "" and again.outcome is None  # the outcome is handed over once


def test_run_generation_never_raises_and_honours_cancel():
    engine = FakeEngine(fake_pairs()["smollm2-135m"], fail_at_step=3, error=SpecchatError("broken drafter"))
    buffer = ReplyBuffer()
    run_generation(engine, GenerationRequest(messages=[]), threading.Event(), buffer, lambda: None)
    delta = buffer.drain()
    assert delta.outcome.finish_reason == "error" and delta.outcome.message == "broken drafter"
    assert isinstance(delta.outcome.error, SpecchatError) and delta.text  # partial text kept
    assert not engine.active.is_set()  # the generator was closed

    cancel = threading.Event()
    cancel.set()
    buffer = ReplyBuffer()
    run_generation(
        FakeEngine(fake_pairs()["smollm2-135m"]), GenerationRequest(messages=[]), cancel, buffer, lambda: None
    )
    assert buffer.drain().outcome.finish_reason == "cancelled"


def test_throttled_progress_posts_stage_changes_and_at_most_10_hz():
    clock, posted = Clock(), []
    progress = ThrottledProgress(lambda text, fraction: posted.append((text, fraction)), clock=clock)
    for i in range(100):
        clock.now += 0.01
        progress("weights", i / 100)
    progress("tokenizer", None)
    progress("done", 1.0)
    assert 9 <= len(posted) <= 13 and posted[-2:] == [("tokenizer", None), ("done", 1.0)]


# -- conversation ---------------------------------------------------------------------------------------------
def test_conversation_without_history_builds_requests():
    errors: list[str] = []
    conv = Conversation(None, errors.append)
    conv.add_user("  \nHow do I sort a list in Python? It is long " + "x" * 80, "p")
    reply, saver = conv.start_reply()
    assert saver is None and conv.request_messages("")[-1]["role"] == "user"  # the empty reply is left out
    conv.finish_reply(
        reply, saver, "Use sorted().", RequestStats(new_tokens=3), finish_reason="eos", pair="p", complete=True
    )
    assert reply.meta["new_tokens"] == 3 and reply.meta["finish_reason"] == "eos" and reply.meta["pair"] == "p"
    assert conv.request_messages("Be brief.") == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": conv.turns[0].content},
        {"role": "assistant", "content": "Use sorted()."},
    ]
    assert conv.key.startswith("scratch-") and not errors
    assert conv.pop_last_reply() is reply and conv.pop_last_reply() is None
    assert title_for("\n  Fix the bug  \nmore") == "Fix the bug" and len(title_for("y" * 200)) == 60
    turn = Turn("user", "FILE + request", {"request": "fix it", "attachments": ["a.py"], "edit": "/x/a.py"})
    assert turn.display == "✎ edit a.py\n\nfix it" and turn.request == "fix it" and turn.paths("edit") == ["/x/a.py"]


def test_sparkline_scales_to_the_highest_sample_and_keeps_its_width():
    assert str(sparkline([0.0] * 60)) == " " * 30  # nothing measured yet: blank, same width
    line = str(sparkline([0.0] * 56 + [5.0, 10.0, 20.0, 40.0]))
    assert len(line) == 30 and line[:28] == " " * 28
    assert line[-1] == SPARK_BARS[-1] and line[-2] == SPARK_BARS[round(10 / 40 * 7)]  # max of each 2 samples
    assert str(sparkline([1.0, 2.0, 3.0], width=30)) == SPARK_BARS[2] + SPARK_BARS[5] + SPARK_BARS[7]


def test_adapt_intervals_slows_text_first_then_statistics_and_recovers_in_reverse():
    (stats_low, stats_high), (text_low, text_high) = STATS_INTERVAL_S, TEXT_INTERVAL_S
    over, under, within = UI_CPU_BUDGET * 2, UI_CPU_BUDGET / 4, UI_CPU_BUDGET * 0.75
    intervals = (stats_low, text_low)
    seen = [intervals]
    for _ in range(12):
        intervals = adapt_intervals(over, *intervals)
        seen.append(intervals)
    assert intervals == (stats_high, text_high)
    # the text interval reached its bound before the statistics' interval moved at all
    first_stats_change = next(i for i, (stats, _) in enumerate(seen) if stats > stats_low)
    assert seen[first_stats_change - 1][1] == text_high
    assert adapt_intervals(within, *intervals) == intervals  # inside the band: no change
    back = [intervals]
    for _ in range(12):
        intervals = adapt_intervals(under, *intervals)
        back.append(intervals)
    assert intervals == (stats_low, text_low)
    first_text_change = next(i for i, (_, text) in enumerate(back) if text < text_high)
    assert back[first_text_change - 1][0] == stats_low


def test_warm_highlighting_builds_the_python_lexer_before_the_first_reply():
    from pygments.lexers.python import PythonLexer

    if "_tokens" in PythonLexer.__dict__:
        del PythonLexer._tokens  # as in a fresh process (an earlier test may have highlighted Python)
    warm_highlighting()
    assert "_tokens" in PythonLexer.__dict__  # compiled once per process; a fence now highlights at once
    assert "def" in str(CopyableFence.highlight("def f():\n    pass\n", "python"))


# -- issue 19: labels that do not mislead -------------------------------------------------------------------------
def test_step_labels_say_what_the_latest_step_did():
    from specchat.app.tui.bridge import LiveView
    from specchat.app.tui.widgets.stats_bar import policy_label

    def label(policy, gamma, drafter="prompt-lookup"):
        return policy_label(LiveView(RequestStats(last_policy=policy, last_gamma=gamma), drafter))

    assert label(PolicyState.SPECULATING, 4) == "prompt-lookup: speculating"
    assert label(PolicyState.SPECULATING, 0) == "prompt-lookup: no draft this step"  # was "speculating" beside γ 0
    assert label(PolicyState.PAUSED, 0) == "prompt-lookup: paused (it did not pay)"
    assert label(PolicyState.OFF, 0, "none") == "plain decoding"


def test_the_step_speed_ratio_needs_enough_steps_of_each_kind():
    # issue 19: "measured 1.32×" at 6% acceptance, from a handful of plain steps
    few = RequestStats(
        drafted=50,
        accepted=3,
        acceptance_rate=0.06,
        steps=30,
        spec_tok_s=13.2,
        plain_tok_s=10.0,
        accepted_length_histogram=(25, 2),
    )
    assert measured_speedup(few) is None
    many = RequestStats(steps=40, spec_tok_s=13.2, plain_tok_s=10.0, accepted_length_histogram=(20, 5))
    assert measured_speedup(many) == pytest.approx(1.32)


def test_a_failed_reply_totals_say_what_went_wrong_and_what_to_do():
    line = reply_totals(RequestStats(drafter="none"), "error", "the model ran out of memory.")
    assert line == (
        "0 tokens · 0.00 s · — tok/s · plain decoding · error: the model ran out of memory · "
        "↑ edits your message, Ctrl+R retries"
    )
    assert stored_totals({"finish_reason": "error", "error": "boom"}).endswith(
        "error: boom · ↑ edits your message, Ctrl+R retries"
    )
    assert reply_totals(RequestStats(), "cancelled") == "stopped during prefill"  # no "0 tokens · 0.00 s" (issue 36)
    assert reply_totals(RequestStats(), "cancelled", prefill=(1024, 2692), elapsed_s=3.25) == (
        "stopped during prefill (1,024 of 2,692 tokens) · 3.2 s"
    )


def test_sizes_use_the_binary_units_of_specchat_models():
    from specchat.app.tui.screens.picker import human_bytes
    from specchat.backend.models.facts.memory import format_bytes

    for n in (0, 512, 1023, 1024, 1_200_000_000, 1_191_182_336, 15_000_000_000, 2**40 * 3):
        assert human_bytes(n) == format_bytes(n)
    assert human_bytes(1_191_182_336) == "1.11 GiB"  # the picker said "1.2 GB" for what `models` calls this


def test_picker_columns_fit_80_and_120_columns():
    from specchat.app.tui.screens.picker import CELL_PADDING, DIALOG_CHROME, column_widths

    names = ["smollm2-135m", "smollm2-135m-nf4-draft", "qwen2.5-coder-7b"]
    drafters, targets = ["prompt-lookup", "draft-model"], ["HuggingFaceTB/SmolLM2-1.7B-Instruct", "Qwen/Qwen2.5-7B"]
    for width in (80, 120):
        widths = column_widths(width - DIALOG_CHROME, names, drafters, targets)
        assert {"pair", "drafter", "memory", "fits", "download"} <= set(widths)
        assert sum(w + CELL_PADDING for w in widths.values()) <= width - DIALOG_CHROME
        assert widths["pair"] >= len("● smollm2-135m-nf4-draft")
    assert "target" in column_widths(120 - DIALOG_CHROME, names, drafters, targets)


def test_loader_progress_is_throttled_within_a_step_but_each_new_step_shows():
    clock, posted = Clock(), []
    progress = ThrottledProgress(lambda text, fraction: posted.append(text), clock=clock)
    for i in range(1, 31):
        clock.now += 0.001
        progress(f"Loading weights: {i}/30", i / 30)  # the text changes every call: still one step
    progress("Reading the tokenizer", None)
    assert posted == ["Loading weights: 1/30", "Loading weights: 30/30", "Reading the tokenizer"]


def test_load_steps_time_each_step():
    from specchat.app.tui.widgets.load_steps import LoadSteps, short_step

    clock = Clock()
    steps = LoadSteps(clock)
    steps.report("Hashing model.gguf", 0.1)
    clock.now += 2.0
    steps.report("Hashing model.gguf", 0.9)
    steps.report("Reading the tokenizer from model.gguf (first start only)", None)
    clock.now += 0.5
    assert steps.durations() == [
        ("Hashing model.gguf", 2.0),
        ("Reading the tokenizer from model.gguf (first start only)", 0.5),
    ]
    assert steps.total() == 2.5 and steps.step_elapsed() == 0.5
    assert short_step("Reading the tokenizer from model.gguf (first start only)") == "Reading the tokenizer"


def test_the_stats_bar_names_the_path_in_a_few_words():
    from specchat.app.tui.widgets.stats_bar import path_label

    assert path_label("CPU native (avx2), Q4_1, Q8_0 as stored") == "CPU native (avx2)"
    building = (
        "CPU int4 Python loop: the CPU kernels are being built in the background (3 s) (log: /x/build.log); "
        "they take over between replies when ready"
    )
    assert path_label(building) == "CPU int4 Python loop · kernels building"
    assert (
        path_label("CPU int4 Python loop: the CPU kernels are unavailable: no C++ compiler") == "CPU int4 Python loop"
    )
    assert path_label(None) == path_label("") == ""
