"""The drafter contract: propose a few tokens for the target to verify, learn from how many it accepted.

A drafter knows only token ids. ``propose(context, max_tokens)`` sees every committed id of the sequence so far
(prompt and generated; never the rejected drafts of earlier steps) and returns a :class:`Draft` of at most
``max_tokens`` *new* ids (never the context with the draft appended), with the distributions they were sampled
from (``probs``), or ``None`` for a deterministic, one-hot draft (prompt lookup). Proposing fewer tokens than
asked, even none, is allowed: the engine then verifies what there is, or runs a plain step.

``observe(num_accepted)`` is called after each verification with how many of the proposed ids the target kept,
so a drafter can roll back its own state (a draft model's cache) or adapt. ``reset()`` starts a new request or
conversation.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(slots=True)
class Draft:
    """The proposed new ids and, for a sampled draft, their distributions q (one row per id)."""

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), V] the distributions each id was drawn from; None: one-hot

    def __len__(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class Drafter(Protocol):
    name: str  # "prompt-lookup" | "draft-model"

    def reset(self) -> None: ...

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft: ...

    def observe(self, num_accepted: int) -> None: ...
