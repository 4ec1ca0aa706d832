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
from typing import Any

import torch

from specchat.backend.api import FinishReason, PolicyState, RequestStats, StepEvent, TokenSource
from specchat.backend.engine.detokenize import IncrementalDetokenizer
from specchat.backend.engine.features import FeatureFeed
from specchat.backend.engine.parts import Conversation, Speculation, Target, describe_error, is_out_of_memory
from specchat.backend.engine.resolve import Sampling
from specchat.backend.engine.target_pass import TargetPasses
from specchat.backend.errors import KVCacheFullError
from specchat.backend.kv.attention import PassCancelled
from specchat.backend.limits import PREFILL_CHUNK, Gamma
from specchat.backend.speculative.constraint import Constraint, plan_draft
from specchat.backend.speculative.drafters.base import Draft
from specchat.backend.speculative.drafters.prediction import PredictionDrafter
from specchat.backend.speculative.policy import GammaPolicy
from specchat.backend.speculative.request_stats import SpecStats
from specchat.backend.speculative.sampling import SeenIds
from specchat.backend.speculative.verify import VerifyResult, verify_tokens, verify_tree


class RequestState(TargetPasses):
    """The mutable state of one request; :meth:`run` is the generator the engine yields from (its target passes and
    the tokens decided from their rows: :class:`~specchat.backend.engine.target_pass.TargetPasses`)."""

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
    ) -> None:
        self.target, self.spec, self.conv, self.prompt, self.s = target, spec, conv, prompt, sampling
        self.constraint = constraint
        self.rule = sampling.rule
        self.cancel, self.t_start = cancel, t_start
        self.context: list[int] = list(prompt)
        self.seen = SeenIds(target.runner.device)  # the ids of ``context``: see _penalty_context
        self.seen.add(prompt)
        self.produced = 0
        self.detok = IncrementalDetokenizer(target.tokenizer, sampling.stop, prompt_tail=prompt)
        self.stats = SpecStats(t0=t_start, seed=sampling.seed)  # wall time counts from the request
        if drafter == "none":
            self.candidates: list[str] = []
        elif drafter == "auto":
            self.candidates = list(spec.drafters)
        else:
            self.candidates = [drafter]
        self.fixed = gamma if isinstance(gamma, int) else None
        # A fixed γ gets a fresh policy that never pauses; "auto" shares the engine's learned one.
        self.policies = {
            n: GammaPolicy(fixed_gamma=self.fixed, max_gamma=max(self.fixed, 1)) if self.fixed else spec.policies[n]
            for n in self.candidates
        }
        for name in self.candidates:  # drafters keep their state across requests (the draft model's cache)
            spec.drafters[name].configure(self.rule, len(prompt))
        self.notices: list[str] = []
        for name in [n for n in self.candidates if n in spec.disabled]:
            self.candidates.remove(name)  # switched off by an earlier failure (out of memory): say so each time
            self.notices.append(f"The {name} drafter is off since {spec.disabled[name]}; decoding without it.")
        self.drafter_used = (
            self.candidates[0] if len(self.candidates) == 1 else ("none" if not self.candidates else "auto")
        )
        self.feed = FeatureFeed.of(spec.drafters, self.candidates)  # draft heads: the taps every pass returns
        # A prediction drafts first wherever it matches the reply, at its own lengths (a policy that never pauses
        # and only measures); the drafters above serve where it does not (speculative/drafters/prediction.py).
        self.prediction = prediction
        if prediction is not None:
            prediction.configure(self.rule, len(prompt))
            self.policies[prediction.name] = GammaPolicy(fixed_gamma=prediction.max_tokens)
            self.stats.prediction = (prediction.name, len(prediction.prediction))

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

    # -- the loop ---------------------------------------------------------------------------------------

    def _ranked(self) -> list[tuple[str, int]]:
        """The drafters whose policy speculates this step, with their γ: drafters of ids first (a match of prompt
        lookup or the suffix drafter costs microseconds and, where there is one, is usually long and right: code
        edits), then draft heads; each group best expected speed-up first (ties: the candidates' order). Empty
        for a plain step."""
        ranked = []
        for order, name in enumerate(self.candidates):
            policy = self.policies[name]
            gamma = policy.choose()
            if gamma > 0:
                head = bool(self.spec.drafters[name].taps)
                ranked.append((head, -(policy.expected_speedup(gamma) or 0.0), order, name, gamma))
        return [(name, gamma) for *_, name, gamma in sorted(ranked)]

    def _idle_state(self) -> PolicyState:
        """The state of a pass that verified no draft: OFF without drafters, PAUSED when every candidate's
        policy is paused, else NO_DRAFT."""
        if not self.candidates:
            return PolicyState.OFF if self.prediction is None else PolicyState.NO_DRAFT
        if all(self.policies[n].state is PolicyState.PAUSED for n in self.candidates):
            return PolicyState.PAUSED
        return PolicyState.NO_DRAFT

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
        for start in range(0, len(todo), PREFILL_CHUNK):
            if prefill_progress:  # not a step: no tokens, no statistics (backend/api.py, StepEvent)
                yield StepEvent.empty(PolicyState.OFF, self.drafter_used, prefill_tokens=len(todo), prefill_done=start)
            if self.cancel.is_set():  # the last progress event before a cancel says how much of the prompt was read
                yield self._final(None, "cancelled", None)
                return
            if self.target.threads is not None:
                self.target.threads.step()
            chunk = todo[start : start + PREFILL_CHUNK]
            try:  # a pass of PREFILL_CHUNK tokens took 4 s on a busy CPU: Esc stops it between two layers
                logits = self._raw_logits(chunk, keep=1, cancel=self.cancel)  # only the last chunk's row is used
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
        first = self._penalised(logits, [])
        if self.constraint is not None:
            first = self.constraint.mask(first)
        pending = self._decide(first, self._positions(1))[0]
        tokens, sources, texts = self._cut([pending], [TokenSource.TARGET])
        if self.constraint is not None:
            self.constraint.commit(tokens)
        self.context.append(pending)
        self.seen.add([pending])
        self.produced = 1
        policy_state = self._idle_state()
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
            message=" ".join(m for m in (notice, *self.notices) if m) or None,
        )
        event.stats = self._report()
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

    def _propose(self, cap: int, forced: list[int]) -> tuple[str | None, int, Draft | None, str | None]:
        """The drafter, γ, draft and failure notice of the next step (no drafter: a plain step). Candidates are
        asked in :meth:`_ranked`'s order; one that finds nothing (no match, no features) passes the step to the
        next, so ``auto`` drafts chat with a head while prompt lookup has nothing to copy. ``forced``: tokens the
        grammar forces next (jump-forward); the drafters continue after them."""
        context = self.context + forced if forced else self.context
        if self.prediction is not None and cap > 0:
            try:
                draft = self.prediction.propose(context, cap)
            except Exception as error:  # as any drafter's: the reply goes on without it
                self.prediction = None
                return None, 0, None, f"The prediction failed ({describe_error(error)}); continuing without it."
            if draft.token_ids:
                return self.prediction.name, len(draft), draft, None
        ranked = self._ranked() if cap > 0 else []
        if not ranked:
            return None, 0, None, None
        first: tuple[str, int, Draft] | None = None
        for name, gamma in ranked:
            gamma = min(gamma, cap)
            try:
                draft = self.spec.drafters[name].propose(context, gamma)
            except Exception as error:  # a failing drafter must not end the reply: continue without it
                return None, 0, None, self._drop_drafter(name, error)
            if draft.prefilled or draft.reused:
                self.stats.observe_draft_context(name, prefilled=draft.prefilled, reused=draft.reused)
            if draft.token_ids:
                return name, gamma, draft, None
            first = first or (name, gamma, draft)
        return (*first, None) if first is not None else (None, 0, None, None)

    def _step(self, pending: int) -> tuple[int, StepEvent]:
        conv = self.conv
        if self.target.threads is not None:
            self.target.threads.step()  # between passes: the drafter's and the target's
        t_step = time.perf_counter()
        room = self.target.context_length - conv.seq.length - 1  # positions left after the pending token
        cap = min(self.s.max_new_tokens - self.produced, room) - 1  # γ that cannot overshoot either limit
        forced = self.constraint.forced(cap) if self.constraint is not None else []
        name, gamma, draft, message = self._propose(cap - len(forced), forced)
        draft_s = time.perf_counter() - t_step
        draft_ids = list(draft.token_ids[:gamma]) if draft is not None else []
        # A tree's first γ nodes are a tree too (a parent comes before its children).
        parents = (
            list(draft.parents[:gamma])
            if draft is not None and draft.parents is not None and draft.is_tree and draft_ids
            else None
        )
        if self.constraint is not None:  # drafts the grammar refuses are cut; forced tokens drafted
            name, draft_ids, parents = plan_draft(self.constraint, name, draft_ids, parents, forced)
        t_verify = time.perf_counter()
        try:
            logits = self._target_logits([pending] + draft_ids, keep=1 + len(draft_ids), parents=parents)
        except KVCacheFullError:
            if not draft_ids:
                raise
            # No room for the draft: the last few positions are still worth a plain step each.
            name, draft, draft_ids, parents = None, None, [], None
            logits = self._target_logits([pending], keep=1)
        verify_s = time.perf_counter() - t_verify
        result: VerifyResult
        if self.constraint is not None and parents is None:  # row by row: each masked after its prefix
            result = verify_tree(
                self._tree_decider(logits, penalise=False), draft_ids, list(range(-1, len(draft_ids) - 1))
            )
            result.path, result.tried = [], None
        elif parents is None:
            result = verify_tokens(self._decide(logits, self._positions(1 + len(draft_ids))), draft_ids)
        else:
            result = verify_tree(self._tree_decider(logits), draft_ids, parents)
            start = conv.seq.length + 1  # the pending token is at conv.seq.length; node i was written at start + i
            conv.seq.cache.move(conv.seq, [start + i for i in result.path], list(range(start, start + result.accepted)))
        conv.seq.commit(1 + result.accepted)
        if self.feed is not None:  # the pending token's row, then the accepted drafts' rows (a tree's path)
            rows = [0] + (
                [1 + node for node in result.path] if parents is not None else list(range(1, 1 + result.accepted))
            )
            self.feed.give(len(conv.cached), [pending] + result.tokens[: result.accepted], rows)
        conv.cached.extend([pending] + result.tokens[: result.accepted])
        tokens, sources, texts = self._cut(list(result.tokens), list(result.sources))
        if self.constraint is not None:
            self.constraint.commit(tokens)
        kept = min(result.accepted, len(tokens))  # drafts the reply holds (past its end: discarded)
        self.produced += len(tokens)
        self.context.extend(tokens)
        self.seen.add(tokens)
        if name is not None and name in self.policies:  # not jump-forward's drafts (the grammar's, not a drafter's)
            self.policies[name].observe(
                gamma=gamma,
                proposed=len(draft_ids),
                accepted=result.accepted,
                draft_s=draft_s,
                verify_s=verify_s,
                tried=result.tried,
            )
            if self.prediction is not None and name == self.prediction.name:
                self.prediction.observe(result.accepted)
            elif name in self.candidates:
                self.spec.drafters[name].observe(result.accepted)
        elif name is None and self.candidates:  # a plain step measures T_target(1) for every candidate's policy
            for policy in self.policies.values():
                policy.observe(gamma=0, proposed=0, accepted=0, draft_s=0.0, verify_s=verify_s)
        state = PolicyState.SPECULATING if draft_ids else self._idle_state()
        if message is not None and state is PolicyState.OFF:
            state = PolicyState.NO_DRAFT  # the step whose drafter failed: the drafter did not pause
        event = self._event(
            tokens,
            sources,
            texts,
            gamma=len(draft_ids),
            accepted=kept,
            draft_s=draft_s,
            verify_s=verify_s,
            t_step=t_step,
            policy=state,
            drafter=name or self.drafter_used,
            message=message,
        )
        self.stats.observe_step(
            drafter=name or self.drafter_used,
            gamma=len(draft_ids),
            accepted=result.accepted,
            emitted=len(tokens),
            policy=state,
            draft_s=draft_s,
            verify_s=verify_s,
            overhead_s=event.overhead_s,
            tried=result.tried,
        )
        if parents is not None:
            self.stats.observe_tree(parents, result.path)
        event.stats = self._report()
        return tokens[-1], event

    def _drop_drafter(self, name: str, error: Exception) -> str:
        """Take a failed drafter out of this request (out of memory: out of the engine's life); the message."""
        self.candidates.remove(name)
        try:
            self.spec.drafters[name].reset()  # its cache state is unknown after a failure: drop it (frees blocks)
        except Exception:  # noqa: BLE001 - best effort; the drafter is not used again in this request
            pass
        rest = f"with {', '.join(self.candidates)}" if self.candidates else "with plain decoding"
        if is_out_of_memory(error):
            self.spec.disable(name, f"it ran out of memory ({describe_error(error)})")
            if self.target.runner.device.type == "cuda":
                torch.cuda.empty_cache()
            return (
                f"The {name} drafter ran out of memory ({describe_error(error)}); it is switched off until the pair "
                f"is loaded again, continuing {rest}."
            )
        return f"The {name} drafter failed ({describe_error(error)}); continuing without it ({rest})."

    def _final(self, event: StepEvent | None, reason: FinishReason, message: str | None) -> StepEvent:
        """Close the request: ``event`` (the last step's, or None for an empty closing event) gets the finish
        reason, the request's totals and any text held back for a stop string that never completed."""
        if event is None:
            event = StepEvent.empty(self._idle_state(), self.drafter_used)
        elif reason != "stop" and event.token_texts:
            tail = self.detok.flush()
            event.token_texts[-1] += tail
            event.text += tail
        policies = list(self.policies.values())
        if len(policies) == 1:
            self.stats.set_policy(policies[0].expected_speedup(), policies[0].estimates())
        event.finish_reason, event.stats = reason, self._report()
        event.message = " ".join(m for m in (event.message, message) if m) or None
        return event
