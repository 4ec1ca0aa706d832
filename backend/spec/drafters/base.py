"""The drafter contract: propose a few tokens for the target to verify, learn from how many it accepted.

A drafter knows only token ids. ``propose(context, max_tokens)`` sees every committed id of the sequence so far
(prompt and generated; never the rejected drafts of earlier steps) and returns a :class:`Draft` of at most
``max_tokens`` *new* ids (never the context with the draft appended), with the distributions they were sampled
from (``probs``), or ``None`` for a deterministic, one-hot draft (prompt lookup). Proposing fewer tokens than
asked, even none, is allowed: the engine then verifies what there is, or runs a plain step.

``observe(num_accepted)`` is called after each verification with how many of the proposed ids the target kept,
so a drafter can roll back its own state (a draft model's cache) or adapt. ``reset()`` starts a new request or
conversation; ``configure(...)`` gives it the request's sampling settings and random generator (a drafter
that samples uses them; a deterministic one ignores them); ``release()`` gives back what it holds (cache
blocks) for good. The whole interface is declared here (as transformers' candidate generators declare
theirs), so the engine never probes a drafter for optional methods.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch


@dataclass(slots=True)
class Draft:
    """The proposed new ids and, for a sampled draft, their distributions q (one row per id).

    ``parents`` None: a chain (each id follows the one before). A tree: ``parents[i]`` is the index of id i's
    parent in ``token_ids`` (-1: it follows the last committed token); a parent always comes before its children.
    """

    token_ids: list[int]
    probs: torch.Tensor | None = None  # [len(token_ids), V] the distributions each id was drawn from; None: one-hot
    parents: list[int] | None = None  # [len(token_ids)] for a tree draft

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def __len__(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class Drafter(Protocol):
    name: str  # "prompt-lookup" | "draft-model"

    def reset(self) -> None: ...

    def configure(self, *, temperature: float, top_k: int | None, top_p: float | None,
                  generator: torch.Generator | None) -> None: ...

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft: ...

    def observe(self, num_accepted: int) -> None: ...

    def release(self) -> None: ...


class StatelessHooks:
    """The hooks a drafter without per-request state needs none of: configure, observe and release do nothing
    beyond :meth:`reset` (a deterministic drafter ignores sampling settings; verification keeps the target's
    distribution whatever it proposes)."""

    def reset(self) -> None:
        """Nothing to forget."""

    def configure(self, *, temperature: float, top_k: int | None, top_p: float | None,
                  generator: torch.Generator | None) -> None:
        """Nothing to configure."""

    def observe(self, num_accepted: int) -> None:
        """Nothing to learn."""

    def release(self) -> None:
        self.reset()
