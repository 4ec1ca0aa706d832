"""One request's decoding loop: prefill, then steps of propose -> verify -> commit, yielding StepEvents.

Split from engine.py (which owns models, caches, conversations and the lock) so that each stays readable.
Invariants between steps: ``conv.cached`` lists exactly the token ids whose K/V are committed in
``conv.seq``; ``pending`` is the last emitted token, not yet in the cache; ``context`` is the prompt plus
every emitted token (the drafters' view of the conversation, and the repetition penalty's, ``seen``).

Every token is decided by :func:`~specchat.backend.speculative.sampling.pick` at its *reply position* (its index in
the reply: 0 for the token the prefill pass decides, ``produced`` for the first row of a step): verification
keeps a draft token iff it equals the target's own, so with a seed the reply is the same for every drafter and
γ. Each step's state says why it was (not) speculating: SPECULATING (a draft was verified), PAUSED (every
candidate drafter's policy is paused), NO_DRAFT (a drafter is on but nothing was verified: nothing found, the
last token, no room in the KV cache, a drafter that failed, the policy's calibration step), OFF (no drafter).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from specchat.backend.api import FinishReason, PolicyState, RequestStats, StepEvent, TokenSource
from specchat.backend.engine.detokenize import IncrementalDetokenizer
from specchat.backend.engine.features import FeatureFeed
from specchat.backend.engine.parts import Conversation, Speculation, Target
from specchat.backend.engine.propose import Proposer
from specchat.backend.engine.resolve import Sampling
from specchat.backend.engine.target_pass import TargetPasses
from specchat.backend.errors import KVCacheFullError
from specchat.backend.kv.attention import PassCancelled
from specchat.backend.limits import Gamma
from specchat.backend.speculative.constraint import JUMP_FORWARD, Constraint, plan_draft
from specchat.backend.speculative.drafters.prediction import PredictionDrafter
from specchat.backend.speculative.request_stats import SpecStats
from specchat.backend.speculative.sampling import SeenIds
from specchat.backend.speculative.verify import VerifyResult, verify_tokens, verify_tree


@dataclass
class StepPlan:
    """The rows of one step's target pass: the pending token, then the draft (a chain, or a tree: ``parents``)
    made by ``drafter`` (None: a plain step) at the γ its policy chose; the time the step started and spent
    drafting, and a notice for the user (a drafter that failed)."""

    pending: int
    drafter: str | None
    gamma: int
    draft_ids: list[int]
    parents: list[int] | None
    message: str | None
    t_step: float
    draft_s: float

    @property
    def rows(self) -> list[int]:
        return [self.pending, *self.draft_ids]

    def without_draft(self) -> StepPlan:
        """The same step as a plain one (no room in the KV cache for the draft)."""
        return StepPlan(self.pending, None, self.gamma, [], None, self.message, self.t_step, self.draft_s)


class RequestState:
    """The mutable state of one request; :meth:`run` is the generator the engine yields from. A step is
    :meth:`plan` (propose), one target pass over the plan's rows, then :meth:`finish` (verify, commit, account)."""

    def __init__(
        self,
        target: Target,
        spec: Speculation,
        conv: Conversation,
        prompt: list[int],
        sampling: Sampling,
        drafter: str,
        gamma: Gamma,
        cancel: threading.Event,
        t_start: float,
        prediction: PredictionDrafter | None = None,
        constraint: Constraint | None = None,
        logprobs: int | None = None,
    ) -> None:
        self.target, self.spec, self.conv, self.prompt, self.s = target, spec, conv, prompt, sampling
        self.cancel, self.t_start = cancel, t_start
        self.context: list[int] = list(prompt)
        self.seen = SeenIds(target.runner.device)  # the ids of ``context``: the repetition penalty's
        self.seen.add(prompt)
        self.produced = 0
        self.detok = IncrementalDetokenizer(target.tokenizer, sampling.stop, prompt_tail=prompt)
        self.stats = SpecStats(t0=t_start, seed=sampling.seed)  # wall time counts from the request
        self.proposer = Proposer(spec, drafter, gamma, sampling.rule, len(prompt), self.stats, prediction)
        self.feed = FeatureFeed.of(spec.drafters, self.proposer.candidates)  # draft heads: the taps passes return
        self.passes = TargetPasses(target, conv, sampling, self.seen, self.feed)
        self.constraint = self.passes.constraint = constraint  # the reply's grammar (None: free text)
        self.passes.top_logprobs = logprobs  # each token's log-probability from the row that decided it

    @property
    def drafter_used(self) -> str:
        return self.proposer.drafter_used

    def _positions(self, rows: int) -> range:
        """The reply positions the next pass's rows decide: the pending token is at ``produced - 1``."""
        return range(self.produced, self.produced + rows)

    def _cut(self, tokens: list[int], sources: list[TokenSource]) -> tuple[list[int], list[TokenSource], list[str]]:
        """Detokenise ``tokens`` and drop any after an EOS, the token limit or the end of a stop string: the
        reply then holds exactly the tokens plain decoding would have emitted."""
        texts: list[str] = []
        for i, token in enumerate(tokens):
            eos = token in self.target.eos_ids
            texts.append("" if eos else self.detok.push(token))
            if eos or self.produced + i + 1 >= self.s.max_new_tokens or self.detok.stopped:
                return tokens[: i + 1], sources[: i + 1], texts
        return tokens, sources, texts

    def _event(self, tokens: list[int], sources: list[TokenSource], texts: list[str], **fields: Any) -> StepEvent:
        """A step's event (``fields``: StepEvent's, with ``t_step`` the step's start instead of ``overhead_s``: the
        step's time neither drafting nor verifying)."""
        spent = time.perf_counter() - fields.pop("t_step") - fields["draft_s"] - fields["verify_s"]
        return StepEvent(tokens, sources, texts, "".join(texts), overhead_s=max(spent, 0.0), **fields)

    def _report(self) -> RequestStats:
        if (c := self.constraint) is not None:
            self.stats.constraint = (c.mask_s, c.masks, c.forced_tokens)
        return self.stats.report(
            prompt_tokens=len(self.prompt), drafter=self.drafter_used if self.drafter_used != "auto" else "none"
        )

    def _finish_reason(self, pending: int) -> FinishReason | None:
        if pending in self.target.eos_ids:
            return "eos"
        if self.detok.stopped:
            return "stop"
        if self.produced >= self.s.max_new_tokens:
            return "length"
        if self.cancel.is_set():
            return "cancelled"
        if self.conv.seq.length + 1 >= self.target.context_length:
            return "context"
        return None

    def run(self, notice: str | None, prefill_progress: bool = False) -> Iterator[StepEvent]:
        conv = self.conv
        t0 = time.perf_counter()
        todo = self.prompt[len(conv.cached) :]
        logits = None
        step = self.target.runner.prefill_chunk
        for start in range(0, len(todo), step):
            if prefill_progress:  # not a step: no tokens, no statistics (backend/api.py, StepEvent)
                yield StepEvent.empty(PolicyState.OFF, self.drafter_used, prefill_tokens=len(todo), prefill_done=start)
            if self.cancel.is_set():  # the last progress event before a cancel says how much of the prompt was read
                yield self._final(None, "cancelled", None)
                return
            if self.target.threads is not None:
                self.target.threads.step()
            chunk = todo[start : start + step]
            try:  # a prefill pass can take seconds on a busy CPU: Esc stops it between two layers
                logits = self.passes.raw_logits(chunk, keep=1, cancel=self.cancel)  # only the last chunk's row is used
            except PassCancelled:
                yield self._final(None, "cancelled", None)
                return
            conv.seq.commit(len(chunk))
            if self.feed is not None:
                self.feed.give(len(conv.cached), chunk)
            conv.cached.extend(chunk)
        if logits is not None:  # kept with the cache: a request with this whole prompt starts from the same row
            conv.prompt_logits, conv.prompt_length = logits[0].clone(), len(self.prompt)
        elif (kept := conv.logits_after(len(self.prompt))) is not None:
            logits = kept[None]
        else:  # the engine leaves the prompt's last token to prefill unless it kept this row
            raise RuntimeError("prefill fed no token and no row was kept for the cached prompt")
        prefill_s = time.perf_counter() - t0
        first = self.passes.penalised(logits, [])
        if self.constraint is not None:
            first = self.constraint.mask(first)
        pending = self.passes.decide(first, self._positions(1))[0]
        tokens, sources, texts = self._cut([pending], [TokenSource.TARGET])
        if self.constraint is not None:
            self.constraint.commit(tokens)
        self.context.append(pending)
        self.seen.add([pending])
        self.produced = 1
        policy_state = self.proposer.idle_state()
        self.stats.observe_prefill(tokens=len(todo), seconds=prefill_s, policy=policy_state)
        event = self._event(
            tokens,
            sources,
            texts,
            gamma=0,
            accepted=0,
            draft_s=0.0,
            verify_s=prefill_s,
            t_step=t0,
            policy=policy_state,
            drafter=self.drafter_used,
            is_prefill=True,
            prefill_tokens=len(todo),
            message=" ".join(m for m in (notice, *self.proposer.notices) if m) or None,
        )
        event.stats, event.logprobs = self._report(), self.passes.take_logprobs(tokens, 0)
        while (reason := self._finish_reason(pending)) is None:
            yield event
            if self.cancel.is_set():  # the consumer may have cancelled while handling the event
                yield self._final(None, "cancelled", None)
                return
            try:
                pending, event = self._step(pending)
            except KVCacheFullError as error:
                yield self._final(None, "context", str(error))
                return
        yield self._final(event, reason, None)

    def _step(self, pending: int) -> tuple[int, StepEvent]:
        """One step alone: :meth:`plan`, the target pass over its rows, :meth:`finish`."""
        plan = self.plan(pending)
        t_verify = time.perf_counter()
        try:
            logits = self.passes.target_logits(plan.rows, keep=len(plan.rows), parents=plan.parents)
        except KVCacheFullError:
            if not plan.draft_ids:
                raise
            plan = plan.without_draft()  # the last few positions are still worth a plain step each
            logits = self.passes.target_logits(plan.rows, keep=1)
        return self.finish(plan, logits, verify_s=time.perf_counter() - t_verify)

    def plan(self, pending: int) -> StepPlan:
        """Propose: the drafter, γ and draft of the step after ``pending``, capped so that it overshoots neither
        the token limit nor the context. A tree's first γ nodes are a tree too (a parent comes before its
        children). Under a constraint the grammar's forced tokens come first (jump-forward) and the drafter
        continues after them; drafts the grammar refuses are cut (:func:`plan_draft`)."""
        if self.target.threads is not None:
            self.target.threads.step()  # between passes: the drafter's and the target's
        t_step = time.perf_counter()
        room = self.target.context_length - self.conv.seq.length - 1  # positions left after the pending token
        cap = min(self.s.max_new_tokens - self.produced, room) - 1
        forced = self.constraint.forced(cap) if self.constraint is not None else []
        proposal = self.proposer.propose(self.context + forced, cap - len(forced), self.target.runner.device)
        draft, gamma = proposal.draft, proposal.gamma
        draft_ids = list(draft.token_ids[:gamma]) if draft is not None else []
        parents = None
        if draft is not None and draft.parents is not None and draft.is_tree and draft_ids:
            parents = list(draft.parents[:gamma])
        drafter = proposal.drafter
        if self.constraint is not None:
            drafter, draft_ids, parents = plan_draft(self.constraint, drafter, draft_ids, parents, forced)
        draft_s = time.perf_counter() - t_step
        return StepPlan(pending, drafter, gamma, draft_ids, parents, proposal.message, t_step, draft_s)

    def finish(self, plan: StepPlan, logits: torch.Tensor, verify_s: float) -> tuple[int, StepEvent]:
        """Verify, commit and account the step ``plan`` from its pass's ``logits`` (one row per plan row, penalised
        for a chain); the new pending token and the step's event."""
        result = self._verify(plan, logits)
        first = self.produced
        tokens, sources, texts = self._commit(plan, result)
        event = self._account(plan, result, tokens, sources, texts, verify_s)
        event.logprobs = self.passes.take_logprobs(tokens, first)
        return tokens[-1], event

    def _verify(self, plan: StepPlan, logits: torch.Tensor) -> VerifyResult:
        """The target's own token at every row; the drafts kept are those equal to it (a tree: along the path)."""
        if self.constraint is not None and plan.parents is None:  # row by row: each masked after its prefix
            chain = list(range(-1, len(plan.draft_ids) - 1))
            result = verify_tree(self.passes.tree_decider(logits, self.produced, False), plan.draft_ids, chain)
            result.path, result.tried = [], None
            return result
        if plan.parents is None:
            return verify_tokens(self.passes.decide(logits, self._positions(len(plan.rows))), plan.draft_ids)
        return verify_tree(self.passes.tree_decider(logits, self.produced), plan.draft_ids, plan.parents)

    def _commit(self, plan: StepPlan, result: VerifyResult) -> tuple[list[int], list[TokenSource], list[str]]:
        """Keep the pending token and the accepted drafts in the cache (a tree's path moved into place first),
        feed their taps to the draft heads, and grow the reply by the tokens it holds."""
        conv = self.conv
        accepted = [plan.pending] + result.tokens[: result.accepted]
        if plan.parents is not None:
            start = conv.seq.length + 1  # the pending token is at conv.seq.length; node i was written at start + i
            conv.seq.cache.move(conv.seq, [start + i for i in result.path], list(range(start, start + result.accepted)))
        conv.seq.commit(len(accepted))
        if self.feed is not None:  # the pending token's row, then the accepted drafts' rows (a tree's path)
            path = result.path if plan.parents is not None else range(result.accepted)
            self.feed.give(len(conv.cached), accepted, [0] + [1 + node for node in path])
        conv.cached.extend(accepted)
        tokens, sources, texts = self._cut(list(result.tokens), list(result.sources))
        if self.constraint is not None:
            self.constraint.commit(tokens)
        self.produced += len(tokens)
        self.context.extend(tokens)
        self.seen.add(tokens)
        return tokens, sources, texts

    def _account(
        self,
        plan: StepPlan,
        result: VerifyResult,
        tokens: list[int],
        sources: list[TokenSource],
        texts: list[str],
        verify_s: float,
    ) -> StepEvent:
        """The step's outcome to its drafter's policy and the request's statistics; the step's event."""
        proposed = len(plan.draft_ids)
        observe = self.proposer.observe if plan.drafter != JUMP_FORWARD else _no_policy  # the grammar's drafts
        observe(
            plan.drafter,
            gamma=plan.gamma,
            proposed=proposed,
            accepted=result.accepted,
            draft_s=plan.draft_s,
            verify_s=verify_s,
            tried=result.tried,
        )
        state = PolicyState.SPECULATING if proposed else self.proposer.idle_state()
        if plan.message is not None and state is PolicyState.OFF:
            state = PolicyState.NO_DRAFT  # the step whose drafter failed: the drafter did not pause
        drafter = plan.drafter or self.drafter_used
        timing = {"draft_s": plan.draft_s, "verify_s": verify_s}
        kept = min(result.accepted, len(tokens))  # drafts the reply holds (past its end: discarded)
        event = self._event(
            tokens,
            sources,
            texts,
            gamma=proposed,
            accepted=kept,
            t_step=plan.t_step,
            policy=state,
            drafter=drafter,
            message=plan.message,
            **timing,
        )
        self.stats.observe_step(
            drafter=drafter,
            gamma=proposed,
            accepted=result.accepted,
            emitted=len(tokens),
            policy=state,
            overhead_s=event.overhead_s,
            tried=result.tried,
            **timing,
        )
        if plan.parents is not None:
            self.stats.observe_tree(plan.parents, result.path)
        event.stats = self._report()
        return event

    def _final(self, event: StepEvent | None, reason: FinishReason, message: str | None) -> StepEvent:
        """Close the request: ``event`` (the last step's, or None for an empty closing event) gets the finish
        reason, the request's totals and any text held back for a stop string that never completed."""
        if event is None:
            event = StepEvent.empty(self.proposer.idle_state(), self.drafter_used)
        elif reason != "stop" and event.token_texts:
            tail = self.detok.flush()
            event.token_texts[-1] += tail
            event.text += tail
        policies = list(self.proposer.policies.values())
        if len(policies) == 1:
            self.stats.set_policy(policies[0].expected_speedup(), policies[0].estimates())
        event.finish_reason, event.stats = reason, self._report()
        event.message = " ".join(m for m in (event.message, message) if m) or None
        return event


def _no_policy(name: str | None, **outcome: Any) -> None:
    """A jump-forward step: its drafts are the grammar's, so no drafter's policy learns from it."""
