"""Drafters on the target's own features: ``eagle3`` (EAGLE-3 head, EAGLE-2 dynamic trees) and ``medusa``.

Contract (the Drafter protocol of ``backend/speculative/drafters/base.py``): ``taps`` names the target's hidden
states the head reads; the engine hands over, after every target pass, the taps of the tokens it committed
(:meth:`observe_hidden`: context positions ``start ..``, their ids, ``[n, len(taps) * hidden]``), so the
drafter holds one feature row per committed token. ``propose(context, max_tokens)`` (the context = committed
ids + the pending token) returns a tree of at most ``max_tokens`` nodes, or nothing when it lacks the features
of a committed token (another drafter ran part of the conversation); :meth:`features_for` tells the engine how
much of a prompt it has features for, so the engine re-reads the rest (prefix reuse stops there).

EAGLE-3 keeps its own K/V of committed positions (:class:`~.eagle3.HeadCache`); the drafted nodes' K/V live
only while one tree grows. Features are kept for the whole context (a changed conversation rebuilds the head's
cache from them): 8,192 positions of the embedded default's three 576-wide taps take 57 MB in float32.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence

import torch
import torch.nn.functional as F

from specchat.backend.kv.kv_cache import common_prefix_len
from specchat.backend.speculative.drafters.base import Draft
from specchat.backend.speculative.heads import trees
from specchat.backend.speculative.heads.eagle3 import Eagle3Head, HeadCache
from specchat.backend.speculative.heads.medusa import MedusaHeads
from specchat.backend.speculative.sampling import GREEDY, SamplingRule

Embed = Callable[[torch.Tensor], torch.Tensor]  # target ids [n] -> embeddings [n, hidden]
EXTEND_CHUNK = 512  # committed positions fed to the head per step (bounds its attention scratch)


class _FeatureDrafter:
    """What both heads share: the committed ids with their feature rows, and the request's sampling rule."""

    name = "head"

    def __init__(self, taps: tuple[int, ...], width: int, device: torch.device, dtype: torch.dtype) -> None:
        self.taps = taps
        self.tokens: list[int] = []  # committed ids whose feature rows are held
        self.features = torch.empty(256, width, dtype=dtype, device=device)  # [capacity, len(taps) * hidden]
        self.rule: SamplingRule = GREEDY
        self.reply_start = 0
        self.last_tree: tuple[int, int] = (0, 0)  # (nodes, depth) of the last draft

    def configure(self, rule: SamplingRule, reply_start: int) -> None:
        self.rule, self.reply_start = rule, reply_start

    def observe(self, num_accepted: int) -> None:
        """Nothing to learn here: the features of what was accepted arrive through observe_hidden."""

    def reset(self) -> None:
        self.tokens = []

    def release(self) -> None:
        self.reset()

    def features_for(self, ids: Sequence[int]) -> int:
        """How many leading ids of ``ids`` this drafter holds features for."""
        return common_prefix_len(self.tokens, ids)

    def observe_hidden(self, start: int, token_ids: Sequence[int], hidden: torch.Tensor) -> None:
        """The taps of committed context positions ``start .. start + n - 1`` (ids ``token_ids``)."""
        if start > len(self.tokens):  # a gap: positions whose features never came; start over from here
            self.reset()
            return
        del self.tokens[start:]
        end = start + len(token_ids)
        if end > self.features.shape[0]:
            grown = self.features.new_empty(max(2 * self.features.shape[0], end), self.features.shape[1])
            grown[:start] = self.features[:start]
            self.features = grown
        self.features[start:end] = hidden.to(self.features.dtype)
        self.tokens.extend(int(t) for t in token_ids)

    def _synced(self, context: Sequence[int]) -> bool:
        """Whether every committed id of ``context`` (all but the pending last one) has its features."""
        committed = len(context) - 1
        if committed < 1 or len(self.tokens) < committed:
            return False
        if len(self.tokens) > committed or self.tokens[committed - 1] != context[committed - 1]:
            keep = common_prefix_len(self.tokens, context[:committed])
            del self.tokens[keep:]
            return keep == committed
        return True


