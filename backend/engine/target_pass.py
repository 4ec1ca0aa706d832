"""A request's target passes and the tokens decided from their rows (held by
:class:`~specchat.backend.engine.request.RequestState` as its ``passes``).

Contract: :meth:`TargetPasses.raw_logits` runs one target pass after the conversation's committed tokens and
returns its kept rows as float32 logits over the tokenizer's ids (an interrupted or failed pass gives its reserved
blocks back; out of memory is an :class:`~specchat.backend.errors.InsufficientMemoryError` saying what to do);
:meth:`~TargetPasses.penalised` applies the repetition penalty a chain's rows see; :meth:`~TargetPasses.decide`
picks each row's token at its reply position (:func:`~specchat.backend.speculative.sampling.pick`), shown to the
trace probe first; :meth:`~TargetPasses.tree_decider` does both for a tree's rows along the path followed.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable
from typing import Any

import torch

from specchat.backend.engine.features import FeatureFeed
from specchat.backend.engine.parts import Conversation, Target, describe_error, is_out_of_memory
from specchat.backend.engine.resolve import Sampling
from specchat.backend.errors import InsufficientMemoryError
from specchat.backend.speculative.constraint import Constraint
from specchat.backend.speculative.sampling import SeenIds, apply_repetition_penalty, pick


class TargetPasses:
    """The target's passes of one request: the model, the conversation's cache slot, the sampling settings, the
    ids the penalty sees (the request's context, grown by the request) and the draft heads' feed."""

    constraint: Constraint | None = None  # the reply's grammar: a row decided here is masked after its prefix
    top_logprobs: int | None = None  # a request's logprobs: the rows decided are kept until take_logprobs

    def __init__(
        self, target: Target, conv: Conversation, sampling: Sampling, seen: SeenIds, feed: FeatureFeed | None
    ) -> None:
        self.target, self.conv, self.s, self.seen, self.feed = target, conv, sampling, seen, feed
        self.rows: dict[int, torch.Tensor] = {}  # reply position -> the row that decided it (with top_logprobs)

    def take_logprobs(self, tokens: list[int], first: int) -> list[dict[str, Any]] | None:
        """Each of ``tokens`` (at reply positions ``first``, ``first + 1``, ...): its log-probability under the row
        that decided it (penalised and masked as ``pick`` saw it; softmax at temperature 1, in float64, so a row
        computed in any pass gives the same figure) and the ``top_logprobs`` likeliest ids (ties: the lower id).
        None without logprobs; the rows kept are dropped."""
        if self.top_logprobs is None:
            return None
        decode, out = self.target.tokenizer.decode, []
        for i, token in enumerate(tokens):
            row = torch.log_softmax(self.rows[first + i].double(), dim=-1)
            top: list[tuple[str, int, float]] = []
            if self.top_logprobs:
                least = torch.topk(row, min(self.top_logprobs, row.shape[0])).values[-1]  # ties at it: all kept
                ids = ((row >= least) & (row > -math.inf)).nonzero()[:, 0].tolist()  # never an id a mask refused
                order = sorted(ids, key=lambda j: (-float(row[j]), j))[: self.top_logprobs]
                top = [(decode([j]), j, float(row[j])) for j in order]
            out.append({"token": decode([token]), "id": token, "logprob": float(row[token]), "top": top})
        self.rows.clear()
        return out

    def penalty_context(self) -> torch.Tensor:
        """The ids every row of a pass sees as the penalty's context (the pending token included); row j of a
        verification also sees the drafts before it."""
        return self.seen.tensor()

    def target_logits(
        self, ids: list[int], keep: int, parents: list[int] | None = None, cancel: threading.Event | None = None
    ) -> torch.Tensor:
        """[keep, V] logits over the tokenizer's ids, penalised per row for a chain; a tree's (``parents``) rows
        are penalised by :meth:`tree_decider`, along the followed path only. ``cancel`` (a prefill pass): raises
        PassCancelled between layers once set, nothing of the pass kept."""
        logits = self.raw_logits(ids, keep, parents, cancel)
        return logits if parents is not None else self.penalised(logits, ids[len(ids) - keep + 1 :])  # drafts

    def decide(self, rows: torch.Tensor, positions: range | list[int]) -> list[int]:
        if self.target.trace is not None:
            self.target.trace(positions, rows)
        if self.top_logprobs is not None:
            self.rows.update(zip(positions, rows))
        return pick(rows, self.s.rule, positions)

    def penalised(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        if not self.s.repetition_penalty:
            return logits
        return apply_repetition_penalty(logits, self.penalty_context(), self.s.repetition_penalty, draft_ids=drafts)

    def raw_logits(
        self, ids: list[int], keep: int, parents: list[int] | None = None, cancel: threading.Event | None = None
    ) -> torch.Tensor:
        """[keep, V] float32 logits over the tokenizer's ids, before any penalty."""
        runner = self.target.runner
        try:
            taps = None if self.feed is None else self.feed.taps
            out = runner.forward(self.conv.seq, ids, logits_to_keep=keep, parents=parents, cancel=cancel, taps=taps)
        except BaseException as error:
            # Nothing of this pass was committed: give back the blocks it reserved, keep the history intact.
            self.conv.seq.truncate(self.conv.seq.length)
            if not is_out_of_memory(error):
                raise
            if runner.device.type == "cuda":
                torch.cuda.empty_cache()
            raise InsufficientMemoryError(
                f"the target model {runner.loaded.spec.source} ran out of memory on {runner.device} while "
                f"generating ({describe_error(error)}); the reply was stopped. Retry with a lower max_new_tokens or a "
                "new conversation, or choose a smaller context_length, a quantized or smaller pair "
                "(`specchat models`)"
            ) from error
        if self.feed is not None:
            self.feed.hidden = out.hidden
        return out.logits[:, : self.target.vocab_limit].float()  # over the tokenizer's ids only

    def tree_decider(self, logits: torch.Tensor, first: int, penalise: bool = True) -> Callable[[int, list[int]], int]:
        """The target's token at a row of a tree pass, given the accepted tokens before it: the row's penalty
        sees the context plus exactly those tokens (its ancestors), its reply position is ``first`` (the step's
        first reply position) plus their number (its depth). With a constraint the row is masked by the grammar's
        state after those tokens (a chain is decided here too then, its rows already penalised: ``penalise``
        False)."""

        def decide(row: int, path: list[int]) -> int:
            rows = logits[row : row + 1]
            if self.constraint is not None:
                self.constraint.at(path)
                rows = self.constraint.mask(rows)
            if penalise and self.s.repetition_penalty:
                context = self.penalty_context()
                if path:
                    context = torch.cat([context, torch.tensor(path, dtype=context.dtype, device=context.device)])
                rows = apply_repetition_penalty(rows, context, self.s.repetition_penalty)
            return self.decide(rows, [first + len(path)])[0]

        return decide
