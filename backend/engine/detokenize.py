"""Incremental detokenisation that never splits a UTF-8 character, with stop strings.

Decoding token by token with ``tokenizer.decode([id])`` breaks byte-level BPE (a multi-byte character spans
tokens) and SentencePiece spacing (a leading space depends on the previous token). We use the usual
two-offset scheme (as in vLLM / text-generation-inference): decode a short window of previous tokens with and
without the new ones and emit the difference, holding back text that ends in U+FFFD (an incomplete
character). Stop strings hold back any tail that could still become a stop string.
"""

from __future__ import annotations

from collections.abc import Sequence

REPLACEMENT = "\ufffd"


class IncrementalDetokenizer:
    """Turns generated token ids into text deltas, one call per token.

    ``push(id)`` returns the text that token completed ("" when it is held back). ``stopped`` becomes True
    once a stop string appears; the text up to (not including) the stop string has then been emitted.
    """

    def __init__(self, tokenizer, stop: Sequence[str] = (), prompt_tail: Sequence[int] = ()) -> None:
        self._tok = tokenizer
        # A few prompt tokens give the decoder the left context it needs for spacing.
        self._ids: list[int] = list(prompt_tail[-4:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._stop = tuple(s for s in stop if s)
        self._max_stop = max((len(s) for s in self._stop), default=0)
        self._pending = ""  # decoded text not yet emitted because it may start a stop string
        self.text = ""  # everything emitted so far
        self.stopped = False

    def push(self, token_id: int) -> str:
        if self.stopped:
            return ""
        self._ids.append(token_id)
        prefix = self._tok.decode(self._ids[self._prefix_offset : self._read_offset], skip_special_tokens=True)
        full = self._tok.decode(self._ids[self._prefix_offset :], skip_special_tokens=True)
        if len(full) <= len(prefix) or full.endswith(REPLACEMENT):
            return ""  # incomplete character (or a token that decodes to nothing yet)
        delta = full[len(prefix) :]
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._ids)
        return self._release(delta)

    def _release(self, delta: str) -> str:
        if not self._stop:
            self.text += delta
            return delta
        buffer = self._pending + delta
        cut = min((i for i in (buffer.find(s) for s in self._stop) if i >= 0), default=-1)
        if cut >= 0:
            self.stopped = True
            self._pending = ""
            out = buffer[:cut]
        else:
            # Keep the longest tail that is a proper prefix of some stop string.
            keep = 0
            for n in range(min(len(buffer), self._max_stop - 1), 0, -1):
                tail = buffer[-n:]
                if any(s.startswith(tail) for s in self._stop):
                    keep = n
                    break
            out, self._pending = buffer[: len(buffer) - keep], buffer[len(buffer) - keep :]
        self.text += out
        return out

    def flush(self) -> str:
        """At the end of a request: release held-back text that did not become a stop string."""
        out, self._pending = self._pending, ""
        self.text += out
        return out
