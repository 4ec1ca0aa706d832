"""The prediction drafter: drafts a reply the caller predicted (OpenAI's Predicted Outputs), such as the current
text of a file the model is asked to rewrite with a small change.

Contract: built per request with the prediction's token ids (tokenised once, by the engine). ``propose(context,
max_tokens)`` drafts the prediction's tokens from where the reply currently stands, or returns an empty draft
when the reply's end matches nothing in the prediction (the engine then lets the request's own drafter try:
prompt lookup or the suffix tree over the conversation). Verification keeps a drafted token iff it equals the
target's own (``backend/speculative/verify.py``), so whatever the prediction says, the reply is the target's.

Where the reply stands (``configure`` gives where it starts in the context):

- *Aligned*: the reply so far has followed the prediction from position ``pos`` on; each call checks that the
  tokens emitted since the last call continue it (the accepted drafts, and the target's own token after them)
  and advances ``pos``. The very first alignment is the prediction's start.
- *Diverged*: a token differed. The drafter looks for where the reply rejoins the prediction: the positions
  ``j`` where the reply's last ``k`` tokens equal ``prediction[j-k:j]`` (``k`` up to ``max_match``). The
  *anchor* is where the reply last followed the prediction. A match within ``near_window`` tokens after the
  anchor needs one token: after a renamed word the next ``:`` is the one after the old word, after an inserted
  line it is the line break just before the anchor. Anywhere else a match needs ``far_match`` tokens (a moved
  or deleted block), since one common token far away (a ``(``, a line break) is no evidence: there the
  request's own drafter (the conversation's n-grams, a loop the reply is in) does better. Near matches come
  first, then the longest; among equals the nearest at or after the anchor, else the nearest before it. The
  drafter drafts from ``j``; until a draft of it is accepted the anchor stays where the reply last followed.
  (Why: the longest match first with single-token matches anywhere saved far fewer passes on the ``rewrite``
  prompts than this rule — ``benchmarks/RESULTS.md``, "Figures moved out of the code": wherever the reply is new
  text, single-token matches far away kept drafting wrong tokens and left the repetitions the reply fell into to
  no drafter.)

Draft length (variable, as llama.cpp's ``ngram-mod`` drafts up to 64): it starts at ``start_tokens``, doubles
after a draft accepted whole (up to ``max_tokens``), and drops at once to ``min_tokens`` after a draft the target
rejected part of: a miss means the reply is being edited here, and a long wrong draft costs its rows in the
target's pass. The engine's cap (the rows a pass may hold with each row's logits independent of the others,
the token limit, the context) bounds it too. The draft is cut after the first EOS id it holds.

Worked examples (also run as unit tests):

>>> p = PredictionDrafter([10, 11, 12, 13, 14, 15, 16, 17], start_tokens=2, min_tokens=1)
>>> p.configure(None, reply_start=3)
>>> p.propose([1, 2, 3, 10], 8).token_ids  # the reply "10" follows the prediction: draft from there
[11, 12]
>>> p.observe(2)  # both accepted: the next draft is twice as long
>>> p.propose([1, 2, 3, 10, 11, 12, 13], 8).token_ids  # 11 12 accepted, 13 the target's own: still aligned
[14, 15, 16, 17]
>>> p.observe(1)  # 14 accepted, then the target said 99 (not 15): a miss, the length drops to 1
>>> p.propose([1, 2, 3, 10, 11, 12, 13, 14, 99], 8).token_ids  # "99" is nowhere in the prediction
[]
>>> p.propose([1, 2, 3, 10, 11, 12, 13, 14, 99, 16], 8).token_ids  # "16" rejoins it: draft what follows
[17]
>>> q = PredictionDrafter(list(range(10, 30)) + [15, 16, 17, 40], start_tokens=4, min_tokens=2, near_window=3,
...                       far_match=3)
>>> q.configure(None, reply_start=0)
>>> q.propose([10, 11, 99], 4).token_ids  # left the prediction after "10 11" (the anchor: 2)
[]
>>> q.propose([10, 11, 99, 13], 4).token_ids  # "13" ends at 4, near the anchor: one token is enough
[14, 15, 16, 17]
>>> q.observe(4)  # accepted: the anchor moves to 8
>>> q.propose([10, 11, 99, 13, 14, 15, 16, 17, 18, 15, 16], 4).token_ids  # "15 16" (twice) is far away: too short
[]
>>> q.propose([10, 11, 99, 13, 14, 15, 16, 17, 18, 15, 16, 17], 4).token_ids  # three tokens: the match after 9
[40]
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from specchat.backend.speculative.drafters.base import Draft
from specchat.backend.speculative.sampling import SamplingRule


class PredictionDrafter:
    """Drafts a predicted reply (see the module docstring). One per request: it holds the request's prediction."""

    name = "prediction"

    def __init__(
        self,
        prediction: Sequence[int],
        *,
        eos_token_ids: Iterable[int] = (),
        max_tokens: int = 64,
        start_tokens: int = 16,
        min_tokens: int = 8,
        max_match: int = 32,
        near_window: int = 16,
        far_match: int = 4,
    ) -> None:
        if not 1 <= min_tokens <= start_tokens <= max_tokens or not 1 <= far_match <= max_match or near_window < 0:
            raise ValueError(
                "PredictionDrafter: need 1 <= min_tokens <= start_tokens <= max_tokens, 1 <= far_match <= max_match "
                f"and near_window >= 0, got {min_tokens}, {start_tokens}, {max_tokens}, {far_match}, {max_match}, "
                f"{near_window}"
            )
        self.prediction = [int(t) for t in prediction]
        self.eos_token_ids = frozenset(int(t) for t in eos_token_ids)
        self.max_tokens, self.start_tokens, self.min_tokens = max_tokens, min(start_tokens, max_tokens), min_tokens
        self.max_match, self.near_window, self.far_match = max_match, near_window, far_match
        # token -> the positions j (ascending) whose preceding token prediction[j - 1] is that token
        self._ends: dict[int, list[int]] = {}
        for j, token in enumerate(self.prediction, 1):
            self._ends.setdefault(token, []).append(j)
        self.reply_start = 0
        self.reset()

    # -- the drafter protocol ---------------------------------------------------------------------------------
    def reset(self) -> None:
        """Back to the start of the prediction (a new reply)."""
        self.pos: int | None = 0  # the prediction position the reply's end is aligned with; None: diverged
        self.anchor = 0  # where the reply last followed the prediction (rejoins prefer what lies after it)
        self.length = self.start_tokens  # the next draft's length, before the caller's cap
        self.rejoins = 0  # how often the reply was found again after a divergence (diagnostics, tests)
        self._seen = 0  # reply tokens already compared with the prediction
        self._drafted = 0  # the length of the last draft
        self._from: int | None = None  # the position the last draft started at
        self._rejoined = False  # the last draft started at a rejoin not yet confirmed by an accepted token

    def configure(self, rule: SamplingRule | None, reply_start: int) -> None:
        """A new reply starting at context index ``reply_start`` (the rule is not needed: drafts are not sampled)."""
        self.reply_start = reply_start
        self.reset()

    def observe(self, num_accepted: int) -> None:
        """Longer drafts after one accepted whole, ``min_tokens`` after a miss (see the module docstring)."""
        if not self._drafted:
            return
        if num_accepted >= self._drafted:
            self.length = min(self.length * 2, self.max_tokens)
        else:
            self.length = self.min_tokens
        if num_accepted and self._from is not None:
            self.anchor = self._from + num_accepted  # the rejoin (or the alignment) is confirmed
            self._rejoined = False
        self._drafted = 0

    def release(self) -> None:
        self.reset()

    def propose(self, context: Sequence[int], max_tokens: int) -> Draft:
        """Up to ``max_tokens`` ids of the prediction continuing ``context``; empty when it has no match."""
        reply_len = len(context) - self.reply_start
        if reply_len < self._seen:  # the context is not the one this reply grew from: start over
            self.reset()
        new = [int(t) for t in context[self.reply_start + self._seen :]] if reply_len > self._seen else []
        self._seen = max(reply_len, 0)
        pred = self.prediction
        if self.pos is not None:
            for token in new:
                if self.pos < len(pred) and pred[self.pos] == token:
                    self.pos += 1
                    if not self._rejoined:
                        self.anchor = self.pos
                else:
                    self.pos = None
                    break
        if self.pos is None and reply_len > 0:
            tail = [int(t) for t in context[max(self.reply_start, len(context) - self.max_match) :]]
            self.pos = self._rejoin(tail)
            if self.pos is not None:
                self.rejoins += 1
                self._rejoined = True
        self._drafted, self._from = 0, self.pos
        if self.pos is None or max_tokens <= 0:
            return Draft([])
        out: list[int] = []
        for token in pred[self.pos : self.pos + min(self.length, max_tokens, self.max_tokens)]:
            out.append(token)
            if token in self.eos_token_ids:
                break
        self._drafted = len(out)
        return Draft(out)

    # -- finding the reply in the prediction ----------------------------------------------------------------------
    def _rejoin(self, tail: list[int]) -> int | None:
        """The position after the best match of the end of ``tail`` (the reply's last tokens), or None."""
        ends = self._ends.get(tail[-1])
        if not ends:
            return None
        pred, anchor = self.prediction, self.anchor
        best: tuple[bool, int, int] | None = None  # (near the anchor, match length, -distance): larger is better
        best_j = None
        for j in ends:
            k = 1
            while k < len(tail) and j - k > 0 and pred[j - k - 1] == tail[-k - 1]:
                k += 1
            near = anchor <= j <= anchor + self.near_window
            if not near and k < self.far_match:
                continue
            # at or after the anchor: nearer first; before it: nearer (larger j) first, after every forward one
            distance = j - anchor if j >= anchor else len(pred) + anchor - j
            if best is None or (near, k, -distance) > best:
                best, best_j = (near, k, -distance), j
        return best_j
