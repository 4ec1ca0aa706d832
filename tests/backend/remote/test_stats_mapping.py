"""Each server's speculation statistics, mapped into RequestStats (backend/remote/stats.py). The bodies are
written from the servers' own code (cited at each); a figure a server does not give stays None (JSON null)."""

from __future__ import annotations

import pytest

from specchat.backend.api import GammaSummary, RequestStats
from specchat.backend.remote.stats import (
    from_llama_server,
    from_sglang,
    from_specchat,
    from_vllm,
    remote_stats,
    server_figures,
    vllm_counters,
    vllm_per_position_between,
)

# vLLM 0.33: the final usage chunk of a stream with stream_options.include_usage, on a server started with
# --per-request-spec-decode-metrics summary (vllm/entrypoints/openai/chat_completion/serving.py puts
# PerRequestMetrics on it; the block is RequestSpecDecodeMetrics.to_dict in vllm/v1/metrics/stats.py).
VLLM_SUMMARY = {
    "id": "chatcmpl-1",
    "object": "chat.completion.chunk",
    "created": 1,
    "model": "m",
    "choices": [],
    "usage": {"prompt_tokens": 25, "completion_tokens": 40, "total_tokens": 65},
    "metrics": {
        "time_to_first_token_ms": 50.0,
        "tokens_per_second": 90.0,
        "speculative_decoding": {
            "mean_acceptance_length": 2.5,
            "draft_acceptance_rate": 0.5,
            "acceptance_histogram": [4, 2, 2, 4],
            "num_spec_steps": 12,
            "num_accepted_draft_tokens": 18,
            "num_draft_tokens": 36,
            "num_spec_tokens": 3,
        },
    },
}


def test_vllm_summary_maps_counts_rates_and_derives_positions_only_when_every_step_drafted_k() -> None:
    figures = from_vllm(VLLM_SUMMARY)
    assert figures["drafted"] == 36 and figures["accepted"] == 18
    assert figures["acceptance_rate"] == 0.5 and figures["mean_accepted_length"] == 2.5
    assert figures["accepted_length_histogram"] == (4, 2, 2, 4)
    # every step drafted k=3 (36 = 12 x 3): position j reached by steps that accepted >= j drafts
    assert figures["per_position_acceptance"] == (round(8 / 12, 4), round(6 / 8, 4), round(4 / 6, 4))
    assert figures["gamma"] == GammaSummary(mode=3, mean=3.0, max=3) and figures["last_gamma"] == 3
    assert "steps" not in figures  # vLLM counts verify steps only when they drafted: not our "steps"

    fewer = {
        "metrics": {"speculative_decoding": {**VLLM_SUMMARY["metrics"]["speculative_decoding"], "num_draft_tokens": 30}}
    }
    assert "per_position_acceptance" not in from_vllm(fewer)  # some steps drafted fewer: not derivable


def test_vllm_detailed_per_step_arrays_give_exact_positions_and_gamma() -> None:
    # `detailed` adds the ordered per-step arrays (vllm/v1/metrics/stats.py, per_step_accepted/per_step_drafted)
    spec = {
        "mean_acceptance_length": 2.0,
        "draft_acceptance_rate": 0.5,
        "acceptance_histogram": [1, 1, 1],
        "num_spec_steps": 3,
        "num_accepted_draft_tokens": 3,
        "num_draft_tokens": 6,
        "num_spec_tokens": 2,
        "per_step_accepted": [2, 0, 1],
        "per_step_drafted": [2, 2, 2],
    }
    figures = from_vllm({"metrics": {"speculative_decoding": spec}})
    assert figures["per_position_acceptance"] == (round(2 / 3, 4), 0.5)
    assert figures["last_gamma"] == 2 and figures["gamma"].mode == 2


def test_llama_server_timings() -> None:
    # tools/server/server-common.cpp server_slot_stats::to_json; the last chunk (server-task.cpp
    # to_json_oaicompat_chat_stream) carries "timings"; draft_n / draft_n_accepted only when the slot drafted.
    chunk = {
        "choices": [],
        "usage": {"prompt_tokens": 30, "completion_tokens": 64, "total_tokens": 94},
        "timings": {
            "cache_n": 10,
            "prompt_n": 20,
            "prompt_ms": 123.4,
            "prompt_per_token_ms": 6.17,
            "prompt_per_second": 162.0,
            "predicted_n": 64,
            "predicted_ms": 800.0,
            "predicted_per_token_ms": 12.5,
            "predicted_per_second": 80.0,
            "draft_n": 48,
            "draft_n_accepted": 36,
        },
    }
    figures = from_llama_server(chunk)
    assert figures == {
        "prefill_tokens": 20,
        "prefill_s": 0.1234,
        "new_tokens": 64,
        "drafted": 48,
        "accepted": 36,
        "acceptance_rate": 0.75,
    }
    no_draft = {k: v for k, v in chunk["timings"].items() if not k.startswith("draft")}
    assert "drafted" not in from_llama_server({"timings": no_draft})
    stats = remote_stats(server_figures(chunk), wall_s=1.0, ttft_s=0.2, counted_tokens=0, drafter="server")
    assert stats.mean_accepted_length is None and stats.steps is None  # llama-server does not report its steps
    assert stats.to_json_stats()["mean_accepted_length"] is None and stats.to_json_stats()["steps"] is None


