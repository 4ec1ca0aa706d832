"""Draft heads' linears as Q8_0 through the block kernels (backend/kernels/block_linear.py): the product is x times
gguf's Q8_0 blocks of the weight within the activations' rounding, and the float one within Q8_0's; a head loaded
on CPU drafts through them with the reply still plain decoding's."""

from __future__ import annotations

import pytest
import torch
from gguf.constants import GGMLQuantizationType
from gguf.quants import dequantize, quantize
from native_fixtures import native_ready  # noqa: F401  (a fixture)
from tiny_heads import eagle3_folder, medusa_folder
from tiny_models import build_tiny, one_thread  # noqa: F401  (one_thread: autouse)
from torch import nn

from specchat.backend.kernels.block_linear import BlockLinear, quantize_linears
from specchat.backend.models.catalog.config_head import HeadSpec
from specchat.backend.models.loading.head_loading import load_head

Q8_0 = GGMLQuantizationType.Q8_0


def test_the_product_is_the_float_one_within_q8_0_rounding(native_ready):  # noqa: F811
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(96, 64), nn.SiLU(), nn.Linear(64, 40, bias=False), nn.Linear(40, 8))
    x = torch.randn(3, 5, 96)
    with torch.inference_mode():
        before = model(x)
        assert quantize_linears(model) == 2  # the last one (40 inputs) is not a whole number of blocks
        after = model(x)
        assert [type(m) for m in model] == [BlockLinear, nn.SiLU, BlockLinear, nn.Linear]
        assert after.shape == before.shape and after.dtype == before.dtype
        assert not torch.equal(after, before)  # it did take the block path
        assert torch.allclose(after, before, atol=0.02 * before.abs().max().item())
        first = model[0]
        dequantised = torch.from_numpy(dequantize(quantize(first.weight.detach().numpy(), Q8_0), Q8_0)).reshape(64, 96)
        # the kernel's only other rounding is the activations' 8 bits: a step of max|x_block| / 127 per input
        reference = x.reshape(-1, 96) @ dequantised.T + first.bias
        step = x.abs().amax() / 127 * dequantised.abs().sum(1).max()
        assert (first(x).reshape(-1, 64) - reference).abs().max() <= step
        assert model(torch.empty(0, 96)).shape == (0, 8)


def test_a_head_loaded_on_cpu_drafts_through_the_blocks(tmp_path, native_ready):  # noqa: F811
    target = build_tiny("llama")
    folder = medusa_folder(tmp_path / "medusa", target.config, heads=3)
    head = load_head(
        HeadSpec(str(folder), "local", path=str(folder)), "medusa", target.config, torch.device("cpu"), target_name="t"
    )
    switched = [m for m in head.module.modules() if isinstance(m, BlockLinear)]
    assert switched and all(m.in_features % 32 == 0 for m in switched)


def test_an_eagle3_head_keeps_its_fusion_of_the_raw_taps_in_float(tmp_path, native_ready):  # noqa: F811
    target = build_tiny("llama")
    folder = eagle3_folder(tmp_path / "eagle3", target.config, taps=(0, 1, 1))
    head = load_head(
        HeadSpec(str(folder), "local", path=str(folder)), "eagle3", target.config, torch.device("cpu"), target_name="t"
    )
    assert type(head.module.fc) is nn.Linear  # its input has the residual stream's outliers
    assert isinstance(head.module.lm_head, BlockLinear)


def test_without_the_kernels_a_head_stays_float(tmp_path, monkeypatch):
    monkeypatch.setenv("SPECCHAT_NATIVE", "0")
    target = build_tiny("llama")
    folder = medusa_folder(tmp_path / "medusa", target.config, heads=3)
    head = load_head(
        HeadSpec(str(folder), "local", path=str(folder)), "medusa", target.config, torch.device("cpu"), target_name="t"
    )
    assert not any(isinstance(m, BlockLinear) for m in head.module.modules())
    assert any(type(m) is nn.Linear for m in head.module.modules())


@pytest.mark.parametrize("rows", [1, 4, 17])
def test_rows_do_not_change_a_rows_result(rows, native_ready):  # noqa: F811
    torch.manual_seed(1)
    layer = nn.Linear(128, 96)
    quantize_linears(layer)
    x = torch.randn(rows, 128)
    with torch.inference_mode():
        assert torch.equal(layer(x)[-1:], layer(x[-1:]))


def test_layers_named_to_keep_stay_float(native_ready):  # noqa: F811
    model = nn.Sequential()
    model.add_module("fc", nn.Linear(64, 32))
    model.add_module("out", nn.Linear(32, 16))
    assert quantize_linears(model, keep=("fc",)) == 1
    assert type(model.fc) is nn.Linear and type(model.out) is BlockLinear
