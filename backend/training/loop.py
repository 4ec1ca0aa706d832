"""The training loop of `specchat train-head`: an EAGLE-3 head from the target's features, with checkpoints.

Contract: :func:`train` runs optimizer steps up to ``steps`` (a step = ``batch`` windows, each through the
training-time test of ``backend/speculative/heads/training.py``), printing a progress line every ``log_every``
steps (loss and top-1 accuracy per TTT step, seconds a step, time left), and saving a checkpoint every
``save_every`` steps and at the end: the head's weights, AdamW's state and the step, as safetensors plus JSON,
written to a temporary name and renamed (a kill never leaves a half-written checkpoint). With ``resume`` it
continues from the checkpoint: the same sample order (a permutation per epoch from ``seed``), learning rate
schedule (linear warm-up, cosine decay to a tenth) and optimizer state, so a resumed run ends where an
uninterrupted one would. :func:`export_head` writes the head in the published layout (config.json +
model.safetensors, bfloat16).
"""

from __future__ import annotations

import json
import math
import os
import time
from collections.abc import Callable
from pathlib import Path

import torch

from specchat.backend.speculative.heads.eagle3 import Eagle3Config, Eagle3Head
from specchat.backend.speculative.heads.training import ttt_losses
from specchat.backend.training.data import Sample

Progress = Callable[[str], None]


def _lr(step: int, steps: int, peak: float, warmup: int) -> float:
    if step < warmup:
        return peak * (step + 1) / warmup
    done = (step - warmup) / max(1, steps - warmup)
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(done, 1.0))))


def _order(count: int, seed: int, epoch: int) -> list[int]:
    generator = torch.Generator().manual_seed(seed * 1000003 + epoch)
    return torch.randperm(count, generator=generator).tolist()


def save_checkpoint(folder: Path, head: Eagle3Head, optimizer: torch.optim.Optimizer, step: int) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    tensors = {f"head.{k}": v.detach().contiguous().cpu() for k, v in head.state_dict().items()}
    names = {id(p): n for n, p in head.named_parameters()}
    for group in optimizer.param_groups:
        for p in group["params"]:
            for key, value in optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    tensors[f"adam.{key}.{names[id(p)]}"] = value.detach().contiguous().cpu().reshape(value.shape)
    tmp = folder / "state.tmp"
    save_file(tensors, str(tmp))
    os.replace(tmp, folder / "state.safetensors")
    meta = folder / "meta.tmp"
    meta.write_text(json.dumps({"step": step, "config": head.config.to_dict()}))
    os.replace(meta, folder / "meta.json")


def load_checkpoint(folder: Path, head: Eagle3Head, optimizer: torch.optim.Optimizer) -> int:
    """Restore a checkpoint into ``head`` and ``optimizer``; the step it was saved at."""
    from safetensors.torch import load_file

    tensors = load_file(str(folder / "state.safetensors"))
    head.load_state_dict({k.removeprefix("head."): v for k, v in tensors.items() if k.startswith("head.")})
    params = dict(head.named_parameters())
    for key, value in tensors.items():
        if not key.startswith("adam."):
            continue
        _, slot, name = key.split(".", 2)
        state = optimizer.state.setdefault(params[name], {})
        state[slot] = value.to(params[name].device)
    return int(json.loads((folder / "meta.json").read_text())["step"])


