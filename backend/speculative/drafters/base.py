"""The drafter contract: propose a few tokens for the target to verify, learn from how many it accepted.

A drafter knows only token ids. ``propose(context, max_tokens)`` sees every committed id of the sequence so far
(prompt and generated, the target's pending token included; never the rejected drafts of earlier steps) and
returns a :class:`Draft` of at most ``max_tokens`` *new* ids (never the context with the draft appended).
Proposing fewer tokens than asked, even none, is allowed: the engine then verifies what there is, or runs a
plain step. Verification keeps a drafted id iff it equals the target's own token at its reply position
(``backend/speculative/verify.py``), so what a drafter proposes never changes the output, only its speed.

``configure(rule, reply_start)`` gives it the request's sampling rule (settings and seed) and where the reply
starts in the context: the draft token at context index j is at reply position j - reply_start, and a drafter
that samples picks it with :func:`specchat.backend.speculative.sampling.pick` at that position (the target's noise:
coupled drafts). ``observe(num_accepted)`` is called after each verification with how many of the proposed ids
the target kept, so a drafter can roll back its own state or adapt. A drafter keeps what it learned across
requests (the draft model's cache: a conversation's next turn reuses its prefix) and syncs to each context
itself; ``reset()`` forgets it (after a failure), ``release()`` gives back what it holds (cache blocks) for
good. The whole interface is declared here (as transformers' candidate generators declare theirs), so the
engine never probes a drafter for optional methods.

Draft heads (``backend/speculative/heads``) read the target's own hidden states too: ``taps`` names them (tap
indices of ``ModelRunner.forward``; ``()`` for a drafter of ids only), and after each target pass the engine
gives ``observe_hidden(start, token_ids, hidden)`` the taps of the tokens it committed (context positions
``start ..``). ``features_for(ids)`` says how many leading ids of a prompt the drafter holds features for: the
engine re-reads the rest of the prompt rather than reuse cached K/V the drafter has no features of.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

import torch

from specchat.backend.speculative.sampling import SamplingRule


@dataclass(slots=True)
class Draft:
    """The proposed new ids, and how much of the context the drafter had to read first.

    ``prefilled``: context ids the drafter fed to its model before drafting (0 for prompt lookup);
    ``reused``: context ids it already held (its cache's common prefix with the context).
    ``parents`` None: a chain (each id follows the one before). A tree: ``parents[i]`` is the index of id i's
    parent in ``token_ids`` (-1: it follows the last committed token); a parent always comes before its children.
    """

    token_ids: list[int]
    prefilled: int = 0
    reused: int = 0
    parents: list[int] | None = None  # [len(token_ids)] for a tree draft

    @property
    def is_tree(self) -> bool:
        return self.parents is not None and any(p != i - 1 for i, p in enumerate(self.parents))

    def __len__(self) -> int:
        return len(self.token_ids)


@runtime_checkable
class Drafter(Protocol):
    name: str  # "prompt-lookup" | "suffix" | "draft-model" | "eagle3" | "medusa"
    taps: tuple[int, ...]  # the target's hidden states it reads; () for none

    def reset(self) -> None: ...

    def observe_hidden(self, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None: ...

    def features_for(self, ids: Sequence[int]) -> int: ...

    def configure(self, rule: SamplingRule, reply_start: int) -> None: ...

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft: ...

    def observe(self, num_accepted: int) -> None: ...

    def release(self) -> None: ...


class StatelessHooks:
    """The hooks a drafter without per-request state needs none of: configure, observe and release do nothing
    beyond :meth:`reset` (a deterministic drafter ignores sampling settings; verification keeps the target's
    tokens whatever it proposes)."""

    def reset(self) -> None:
        """Nothing to forget."""

    def configure(self, rule: SamplingRule, reply_start: int) -> None:
        """Nothing to configure."""

    def observe(self, num_accepted: int) -> None:
        """Nothing to learn."""

    def release(self) -> None:
        self.reset()

    taps: tuple[int, ...] = ()

    def observe_hidden(self, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        """Reads no hidden states."""

    def features_for(self, ids: Sequence[int]) -> int:
        """Needs no features: any cached prefix will do."""
        return len(ids)
