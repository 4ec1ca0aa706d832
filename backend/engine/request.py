"""One request's decoding loop: prefill, then steps of propose -> verify -> commit, yielding StepEvents.

Split from engine.py (which owns models, caches, conversations and the lock) so that each stays readable.
Invariants between steps: ``conv.cached`` lists exactly the token ids whose K/V are committed in
``conv.seq``; ``pending`` is the last emitted token, not yet in the cache; ``context`` is the prompt plus
every emitted token (the drafters' view of the conversation).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from specchat.backend.api import (
    DEFAULT_MAX_NEW_TOKENS,
    PREFILL_CHUNK,
    FinishReason,
    Gamma,
    PolicyState,
    RequestStats,
    SamplingParams,
    StepEvent,
    TokenSource,
    check_sampling_value,
)
from specchat.backend.engine.detokenize import IncrementalDetokenizer
from specchat.backend.engine.runner import ModelRunner
from specchat.backend.errors import InsufficientMemoryError, KVCacheFullError
from specchat.backend.kv.kv_cache import Sequence
from specchat.backend.spec.drafters.base import Draft, Drafter
from specchat.backend.spec.policy import GammaPolicy
from specchat.backend.spec.sampling import apply_repetition_penalty, logits_to_probs, make_generator, sample
from specchat.backend.spec.stats import SpecStats
from specchat.backend.spec.verify import VerifyResult, verify_greedy, verify_sampling


@dataclass
class Conversation:
    """A cache slot: the sequence, the token ids whose K/V it holds, and how many old messages were dropped."""

    seq: Sequence
    cached: list[int] = field(default_factory=list)  # token ids whose K/V are committed in seq
    dropped: int = 0  # oldest messages left out to fit the context (kept stable across turns)


@dataclass(frozen=True)
class Speculation:
    """What a request uses of the engine's speculation parts (the engine keeps them between requests)."""

    drafters: Mapping[str, Drafter]
    policies: Mapping[str, GammaPolicy]  # learned costs and acceptance, shared by "auto" requests
    disabled: Mapping[str, str]  # drafter -> why it is off for the engine's life (out of memory)
    disable: Callable[[str, str], None]  # switch a drafter off for the engine's life, with the reason


@dataclass(frozen=True)
class Target:
    """The target model as a request sees it: its runner, and what decides where a reply ends."""

    runner: ModelRunner
    tokenizer: Any
    eos_ids: frozenset[int]
    vocab_limit: int  # p and q are compared over the tokenizer's ids only
    context_length: int


def is_out_of_memory(error: BaseException) -> bool:
    """CUDA/host allocation failures (torch raises OutOfMemoryError, or RuntimeError on some paths)."""
    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):
        return True
    return isinstance(error, RuntimeError) and "out of memory" in str(error).lower()


def _describe(error: BaseException) -> str:
    detail = str(error).splitlines()[0] if str(error) else ""
    return f"{type(error).__name__}: {detail}" if detail else type(error).__name__


@dataclass(slots=True, frozen=True)
class Sampling:
    temperature: float
    top_k: int | None
    top_p: float | None
    repetition_penalty: float | None
    max_new_tokens: int
    seed: int | None
    stop: tuple[str, ...]

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0


def resolve_sampling(params: SamplingParams, pair, generation_config: dict) -> Sampling:
    """Request settings, else the pair's defaults, else the model's generation_config; validated."""
    defaults = dict(pair.sampling or {})

    def pick(name: str, fallback):
        value = getattr(params, name)
        if value is None:
            value = defaults.get(name, generation_config.get(name, fallback))
        return value

    do_sample = generation_config.get("do_sample", False)
    temperature = pick("temperature", 0.7 if do_sample else 0.0)
    top_k, top_p = pick("top_k", None), pick("top_p", None)
    penalty = pick("repetition_penalty", None)
    max_new = params.max_new_tokens if params.max_new_tokens is not None else defaults.get(
        "max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    for name, value in (("temperature", temperature), ("top_k", top_k), ("top_p", top_p),
                        ("repetition_penalty", penalty), ("max_new_tokens", max_new)):
        check_sampling_value(name, value)  # the pair's and the model's defaults pass the request's limits too
    return Sampling(float(temperature), top_k or None, top_p if top_p and top_p < 1 else None,
                    penalty if penalty and penalty != 1 else None, max_new, params.seed, tuple(params.stop))


