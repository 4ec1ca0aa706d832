"""The data of `specchat train-head`: the target's own replies, then its features on prompt + reply, on disk.

Contract (every stage resumable: it skips what its output already holds, so a killed run loses at most one item):

- :func:`generate_replies` asks the engine for a reply to each prompt not yet in ``replies.jsonl`` and appends
  one line per reply: ``{"id", "token_ids", "text"}`` (the fields ``specchat generate --json`` writes, so its output
  can stand in).
- :func:`extract_features` runs the target once over each prompt + reply (``ModelRunner.forward`` with the head's
  taps, on a scratch sequence) and keeps the last ``max_len`` positions: ids, taps (bfloat16), the target's
  ``top_k`` next-token ids and probabilities at each position, and a loss weight (1 on the reply,
  ``prompt_weight`` on the prompt). Shards of :data:`SHARD_SAMPLES` samples as safetensors, with
  ``features/index.json`` listing the sample ids done.
- :func:`load_samples` reads the shards back as :class:`Sample`\\ s; :func:`token_counts` counts the target's
  next tokens on weighted positions (the draft vocabulary's input).
"""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import torch

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.prompting import render
from specchat.backend.limits import PREFILL_CHUNK

SHARD_SAMPLES = 32
Progress = Callable[[str], None]


@dataclass(frozen=True, slots=True)
class Paths:
    out: Path

    @property
    def replies(self) -> Path:
        return self.out / "replies.jsonl"

    @property
    def features(self) -> Path:
        return self.out / "features"

    @property
    def checkpoint(self) -> Path:
        return self.out / "checkpoint"

    @property
    def head(self) -> Path:
        return self.out / "head"


@dataclass(frozen=True, slots=True)
class Sample:
    ids: torch.Tensor  # [T] long
    taps: torch.Tensor  # [T, len(taps) * hidden] bfloat16
    label_ids: torch.Tensor  # [T, K] long
    label_probs: torch.Tensor  # [T, K] float16
    weights: torch.Tensor  # [T] float32


def read_jsonl(path: Path) -> list[dict]:
    """Lines of a JSONL file that parse (a line cut short by a kill is skipped)."""
    if not path.exists():
        return []
    out = []
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            item = json.loads(line)
        except ValueError:
            continue
        if isinstance(item, dict):
            out.append(item)
    return out


def generate_replies(
    engine,
    prompts: list[tuple[str, list[dict]]],
    paths: Paths,
    *,
    max_new_tokens: int,
    temperature: float,
    seed: int,
    progress: Progress,
) -> dict[str, list[int]]:
    """The target's reply to every prompt (see the module docstring); returns id -> reply ids."""
    paths.out.mkdir(parents=True, exist_ok=True)
    replies = {str(r["id"]): [int(t) for t in r.get("token_ids", [])] for r in read_jsonl(paths.replies)}
    todo = [(pid, messages) for pid, messages in prompts if pid not in replies]
    if todo:
        progress(f"replies: {len(replies)} of {len(prompts)} done, generating {len(todo)}")
    with paths.replies.open("a", encoding="utf-8") as handle:
        for n, (pid, messages) in enumerate(todo, 1):
            sampling = SamplingParams(temperature=temperature, max_new_tokens=max_new_tokens, seed=seed)
            request = GenerationRequest(messages=messages, sampling=sampling, drafter="auto")
            tokens: list[int] = []
            text = []
            for event in engine.generate(request):
                tokens += event.token_ids
                text.append(event.text)
            handle.write(json.dumps({"id": pid, "token_ids": tokens, "text": "".join(text)}) + "\n")
            handle.flush()
            replies[pid] = tokens
            if n % 10 == 0 or n == len(todo):
                progress(f"replies: {len(replies)} of {len(prompts)}")
    return replies


def _done_ids(paths: Paths) -> tuple[list[str], int]:
    index = paths.features / "index.json"
    if not index.exists():
        return [], 0
    data = json.loads(index.read_text())
    return list(data["ids"]), int(data["shards"])