class Eagle3Drafter(_FeatureDrafter):
    """EAGLE-3 with EAGLE-2 dynamic trees (``trees.grow``): ``top_k`` children per expanded node, at most ``depth``
    levels, the ``max_tokens`` best nodes kept."""

    name = "eagle3"

    def __init__(
        self,
        head: Eagle3Head,
        embed: Embed,
        taps: tuple[int, ...],
        *,
        eos_token_ids: Iterable[int] = (),
        top_k: int = 4,
        depth: int = 6,
    ) -> None:
        weight = head.fc.weight
        super().__init__(taps, head.fc.in_features, weight.device, weight.dtype)
        self.head, self.embed = head, embed
        self.top_k, self.depth = top_k, depth
        self.stop = frozenset(int(t) for t in eos_token_ids)
        c = head.config
        self.cache = HeadCache(c.num_kv_heads, c.head_dim, weight.dtype, weight.device)
        self.entry_ids: list[int] = []  # entry t of the cache read token t+1: its id
        self.last_out: torch.Tensor | None = None  # the output of the newest entry [hidden]

    def reset(self) -> None:
        super().reset()
        self.cache.truncate(0)
        self.entry_ids = []
        self.last_out = None

    def _embed(self, ids: Sequence[int] | torch.Tensor) -> torch.Tensor:
        device = self.features.device
        tensor = ids if isinstance(ids, torch.Tensor) else torch.tensor(list(ids), dtype=torch.long, device=device)
        if self.head.embed_tokens is not None:
            return self.head.embed_tokens(tensor)
        return self.embed(tensor).to(self.features.dtype)

    def _extend(self, context: Sequence[int]) -> torch.Tensor:
        """Head entries for every committed position; the newest one's output [hidden]."""
        committed = len(context) - 1
        valid = common_prefix_len(self.entry_ids, context[1:])
        if valid < self.cache.length:
            self.cache.truncate(valid)
            del self.entry_ids[valid:]
            self.last_out = None
        m = self.cache.length
        if m == committed and self.last_out is not None:
            return self.last_out
        if m == committed:  # the newest entry's output was not kept: compute that entry again
            m -= 1
            self.cache.truncate(m)
            del self.entry_ids[m:]
        head = self.head
        for start in range(m, committed, EXTEND_CHUNK):
            end = min(start + EXTEND_CHUNK, committed)
            ids = list(context[start + 1 : end + 1])
            feature = head.fuse(self.features[start:end])
            positions = torch.arange(start, end, device=feature.device)
            q, k, v = head.qkv(self._embed(ids), feature, positions)
            self.cache.append(k, v)
            keys, values = self.cache.keys()
            n, length = end - start, self.cache.length
            mask = (
                torch.arange(length, device=q.device)[None, :]
                <= torch.arange(length - n, length, device=q.device)[:, None]
            )
            out = F.scaled_dot_product_attention(
                q.transpose(0, 1)[None], keys[None], values[None], attn_mask=mask, scale=head.scale, enable_gqa=True
            )  # [1, heads, n, d]
            hidden = head.finish(feature, out[0].transpose(0, 1).flatten(1))
            self.entry_ids.extend(ids)
            self.last_out = hidden[-1]
        assert self.last_out is not None  # noqa: S101 - committed > m here
        return self.last_out

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        self.last_tree = (0, 0)
        if max_tokens <= 0 or not self._synced(context):
            return Draft([])
        head = self.head
        with torch.inference_mode():
            root = self._extend(context)
            committed = len(context) - 1
            keys, values = self.cache.keys()
            fed: dict[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = {}  # node -> (output, k, v)

            def expand(tree: trees.Grown, nodes: list[int]) -> torch.Tensor:
                """One head step over ``nodes`` (all of one depth): their children's logits."""
                parents = [tree.parents[n] for n in nodes]
                feature = torch.stack([root if p < 0 else fed[p][0] for p in parents])
                position = committed - 1 + tree.depths[nodes[0]]
                positions = torch.full((len(nodes),), position, device=feature.device)
                q, k, v = head.qkv(self._embed([tree.tokens[n] for n in nodes]), feature, positions)
                chains = [_ancestors(tree.parents, p) for p in parents]  # the fed nodes above each, root first
                own_k = torch.stack([torch.stack([fed[a][1] for a in c] + [k[i]]) for i, c in enumerate(chains)])
                own_v = torch.stack([torch.stack([fed[a][2] for a in c] + [v[i]]) for i, c in enumerate(chains)])
                hidden = head.finish(feature, _tree_attention(q, keys, values, own_k, own_v, head.scale))
                for i, n in enumerate(nodes):
                    fed[n] = (hidden[i], k[i], v[i])
                return head.logits(hidden)

            grown = trees.grow(
                head.logits(root[None]),
                expand,
                head.target_ids,
                self.rule,
                len(context) - self.reply_start,
                budget=max_tokens,
                depth=min(self.depth, max_tokens),
                top_k=self.top_k,
                stop_ids=self.stop,
            )
        tokens, parents = grown.best(max_tokens)
        depth = [0] * len(parents)
        for i, p in enumerate(parents):
            depth[i] = 1 if p < 0 else depth[p] + 1
        self.last_tree = (len(tokens), max(depth, default=0))
        return Draft(tokens, parents=parents)


class MedusaDrafter(_FeatureDrafter):
    """Medusa heads with a static tree: the config's ``medusa_choices``, else :func:`trees.static_paths`."""

    name = "medusa"

    def __init__(self, heads: MedusaHeads, taps: tuple[int, ...], *, top_k: int = 10) -> None:
        weight = next(heads.medusa_head.parameters())  # the heads' device and dtype
        super().__init__(taps, heads.config.hidden_size, weight.device, weight.dtype)
        self.heads = heads
        self.paths = heads.config.choices or tuple(trees.static_paths(heads.config.num_heads, 64, top_k=top_k))
        self.paths = tuple(p for p in self.paths if len(p) <= heads.config.num_heads)

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        self.last_tree = (0, 0)
        if max_tokens <= 0 or not self._synced(context):
            return Draft([])
        chosen, parents = trees.select_static(self.paths, max_tokens)
        if not chosen:
            return Draft([])
        rank = 1 + max(r for path in chosen for r in path)
        first = len(context) - self.reply_start
        with torch.inference_mode():
            logits = self.heads(self.features[len(context) - 2])  # [heads, vocab]
            ranked = [
                trees.ranked_children(logits[d : d + 1], lambda ids: ids, self.rule, [first + d], rank)[0][0].tolist()
                for d in range(max(len(p) for p in chosen))
            ]
        tokens = [ranked[len(path) - 1][path[-1]] for path in chosen]
        self.last_tree = (len(tokens), max(len(p) for p in chosen))
        return Draft(tokens, parents=parents)


def _ancestors(parents: list[int], node: int) -> list[int]:
    """``node`` and its ancestors, root first (empty for -1)."""
    chain = []
    while node >= 0:
        chain.append(node)
        node = parents[node]
    return chain[::-1]


def _tree_attention(
    q: torch.Tensor,  # [r, heads, d]
    keys: torch.Tensor,  # [kv_heads, m, d] the committed positions
    values: torch.Tensor,
    own_k: torch.Tensor,  # [r, a, kv_heads, d] each row's ancestors and itself
    own_v: torch.Tensor,
    scale: float,
) -> torch.Tensor:  # [r, heads * d]
    r, heads, d = q.shape
    groups = keys.shape[0]
    qg = q.view(r, groups, heads // groups, d)
    scores = (
        torch.cat([torch.einsum("rgpd,gld->rgpl", qg, keys), torch.einsum("rgpd,ragd->rgpa", qg, own_k)], dim=-1)
        * scale
    )
    probs = torch.softmax(scores.float(), dim=-1).to(q.dtype)
    m = keys.shape[1]
    out = torch.einsum("rgpl,gld->rgpd", probs[..., :m], values) + torch.einsum(
        "rgpa,ragd->rgpd", probs[..., m:], own_v
    )
    return out.reshape(r, heads * d)


def head_drafter(
    kind: str, module: torch.nn.Module, taps: tuple[int, ...], embedding: Embed, eos_token_ids: Iterable[int]
) -> Eagle3Drafter | MedusaDrafter:
    """The drafter of a loaded head: ``kind`` "eagle3" (``module`` an Eagle3Head; ``embedding`` the target's
    input embedding, used unless the head has its own) or "medusa" (MedusaHeads)."""
    if kind == "medusa" and isinstance(module, MedusaHeads):
        return MedusaDrafter(module, taps)
    if kind == "eagle3" and isinstance(module, Eagle3Head):
        return Eagle3Drafter(module, embedding, taps, eos_token_ids=eos_token_ids)
    raise ValueError(f"head_drafter: a {type(module).__name__} is not a {kind} head")
