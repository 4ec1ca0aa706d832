"""gumbel.py: the noise is a fixed function of (seed, position, token id): bit-exact with the plain-Python
splitmix64 reference, independent of the batch it is computed in, standard Gumbel, and unrelated across
consecutive seeds and positions (what `--samples` and a reply's positions rely on)."""

from __future__ import annotations

import math

import pytest
import torch

from specchat.backend.speculative.gumbel import gumbel_noise, mix64, reference_gumbel, token_bits

EULER = 0.5772156649015329


@pytest.mark.parametrize("seed", [0, 1, 123456789, 2**53 - 1, 2**63, 2**64 - 1])
def test_matches_the_python_reference_bit_for_bit(seed: int) -> None:
    positions = [0, 1, 17, 2**31 + 5]
    ids = torch.tensor([[0, 1, 2, 49151], [7, 8, 9, 10], [151935, 3, 3, 0], [5, 6, 7, 8]])
    noise = gumbel_noise(seed, positions, ids)
    assert noise.dtype == torch.float64
    expected = torch.tensor(
        [[reference_gumbel(seed, p, int(v)) for v in row] for p, row in zip(positions, ids)], dtype=torch.float64
    )
    assert torch.equal(noise, expected)


def test_the_known_first_values_never_change() -> None:
    """A seed must replay the same reply across versions: these bits are part of the contract."""
    assert [hex(token_bits(0, 0, v)) for v in range(2)] == ["0xb07501aa72beede5", "0x2aea903b81833e5c"]
    # ... built on the real splitmix64: its first two outputs from state 0 are the published ones.
    assert [hex(mix64(0)), hex(mix64(0x9E3779B97F4A7C15))] == ["0xe220a8397b1dcdaf", "0x6e789e6aa1b965f4"]


def test_a_row_has_the_same_noise_alone_and_among_others() -> None:
    ids = torch.arange(1000)[None]
    together = gumbel_noise(5, [3, 4, 5, 6], ids)  # a [1, m] row shared by four positions broadcasts
    for i, position in enumerate([3, 4, 5, 6]):
        assert torch.equal(gumbel_noise(5, [position], ids)[0], together[i])
    picked = torch.tensor([[999, 0, 500]])
    assert torch.equal(gumbel_noise(5, [4], picked)[0], together[1, [999, 0, 500]])


def test_standard_gumbel_and_unrelated_across_seeds_and_positions() -> None:
    """200,000 values per stream: mean γ_E and variance π²/6 within 5 standard errors; correlation between
    consecutive seeds (`--samples` uses s, s+1, ...) and consecutive positions below 5 / sqrt(N)."""
    n = 200_000
    ids = torch.arange(n)[None]
    a = gumbel_noise(41, [9], ids)[0]
    b = gumbel_noise(42, [9], ids)[0]
    c = gumbel_noise(41, [10], ids)[0]
    var = math.pi**2 / 6
    assert abs(float(a.mean()) - EULER) < 5 * math.sqrt(var / n)
    assert abs(float(a.var()) - var) < 0.05
    for other in (b, c):
        corr = float(torch.corrcoef(torch.stack([a, other]))[0, 1])
        assert abs(corr) < 5 / math.sqrt(n)
    # The same token at consecutive positions: no relation either (noise keyed by position, not by step).
    tokens = torch.arange(50)[None]
    rows = gumbel_noise(7, list(range(4000)), tokens)  # [4000, 50]
    corr = float(torch.corrcoef(torch.stack([rows[:-1].flatten(), rows[1:].flatten()]))[0, 1])
    assert abs(corr) < 5 / math.sqrt(rows[:-1].numel())
    u = torch.exp(-torch.exp(-a))  # back to the uniform: evenly spread over ten bins
    counts = torch.histc(u, bins=10, min=0, max=1)
    assert float((counts - n / 10).abs().max()) < 5 * math.sqrt(n / 10)
