"""A request's target passes and the tokens decided from their rows: the logits half of
:class:`~specchat.backend.engine.request.RequestState` (split from request.py, which keeps the loop).

Contract: :meth:`TargetPasses._raw_logits` runs one target pass after the conversation's committed tokens and
returns its kept rows as float32 logits over the tokenizer's ids (an interrupted or failed pass gives its reserved
blocks back; out of memory is an :class:`~specchat.backend.errors.InsufficientMemoryError` saying what to do);
:meth:`~TargetPasses._penalised` applies the repetition penalty a chain's rows see; :meth:`~TargetPasses._decide`
picks each row's token at its reply position (:func:`~specchat.backend.speculative.sampling.pick`), shown to the
trace probe first; :meth:`~TargetPasses._tree_decider` does both for a tree's rows along the path followed.
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import torch

from specchat.backend.engine.features import FeatureFeed
from specchat.backend.engine.parts import Conversation, Target, describe_error, is_out_of_memory
from specchat.backend.engine.resolve import Sampling
from specchat.backend.errors import InsufficientMemoryError
from specchat.backend.speculative.constraint import Constraint
from specchat.backend.speculative.sampling import SamplingRule, SeenIds, apply_repetition_penalty, pick


class TargetPasses:
    """The target's passes of one request (a base of RequestState, which sets these attributes)."""

    target: Target
    conv: Conversation
    s: Sampling
    rule: SamplingRule
    seen: SeenIds  # the ids of the request's context: the penalty's
    feed: FeatureFeed | None  # draft heads: the taps every pass returns
    produced: int  # reply tokens emitted so far
    constraint: Constraint | None  # the reply's grammar: each row masked by the state after its prefix

    def _penalty_context(self) -> torch.Tensor:
        """The ids every row of a pass sees as the penalty's context (the pending token included); row j of a
        verification also sees the drafts before it."""
        return self.seen.tensor()

    def _positions(self, rows: int) -> range:
        """The reply positions the next pass's rows decide: the pending token is at ``produced - 1``."""
        return range(self.produced, self.produced + rows)

    def _target_logits(
        self, ids: list[int], keep: int, parents: list[int] | None = None, cancel: threading.Event | None = None
    ) -> torch.Tensor:
        """[keep, V] logits over the tokenizer's ids, penalised per row for a chain; a tree's (``parents``) rows
        are penalised by :meth:`_tree_decider`, along the followed path only. ``cancel`` (a prefill pass): raises
        PassCancelled between layers once set, nothing of the pass kept."""
        logits = self._raw_logits(ids, keep, parents, cancel)
        return logits if parents is not None else self._penalised(logits, ids[len(ids) - keep + 1 :])  # drafts

    def _decide(self, rows: torch.Tensor, positions: range | list[int]) -> list[int]:
        if self.target.trace is not None:
            self.target.trace(positions, rows)
        return pick(rows, self.rule, positions)

    def _penalised(self, logits: torch.Tensor, drafts: list[int]) -> torch.Tensor:
        if not self.s.repetition_penalty:
            return logits
        return apply_repetition_penalty(logits, self._penalty_context(), self.s.repetition_penalty, draft_ids=drafts)

    def _raw_logits(
        self, ids: list[int], keep: int, parents: list[int] | None = None, cancel: threading.Event | None = None
    ) -> torch.Tensor:
        """[keep, V] float32 logits over the tokenizer's ids, before any penalty."""
        runner = self.target.runner
        try:
            if self.feed is None:
                logits = runner.forward(self.conv.seq, ids, logits_to_keep=keep, parents=parents, cancel=cancel)
            else:
                logits, self.feed.hidden = runner.forward(
                    self.conv.seq, ids, logits_to_keep=keep, parents=parents, cancel=cancel, taps=self.feed.taps
                )
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
        return logits[:, : self.target.vocab_limit].float()  # over the tokenizer's ids only

    def _tree_decider(self, logits: torch.Tensor, penalise: bool = True) -> Callable[[int, list[int]], int]:
        """The target's token at a row of a tree pass, given the accepted tokens before it: the row's penalty
        sees the context plus exactly those tokens (its ancestors), its reply position is ``produced`` plus
        their number (its depth). With a constraint the row is masked by the grammar's state after those tokens
        (a chain goes through here too then, its rows already penalised: ``penalise`` False)."""

        def decide(row: int, path: list[int]) -> int:
            rows = logits[row : row + 1]
            if self.constraint is not None:
                self.constraint.at(path)
                rows = self.constraint.mask(rows)
            if penalise and self.s.repetition_penalty:
                context = self._penalty_context()
                if path:
                    context = torch.cat([context, torch.tensor(path, dtype=context.dtype, device=context.device)])
                rows = apply_repetition_penalty(rows, context, self.s.repetition_penalty)
            return self._decide(rows, [self.produced + len(path)])[0]

        return decide
