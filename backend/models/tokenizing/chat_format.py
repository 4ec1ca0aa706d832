"""How a model chats, from the model itself: where its replies stop, and whether it has a chat format at all.

Contract:

- :func:`stop_ids(tokenizer, generation_config)`: the ids a reply ends at: the generation config's
  ``eos_token_id`` (an int or a list), the tokenizer's eos, and each end-of-turn token of :data:`END_OF_TURN`
  (``<end_of_turn>``, ``<|eot_id|>``, ``<|im_end|>``, ``<|end|>``, ``<|eom_id|>``) that is one token of the
  vocabulary and that the chat template writes: a Gemma GGUF states ``<eos>`` as its eos but ends every turn with
  ``<end_of_turn>``, and a reply must stop there, as llama.cpp stops at its end-of-generation tokens.
- :func:`plain_completion_note(tokenizer)`: None when the tokenizer has a chat template; else the line the UI
  shows at load, :data:`PLAIN_COMPLETION`: the model is a base model and runs as plain completion of the text
  (``engine.prompting.render`` joins the messages), no chat format is invented for it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

END_OF_TURN = ("<end_of_turn>", "<|eot_id|>", "<|im_end|>", "<|end|>", "<|eom_id|>")
PLAIN_COMPLETION = "no chat template: plain completion (a base model: it continues the text, it does not chat)"


def _ids(value: Any) -> set[int]:
    if isinstance(value, bool):
        return set()
    if isinstance(value, int):
        return {value}
    if isinstance(value, (list, tuple)):
        return {int(v) for v in value if isinstance(v, int) and not isinstance(v, bool)}
    return set()


def stop_ids(tokenizer: Any, generation_config: Mapping[str, Any]) -> frozenset[int]:
    """See the module docstring."""
    ids = _ids(generation_config.get("eos_token_id")) | _ids(getattr(tokenizer, "eos_token_id", None))
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):  # several named templates: any of them
        template = "\n".join(str(t) for t in template.values())
    named = [token for token in END_OF_TURN if isinstance(template, str) and token in template]
    if named:
        # The light tokenizer looks one token up; a vocabulary dict of a 150k-entry tokenizer is ~38 MiB at once.
        find = getattr(tokenizer, "token_to_id", None)
        if not callable(find):
            find = tokenizer.get_vocab().get
        for token in named:
            found = find(token)
            if found is not None:
                ids.add(int(found))
    return frozenset(ids)


def plain_completion_note(tokenizer: Any) -> str | None:
    """See the module docstring."""
    return None if getattr(tokenizer, "chat_template", None) else PLAIN_COMPLETION
