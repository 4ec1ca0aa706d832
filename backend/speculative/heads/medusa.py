"""Medusa heads (Cai et al., arXiv 2401.10774) in their published layout.

K heads over the target's last (normed) hidden state of the last committed token: head k is ``medusa_num_layers``
residual blocks ``x + SiLU(linear(x))`` then a linear map to the vocabulary, and predicts the token k+1 places
after the target's own next token. State-dict keys: ``medusa_head.{k}.{j}.linear.{weight,bias}`` for block j and
``medusa_head.{k}.{L}.weight`` for the output map (L = medusa_num_layers); the first Medusa release saved the
same keys without the ``medusa_head.`` prefix (``medusa_lm_head.pt``), read too. Config: ``medusa_num_heads``,
``medusa_num_layers``, ``hidden_size``, ``vocab_size`` (from the base model's config when the head's omits them),
and optionally ``medusa_choices``: the static tree (paths of ranks, see ``trees.py``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from specchat.backend.errors import ModelLoadError


@dataclass(frozen=True, slots=True)
class MedusaConfig:
    num_heads: int
    num_layers: int
    hidden_size: int
    vocab_size: int
    choices: tuple[tuple[int, ...], ...] | None  # the static tree shipped with the head, if any

    @classmethod
    def from_dict(cls, data: Mapping[str, Any], where: str, *, hidden_size: int, vocab_size: int) -> MedusaConfig:
        """Read a Medusa config.json; sizes it omits are the target's (``hidden_size``, ``vocab_size``)."""

        def count(key: str, default: int | None = None) -> int:
            value = data.get(key, default)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ModelLoadError(
                    f"{where}: field {key!r} = {value!r}: a Medusa config.json needs a whole number >= 1"
                )
            return value

        choices = data.get("medusa_choices")
        parsed = None
        if choices is not None:
            ok = isinstance(choices, list) and all(
                isinstance(p, (list, tuple)) and p and all(isinstance(r, int) and r >= 0 for r in p) for p in choices
            )
            if not ok:
                raise ModelLoadError(
                    f"{where}: medusa_choices must be a list of paths of ranks, e.g. [[0], [0, 0], [1]]"
                )
            parsed = tuple(tuple(p) for p in choices)
        return cls(
            num_heads=count("medusa_num_heads"),
            num_layers=count("medusa_num_layers", 1),
            hidden_size=count("hidden_size", hidden_size),
            vocab_size=count("vocab_size", vocab_size),
            choices=parsed,
        )


class ResBlock(nn.Module):
    def __init__(self, size: int) -> None:
        super().__init__()
        self.linear = nn.Linear(size, size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class MedusaHeads(nn.Module):
    """``medusa_head[k]`` = Sequential(ResBlock × num_layers, Linear(hidden, vocab, bias=False))."""

    def __init__(self, config: MedusaConfig) -> None:
        super().__init__()
        self.config = config
        self.medusa_head = nn.ModuleList(
            nn.Sequential(
                *[ResBlock(config.hidden_size) for _ in range(config.num_layers)],
                nn.Linear(config.hidden_size, config.vocab_size, bias=False),
            )
            for _ in range(config.num_heads)
        )

    @property
    def lm_dtype(self) -> torch.dtype:
        return next(self.parameters()).dtype

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:  # [hidden] -> [num_heads, vocab] float32
        x = hidden.to(self.lm_dtype)
        return torch.stack([head(x) for head in self.medusa_head]).float()


def medusa_state(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The state dict with the ``medusa_head.`` prefix (the first release saved it without)."""
    out = {}
    for key, value in state.items():
        if key.startswith("medusa_head."):
            out[key] = value
        elif key.split(".", 1)[0].isdigit():
            out["medusa_head." + key] = value
    return out
