"""The propose phase of a request's step: which drafter speculates, with what γ, and its draft.

Contract: :class:`Proposer` holds a request's candidate drafters (``none``: no candidate; ``auto``: every drafter
the pair has; else the one named), their γ policies (a fixed γ: a fresh policy that never pauses; ``auto``: the
engine's learned ones, shared between requests) and an optional prediction (drafts first wherever it matches the
reply). :meth:`Proposer.propose` returns a :class:`Proposal` (no drafter: a plain step); :meth:`Proposer.observe`
feeds the verified outcome back to the drafter's policy. A drafter that fails is dropped from the request (out of
memory: from the engine's life) and the reply goes on without it.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from specchat.backend.api import PolicyState
from specchat.backend.engine.parts import Speculation, describe_error, is_out_of_memory
from specchat.backend.limits import Gamma
from specchat.backend.speculative.drafters.base import Draft
from specchat.backend.speculative.drafters.prediction import PredictionDrafter
from specchat.backend.speculative.policy import GammaPolicy
from specchat.backend.speculative.request_stats import SpecStats
from specchat.backend.speculative.sampling import SamplingRule


@dataclass
class Proposal:
    """A step's draft: the drafter that made it (None: a plain step), the γ its policy chose, the draft itself
    and a notice for the user (a drafter that failed)."""

    drafter: str | None = None
    gamma: int = 0
    draft: Draft | None = None
    message: str | None = None


class Proposer:
    def __init__(
        self,
        spec: Speculation,
        drafter: str,
        gamma: Gamma,
        rule: SamplingRule,
        prompt_length: int,
        stats: SpecStats,
        prediction: PredictionDrafter | None,
    ) -> None:
        self.spec, self.stats = spec, stats
        if drafter == "none":
            self.candidates: list[str] = []
        elif drafter == "auto":
            self.candidates = list(spec.drafters)
        else:
            self.candidates = [drafter]
        fixed = gamma if isinstance(gamma, int) else None
        # A fixed γ gets a fresh policy that never pauses; "auto" shares the engine's learned one.
        self.policies = {
            n: GammaPolicy(fixed_gamma=fixed, max_gamma=max(fixed, 1)) if fixed else spec.policies[n]
            for n in self.candidates
        }
        for name in self.candidates:  # drafters keep their state across requests (the draft model's cache)
            spec.drafters[name].configure(rule, prompt_length)
        self.notices: list[str] = []
        for name in [n for n in self.candidates if n in spec.disabled]:
            self.candidates.remove(name)  # switched off by an earlier failure (out of memory): say so each time
            self.notices.append(f"The {name} drafter is off since {spec.disabled[name]}; decoding without it.")
        self.drafter_used = (
            self.candidates[0] if len(self.candidates) == 1 else ("none" if not self.candidates else "auto")
        )
        # A prediction drafts first wherever it matches the reply, at its own lengths (a policy that never pauses
        # and only measures); the drafters above serve where it does not (speculative/drafters/prediction.py).
        self.prediction = prediction
        if prediction is not None:
            prediction.configure(rule, prompt_length)
            self.policies[prediction.name] = GammaPolicy(fixed_gamma=prediction.max_tokens)
            stats.prediction = (prediction.name, len(prediction.prediction))

    def ranked(self) -> list[tuple[str, int]]:
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

    def idle_state(self) -> PolicyState:
        """The state of a pass that verified no draft: OFF without drafters, PAUSED when every candidate's
        policy is paused, else NO_DRAFT."""
        if not self.candidates:
            return PolicyState.OFF if self.prediction is None else PolicyState.NO_DRAFT
        if all(self.policies[n].state is PolicyState.PAUSED for n in self.candidates):
            return PolicyState.PAUSED
        return PolicyState.NO_DRAFT

    def propose(self, context: list[int], cap: int, device: torch.device) -> Proposal:
        """The next step's proposal for ``context``, at most ``cap`` tokens. Candidates are asked in
        :meth:`ranked`'s order; one that finds nothing (no match, no features) passes the step to the next, so
        ``auto`` drafts chat with a head while prompt lookup has nothing to copy."""
        if self.prediction is not None and cap > 0:
            try:
                draft = self.prediction.propose(context, cap)
            except Exception as error:  # as any drafter's: the reply goes on without it
                self.prediction = None
                return Proposal(message=f"The prediction failed ({describe_error(error)}); continuing without it.")
            if draft.token_ids:
                return Proposal(self.prediction.name, len(draft), draft)
        ranked = self.ranked() if cap > 0 else []
        first: Proposal | None = None
        for name, gamma in ranked:
            gamma = min(gamma, cap)
            try:
                draft = self.spec.drafters[name].propose(context, gamma)
            except Exception as error:  # a failing drafter must not end the reply: continue without it
                return Proposal(message=self._drop(name, error, device))
            if draft.prefilled or draft.reused:
                self.stats.observe_draft_context(name, prefilled=draft.prefilled, reused=draft.reused)
            if draft.token_ids:
                return Proposal(name, gamma, draft)
            first = first or Proposal(name, gamma, draft)
        return first or Proposal()

    def observe(
        self,
        name: str | None,
        *,
        gamma: int,
        proposed: int,
        accepted: int,
        draft_s: float,
        verify_s: float,
        tried: int | None,
    ) -> None:
        """A verified step's outcome, to the policy of the drafter that proposed it; a plain step (``name``
        None) measures T_target(1) for every candidate's policy."""
        if name is not None:
            self.policies[name].observe(
                gamma=gamma, proposed=proposed, accepted=accepted, draft_s=draft_s, verify_s=verify_s, tried=tried
            )
            if self.prediction is not None and name == self.prediction.name:
                self.prediction.observe(accepted)
            elif name in self.candidates:
                self.spec.drafters[name].observe(accepted)
        elif self.candidates:
            for policy in self.policies.values():
                policy.observe(gamma=0, proposed=0, accepted=0, draft_s=0.0, verify_s=verify_s)

    def _drop(self, name: str, error: Exception, device: torch.device) -> str:
        """Take a failed drafter out of this request (out of memory: out of the engine's life); the message."""
        self.candidates.remove(name)
        try:
            self.spec.drafters[name].reset()  # its cache state is unknown after a failure: drop it (frees blocks)
        except Exception:  # noqa: BLE001 - best effort; the drafter is not used again in this request
            pass
        rest = f"with {', '.join(self.candidates)}" if self.candidates else "with plain decoding"
        if is_out_of_memory(error):
            self.spec.disable(name, f"it ran out of memory ({describe_error(error)})")
            if device.type == "cuda":
                torch.cuda.empty_cache()
            return (
                f"The {name} drafter ran out of memory ({describe_error(error)}); it is switched off until the pair "
                f"is loaded again, continuing {rest}."
            )
        return f"The {name} drafter failed ({describe_error(error)}); continuing without it ({rest})."
