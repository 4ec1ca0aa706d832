"""Tiny random draft heads in the published layouts, saved as a head folder (config.json + model.safetensors).

``eagle3_folder(path, target_config, draft_vocab=..., seed=...)`` writes an EAGLE-3 head for a tiny target
(tests/support/tiny_models.py): hidden size and vocabulary of the target, a draft vocabulary of the ``draft_vocab``
ids ``low ..`` (``d2t``/``t2d`` as the EAGLE authors' training writes them), taps of its own (the tiny targets have
two layers: the default low/mid/high would read layer ids past them). ``medusa_folder`` writes Medusa heads
(``legacy=True``: keys without the ``medusa_head.`` prefix, as the first release). A small draft vocabulary makes a
random head right often enough that trees are accepted and rejected in a short reply.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from specchat.backend.speculative.heads.eagle3 import Eagle3Config, Eagle3Head
from specchat.backend.speculative.heads.medusa import MedusaConfig, MedusaHeads


def eagle3_config(target_config, *, draft_vocab: int = 24, taps=(0, 1, 1), **overrides: Any) -> Eagle3Config:
    fields: dict[str, Any] = dict(
        hidden_size=target_config.hidden_size,
        intermediate_size=96,
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        vocab_size=target_config.vocab_size,
        draft_vocab_size=draft_vocab,
        target_hidden_size=target_config.hidden_size,
        rms_norm_eps=1e-6,
        rope_theta=10000.0,
        rope_scaling=None,
        taps=tuple(taps),
    )
    fields.update(overrides)
    return Eagle3Config(**fields)


def eagle3_head(config: Eagle3Config, *, seed: int = 0, low: int = 3, std: float = 0.2) -> Eagle3Head:
    """Random weights; the draft vocabulary is the ids ``low ..`` (all ids when it is the whole vocabulary)."""
    low = 0 if config.draft_vocab_size + low > config.vocab_size else low
    torch.manual_seed(seed)
    head = Eagle3Head(config)
    with torch.no_grad():
        for p in head.parameters():
            p.normal_(0.0, std) if p.dim() > 1 else p.fill_(1.0)
        ids = torch.arange(low, low + config.draft_vocab_size)
        head.d2t.copy_(ids - torch.arange(config.draft_vocab_size))
        head.t2d.zero_()
        head.t2d[ids] = True
    return head


def save_head(head: torch.nn.Module, config: dict, folder: Path, *, prefix: str = "") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    state = {prefix + k: v.contiguous().clone() for k, v in head.state_dict().items()}
    save_file(state, str(folder / "model.safetensors"))
    return folder


def eagle3_folder(folder: Path, target_config, *, seed: int = 0, **overrides: Any) -> Path:
    config = eagle3_config(target_config, **overrides)
    return save_head(eagle3_head(config, seed=seed), config.to_dict(), folder)


def medusa_folder(
    folder: Path, target_config, *, heads: int = 3, layers: int = 1, seed: int = 0, legacy: bool = False, choices=None
) -> Path:
    config = MedusaConfig(heads, layers, target_config.hidden_size, target_config.vocab_size, None)
    torch.manual_seed(seed)
    module = MedusaHeads(config)
    with torch.no_grad():
        for p in module.parameters():
            p.normal_(0.0, 0.3)
    data: dict[str, Any] = {"medusa_num_heads": heads, "medusa_num_layers": layers}
    if choices is not None:
        data["medusa_choices"] = [list(c) for c in choices]
    state = module.state_dict()
    if legacy:
        state = {k.removeprefix("medusa_head."): v for k, v in state.items()}
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(data))
    save_file({k: v.contiguous().clone() for k, v in state.items()}, str(folder / "model.safetensors"))
    return folder


TAPS = (0, 1, 1)  # the tiny targets' two layers: embeddings, after layer 0 (twice: EAGLE-3 reads three)
_TRAINED: dict[tuple, Eagle3Head] = {}


def trained_eagle3(family: str = "llama", *, steps: int = 120, prompt: tuple[int, ...] | None = None) -> Eagle3Head:
    """An EAGLE-3 head trained (a few seconds) on the tiny ``family`` target's own sampled continuations of random
    prompts (or all of ``prompt``: a head that knows what the target says after it), with the whole vocabulary as
    its draft vocabulary: it predicts the target well enough that trees are often partly accepted. Cached per
    process; tests must not change it."""
    key = (family, steps, prompt)
    if key not in _TRAINED:
        _TRAINED[key] = _train(family, steps, prompt)
    return _TRAINED[key]


def _train(family: str, steps: int, fixed: tuple[int, ...] | None) -> Eagle3Head:
    import tempfile

    from engine_fixtures import tiny_loaded, tiny_pair
    from tiny_models import random_ids

    from specchat.backend.api import GenerationRequest, SamplingParams
    from specchat.backend.engine.engine import Engine
    from specchat.backend.training.data import Sample
    from specchat.backend.training.loop import fresh_head, train

    loaded = tiny_loaded(family)
    engine = Engine(loaded, None, tiny_pair(drafter="none"))
    config = loaded.model.config
    samples = []
    for i in range(24 if fixed is None else 96):
        prompt = list(fixed) if fixed is not None else random_ids(6, seed=100 + i)
        sampling = SamplingParams(temperature=1.0, max_new_tokens=40 if fixed is None else 8, seed=i)
        reply = [
            t for e in engine.generate(GenerationRequest(prompt_ids=prompt, sampling=sampling)) for t in e.token_ids
        ]
        ids = prompt + reply
        seq = engine.runner.cache.new_sequence()
        out = engine.runner.forward(seq, ids, logits_to_keep=len(ids), taps=TAPS)
        logits, hidden = out.logits, out.hidden
        seq.free()
        values, index = torch.topk(torch.softmax(logits.float(), -1), 8, dim=-1)
        weights = torch.ones(len(ids))
        weights[: len(prompt)] = 0.3
        samples.append(Sample(torch.tensor(ids), hidden.to(torch.bfloat16), index, values.half(), weights))
    head_config = eagle3_config(config, draft_vocab=config.vocab_size, taps=TAPS)
    d2t = torch.zeros(config.vocab_size, dtype=torch.long)
    t2d = torch.ones(config.vocab_size, dtype=torch.bool)
    torch.manual_seed(0)
    head = fresh_head(head_config, d2t, t2d, torch.device("cpu"))
    embed = loaded.model.get_input_embeddings()
    with tempfile.TemporaryDirectory() as folder:
        train(head, embed, samples, Path(folder), steps=steps, batch=4, lr=3e-3, warmup=10, progress=lambda m: None)
    engine.close()
    return head