def train(
    head: Eagle3Head,
    embed: Callable[[torch.Tensor], torch.Tensor],
    samples: list[Sample],
    checkpoint: Path,
    *,
    steps: int,
    batch: int = 8,
    lr: float = 3e-4,
    warmup: int = 50,
    ttt_steps: int = 5,
    seed: int = 0,
    resume: bool = False,
    log_every: int = 10,
    save_every: int = 100,
    stop: Callable[[int], bool] | None = None,
    between: Callable[[], object] | None = None,
    progress: Progress,
) -> int:
    """Train ``head`` in place up to ``steps`` optimizer steps (module docstring); returns the last step, which is
    below ``steps`` when ``stop(step)`` said to stop early (checkpointed: a resumed run goes on from there with
    the same schedule). ``between`` runs before each window (the engine's thread governor: on a CPU shared with
    other programs, fewer compute threads)."""
    if not samples:
        raise ValueError("train: no samples")
    device = head.fc.weight.device
    trainable = [p for p in head.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
    step = 0
    if resume and (checkpoint / "state.safetensors").exists():
        step = load_checkpoint(checkpoint, head, optimizer)
        progress(f"resuming from step {step} ({checkpoint})")
    if step >= steps:
        progress(f"already at step {step} of {steps}: nothing to train")
        return step
    head.train()
    window: list[tuple[list[float], list[tuple[int, int]]]] = []
    started, first = time.perf_counter(), step
    while step < steps:
        for group in optimizer.param_groups:
            group["lr"] = _lr(step, steps, lr, warmup)
        optimizer.zero_grad(set_to_none=True)
        for b in range(batch):
            if between is not None:
                between()
            index = step * batch + b
            epoch, at = divmod(index, len(samples))
            s = samples[_order(len(samples), seed, epoch)[at]]
            out = ttt_losses(
                head,
                embed,
                s.ids.to(device),
                s.taps.to(device),
                s.label_ids.to(device),
                s.label_probs.to(device),
                s.weights.to(device),
                steps=ttt_steps,
            )
            (out.loss / batch).backward()
            window.append((out.per_step, out.accuracy))
        torch.nn.utils.clip_grad_norm_(trainable, 1.0)
        optimizer.step()
        step += 1
        if step % log_every == 0 or step == steps:
            progress(_line(step, steps, window, started, first))
            window = []
        stopping = stop is not None and step < steps and stop(step)
        if step % save_every == 0 or step == steps or stopping:
            save_checkpoint(checkpoint, head, optimizer, step)
        if stopping:
            progress(f"stopped at step {step} of {steps} (checkpoint saved)")
            break
    head.eval()
    return step


def _line(step: int, steps: int, window, started: float, first: int) -> str:
    depth = max((len(p) for p, _ in window), default=0)
    losses, accs = [], []
    for j in range(depth):
        values = [p[j] for p, _ in window if len(p) > j]
        right = sum(a[j][0] for _, a in window if len(a) > j)
        counted = sum(a[j][1] for _, a in window if len(a) > j)
        losses.append(sum(values) / max(1, len(values)))
        accs.append(right / counted if counted else 0.0)
    per = (time.perf_counter() - started) / max(1, step - first)
    left = per * (steps - step)
    return (
        f"step {step}/{steps} · loss {' '.join(f'{x:.2f}' for x in losses)} · top-1 "
        f"{' '.join(f'{x:.2f}' for x in accs)} · {per:.1f} s/step · {left / 60:.0f} min left"
    )


def export_head(head: Eagle3Head, folder: Path, *, target_layers: int, dtype: torch.dtype = torch.bfloat16) -> int:
    """The head in the published layout (config.json + model.safetensors in ``dtype``); its bytes on disk."""
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    config = head.config.to_dict()
    config["target_num_hidden_layers"] = target_layers  # checked on load (an extra field others ignore)
    config["torch_dtype"] = str(dtype).removeprefix("torch.")
    state = {}
    for key, value in head.state_dict().items():
        if key == "embed_tokens.weight":
            continue  # the target's own embedding is used
        state[key] = (value.to(dtype) if value.is_floating_point() else value).contiguous().cpu()
    tmp = folder / "model.tmp"
    save_file(state, str(tmp), metadata={"format": "pt"})
    os.replace(tmp, folder / "model.safetensors")
    (folder / "config.json").write_text(json.dumps(config, indent=2) + "\n")
    return (folder / "model.safetensors").stat().st_size + (folder / "config.json").stat().st_size


def fresh_head(
    config: Eagle3Config,
    d2t: torch.Tensor,
    t2d: torch.Tensor,
    device: torch.device,
    *,
    output_rows: torch.Tensor | None = None,
    final_norm: torch.Tensor | None = None,
) -> Eagle3Head:
    """A new head with its draft vocabulary (d2t, t2d), weights initialised for training, float32.

    ``output_rows`` [draft_vocab, hidden] (the target's output layer at the draft ids, in draft order) start the
    head's lm_head, which then stays frozen, and ``final_norm`` [hidden] its norm: the head learns to predict the
    target's next top-layer state, which the target's own output layer already reads (EAGLE-1's frozen head).
    Fewer weights to learn, but no guarantee on a small budget: for the embedded default (687
    replies, 1,200 steps) a frozen output layer did worse on held-out replies than one learnt from scratch
    (benchmarks/RESULTS.md, "What more data and a frozen output layer do")."""
    from specchat.backend.speculative.heads.training import init_weights

    head = Eagle3Head(config)
    init_weights(head)
    with torch.no_grad():
        head.d2t.copy_(d2t)
        head.t2d.copy_(t2d)
        if output_rows is not None:
            head.lm_head.weight.copy_(output_rows)
            head.lm_head.weight.requires_grad_(False)
        if final_norm is not None:
            head.norm.weight.copy_(final_norm)
    return head.to(device)
