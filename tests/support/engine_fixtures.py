"""Engines over tiny random-weight models and a tiny word-level tokenizer: no files, no downloads.

``tiny_tokenizer()`` maps the ids of tests/support/tiny_models.py's vocabulary to short words ("w3", "w4", ...), with
``<pad>``=0, ``<s>``=1, ``</s>``=2 and a ChatML-like template, so the engine's chat, detokenisation and
stop-string paths run as they do on real models. ``tiny_engine()`` builds an Engine (target + optional
draft) around them.
"""

from __future__ import annotations

import dataclasses

import torch
from tiny_models import VOCAB_SIZE, build_tiny
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from specchat.backend.engine.engine import Engine
from specchat.backend.models.catalog.config import load_pairs
from specchat.backend.models.loading.pair import LoadedModel

CHAT_TEMPLATE = (
    "{% for m in messages %}<s>{{ m['role'] }} {{ m['content'] }} </s> {% endfor %}"
    "{% if add_generation_prompt %}<s>assistant {% endif %}"
)


def tiny_tokenizer() -> PreTrainedTokenizerFast:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2}
    for i in range(3, VOCAB_SIZE):
        vocab[f"w{i}"] = i
    # Words the chat template and tests use map onto ordinary ids.
    for word, i in (("user", 3), ("assistant", 4), ("system", 5)):
        vocab.pop(f"w{i}")
        vocab[word] = i
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>")
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_loaded(family: str = "llama", *, seed: int = 0, **overrides) -> LoadedModel:
    model = build_tiny(family, seed=seed, **overrides)
    pair = load_pairs()["smollm2-135m"]
    return LoadedModel(
        model=model,
        tokenizer=tiny_tokenizer(),
        spec=pair.target,
        device=torch.device("cpu"),
        dtype=torch.float32,
        generation_config={"eos_token_id": 2},
    )


def tiny_pair(*, drafter: str = "prompt-lookup", gamma="auto", context_length: int = 256, sampling=None):
    base = load_pairs()["smollm2-135m" if drafter != "draft-model" else "smollm2-135m-nf4-draft"]
    return dataclasses.replace(
        base,
        name=f"tiny-{drafter}",
        drafter=drafter,
        gamma=gamma,
        context_length=context_length,
        sampling=sampling or {},
    )


def tiny_engine(
    family: str = "llama",
    *,
    drafter: str = "prompt-lookup",
    draft_family: str | None = None,
    draft_seed: int = 0,
    gamma="auto",
    context_length: int = 256,
    kv_tokens: int | None = None,
    prefix_cache_bytes: int = 0,
    **overrides,
) -> Engine:
    """Target = tiny ``family`` (seed 0). With ``draft_family`` a draft model is attached; a draft with the
    same family and seed as the target is the target's twin (greedy acceptance 100%)."""
    target = tiny_loaded(family, **overrides)
    draft = tiny_loaded(draft_family, seed=draft_seed) if draft_family else None
    pair = tiny_pair(drafter=drafter, gamma=gamma, context_length=context_length)
    return Engine(target, draft, pair, kv_tokens=kv_tokens, prefix_cache_bytes=prefix_cache_bytes)


def hf_greedy(
    family: str, prompt: list[int], max_new_tokens: int, *, repetition_penalty: float | None = None, **overrides
) -> list[int]:
    """transformers generate() greedy on a fresh copy of the same tiny model (its own attention and cache), with
    transformers' own repetition penalty when given."""
    attn = "eager" if family == "gemma2" else "sdpa"  # Gemma 2 has no SDPA path (softcapping)
    model = build_tiny(family, attn_implementation=attn, **overrides)
    out = model.generate(
        torch.tensor([prompt]),
        max_new_tokens=max_new_tokens,
        do_sample=False,
        repetition_penalty=repetition_penalty,
        eos_token_id=2,
        pad_token_id=0,
        attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
    )
    return out[0, len(prompt) :].tolist()
