"""Refusing a draft model whose tokenizer does not map text to the target's token ids (``loading.load_pair``
calls it before any weights load): speculative decoding compares ids, so both must split text alike."""

from __future__ import annotations

from typing import Any

from specchat.backend.errors import IncompatiblePairError

# Text whose token ids must agree between draft and target: code, prose, numbers, whitespace, non-ASCII.
_PROBES = (
    "def f(x):\n    return x ** 2  # square\n",
    "The quick brown fox, 1234567 times!",
    "  \t\n\n  indented\r\n",
    "naïve café — 東京 🙂 Привет",
    "<|im_start|>user\nhi<|im_end|>",
)


def check_tokenizers_compatible(target_tok: Any, draft_tok: Any, *, target_name: str, draft_name: str) -> None:
    """Refuse a draft whose tokenizer does not map text to the target's ids. IncompatiblePairError says how."""
    advice = "choose a draft from the target's model family (same tokenizer)"
    t_vocab, d_vocab = target_tok.get_vocab(), draft_tok.get_vocab()
    if t_vocab != d_vocab:
        # Sorted by id so the example named is the lowest differing id, the same on every run.
        moved = sorted((tok for tok, i in t_vocab.items() if tok in d_vocab and d_vocab[tok] != i), key=t_vocab.get)
        only_t = sorted((tok for tok in t_vocab if tok not in d_vocab), key=t_vocab.get)
        only_d = sorted((tok for tok in d_vocab if tok not in t_vocab), key=d_vocab.get)
        details = []
        if moved:
            tok = moved[0]
            details.append(
                f"{len(moved)} token(s) have different ids (e.g. {tok!r}: target {t_vocab[tok]}, draft {d_vocab[tok]})"
            )
        if only_t:
            details.append(f"{len(only_t)} only in the target (e.g. {only_t[0]!r})")
        if only_d:
            details.append(f"{len(only_d)} only in the draft (e.g. {only_d[0]!r})")
        raise IncompatiblePairError(
            f"draft {draft_name} and target {target_name} have different vocabularies ({len(d_vocab)} vs "
            f"{len(t_vocab)} tokens; {'; '.join(details)}); {advice}"
        )
    for attr in ("bos_token_id", "eos_token_id", "pad_token_id", "unk_token_id"):
        t_id, d_id = getattr(target_tok, attr, None), getattr(draft_tok, attr, None)
        if t_id != d_id:
            raise IncompatiblePairError(
                f"draft {draft_name} and target {target_name} disagree on {attr}: target "
                f"{t_id!r}, draft {d_id!r}; {advice}"
            )
    for text in _PROBES:
        t_ids = target_tok(text, add_special_tokens=False)["input_ids"]
        d_ids = draft_tok(text, add_special_tokens=False)["input_ids"]
        if t_ids != d_ids:
            raise IncompatiblePairError(
                f"draft {draft_name} and target {target_name} split {text!r} differently "
                f"(target {t_ids[:8]}..., draft {d_ids[:8]}...); {advice}"
            )
