"""A request's grammar constraint (JSON schema, JSON object, Lark / GBNF grammar, regex), composed with lossless
verification: the target's row at each position is masked to the tokens the grammar allows after that row's prefix,
before :func:`~specchat.backend.speculative.sampling.pick` decides it.

Contract (``docs/constrained.md`` states it for users):

- ``backend/constraint_spec.py``'s ``grammar_text`` turns a :class:`~specchat.backend.api.ConstraintSpec` into
  llguidance's grammar text (``check_grammar`` also validates it); the tokenizer's view is :func:`ll_tokenizer`.
- :class:`Constraint` is one request's matcher. Its *base* state is after the reply's committed tokens;
  :meth:`Constraint.at` moves it to base + a path of drafts (rolling back what it followed before), so every row of
  a verification pass, chain or tree, is masked by the state after exactly its own prefix; :meth:`Constraint.commit`
  advances the base by the tokens the reply kept. :meth:`Constraint.mask` sets every disallowed logit to -inf in
  place: the row then goes to ``pick`` unchanged in every other way (the same Gumbel noise, seed and position), so a
  seeded constrained reply is the same for every drafter, γ and jump-forward setting. An end-of-text id is allowed
  only where the grammar accepts (llguidance's own rule: its tokenizer is given the engine's EOS ids).
- :meth:`Constraint.cut` keeps the drafts the grammar allows (a chain's longest valid prefix; a tree's nodes whose
  whole path is valid): a draft the grammar refuses could never be accepted, so it is not verified.
- :meth:`Constraint.forced` are the tokens the grammar forces next (jump-forward): they are placed as drafts and
  verified like any other, so they cost no extra pass and never change the reply.

Why llguidance (not xgrammar, not a hand-written matcher): measured in docs/constrained.md (mask cost per token,
schema coverage); it has rollback, which speculation needs for rejected drafts.
"""

from __future__ import annotations

import copy
import threading
import time
import weakref
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import numpy
import torch

from specchat.backend.api import ConstraintSpec
from specchat.backend.constraint_spec import grammar_text
from specchat.backend.errors import RequestError

if TYPE_CHECKING:  # imported where a grammar is used: a chat with none never holds the grammar engine's ~2 MiB
    import llguidance

_MINUS_INF = torch.tensor(float("-inf"))
_tokenizers: weakref.WeakKeyDictionary[Any, llguidance.LLTokenizer] = weakref.WeakKeyDictionary()
_lock = threading.Lock()


def ll_tokenizer(tokenizer: Any, vocab: int, eos_ids: Collection[int]) -> llguidance.LLTokenizer:
    """llguidance's view of a Hugging Face fast tokenizer (built once per tokenizer: ~1 s)."""
    with _lock:
        cached = _tokenizers.get(tokenizer)
        if cached is None:
            backend = getattr(tokenizer, "backend_tokenizer", None)  # transformers' fast ones, and LightTokenizer
            if backend is None or not hasattr(backend, "to_str"):
                raise RequestError(
                    "constrained decoding needs a fast (Rust `tokenizers`) tokenizer; this model's "
                    f"{type(tokenizer).__name__} is not one"
                )
            backend = copy.copy(backend)  # as llguidance.hf.from_tokenizer: no padding or truncation in its copy
            backend.no_padding()
            backend.no_truncation()
            import llguidance

            try:
                cached = llguidance.LLTokenizer(backend.to_str(), n_vocab=vocab, eos_token=sorted(eos_ids))
            except (ValueError, TypeError) as error:
                raise RequestError(f"the grammar engine cannot read this model's tokenizer ({error})") from None
            _tokenizers[tokenizer] = cached
        return cached


