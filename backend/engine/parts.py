"""What a request works on: its conversation's cache slot, the target as a request sees it, and the engine's
speculation parts (kept between requests). Split from ``request.py`` (the loop) and ``engine.py`` (the owner).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from specchat.backend.engine.runner import ModelRunner
from specchat.backend.engine.threads import ThreadGovernor
from specchat.backend.kv.kv_cache import Sequence
from specchat.backend.speculative.drafters.base import Drafter
from specchat.backend.speculative.policy import GammaPolicy


@dataclass
class Conversation:
    """A cache slot: the sequence, the token ids whose K/V it holds, and how many old messages were dropped.

    ``prompt_logits``: the target's raw logits row (sliced to the tokenizer's ids, float32, before any penalty)
    that followed ``cached[:prompt_length]``, the last prompt token's row of the prefill that read it. A later
    request whose whole prompt is that prefix (``generate --samples``, a regenerated reply) decides its first
    token from this row instead of computing the last prompt token again by another path (a one-token pass
    rounds differently from a prefill pass of many rows): every number is the one a fresh request computes."""

    seq: Sequence
    cached: list[int] = field(default_factory=list)  # token ids whose K/V are committed in seq
    dropped: int = 0  # oldest messages left out to fit the context (kept stable across turns)
    prompt_logits: torch.Tensor | None = None  # [V] float32
    prompt_length: int = 0

    def logits_after(self, length: int) -> torch.Tensor | None:
        """The kept prefill row that followed ``cached[:length]``, if that is what it is."""
        if self.prompt_logits is None or self.prompt_length != length or len(self.cached) < length:
            return None
        return self.prompt_logits

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` cached tokens (and the kept row only if it still follows them)."""
        self.seq.truncate(length)
        del self.cached[length:]
        if self.prompt_length > length:
            self.prompt_logits, self.prompt_length = None, 0


@dataclass(frozen=True)
class Speculation:
    """What a request uses of the engine's speculation parts (the engine keeps them between requests)."""

    drafters: Mapping[str, Drafter]
    policies: Mapping[str, GammaPolicy]  # learned costs and acceptance, shared by "auto" requests
    disabled: Mapping[str, str]  # drafter -> why it is off for the engine's life (out of memory)
    disable: Callable[[str, str], None]  # switch a drafter off for the engine's life, with the reason


@dataclass
class Lane:
    """One stream of a batch as the engine's request code sees it (backend/engine/batch.py): the runner its
    passes go through, its own drafters and policies; ``state`` the request once made (its live figures)."""

    runner: Any  # a ModelRunner, or what stands in for one (the same forward)
    drafters: Mapping[str, Drafter]
    policies: Mapping[str, GammaPolicy]
    state: Any = None  # the RequestState, set by the engine


@dataclass(frozen=True)
class Target:
    """The target model as a request sees it: its runner, and what decides where a reply ends."""

    runner: ModelRunner
    tokenizer: Any
    eos_ids: frozenset[int]
    vocab_limit: int  # p and q are compared over the tokenizer's ids only
    context_length: int
    threads: ThreadGovernor | None = None  # CPU: fewer compute threads while other programs are busy
    # A probe shown every processed logits row a token is decided from, with its reply position (the replay
    # bench's diagnostics: backend/bench/replay.py); None in normal use.
    trace: Callable[[range | list[int], torch.Tensor], None] | None = None


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA/host allocation failures (torch raises OutOfMemoryError, or RuntimeError on some paths)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def describe_error(error: BaseException) -> str:
    detail = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__
