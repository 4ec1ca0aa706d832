"""A batch's streams as the engine's request code sees them (backend/engine/batch.py): each its own drafters and
:class:`~specchat.backend.speculative.batch_policy.BatchPolicy` per drafter, and what each offers the γ
allocation. Nothing of one stream's drafting state is another's, so its reply is its solo run's."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING, Any

from specchat.backend.api import GenerationRequest
from specchat.backend.engine.parts import Lane
from specchat.backend.engine.resolve import resolve_sampling
from specchat.backend.errors import RequestError
from specchat.backend.limits import MAX_GAMMA
from specchat.backend.speculative.batch_policy import BatchPolicy, Offer, PassCost
from specchat.backend.speculative.drafters.base import Drafter
from specchat.backend.speculative.drafters.draft_model import DraftModelDrafter
from specchat.backend.speculative.drafters.prompt_lookup import PromptLookupDrafter
from specchat.backend.speculative.drafters.suffix import ReplyMemory, SuffixDrafter
from specchat.backend.speculative.heads.drafter import head_drafter

if TYPE_CHECKING:
    from specchat.backend.engine.engine import Engine

# The longest draft the allocation weighs for a stream that shares its pass: past a few positions α̂_k is the
# neighbours' (shrunk) value, and on a 2-core CPU longer drafts in a shared pass cost more than they returned
# (benchmarks/RESULTS.md, "Continuous batching").
BATCH_MAX_GAMMA = 4


def stream_drafters(engine: Engine, memory: ReplyMemory) -> dict[str, Drafter]:
    """Drafters of the engine's kinds for one stream, with nothing of another request in them (the suffix
    drafter reads ``memory``); :func:`release_lane` resets them (the draft model's blocks go back)."""
    drafters: dict[str, Drafter] = {
        "prompt-lookup": PromptLookupDrafter(eos_token_ids=engine.eos_ids),
        "suffix": SuffixDrafter(memory=memory, eos_token_ids=engine.eos_ids),
    }
    if engine.draft_runner is not None:
        drafters["draft-model"] = DraftModelDrafter(
            engine.draft_runner.forward,
            engine.draft_runner.cache,
            vocab_limit=engine.vocab_limit,
            eos_token_ids=engine.eos_ids,
        )
    if engine.head is not None:
        head, embedding = engine.head, engine.target.model.get_input_embeddings()
        drafters[head.drafter] = head_drafter(head.drafter, head.module, head.taps, embedding, engine.eos_ids)
    return drafters


def lane_for(engine: Engine, runner: Any, cost: PassCost, *, share: bool = False) -> Lane:
    """A new stream's lane: ``runner`` its passes' runner; its policies start from the batch's measured pass
    times ``cost``; ``share``: its suffix drafter reads the engine's memory of replies (the operator's opt-in to
    sharing), else one of its own."""
    drafters = stream_drafters(engine, engine.reply_memory if share else ReplyMemory())
    policies = {name: BatchPolicy(max_gamma=MAX_GAMMA) for name in drafters}
    for policy in policies.values():
        policy.learn_costs(cost)
    return Lane(runner, drafters, policies)


def kv_need(engine: Engine, request: GenerationRequest) -> int:
    """Tokens of K/V a request may come to (its prompt, its reply and a verification step): what a batch checks
    is free before admitting it; 0 for an invalid request (it fails with its own error once it runs)."""
    try:
        prompt, _ = engine._prompt_ids(request, None, engine.context_length - 1)
        sampling = resolve_sampling(request.sampling, engine.pair, engine.target.generation_config)
    except RequestError:
        return 0
    return min(len(prompt) + sampling.max_new_tokens, engine.context_length) + MAX_GAMMA + 2


def release_lane(lane: Lane | None) -> None:
    if lane is None:
        return
    for drafter in lane.drafters.values():
        try:
            drafter.reset()
        except Exception:  # noqa: BLE001 - best effort: the stream has ended either way
            pass


def lane_rows(streams: Iterable[Any], one_row_s: float) -> tuple[int, list[Offer], list[Lane]]:
    """What the next pass holds before any draft the allocation gives (one row per decoding stream, plus the
    drafts of streams whose γ is fixed), and the offers of the streams whose γ the batch chooses, with their
    lanes. A prefilling stream's rows are its prompt piece (the scheduler adds it)."""
    base, offers, lanes = 0, [], []
    for stream in streams:
        lane, ticket = stream.lane, stream.ticket
        state = lane.state if lane is not None else None
        if state is None or ticket is None or ticket.prefill:
            continue
        base += 1
        proposer = state.proposer
        policies = [proposer.policies[n] for n in proposer.candidates]
        if proposer.prediction is not None or not policies or not all(isinstance(p, BatchPolicy) for p in policies):
            base += max((p.fixed_gamma or 0 for p in policies), default=0)  # a fixed γ: its rows as asked
            continue
        best = max(
            (p.offer(BATCH_MAX_GAMMA, one_row_s) for p in policies if isinstance(p, BatchPolicy)),
            key=lambda o: o.expected[-1],
        )
        offers.append(best)
        lanes.append(lane)
    return base, offers, lanes