def test_sglang_spec_tokens_details_and_meta_info() -> None:
    # python/sglang/srt/entrypoints/openai/protocol.py SpecTokensDetails under "sglext" (return_spec_tokens_details),
    # computed by srt/managers/tokenizer_manager.py _calculate_spec_decoding_metrics (also the /generate meta_info)
    details = {
        "spec_accept_rate": 0.6,
        "spec_accept_length": 3.4,
        "spec_cap_length": 0.0,
        "spec_block_accept_length": 0.0,
        "spec_num_correct_drafts": 48,
        "spec_num_proposed_drafts": 80,
        "spec_verify_ct": 20,
        "spec_correct_drafts_histogram": [2, 3, 5, 4, 6],
        "spec_cap_lens_histogram": [],
    }
    figures = from_sglang({"choices": [], "sglext": {"spec_tokens_details": details}})
    assert figures["steps"] == 20 and figures["drafted"] == 80 and figures["accepted"] == 48
    assert figures["acceptance_rate"] == 0.6 and figures["mean_accepted_length"] == 3.4
    assert figures["accepted_length_histogram"] == (2, 3, 5, 4, 6)
    assert figures["last_gamma"] == 4  # 80 proposed over 20 verify steps
    assert from_sglang({"text": "...", "meta_info": details}) == figures
    assert from_sglang({"meta_info": {"prompt_tokens": 3, "completion_tokens": 9}}) == {}  # no speculation


def test_specchat_serve_block_round_trips_the_engine_stats() -> None:
    stats = RequestStats(
        new_tokens=9,
        steps=5,
        drafted=8,
        accepted=4,
        acceptance_rate=0.5,
        per_position_acceptance=(0.75, 0.25),
        gamma=GammaSummary(2, 2.0, 2),
        last_gamma=2,
        drafter="prompt-lookup",
    )
    figures = from_specchat({"specchat": {"stats": stats.to_dict()}})
    assert figures["per_position_acceptance"] == (0.75, 0.25) and figures["drafter"] == "prompt-lookup"
    assert figures["steps"] == 5 and figures["gamma"] == GammaSummary(2, 2.0, 2)
    damaged = from_specchat({"specchat": {"stats": {"steps": "five", "drafted": 3}}})
    assert damaged == {"drafted": 3}  # a damaged figure is dropped, not reported as 0


@pytest.mark.parametrize(
    "chunk",
    [
        {"metrics": {"speculative_decoding": {"num_draft_tokens": -1, "draft_acceptance_rate": 7.0}}},
        {"timings": {"prompt_n": "x", "draft_n": 3, "draft_n_accepted": 5}},
        {"sglext": {"spec_tokens_details": {"spec_verify_ct": True, "spec_accept_rate": float("nan")}}},
        {"usage": [1, 2]},
        {"specchat": "nope"},
        {"metrics": None},
    ],
)
def test_bad_values_from_a_server_are_dropped_never_raised(chunk: dict) -> None:
    assert server_figures(chunk) == {}


def test_remote_stats_measure_time_here_and_leave_unknown_fields_none() -> None:
    stats = remote_stats(
        {"new_tokens": 40, "prompt_tokens": 25, "tok_s": 999.0},
        wall_s=2.0,
        ttft_s=0.5,
        counted_tokens=0,
        drafter="server",
    )
    assert stats.tok_s == 20.0 and stats.ttft_s == 0.5 and stats.wall_s == 2.0  # the client's clock, not the server's
    assert stats.prompt_tokens == 25
    json_stats = stats.to_json_stats()
    for name in (
        "prefill_s",
        "prefill_tokens",
        "steps",
        "spec_paused_steps",
        "drafted",
        "accepted",
        "acceptance_rate",
        "mean_accepted_length",
    ):
        assert json_stats[name] is None, name
    assert RequestStats.from_dict(stats.to_dict()) == stats  # the history reads a remote reply back unchanged


def test_vllm_prometheus_counters_give_the_per_position_acceptance_between_two_readings() -> None:
    # vllm/v1/spec_decode/metrics.py: counters vllm:spec_decode_num_drafts / _num_draft_tokens /
    # _num_accepted_tokens and _num_accepted_tokens_per_pos{position}; per-position acceptance is
    # accepted_per_pos / num_drafts (its docstring's PromQL), exposed with the _total suffix of Prometheus counters.
    def text(drafts: int, pos: tuple[int, ...]) -> str:
        lines = [
            "# HELP vllm:spec_decode_num_drafts_total Number of spec decoding drafts.",
            "# TYPE vllm:spec_decode_num_drafts_total counter",
            f'vllm:spec_decode_num_drafts_total{{engine="0",model_name="m"}} {float(drafts)}',
            f'vllm:spec_decode_num_draft_tokens_total{{engine="0",model_name="m"}} {float(drafts * 3)}',
            f'vllm:spec_decode_num_accepted_tokens_total{{engine="0",model_name="m"}} {float(sum(pos))}',
        ]
        lines += [
            f'vllm:spec_decode_num_accepted_tokens_per_pos_total{{engine="0",model_name="m",position="{j}"}} {float(n)}'
            for j, n in enumerate(pos)
        ]
        return "\n".join(lines) + "\n"

    before, after = vllm_counters(text(10, (8, 5, 2))), vllm_counters(text(30, (24, 13, 6)))
    assert before["vllm:spec_decode_num_drafts_total"] == 10 and before["per_position"] == {0: 8, 1: 5, 2: 2}
    assert vllm_per_position_between(before, after) == (0.8, 0.4, 0.2)
    assert vllm_per_position_between(after, after) == ()  # nothing drafted in between
    assert vllm_counters("garbage\nvllm:spec_decode_num_drafts_total{x} NaN\n")["per_position"] == {}