def extract_features(
    engine,
    prompts: list[tuple[str, list[dict]]],
    replies: dict[str, list[int]],
    paths: Paths,
    taps: tuple[int, ...],
    *,
    top_k: int = 8,
    max_len: int = 384,
    prompt_weight: float = 0.3,
    progress: Progress,
) -> None:
    """The target's features on each prompt + reply (module docstring)."""
    from safetensors.torch import save_file

    paths.features.mkdir(parents=True, exist_ok=True)
    done, shards = _done_ids(paths)
    seen = set(done)
    todo = [(pid, m) for pid, m in prompts if pid in replies and pid not in seen and replies[pid]]
    if todo:
        progress(f"features: {len(done)} samples done, reading {len(todo)} more")
    runner, vocab = engine.runner, engine.vocab_limit
    batch: list[tuple[str, dict[str, torch.Tensor]]] = []
    for n, (pid, messages) in enumerate(todo, 1):
        prompt = render(engine.tokenizer, messages)
        ids = prompt + replies[pid]
        first = max(0, len(ids) - max_len)  # the window kept
        labelled = first if prompt_weight > 0 else max(first, len(prompt) - 1)  # rows whose next token is learnt
        label_ids = torch.zeros(len(ids), top_k, dtype=torch.int32)  # rows without labels carry no loss
        label_probs = torch.zeros(len(ids), top_k, dtype=torch.float16)
        seq = runner.cache.new_sequence()
        hidden = []
        try:
            for start in range(0, len(ids), PREFILL_CHUNK):
                if engine.threads is not None:  # fewer threads while other programs are busy (engine/threads.py)
                    engine.threads.step()
                chunk = ids[start : start + PREFILL_CHUNK]
                end = start + len(chunk)
                keep = max(1, min(len(chunk), end - labelled))  # the head's logits of the rows needing labels
                out = runner.forward(seq, chunk, logits_to_keep=keep, taps=taps)
                logits, h = out.logits, out.hidden
                assert h is not None  # taps were asked for
                seq.commit(len(chunk))
                hidden.append(h.to(torch.bfloat16).cpu())
                if end > labelled:
                    probs = torch.softmax(logits[:, :vocab].float(), dim=-1)
                    values, index = torch.topk(probs, top_k, dim=-1)
                    label_ids[end - keep : end] = index.to(torch.int32).cpu()
                    label_probs[end - keep : end] = values.to(torch.float16).cpu()
        finally:
            seq.free()
        window = slice(first, len(ids))
        weights = torch.full((len(ids),), prompt_weight)
        weights[len(prompt) :] = 1.0
        sample = {
            "ids": torch.tensor(ids, dtype=torch.int32)[window],
            "taps": torch.cat(hidden)[window],
            "label_ids": label_ids[window],
            "label_probs": label_probs[window],
            "weights": weights[window].to(torch.float16),
        }
        batch.append((pid, sample))
        if len(batch) == SHARD_SAMPLES or n == len(todo):
            tensors = {f"{i}.{k}": v.contiguous() for i, (_, s) in enumerate(batch) for k, v in s.items()}
            tmp = paths.features / f"shard-{shards:05d}.tmp"
            save_file(tensors, str(tmp))
            os.replace(tmp, paths.features / f"shard-{shards:05d}.safetensors")
            shards += 1
            done += [pid for pid, _ in batch]
            index_file = paths.features / "index.json"
            index_file.with_suffix(".tmp").write_text(json.dumps({"ids": done, "shards": shards, "taps": list(taps)}))
            os.replace(index_file.with_suffix(".tmp"), index_file)
            batch = []
            progress(f"features: {len(done)} samples")


def load_samples(paths: Paths, skip: Iterable[str] = ()) -> list[tuple[str, Sample]]:
    """Every sample of the shards (``skip``: ids left out, e.g. held out for the report)."""
    from safetensors.torch import load_file

    done, shards = _done_ids(paths)
    skipped = set(skip)
    out: list[tuple[str, Sample]] = []
    for shard in range(shards):
        tensors = load_file(str(paths.features / f"shard-{shard:05d}.safetensors"))
        for i in range(len({k.split(".", 1)[0] for k in tensors})):
            pid = done[len(out)] if len(out) < len(done) else f"#{len(out)}"
            out.append(
                (
                    pid,
                    Sample(
                        ids=tensors[f"{i}.ids"].long(),
                        taps=tensors[f"{i}.taps"],
                        label_ids=tensors[f"{i}.label_ids"].long(),
                        label_probs=tensors[f"{i}.label_probs"],
                        weights=tensors[f"{i}.weights"].float(),
                    ),
                )
            )
    return [(pid, s) for pid, s in out if pid not in skipped]


def token_counts(samples: Iterable[Sample], vocab_size: int) -> torch.Tensor:
    """How often each target id is the target's most likely next token on a weighted position."""
    counts = torch.zeros(vocab_size, dtype=torch.float64)
    for s in samples:
        top = s.label_ids[:, 0]
        counts.index_add_(0, top, s.weights.double())
    return counts