class RequestState:
    """The mutable state of one request; :meth:`run` is the generator the engine yields from."""

    def __init__(self, target: Target, spec: Speculation, conv: Conversation, prompt: list[int],
                 sampling: Sampling, drafter: str, gamma: Gamma, cancel: threading.Event, t_start: float) -> None:
        self.target, self.spec, self.conv, self.prompt, self.s = target, spec, conv, prompt, sampling
        self.cancel, self.t_start = cancel, t_start
        self.generator = make_generator(sampling.seed, target.runner.device)
        self.context: list[int] = list(prompt)
        self.produced = 0
        self.detok = IncrementalDetokenizer(target.tokenizer, sampling.stop, prompt_tail=prompt)
        self.stats = SpecStats(t0=t_start)  # wall time counts from the request, prompt rendering included
        if drafter == "none":
            self.candidates: list[str] = []
        elif drafter == "auto":
            self.candidates = list(spec.drafters)
        else:
            self.candidates = [drafter]
        self.fixed = gamma if isinstance(gamma, int) else None
        # A fixed γ gets a fresh policy that never pauses; "auto" shares the engine's learned one.
        self.policies = {n: GammaPolicy(fixed_gamma=self.fixed, max_gamma=max(self.fixed, 1)) if self.fixed
                         else spec.policies[n] for n in self.candidates}
        for name in self.candidates:
            drafter_obj = spec.drafters[name]
            drafter_obj.reset()
            drafter_obj.configure(temperature=sampling.temperature, top_k=sampling.top_k, top_p=sampling.top_p,
                                  generator=self.generator)
        self.notices: list[str] = []
        for name in [n for n in self.candidates if n in spec.disabled]:
            self.candidates.remove(name)  # switched off by an earlier failure (out of memory): say so each time
            self.notices.append(f"The {name} drafter is off since {spec.disabled[name]}; decoding without it.")
        self.drafter_used = self.candidates[0] if len(self.candidates) == 1 else ("none" if not self.candidates
                                                                                    else "auto")

    # -- logits -> tokens -------------------------------------------------------------------------------

    def _target_logits(self, ids: list[int]) -> torch.Tensor:
        runner = self.target.runner
        try:
            logits = runner.forward(self.conv.seq, ids, logits_to_keep=len(ids))
        except BaseException as error:
            # Nothing of this pass was committed: give back the blocks it reserved, keep the history intact.
            self.conv.seq.truncate(self.conv.seq.length)
            if not is_out_of_memory(error):
                raise
            if runner.device.type == "cuda":
                torch.cuda.empty_cache()
            raise InsufficientMemoryError(
                f"the target model {runner.loaded.spec.source} ran out of memory on {runner.device} while "
                f"generating ({_describe(error)}); the reply was stopped. Retry with a lower max_new_tokens or a "
                "new conversation, or choose a smaller context_length, a quantized or smaller pair "
                "(`specchat models`)") from error
        logits = logits[:, : self.target.vocab_limit].float()  # [n, V] over the tokenizer's ids only
        if self.s.repetition_penalty:
            logits = apply_repetition_penalty(logits, self.context[: len(self.context) - len(ids) + 1],
                                              self.s.repetition_penalty, draft_ids=ids[1:])
        return logits

    def _sample_plain(self, logits: torch.Tensor) -> int:  # logits [1, V]
        if self.s.greedy:
            return int(logits[0].argmax())
        probs = logits_to_probs(logits, temperature=self.s.temperature, top_k=self.s.top_k, top_p=self.s.top_p)
        return int(sample(probs, self.generator)[0])

    def _verify(self, logits: torch.Tensor, draft: Draft) -> VerifyResult:  # logits [γ+1, V]
        if self.s.greedy:
            return verify_greedy(logits, draft.token_ids)
        probs = logits_to_probs(logits, temperature=self.s.temperature, top_k=self.s.top_k, top_p=self.s.top_p)
        return verify_sampling(probs, draft.token_ids, draft.probs, self.generator)

    # -- the loop ---------------------------------------------------------------------------------------

    def _choose(self) -> tuple[str | None, int]:
        """The drafter and γ for the next step (None, 0: a plain step)."""
        best, best_gamma, best_speedup = None, 0, -1.0
        for name in self.candidates:
            policy = self.policies[name]
            gamma = policy.choose()
            if gamma <= 0:
                continue
            speedup = policy.expected_speedup(gamma) or 0.0
            if speedup > best_speedup:
                best, best_gamma, best_speedup = name, gamma, speedup
        return best, best_gamma

    def _event(self, tokens: list[int], sources: list[TokenSource], *, gamma: int, accepted: int, draft_s: float,
               verify_s: float, t_step: float, policy: PolicyState, drafter: str, is_prefill: bool = False,
               prefill_tokens: int = 0, message: str | None = None) -> StepEvent:
        texts = [self.detok.push(t) if t not in self.target.eos_ids else "" for t in tokens]
        return StepEvent(token_ids=tokens, sources=sources, token_texts=texts, text="".join(texts), gamma=gamma,
                         accepted=accepted, draft_s=draft_s, verify_s=verify_s,
                         overhead_s=max(time.perf_counter() - t_step - draft_s - verify_s, 0.0), policy=policy,
                         drafter=drafter, is_prefill=is_prefill, prefill_tokens=prefill_tokens, message=message)

    def _report(self) -> RequestStats:
        return self.stats.report(prompt_tokens=len(self.prompt),
                                 drafter=self.drafter_used if self.drafter_used != "auto" else "none")

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
        todo = self.prompt[len(conv.cached):]
        logits = None
        for start in range(0, len(todo), PREFILL_CHUNK):
            if self.cancel.is_set():
                yield self._final(None, "cancelled", None)
                return
            if prefill_progress:  # not a step: no tokens, no statistics (backend/api.py, StepEvent)
                yield StepEvent(token_ids=[], sources=[], token_texts=[], text="", gamma=0, accepted=0, draft_s=0.0,
                                verify_s=0.0, overhead_s=0.0, policy=PolicyState.OFF, drafter=self.drafter_used,
                                prefill_tokens=len(todo), prefill_done=start)
                if self.cancel.is_set():
                    yield self._final(None, "cancelled", None)
                    return
            chunk = todo[start:start + PREFILL_CHUNK]
            self.context = self.prompt[: len(conv.cached) + len(chunk)]
            logits = self._target_logits(chunk)[-1:]
            conv.seq.commit(len(chunk))
            conv.cached.extend(chunk)
        prefill_s = time.perf_counter() - t0
        if logits is None:  # the engine always leaves at least the prompt's last token to prefill
            raise RuntimeError("prefill fed no token: the conversation's cache holds the whole prompt")
        pending = self._sample_plain(logits)
        self.context = list(self.prompt) + [pending]
        self.produced = 1
        policy_state = PolicyState.SPECULATING if self.candidates else PolicyState.OFF
        self.stats.observe_prefill(tokens=len(todo), seconds=prefill_s, policy=policy_state)
        event = self._event([pending], [TokenSource.TARGET], gamma=0, accepted=0, draft_s=0.0, verify_s=prefill_s,
                            t_step=t0, policy=policy_state, drafter=self.drafter_used, is_prefill=True,
                            prefill_tokens=len(todo),
                            message=" ".join(m for m in (notice, *self.notices) if m) or None)
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

    def _step(self, pending: int) -> tuple[int, StepEvent]:
        conv = self.conv
        t_step = time.perf_counter()
        room = self.target.context_length - conv.seq.length - 1  # positions left after the pending token
        cap = min(self.s.max_new_tokens - self.produced, room) - 1  # γ that cannot overshoot either limit
        name, gamma = self._choose() if cap > 0 else (None, 0)
        gamma = min(gamma, cap)
        draft, message = None, None
        if name is not None and gamma > 0:
            try:
                draft = self.spec.drafters[name].propose(self.context, gamma)
            except Exception as error:  # a failing drafter must not end the reply: continue without it
                message = self._drop_drafter(name, error)
                name, draft = None, None
        draft_s = time.perf_counter() - t_step
        draft_ids = list(draft.token_ids[:gamma]) if draft is not None else []
        t_verify = time.perf_counter()
        try:
            logits = self._target_logits([pending] + draft_ids)  # [1 + k, V]
        except KVCacheFullError:
            if not draft_ids:
                raise
            # No room for the draft: the last few positions are still worth a plain step each.
            name, draft, draft_ids = None, None, []
            logits = self._target_logits([pending])
        verify_s = time.perf_counter() - t_verify
        if draft_ids:
            result = self._verify(logits, draft)
        else:
            result = VerifyResult(tokens=[self._sample_plain(logits[-1:])], sources=[TokenSource.TARGET], accepted=0)
        conv.seq.commit(1 + result.accepted)
        conv.cached.extend([pending] + draft_ids[: result.accepted])
        tokens, sources = list(result.tokens), list(result.sources)
        for i, token in enumerate(tokens):  # nothing after an EOS, nothing past max_new_tokens
            if token in self.target.eos_ids or self.produced + i + 1 >= self.s.max_new_tokens:
                tokens, sources = tokens[: i + 1], sources[: i + 1]
                break
        self.produced += len(tokens)
        self.context.extend(tokens)
        if name is not None:
            self.policies[name].observe(gamma=gamma, proposed=len(draft_ids), accepted=result.accepted,
                                        draft_s=draft_s, verify_s=verify_s)
            if name in self.candidates:
                self.spec.drafters[name].observe(result.accepted)
        elif self.candidates:  # a paused step measures T_target(1) for every candidate's policy
            for policy in self.policies.values():
                policy.observe(gamma=0, proposed=0, accepted=0, draft_s=0.0, verify_s=verify_s)
        paused = bool(self.candidates) and name is None
        state = (PolicyState.SPECULATING if name is not None
                 else PolicyState.PAUSED if paused else PolicyState.OFF)
        event = self._event(tokens, sources, gamma=len(draft_ids), accepted=result.accepted, draft_s=draft_s,
                            verify_s=verify_s, t_step=t_step, policy=state, drafter=name or self.drafter_used,
                            message=message)
        self.stats.observe_step(drafter=name or self.drafter_used, gamma=len(draft_ids), accepted=result.accepted,
                                emitted=len(tokens), policy=state, draft_s=draft_s, verify_s=verify_s,
                                overhead_s=event.overhead_s)
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
            self.spec.disable(name, f"it ran out of memory ({_describe(error)})")
            if self.target.runner.device.type == "cuda":
                torch.cuda.empty_cache()
            return (f"The {name} drafter ran out of memory ({_describe(error)}); it is switched off until the pair "
                    f"is loaded again, continuing {rest}.")
        return f"The {name} drafter failed ({_describe(error)}); continuing without it ({rest})."

    def _final(self, event: StepEvent | None, reason: FinishReason, message: str | None) -> StepEvent:
        """Close the request: ``event`` (the last step's, or None for an empty closing event) gets the finish
        reason, the request's totals and any text held back for a stop string that never completed."""
        if event is None:
            event = StepEvent(token_ids=[], sources=[], token_texts=[], text="", gamma=0, accepted=0,
                              draft_s=0.0, verify_s=0.0, overhead_s=0.0,
                              policy=PolicyState.SPECULATING if self.candidates else PolicyState.OFF,
                              drafter=self.drafter_used)
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
