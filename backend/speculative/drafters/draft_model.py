"""A small draft model with its own paged KV cache, drafting with the target's own noise (coupled drafts).

Contract: ``propose(context, k)`` returns up to ``k`` tokens continuing ``context`` (all token ids so far, the
target's pending token included). Each is chosen by :func:`~specchat.backend.speculative.sampling.pick` under the
request's rule, on the draft's logits after the same repetition penalty (the context plus the tokens drafted
before it), temperature, top-k and top-p as the target's, at its reply position: greedy drafts take the
argmax, sampled ones use the Gumbel noise the target will use at that position. A drafted token is then
accepted exactly when the draft's and the target's perturbed argmaxes agree, which happens with probability
at least (1 - TV)/(1 + TV) per token (TV between the two processed distributions), against 1 - TV for
rejection sampling and Σ q·p for an independent draft. Drafting stops at EOS.

Cache: kept across requests (a conversation's next turn reuses it) and synced to each context by common
prefix: truncated to the longest common prefix of what it holds and the new context (a pointer move, no copy),
then only the missing ids are fed, in chunks of :data:`~specchat.backend.limits.PREFILL_CHUNK` with one logits row
kept. Each :class:`~specchat.backend.speculative.drafters.base.Draft` says how many context ids were fed and reused.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from specchat.backend.kv.kv_cache import PagedKVCache, common_prefix_len
from specchat.backend.kv.kv_cache import Sequence as CacheSequence
from specchat.backend.limits import PREFILL_CHUNK
from specchat.backend.speculative.drafters.base import Draft
from specchat.backend.speculative.sampling import GREEDY, SamplingRule, SeenIds, apply_repetition_penalty, pick

Forward = Callable[..., Any]  # (seq, ids, *, logits_to_keep) -> a Pass (.logits [logits_to_keep, V]): the runner's


class DraftModelDrafter:
    """``forward`` is the draft model's runner (``backend/engine/runner.py``), over ``cache``."""

    name = "draft-model"

    def __init__(
        self,
        forward: Forward,
        cache: PagedKVCache,
        *,
        vocab_limit: int,
        eos_token_ids: Iterable[int],
        prefill_chunk: int = PREFILL_CHUNK,
    ) -> None:
        self.forward = forward
        self.cache = cache
        self.vocab_limit = vocab_limit  # the tokenizer's ids: the draft picks among the target's ids only
        self.eos = frozenset(eos_token_ids)
        self.prefill_chunk = prefill_chunk
        self.seq: CacheSequence = cache.new_sequence()
        self.cached: list[int] = []  # token ids whose K/V are in self.seq
        self.rule: SamplingRule = GREEDY
        self.reply_start = 0
        self.seen = SeenIds(cache.device)  # the penalty's context: the ids of the last context proposed from

    def configure(self, rule: SamplingRule, reply_start: int) -> None:
        """Per request: draft with the target's rule (settings, penalty, seed); the reply starts at context
        index ``reply_start``."""
        self.rule, self.reply_start = rule, reply_start

    def reset(self) -> None:
        self.seq.truncate(0)
        self.cached = []
        self.seen.clear()

    def release(self) -> None:
        self.seq.free()
        self.cached = []
        self.seen.clear()

    def observe(self, num_accepted: int) -> None:
        """Nothing to learn: the next propose() rolls the cache back to the accepted prefix."""

    taps: tuple[int, ...] = ()  # reads ids only

    def observe_hidden(self, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        """Reads no hidden states of the target."""

    def features_for(self, ids: Sequence[int]) -> int:
        return len(ids)

    def _forward(self, ids: list[int]) -> torch.Tensor:  # [1, vocab_limit] the last id's logits
        logits: torch.Tensor = self.forward(self.seq, ids, logits_to_keep=1).logits  # [1, V_draft]
        self.seq.commit(len(ids))
        self.cached.extend(ids)
        return logits[:, : self.vocab_limit]

    def _sync(self, context: Sequence[int]) -> tuple[torch.Tensor, int, int]:
        """Bring the cache to ``context`` minus nothing: the logits after its last id, ids fed and reused."""
        n = len(self.cached)
        if len(context) > n and list(context[:n]) == self.cached:
            keep = n  # the usual step: the context only grew
        else:
            keep = min(common_prefix_len(self.cached, context), len(context) - 1)  # feed at least one id
            self.seq.truncate(keep)
            del self.cached[keep:]
        todo = list(context[keep:])
        logits = None
        for start in range(0, len(todo), self.prefill_chunk):
            logits = self._forward(todo[start : start + self.prefill_chunk])
        assert logits is not None  # todo is never empty: keep <= len(context) - 1
        return logits, len(todo), keep

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or not context:
            return Draft(token_ids=[])
        logits, fed, reused = self._sync(context)
        rule = self.rule
        if rule.repetition_penalty:
            self.seen.sync(context)
        position = len(context) - self.reply_start  # the reply position of the first drafted token
        tokens: list[int] = []
        for i in range(max_tokens):
            row = logits.float()
            if rule.repetition_penalty:
                seen = self.seen.tensor()
                if tokens:
                    seen = torch.cat([seen, torch.tensor(tokens, dtype=torch.long, device=seen.device)])
                row = apply_repetition_penalty(row, seen, rule.repetition_penalty)
            token = pick(row, rule, [position + i])[0]
            tokens.append(token)
            if token in self.eos or i == max_tokens - 1:
                break
            logits = self._forward([token])
        return Draft(token_ids=tokens, prefilled=fed, reused=reused)
