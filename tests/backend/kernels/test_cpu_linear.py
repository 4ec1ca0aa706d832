"""cpu_linear.py: oneDNN-packed linear layers on CPU give the stock outputs, switch on and off, leave
quantised/other layers alone, and the bench's transformers twin runs stock layers."""

from __future__ import annotations

import pytest
import torch
from tiny_models import build_tiny
from torch import nn

from specchat.backend.bench.hf import sdpa_twin
from specchat.backend.kernels import cpu_linear

pytestmark = pytest.mark.skipif(not cpu_linear.enabled(), reason="this PyTorch build has no oneDNN")


def _linears(model: nn.Module) -> list[nn.Linear]:
    return [m for m in model.modules() if isinstance(m, nn.Linear)]


@pytest.mark.parametrize("rows", [1, 2, 7, 33])
def test_packed_layer_matches_f_linear(rows: int) -> None:
    torch.manual_seed(0)
    layer = nn.Linear(48, 80, bias=True)
    x = torch.randn(1, rows, 48)
    with torch.no_grad():
        expected = layer(x)
        assert cpu_linear.pack_linears(layer) == 1
        assert type(layer) is cpu_linear.PackedLinear
        got = layer(x)
    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert cpu_linear.unpack_linears(layer) == 1 and type(layer) is nn.Linear and "_packed" not in layer._buffers


def test_packed_model_logits_match_and_greedy_tokens_are_the_same() -> None:
    model = build_tiny("qwen2")  # qkv bias: packed layers with and without bias
    ids = torch.randint(3, 128, (1, 24), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits
        count = cpu_linear.pack_linears(model)
        got = model(ids).logits
    assert count == len(_linears(model)) and count > 0
    assert all(type(m) is cpu_linear.PackedLinear for m in _linears(model))
    torch.testing.assert_close(got, expected, atol=1e-4, rtol=1e-4)
    assert torch.equal(got.argmax(-1), expected.argmax(-1))
    assert all(m.weight.dtype == torch.float32 and m.weight.numel() for m in _linears(model))  # dense weights stay


def test_packed_bytes_counts_eligible_layers() -> None:
    model = build_tiny("llama")
    expected = sum(m.weight.numel() * 4 for m in _linears(model))
    assert cpu_linear.packed_bytes(model) == expected > 0


def test_switched_off_by_the_environment(monkeypatch) -> None:
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    model = build_tiny("llama")
    assert not cpu_linear.enabled()
    assert cpu_linear.pack_linears(model) == 0 and cpu_linear.packed_bytes(model) == 0
    assert not any(isinstance(m, cpu_linear.PackedLinear) for m in model.modules())


def test_subclasses_and_other_dtypes_are_left_alone() -> None:
    class QuantLinear(nn.Linear):  # as bitsandbytes' Linear4bit / Linear8bitLt subclass nn.Linear
        pass

    model = nn.Sequential(QuantLinear(8, 8), nn.Linear(8, 8).to(torch.bfloat16), nn.Linear(8, 8))
    assert cpu_linear.pack_linears(model) == 1
    assert [type(m).__name__ for m in model] == ["QuantLinear", "Linear", "PackedLinear"]


def test_disagreeing_kernel_is_abandoned(monkeypatch) -> None:
    model = build_tiny("llama")
    real = torch.ops.mkldnn._linear_pointwise

    def wrong(*args):
        return real(*args) + 1.0

    monkeypatch.setattr(
        cpu_linear.PackedLinear, "forward", lambda self, x: wrong(x, self._packed, self.bias, "none", [], "")
    )
    assert cpu_linear.pack_linears(model) == 0
    assert not any(isinstance(m, cpu_linear.PackedLinear) for m in model.modules())


def test_bench_twin_runs_stock_layers_on_the_same_weights() -> None:
    model = build_tiny("llama")
    cpu_linear.pack_linears(model)
    twin = sdpa_twin(model)
    assert all(type(m) is nn.Linear for m in _linears(twin))
    assert all(type(m) is cpu_linear.PackedLinear for m in _linears(model))
    assert all(a.data_ptr() == b.data_ptr() for a, b in zip(model.parameters(), twin.parameters()))
    ids = torch.tensor([[5, 9, 17, 33, 2, 64]])
    with torch.no_grad():
        torch.testing.assert_close(twin(ids).logits, model(ids).logits, atol=1e-4, rtol=1e-4)


def test_engine_packs_on_cpu_only_when_the_copy_fits(monkeypatch) -> None:
    from engine_fixtures import tiny_engine

    from specchat.backend.engine import runner as runner_module

    eng = tiny_engine("llama")
    assert all(type(m) is cpu_linear.PackedLinear for m in _linears(eng.target.model))
    assert eng.runner.path == "cpu-packed"
    monkeypatch.setattr(runner_module, "free_memory", lambda device: runner_module.PACKING_SPARE_BYTES)
    eng = tiny_engine("llama")
    assert all(type(m) is nn.Linear for m in _linears(eng.target.model)) and eng.runner.path == "eager"
