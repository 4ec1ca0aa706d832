"""`specchat train-head`, end to end: self-distillation of an EAGLE-3 head for a pair's target.

Stages, in ``out`` (each resumable, see ``data.py`` and ``loop.py``): the target's replies to the prompts (greedy
unless a temperature is given), its features on prompt + reply, the draft vocabulary (the ``draft_vocab`` ids the
target predicts most often on the training positions, fixed at the first run), training with the training-time
test, the head exported in the published layout (``out/head``), and an acceptance report on held-out prompts:
the engine drafts with the new head (greedy, ``report_tokens`` new tokens each) and reports the mean accepted
length τ and the acceptance at each depth of its trees (``out/report.json``).

The target runs where the pair's device puts it (CUDA when present); the head trains on the same device.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.models.catalog.config import PairConfig
from specchat.backend.models.catalog.config_head import HEAD_DRAFTERS
from specchat.backend.speculative.heads.eagle3 import Eagle3Config, default_taps
from specchat.backend.speculative.heads.training import coverage, draft_vocabulary
from specchat.backend.training import data, loop

Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Options:
    steps: int = 2000
    batch: int = 8
    lr: float = 3e-4
    ttt_steps: int = 5
    draft_vocab: int = 8192
    max_new_tokens: int = 256
    temperature: float = 0.0
    max_len: int = 384
    prompt_weight: float = 0.0  # > 0 also trains on the prompt's positions (slower: they then need every step)
    report_tokens: int = 128
    seed: int = 0
    resume: bool = False
    max_minutes: float | None = None  # stop training after this long (checkpointed; --resume goes on)


def _vocab(paths: data.Paths, samples: list[data.Sample], vocab_size: int, size: int, progress: Progress):
    from safetensors.torch import load_file, save_file

    file = paths.out / "vocab.safetensors"
    if file.exists():
        saved = load_file(str(file))
        return saved["d2t"], saved["t2d"]
    counts = data.token_counts(samples, vocab_size)
    d2t, t2d = draft_vocabulary(counts, size)
    save_file({"d2t": d2t, "t2d": t2d}, str(file))
    progress(f"draft vocabulary: {int(t2d.sum())} ids cover {coverage(counts, t2d):.1%} of the target's next tokens")
    return d2t, t2d


def _output_layer(
    model, embed, d2t: torch.Tensor, device: torch.device
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """The target's output rows at the draft ids [draft_vocab, hidden] float32 and its final norm [hidden], each
    None where it cannot be read as plain numbers (``loop.fresh_head``: what they start). The native model reads
    both from the file (its blocks de-quantised; the norm as the pass multiplies by it, gemma's 1 + w). A tied
    transformers output layer is the embedding, read through the embedding itself."""
    text = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    ids = d2t + torch.arange(d2t.numel())
    rows = None
    if hasattr(model, "output_rows"):  # the native model: the file's blocks de-quantised, unscaled
        with torch.no_grad():
            return model.output_rows(ids).float().cpu(), model.final_norm_scale()
    with torch.no_grad():
        if getattr(text, "tie_word_embeddings", False):
            rows = embed(ids.to(device)).float().cpu()
        else:
            weight = getattr(model.get_output_embeddings(), "weight", None)
            if isinstance(weight, torch.Tensor) and weight.is_floating_point():
                rows = weight[ids.to(weight.device)].float().cpu()
        norm = getattr(getattr(getattr(model, "model", None), "norm", None), "weight", None)
        norm = norm.detach().float().cpu() if isinstance(norm, torch.Tensor) and norm.is_floating_point() else None
    return rows, norm


def head_config(target_config, taps: tuple[int, ...], draft_vocab: int) -> Eagle3Config:
    """An EAGLE-3 head shaped like one layer of the target (as the EAGLE authors' heads are)."""
    text = target_config.get_text_config() if hasattr(target_config, "get_text_config") else target_config
    heads = int(text.num_attention_heads)
    return Eagle3Config(
        hidden_size=int(text.hidden_size),
        intermediate_size=int(text.intermediate_size),
        num_heads=heads,
        num_kv_heads=int(getattr(text, "num_key_value_heads", None) or heads),
        head_dim=int(getattr(text, "head_dim", None) or text.hidden_size // heads),
        vocab_size=int(text.vocab_size),
        draft_vocab_size=draft_vocab,
        target_hidden_size=int(text.hidden_size),
        rms_norm_eps=float(getattr(text, "rms_norm_eps", 1e-6)),
        rope_theta=float(getattr(text, "rope_theta", None) or 10000.0),
        rope_scaling=None,
        taps=taps,
    )


def acceptance_report(engine, prompts: list[tuple[str, list[dict]]], *, max_new_tokens: int) -> dict[str, Any]:
    """τ and per-depth acceptance of the engine's eagle3 drafter over ``prompts`` (greedy): depth i's acceptance
    is P(accepted >= i | accepted >= i - 1) over speculating steps."""
    accepted: list[int] = []
    tokens = steps = 0
    started = time.perf_counter()
    for _, messages in prompts:
        request = GenerationRequest(
            messages=messages, sampling=SamplingParams(temperature=0, max_new_tokens=max_new_tokens), drafter="eagle3"
        )
        for event in engine.generate(request):
            tokens += len(event.token_ids)
            if event.gamma and not event.is_prefill:
                accepted.append(event.accepted)
            steps += not event.is_prefill and bool(event.token_ids)
    depth = max(accepted, default=0)
    per_depth = []
    for i in range(1, depth + 1):
        reached = sum(1 for a in accepted if a >= i - 1)
        per_depth.append(round(sum(1 for a in accepted if a >= i) / reached, 4) if reached else None)
    return {
        "prompts": len(prompts),
        "new_tokens": tokens,
        "speculating_steps": len(accepted),
        "tau": round(1 + sum(accepted) / len(accepted), 4) if accepted else None,
        "per_depth_acceptance": per_depth,
        "seconds": round(time.perf_counter() - started, 2),
    }


def run(
    pair: PairConfig,
    prompts: list[tuple[str, list[dict]]],
    out: Path,
    options: Options,
    *,
    eval_prompts: list[tuple[str, list[dict]]] | None = None,
    device: str | None = None,
    progress: Progress,
    confirm_download=None,
) -> dict[str, Any]:
    """Every stage (module docstring); returns the report."""
    from specchat.backend.engine.engine import load_engine

    if eval_prompts is None:  # hold out one prompt in twenty (at least one) for the report
        held = max(1, len(prompts) // 20)
        eval_prompts, prompts = prompts[-held:], prompts[:-held]
    # Replies and features come from the target alone (no head: the native layers may decode the replies).
    plain = dataclasses.replace(pair, head=None, drafter="auto" if pair.drafter in HEAD_DRAFTERS else pair.drafter)

    def say(message: str, fraction: float | None = None) -> None:
        progress(message)

    engine = load_engine(plain, device=device, progress=say, confirm_download=confirm_download)
    paths = data.Paths(out)
    config = engine.target.model.config
    layers = int((config.get_text_config() if hasattr(config, "get_text_config") else config).num_hidden_layers)
    taps = default_taps(layers)
    replies = data.generate_replies(
        engine,
        prompts,
        paths,
        max_new_tokens=options.max_new_tokens,
        temperature=options.temperature,
        seed=options.seed,
        progress=progress,
    )
    data.extract_features(
        engine,
        prompts,
        replies,
        paths,
        taps,
        max_len=options.max_len,
        prompt_weight=options.prompt_weight,
        progress=progress,
    )
    wanted = {pid for pid, _ in prompts}
    samples = [s for pid, s in data.load_samples(paths) if pid in wanted]
    progress(f"training on {len(samples)} samples, {sum(int((s.weights > 0).sum()) for s in samples)} positions")
    d2t, t2d = _vocab(paths, samples, int(config.vocab_size), options.draft_vocab, progress)
    embed = engine.target.model.get_input_embeddings()
    rows, norm = _output_layer(engine.target.model, embed, d2t, engine.runner.device)
    progress(
        "the head's output layer: the target's rows, frozen"
        if rows is not None
        else "the head's output layer: trained from scratch (the target's is not readable as plain numbers)"
    )
    head = loop.fresh_head(
        head_config(config, taps, int(t2d.sum())), d2t, t2d, engine.runner.device, output_rows=rows, final_norm=norm
    )
    deadline = None if options.max_minutes is None else time.monotonic() + 60 * options.max_minutes
    reached = loop.train(
        head,
        lambda ids: embed(ids).float(),
        samples,
        paths.checkpoint,
        steps=options.steps,
        batch=options.batch,
        lr=options.lr,
        ttt_steps=options.ttt_steps,
        seed=options.seed,
        resume=options.resume,
        stop=None if deadline is None else (lambda step: time.monotonic() > deadline),
        between=engine.threads.step if engine.threads is not None else None,
        progress=progress,
    )
    if reached < options.steps:
        engine.close()
        return {"stopped_at": reached, "steps": options.steps, "resume": "run again with --resume to go on"}
    size = loop.export_head(head, paths.head, target_layers=layers)
    progress(f"head written to {paths.head} ({size / 2**20:.1f} MiB, bfloat16)")
    from specchat.backend.models.catalog.config_head import HeadSpec
    from specchat.backend.models.loading.head_loading import load_head

    folder = str(paths.head.resolve())
    loaded = load_head(
        HeadSpec(folder, "local", path=folder), "eagle3", config, engine.runner.device, target_name=pair.target.source
    )
    engine.attach_head(loaded)
    progress(f"acceptance report on {len(eval_prompts)} held-out prompts ({options.report_tokens} tokens each)")
    report = acceptance_report(engine, eval_prompts, max_new_tokens=options.report_tokens)
    report.update(head_bytes=size, samples=len(samples), steps=options.steps)
    tmp = out / "report.tmp"
    tmp.write_text(json.dumps(report, indent=2) + "\n")
    os.replace(tmp, out / "report.json")
    engine.close()
    return report
