"""A small draft model with its own paged KV cache.

Contract: ``propose(context, k)`` returns up to ``k`` tokens continuing ``context`` (all token ids so far,
the target's pending token included), sampled from the draft's distribution q with the request's
temperature/top-k/top-p (so acceptance stays high at temperature > 0; greedy when temperature is 0), and
their probabilities q (``[k, V]``) when sampling. The draft cache is kept in step with the target by
prefix matching: before drafting, it is truncated to the longest common prefix of what it holds and the
new context (a pointer move, no copy) and only the missing tokens are fed. Drafting stops at EOS.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from specchat.backend.kv.kv_cache import PagedKVCache, common_prefix_len
from specchat.backend.kv.kv_cache import Sequence as CacheSequence
from specchat.backend.spec.drafters.base import Draft
from specchat.backend.spec.sampling import logits_to_probs, sample

Forward = Callable[..., torch.Tensor]  # (seq, ids, *, logits_to_keep) -> [logits_to_keep, V]: the model runner's


class DraftModelDrafter:
    """``forward`` is the draft model's runner (``backend/engine/runner.py``), over ``cache``."""

    name = "draft-model"

    def __init__(self, forward: Forward, cache: PagedKVCache, *, vocab_limit: int,
                 eos_token_ids: Sequence[int]) -> None:
        self.forward = forward
        self.cache = cache
        self.vocab_limit = vocab_limit  # the tokenizer's ids: q is compared with p over these only
        self.eos = frozenset(eos_token_ids)
        self.seq: CacheSequence = cache.new_sequence()
        self.cached: list[int] = []  # token ids whose K/V are in self.seq
        self.temperature = 0.0
        self.top_k: int | None = None
        self.top_p: float | None = None
        self.generator: torch.Generator | None = None

    def configure(self, *, temperature: float, top_k: int | None, top_p: float | None,
                  generator: torch.Generator | None) -> None:
        """Per request: draft with the same sampling settings as the target (applied to q as to p)."""
        self.temperature, self.top_k, self.top_p, self.generator = temperature, top_k, top_p, generator

    def reset(self) -> None:
        self.seq.truncate(0)
        self.cached = []

    def release(self) -> None:
        self.seq.free()
        self.cached = []

    def observe(self, num_accepted: int) -> None:
        """Nothing to learn: the next propose() rolls the cache back to the accepted prefix."""

    def _forward(self, ids: list[int]) -> torch.Tensor:
        logits = self.forward(self.seq, ids, logits_to_keep=1)  # [1, V_draft]
        self.seq.commit(len(ids))
        self.cached.extend(ids)
        return logits[:, : self.vocab_limit]

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        if max_tokens <= 0 or not context:
            return Draft(token_ids=[])
        keep = common_prefix_len(self.cached, context)
        keep = min(keep, len(context) - 1)  # feed at least one token to get the next distribution
        if keep < len(self.cached):
            self.seq.truncate(keep)
            del self.cached[keep:]
        logits = self._forward(list(context[keep:]))
        tokens: list[int] = []
        probs: list[torch.Tensor] = []
        greedy = self.temperature <= 0
        for i in range(max_tokens):
            if greedy:
                token = int(logits[0].argmax())
            else:
                q = logits_to_probs(logits.float(), temperature=self.temperature, top_k=self.top_k,
                                    top_p=self.top_p)  # [1, V]
                token = int(sample(q, self.generator)[0])
                probs.append(q[0])
            tokens.append(token)
            if token in self.eos or i == max_tokens - 1:
                break
            logits = self._forward([token])
        return Draft(token_ids=tokens, probs=None if greedy else torch.stack(probs))  # [k, V]
