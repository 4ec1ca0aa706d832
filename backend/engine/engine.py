"""The decoding engine: a loaded pair, its drafters and policies, conversations and caches.

Contract: :meth:`Engine.generate` is a generator yielding one :class:`StepEvent` per target forward pass
(the first after prefill). The engine has one owner at a time: a second ``generate`` waits on a lock until
the first has ended (many replies at once: ``batch.py``); cancellation (``cancel.set()``) is cooperative and
takes effect between steps. A reply's steps are ``request.py``'s: plan, one target pass, finish.
"""

from __future__ import annotations

import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

import torch

from specchat.backend.api import GenerationRequest, StepEvent
from specchat.backend.engine import upgrade
from specchat.backend.engine.heap import settle_heap as settle_heap
from specchat.backend.engine.heap import start_heap as start_heap
from specchat.backend.engine.parts import Conversation, Lane, Speculation, Target
from specchat.backend.engine.prefix_cache import PrefixCache
from specchat.backend.engine.prompting import prompt_ids
from specchat.backend.engine.request import RequestState
from specchat.backend.engine.resolve import resolve_sampling
from specchat.backend.engine.runner import ModelRunner
from specchat.backend.engine.threads import ThreadGovernor, in_a_thread_of_its_own
from specchat.backend.errors import RequestError
from specchat.backend.kv import attention
from specchat.backend.kv.kv_cache import PagedKVCache, common_prefix_len, kv_bytes_per_token
from specchat.backend.limits import HEAD_DRAFTERS, KV_BLOCK_SIZE, MAX_GAMMA, MAX_PREDICTION_GAMMA, check_gamma
from specchat.backend.models.catalog.config import PairConfig
from specchat.backend.models.loading.capture import Progress, user_callback
from specchat.backend.models.loading.head_loading import LoadedHead, plan_pair_head
from specchat.backend.models.loading.pair import ConfirmDownload, LoadedModel
from specchat.backend.models.tokenizing.chat_format import plain_completion_note, stop_ids
from specchat.backend.speculative.constraint import constraint_for
from specchat.backend.speculative.drafters.base import Drafter
from specchat.backend.speculative.drafters.draft_model import DraftModelDrafter
from specchat.backend.speculative.drafters.prediction import PredictionDrafter
from specchat.backend.speculative.drafters.prompt_lookup import PromptLookupDrafter
from specchat.backend.speculative.drafters.suffix import ReplyMemory, SuffixDrafter
from specchat.backend.speculative.heads.drafter import head_drafter
from specchat.backend.speculative.policy import GammaPolicy


def _eos_ids(loaded: LoadedModel) -> frozenset[int]:
    """Where a reply stops: eos and the end-of-turn tokens the chat template writes (``chat_format.stop_ids``)."""
    return stop_ids(loaded.tokenizer, loaded.generation_config)


