"""The target's hidden states a request's drafters read (draft heads), from each pass to each drafter.

Contract: :meth:`FeatureFeed.of` returns None when no candidate drafter reads taps (then no pass asks for any);
otherwise ``taps`` is the union the request's passes ask ``ModelRunner.forward`` for, and after each pass
:meth:`give` hands every drafter that reads taps its own columns of the rows the engine committed: the prefill's
rows, or a step's pending token and accepted drafts (a tree's accepted path, in order), with their ids and
context positions. Only committed tokens' taps are kept: a rejected draft's row never reaches a drafter.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch

from specchat.backend.speculative.drafters.base import Drafter


class FeatureFeed:
    def __init__(self, drafters: list[Drafter]) -> None:
        self.drafters = drafters
        self.taps = tuple(sorted({t for d in drafters for t in d.taps}))
        self._columns = {id(d): [self.taps.index(t) for t in d.taps] for d in drafters}
        self.hidden: torch.Tensor | None = None  # [n, len(taps) * hidden] of the latest pass

    @classmethod
    def of(cls, drafters: Mapping[str, Drafter], candidates: Sequence[str]) -> FeatureFeed | None:
        readers = [drafters[name] for name in candidates if drafters[name].taps]
        return cls(readers) if readers else None

    def give(self, start: int, token_ids: Sequence[int], rows: Sequence[int] | None = None) -> None:
        """The latest pass's ``rows`` (None: all) are committed tokens ``token_ids`` at context positions
        ``start ..``: hand each drafter its taps of them."""
        hidden = self.hidden
        if hidden is None or not token_ids:
            return
        if rows is not None:
            hidden = hidden[torch.tensor(list(rows), dtype=torch.long, device=hidden.device)]
        width = hidden.shape[1] // len(self.taps)
        for drafter in self.drafters:
            columns = self._columns[id(drafter)]
            if len(columns) == len(self.taps):
                part = hidden
            else:
                part = torch.cat([hidden[:, c * width : (c + 1) * width] for c in columns], dim=1)
            drafter.observe_hidden(start, token_ids, part)