class Constraint:
    """One request's grammar state (module docstring). ``mask_s`` / ``masks`` time the masks computed."""

    def __init__(self, spec: ConstraintSpec, tokenizer: llguidance.LLTokenizer, vocab: int) -> None:
        self.spec, self.vocab = spec, vocab
        import llguidance

        grammar = grammar_text(spec)
        self.matcher = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        if self.matcher.is_error():
            raise RequestError(f"the {spec.kind.replace('_', ' ')} is not supported: {self.matcher.get_error()}")
        self._words = (tokenizer.vocab_size + 31) // 32
        self._bits = torch.zeros(self._words, dtype=torch.int32)
        self.path: list[int] = []  # tokens followed past the base state (a draft being verified)
        self.mask_s = 0.0
        self.masks = 0
        self.forced_tokens = 0

    @property
    def jump_forward(self) -> bool:
        return self.spec.jump_forward

    def _consume(self, tokens: Sequence[int]) -> None:
        for token in tokens:
            if not self.matcher.consume_token(int(token)):
                raise RequestError(f"the constraint refused token {token}: {self.matcher.get_error()}")
        self.path.extend(int(t) for t in tokens)

    def at(self, path: Sequence[int]) -> None:
        """Move to the state after base + ``path`` (rolling back the part of the followed path that differs)."""
        common = 0
        while common < min(len(path), len(self.path)) and self.path[common] == path[common]:
            common += 1
        if common < len(self.path):
            self.matcher.rollback(len(self.path) - common)
            del self.path[common:]
        self._consume(path[common:])

    def commit(self, tokens: Sequence[int]) -> None:
        """The reply kept ``tokens`` (from the base): they become the base."""
        self.at(tokens)
        self.path = []

    def allowed(self) -> torch.Tensor:
        """[vocab] bool: the ids the grammar allows at the current state."""
        t0 = time.perf_counter()
        self.matcher.unsafe_compute_mask_ptr(self._bits.data_ptr(), self._words * 4)
        bits = numpy.unpackbits(self._bits.numpy().view(numpy.uint8), bitorder="little")  # id i: bit i % 32 of word
        allowed = torch.from_numpy(bits[: self.vocab].view(numpy.bool_))
        self.mask_s += time.perf_counter() - t0
        self.masks += 1
        if not bool(allowed.any()):
            raise RequestError(f"the constraint allows no token here ({self.matcher.get_error() or 'a dead end'})")
        return allowed

    def mask(self, row: torch.Tensor) -> torch.Tensor:
        """A copy of ``row`` ([1, V] float32 logits) with every id the grammar refuses at -inf."""
        allowed = self.allowed()
        t0 = time.perf_counter()
        width = row.shape[-1]
        if width > self.vocab:
            allowed = torch.cat([allowed, allowed.new_zeros(width - self.vocab)])
        out = torch.where(allowed[:width].to(row.device), row, _MINUS_INF.to(row.device))
        self.mask_s += time.perf_counter() - t0
        return out

    def forced(self, most: int) -> list[int]:
        """At most ``most`` tokens the grammar forces after the base (jump-forward drafts; none when it is off)."""
        self.at([])
        if most <= 0 or not self.jump_forward or self.matcher.is_stopped():
            return []
        t0 = time.perf_counter()
        tokens = [int(t) for t in self.matcher.compute_ff_tokens()[:most]]
        self.mask_s += time.perf_counter() - t0
        return tokens

    def cut(self, draft_ids: list[int], parents: list[int] | None) -> tuple[list[int], list[int] | None]:
        """The drafts the grammar allows at the current state: a chain's longest valid prefix; a tree's nodes whose
        path is valid (parents re-indexed). Everything else could never be accepted."""
        if not draft_ids:
            return draft_ids, parents
        if parents is None:
            return draft_ids[: self.matcher.validate_tokens(draft_ids)], None
        paths: list[list[int]] = []
        index: dict[int, int] = {-1: -1}
        kept_ids: list[int] = []
        kept_parents: list[int] = []
        for node, (token, parent) in enumerate(zip(draft_ids, parents)):
            if parent not in index:
                continue  # its parent was refused
            path = (paths[index[parent]] if parent >= 0 else []) + [token]
            if self.matcher.validate_tokens(path) == len(path):
                index[node] = len(kept_ids)
                kept_ids.append(token)
                kept_parents.append(index[parent])
                paths.append(path)
        return kept_ids, kept_parents


def constraint_for(spec: ConstraintSpec, tokenizer: Any, vocab: int, eos_ids: Collection[int]) -> Constraint:
    """A request's :class:`Constraint` over the target's tokenizer."""
    return Constraint(spec, ll_tokenizer(tokenizer, vocab, eos_ids), vocab)


JUMP_FORWARD = "jump-forward"  # the drafter name of a step whose draft is the grammar's forced tokens


def plan_draft(
    constraint: Constraint, name: str | None, draft_ids: list[int], parents: list[int] | None, forced: list[int]
) -> tuple[str | None, list[int], list[int] | None]:
    """A step's draft under ``constraint``: the tokens the grammar forces (``forced``: :meth:`Constraint.forced`),
    then the drafter's draft from after them, cut to what the grammar allows there. With forced tokens the step is
    named :data:`JUMP_FORWARD` (its acceptance is not the drafter's, so no policy learns from it) and a drafter's
    tree hangs below the last forced token. A draft is only ever a guess: verification decides every token as
    without it."""
    constraint.at(forced)
    draft_ids, parents = constraint.cut(draft_ids, parents)
    constraint.at([])
    if not forced:
        return (name if draft_ids else None), draft_ids, (parents if draft_ids else None)
    constraint.forced_tokens += len(forced)
    f = len(forced)
    if parents is None:
        return JUMP_FORWARD, forced + draft_ids, None
    return JUMP_FORWARD, forced + draft_ids, list(range(-1, f - 1)) + [p + f if p >= 0 else f - 1 for p in parents]
