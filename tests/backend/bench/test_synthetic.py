"""`specchat bench --synthetic`: the `tiny` pair runs end to end on CPU and every reported field is a measured,
finite, positive number; the speedup formula on injected times; random builds and the nf4 swap."""

from __future__ import annotations

import argparse
import json
import math

import pytest
import torch
from tiny_models import one_thread  # noqa: F401  (autouse)

from specchat.backend.bench.synthetic import expected_speedups, run_synthetic
from specchat.backend.bench.synthetic_models import TINY_TARGET, build_random, quantize_nf4, weight_bytes_per_step
from specchat.backend.errors import ConfigError

NUMBERS = [
    "target_params",
    "draft_params",
    "prompt_tokens",
    "new_tokens",
    "target_weight_bytes_per_step",
    "kv_bytes_per_token",
    "read_bandwidth_GBps",
    "bandwidth_bound_tok_s",
    "specchat_plain_tok_s",
    "hf_plain_tok_s",
    "specchat_vs_hf_plain",
    "specchat_fraction_of_bound",
    "hf_fraction_of_bound",
    "verify8_over_step1",
    "draft_step_ms",
    "hf_assisted_target_forwards",
    "hf_assisted_step_ms",
    "hf_assisted_tok_s",
]


def _positive(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def test_tiny_synthetic_bench_reports_measured_numbers(tmp_path, capsys) -> None:
    args = argparse.Namespace(synthetic="tiny", device="cpu", max_new_tokens=6, out=str(tmp_path), seed=0)
    assert run_synthetic(args) == 0
    result = json.loads((tmp_path / "synthetic_tiny.json").read_text())
    bad = {k: result.get(k) for k in NUMBERS if not _positive(result.get(k))}
    assert not bad, bad
    assert result["new_tokens"] == 6 and result["cuda_graphs"] is False and result["device"] == "cpu"
    assert sorted(result["target_step_ms"], key=int) == [str(n) for n in range(1, 17)]
    assert all(_positive(v) for v in result["target_step_ms"].values())
    assert set(result["expected_speedup"]) == {"0.6", "0.8", "0.9"}
    for entry in result["expected_speedup"].values():
        assert 1 <= entry["gamma"] <= 15 and _positive(entry["speedup"])
    assert result["hf_assisted_target_forwards"] >= 2  # prefill + at least one verification
    table = capsys.readouterr().out
    assert "specchat plain decode" in table and "expected speedup" in table


def test_unknown_name_is_refused() -> None:
    with pytest.raises(ConfigError, match="llama3-8b"):
        run_synthetic(argparse.Namespace(synthetic="gpt-9", device="cpu", max_new_tokens=None, out=None, seed=0))


def test_expected_speedup_formula_on_injected_times() -> None:
    # Target cost grows 10% per extra token; draft costs 5% of a target step.
    target = {n: 1.0 + 0.1 * (n - 1) for n in range(1, 17)}
    got = expected_speedups(target, 0.05, alphas=(0.6, 0.9))

    def s(alpha, gamma):
        return (1 - alpha ** (gamma + 1)) / (1 - alpha) / (gamma * 0.05 + target[gamma + 1])

    for alpha in (0.6, 0.9):
        best = max(range(1, 16), key=lambda g: s(alpha, g))
        assert got[str(alpha)]["gamma"] == best
        assert got[str(alpha)]["speedup"] == pytest.approx(s(alpha, best))
    assert got["0.9"]["gamma"] > got["0.6"]["gamma"]  # better acceptance pays for longer drafts
    flat = expected_speedups({n: 1.0 for n in range(1, 17)}, 0.0, alphas=(0.8,))
    assert flat["0.8"]["gamma"] == 15  # free drafts and free verification: draft as much as possible


def test_random_build_weights_and_nf4_swap() -> None:
    model = build_random(TINY_TARGET, torch.device("cpu"), torch.float32, seed=3)
    w = model.model.layers[0].mlp.up_proj.weight
    assert 0.015 < float(w.detach().std()) < 0.025 and float(model.model.norm.weight.detach().min()) == 1.0
    emb = TINY_TARGET["vocab_size"] * TINY_TARGET["hidden_size"] * 4
    total = sum(p.numel() * 4 for p in model.parameters())
    assert weight_bytes_per_step(model) == total - emb  # untied: the input embedding is not read per step
    ids = torch.randint(3, TINY_TARGET["vocab_size"], (1, 12))
    with torch.no_grad():
        ref = model(ids).logits
        pytest.importorskip("bitsandbytes")
        quantize_nf4(model, torch.float32)
        got = model(ids).logits
    assert model.model.layers[0].mlp.up_proj.weight.dtype == torch.uint8  # packed 4-bit
    assert model.lm_head.weight.dtype == torch.float32  # the head stays unquantised
    assert torch.isfinite(got).all() and (got - ref).abs().max() < 0.25 * ref.abs().max()