class Engine:
    """Target (+ optional draft model) with their paged caches, for one process. ``target`` and ``draft`` are
    loaded models; each gets a :class:`ModelRunner` (paged attention, its cache, the device's fast path).
    ``kv_tokens`` sizes each pool (default: the pair's context length plus room for one verification step).
    ``prefix_cache_bytes``: the K/V memory the target's pool holds on top of that for prompts kept across requests
    (``GenerationRequest.prefix_cache``; `specchat serve`); 0 keeps none. ``parallel``: the streams a batch
    (backend/engine/batch.py) may run at once; the pools hold that many.
    """

    def __init__(
        self,
        target: LoadedModel,
        draft: LoadedModel | None,
        pair: PairConfig,
        *,
        kv_tokens: int | None = None,
        head: LoadedHead | None = None,
        prefix_cache_bytes: int = 0,
        parallel: int = 1,
    ) -> None:
        self.pair = pair
        self.tokenizer = target.tokenizer
        self.context_length = pair.context_length
        self.vocab_limit = len(self.tokenizer)  # p and q are compared over the tokenizer's ids only
        self.eos_ids = _eos_ids(target)
        self.parallel = max(int(parallel), 1)  # streams a batch scheduler may run at once (backend/engine/batch.py)
        # Each stream may reach the whole context (pages take memory only where written: kv_cache.lazy_zeros).
        self.stream_tokens = kv_tokens or self.context_length + MAX_GAMMA + 2
        self.prefix_cache_bytes = prefix_cache_bytes
        self._conversations: OrderedDict[str, Conversation] = OrderedDict()
        self._lock = threading.Lock()
        # Earlier replies the suffix drafter matches against (bounded; empty when history is off).
        self.reply_memory = ReplyMemory()
        self.remember_replies = True
        self.drafters: dict[str, Drafter] = {
            "prompt-lookup": PromptLookupDrafter(eos_token_ids=self.eos_ids),
            "suffix": SuffixDrafter(memory=self.reply_memory, eos_token_ids=self.eos_ids),
        }
        self.head: LoadedHead | None = None
        self._runners(target, draft)
        self.disabled_drafters: dict[str, str] = {}  # drafter -> why it was switched off (out of memory)
        if head is not None:
            self.attach_head(head)
        # On CPU: the compute threads follow what other programs leave free (backend/engine/threads.py).
        self.threads = ThreadGovernor() if target.device.type == "cpu" else None
        self.trace: Callable[[range | list[int], torch.Tensor], None] | None = None  # parts.Target.trace

    def _runners(self, target: LoadedModel, draft: LoadedModel | None) -> None:
        """The models' runners and caches, the draft model's drafter, fresh γ policies."""
        self.target, self.draft, tokens = target, draft, self.stream_tokens
        block = kv_bytes_per_token(target.model.config, target.dtype) * KV_BLOCK_SIZE
        prefix_blocks, others = max(self.prefix_cache_bytes, 0) // block, (self.parallel - 1) * tokens
        self.runner = ModelRunner(target, kv_tokens=tokens, kept_tokens=others + prefix_blocks * KV_BLOCK_SIZE)
        self.cache = self.runner.cache
        self.prefix = PrefixCache(self.cache, prefix_blocks)
        self.draft_runner: ModelRunner | None = None
        if draft is not None:
            self.draft_runner = ModelRunner(draft, kv_tokens=tokens, kept_tokens=others)
            self.drafters["draft-model"] = DraftModelDrafter(
                self.draft_runner.forward,
                self.draft_runner.cache,
                vocab_limit=self.vocab_limit,
                eos_token_ids=self.eos_ids,
                prefill_chunk=self.draft_runner.prefill_chunk,
            )
        # Measured costs and acceptance outlive a request: the next reply starts from what was learned.
        self.policies: dict[str, GammaPolicy] = {n: GammaPolicy(max_gamma=MAX_GAMMA) for n in self.drafters}

    def use_models(self, target: LoadedModel, draft: LoadedModel | None) -> None:
        """From the next reply on, ``target`` and ``draft`` (the same specs on another path: upgrade.py), lock held."""
        self._release()  # cached conversations and prefix entries go: another path's K/V
        self._runners(target, draft)
        if self.head is not None:
            self._attach(self.head)

    @property
    def start_line(self) -> str:
        """How the target (and the draft model) run, in one line: the forward path, and why the CPU native model
        does not run where it does not (what the UI, ``generate`` and ``serve`` show)."""
        line = self.runner.start_line
        if self.draft_runner is not None:
            line += f"; draft: {self.draft_runner.start_line}"
        return line

    @property
    def fallback_reason(self) -> str | None:
        """Why the CPU native model does not run the target (None where it does, or on CUDA)."""
        return self.target.native_reason

    def attach_head(self, head: LoadedHead) -> None:
        """Draft with ``head`` from the next request on (drafter ``head.drafter``; ``auto`` may pick it). Its passes
        return taps from then on (``ModelRunner.require_taps``), so cached conversations, whose K/V another path
        may have computed, are dropped."""
        with self._lock:
            self._attach(head)

    def _attach(self, head: LoadedHead) -> None:
        self.head = head
        embedding = self.target.model.get_input_embeddings()
        self.drafters[head.drafter] = head_drafter(head.drafter, head.module, head.taps, embedding, self.eos_ids)
        self.policies[head.drafter] = GammaPolicy(max_gamma=MAX_GAMMA)
        self.disabled_drafters.pop(head.drafter, None)
        if self.runner.require_taps():
            for conv in self._conversations.values():
                conv.seq.free()
            self._conversations.clear()
            self.prefix.clear()

    @property
    def draft_cache(self) -> PagedKVCache | None:
        return self.draft_runner.cache if self.draft_runner is not None else None

    # -- public API -------------------------------------------------------------------------------------

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[StepEvent]:
        """Stream one reply. Raises RequestError for invalid requests before anything is computed."""
        with self._lock:
            upgrade.between_replies(self)  # the native model, once the kernels built in the background are ready
            yield from self._generate(request, cancel or threading.Event())

    def forget(self, conversation: str) -> None:
        with self._lock:
            conv = self._conversations.pop(conversation, None)
            if conv is not None:
                conv.seq.free()

    def close(self) -> None:
        with self._lock:
            self._release()

    def _release(self) -> None:
        for conv in self._conversations.values():
            conv.seq.free()
        self._conversations.clear()
        self.prefix.clear()
        for drafter in self.drafters.values():
            drafter.reset()  # the draft model's cache blocks go back too
        for runner in filter(None, (self.runner, self.draft_runner)):
            runner.close()  # frees the CUDA graphs' memory pool

    def forget_requests(self) -> None:
        """Forget what earlier requests taught the engine, so the next reply depends on nothing but its own
        request: the suffix drafter's memory of replies, the γ policies' acceptance estimates (their measured
        pass costs, a property of the machine, are kept), the drafters' state (the draft model's cached
        context) and cached conversations. `specchat serve` calls it before each request unless the operator
        opts in to sharing (one client's requests must not shape, nor show in, another's reply). The prefix cache
        stays: its entries are kept per scope (a client) and only the requests of that scope read them."""
        with self._lock:
            self.reply_memory.clear()
            for policy in self.policies.values():
                policy.reset()
            for drafter in self.drafters.values():
                drafter.reset()
            for conv in self._conversations.values():
                conv.seq.free()
            self._conversations.clear()

    def use_reply_memory(self, enabled: bool, replies: Iterable[str] = ()) -> int:
        """Turn the suffix drafter's memory of earlier replies on (seeded with ``replies``, oldest first: the
        local chat history) or off (emptied; finished replies are not kept: ``--no-history``). Only the newest
        replies that fit the memory's bound are tokenised. Returns the tokens it holds."""
        with self._lock:
            self.reply_memory.clear()
            self.remember_replies = enabled
            if not enabled:
                return 0
            # Newest first, up to three quarters of the bound (what it keeps after dropping old replies), so
            # seeding never rebuilds the index; then remembered oldest first.
            newest: list[list[int]] = []
            budget = (self.reply_memory.max_tokens * 3) // 4
            for text in reversed(list(replies)):
                if budget <= 0:
                    break
                ids = self.tokenizer.encode(text, add_special_tokens=False)[-budget:]
                newest.append(ids)
                budget -= len(ids)
            self.reply_memory.remember_all(reversed(newest))
            return self.reply_memory.num_tokens

    def blocks_in_use(self) -> int:
        """Blocks held in the target pool (conversations and prefix-cache entries kept for reuse included)."""
        return self.cache.pool.num_used

    # -- internals --------------------------------------------------------------------------------------

    def _prompt_ids(
        self, request: GenerationRequest, conv: Conversation | None, budget: int
    ) -> tuple[list[int], str | None]:
        return prompt_ids(self.tokenizer, self.pair.name, self.context_length, request, conv, budget)

    def _conversation(self, key: str | None) -> Conversation:
        if key is None:
            return Conversation(self.cache.new_sequence())
        conv = self._conversations.get(key)
        if conv is None:
            conv = self._conversations[key] = Conversation(self.cache.new_sequence())
        self._conversations.move_to_end(key)
        return conv

    def _make_room(self, keep: Conversation, tokens: int) -> None:
        """Evict prefix-cache entries, then least recently used conversations, until ``tokens`` more fit in the
        pool."""
        needed = -(-tokens // self.cache.pool.block_size) + 1
        self.prefix.make_room(needed)
        for key in list(self._conversations):
            if self.cache.pool.num_free >= needed:
                return
            conv = self._conversations[key]
            if conv is not keep:
                conv.seq.free()
                del self._conversations[key]

    def _prediction(self, text: str | None) -> PredictionDrafter | None:
        """The request's prediction drafter (None without a prediction): its text tokenised once, its drafts at
        most the rows a pass verifies exactly on this path (``ModelRunner.exact_rows``)."""
        if text is None:
            return None
        ids = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        cap = min(MAX_PREDICTION_GAMMA, self.runner.exact_rows - 1)
        return PredictionDrafter(ids, eos_token_ids=self.eos_ids, max_tokens=cap)

    def _generate(
        self, request: GenerationRequest, cancel: threading.Event, lane: Lane | None = None
    ) -> Iterator[StepEvent]:
        """One reply, the lock held; ``lane``: a stream of a batch (its own runner, drafters, policies)."""
        t_start = time.perf_counter()
        sampling = resolve_sampling(request.sampling, self.pair, self.target.generation_config)
        drafter_name = request.drafter or self.pair.drafter
        if drafter_name == "draft-model" and "draft-model" not in self.drafters:
            raise RequestError(
                f"pair {self.pair.name!r} has no draft model; use --drafter prompt-lookup, suffix or "
                "none, or pick a pair with a draft model"
            )
        if drafter_name in HEAD_DRAFTERS and drafter_name not in self.drafters:
            raise RequestError(
                f"pair {self.pair.name!r} has no {drafter_name} head; use --drafter prompt-lookup, suffix, auto or "
                "none, or give the pair a head (models.yaml: head:, or `specchat train-head`)"
            )
        gamma = check_gamma(request.gamma if request.gamma is not None else self.pair.gamma)
        spec = request.constraint  # a schema the grammar engine refuses: RequestError before any cache is touched
        constraint = constraint_for(spec, self.tokenizer, self.vocab_limit, self.eos_ids) if spec else None
        budget = self.context_length - 1
        scope = request.prefix_cache
        if scope is not None:  # the prompt first: it picks the entry (a refused prompt touches no entry)
            prompt, notice = self._prompt_ids(request, None, budget)
            conv = self.prefix.take(scope, prompt)
        else:
            conv = self._conversation(request.conversation)
        state: RequestState | None = None
        try:
            if scope is None:
                prompt, notice = self._prompt_ids(request, conv if request.conversation else None, budget)
            keep = common_prefix_len(conv.cached, prompt)
            if keep < len(prompt) or conv.logits_after(len(prompt)) is None:
                keep = min(keep, len(prompt) - 1)  # the last prompt token's row is computed by the prefill
            for name, drafter in self.drafters.items():  # a head needs the features of every token it reads
                if drafter.taps and drafter_name in (name, "auto"):
                    keep = min(keep, drafter.features_for(prompt))
            conv.truncate(keep)
            prediction = self._prediction(request.prediction)
            spare = max(MAX_GAMMA, prediction.max_tokens if prediction is not None else 0)
            self._make_room(conv, len(prompt) - keep + sampling.max_new_tokens + spare)
            if not conv.seq.block_table:  # placed where it fits in one run: kept prompts do not split it
                expected = len(prompt) + sampling.max_new_tokens + spare
                self.prefix.make_run(-(-expected // self.cache.pool.block_size))
                conv.seq.expect(expected)
            target = Target(
                self.runner if lane is None else lane.runner,
                self.tokenizer,
                self.eos_ids,
                self.vocab_limit,
                self.context_length,
                self.threads,
                self.trace,
            )
            drafters, policies = (self.drafters, self.policies) if lane is None else (lane.drafters, lane.policies)
            speculation = Speculation(drafters, policies, self.disabled_drafters, self.disabled_drafters.__setitem__)
            state = RequestState(
                target,
                speculation,
                conv,
                prompt,
                sampling,
                drafter_name,
                gamma,
                cancel,
                t_start,
                prediction,
                constraint,
                request.logprobs,
            )
            if lane is not None:
                lane.state = state
            yield from state.run(notice, request.prefill_progress)
        finally:
            if scope is not None:
                self.prefix.put(scope, conv)
            elif request.conversation is None:
                conv.seq.free()
            if state is not None and self.remember_replies:
                self.reply_memory.remember(state.context[len(state.prompt) :])


@in_a_thread_of_its_own
def load_engine(
    pair: PairConfig,
    *,
    device: str | None = None,
    progress: Progress | None = None,
    confirm_download: ConfirmDownload | None = None,
    prefix_cache_bytes: int = 0,
    parallel: int = 1,
) -> Engine:
    """Load the pair's models (checking memory and tokenizer compatibility first) and build an engine
    (``prefix_cache_bytes``, ``parallel``: see :class:`Engine`)."""
    from specchat.backend.models.facts.memory import check_fits
    from specchat.backend.models.loading.pair import load_pair, resolve_device

    dev = resolve_device(device)
    estimate = check_fits(pair, dev)
    if not estimate.known:  # a hub model not downloaded yet: fetched (after asking) and its sizes read first
        from specchat.backend.models.hub.fetch import fetch_sources

        pair = fetch_sources(pair, progress=progress, confirm_download=confirm_download)
        check_fits(pair, dev)
    start_heap()
    plan = plan_pair_head(pair, progress, confirm_download)  # found and checked before any weights load
    # Only the name: loading registers the function with transformers where it builds a transformers model
    # (registering imports transformers' modelling code, which the light int4 model on CPU never needs).
    target, draft = load_pair(
        pair,
        dev,
        attn_implementation=attention.ATTN_IMPLEMENTATION,
        progress=progress,
        confirm_download=confirm_download,
    )
    head = None
    if plan is not None:
        from specchat.backend.models.loading.head_loading import load_planned

        head = load_planned(plan, target.model.config, dev, target_name=pair.target.source)
    engine = Engine(target, draft, pair, head=head, prefix_cache_bytes=prefix_cache_bytes, parallel=parallel)
    note = plain_completion_note(target.tokenizer)
    report = user_callback(progress)  # reaches the terminal through a caller's capture of library output
    if note is not None and report is not None:
        report(note, None)
    settle_heap()
    return engine
