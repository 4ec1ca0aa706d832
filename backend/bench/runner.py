"""`specchat bench`'s runner: every mode on every prompt, interleaved, in one process.

Modes: ``modes.py`` (names, defaults, ``--modes``); here each runs: specchat's through the engine,
transformers' (``hf.py``), llama-cpp-python's (``llamacpp.py``) and llama-server's (``llama_server.py``).

Protocol: one warm-up generation per mode (which also measures each mode's speed, for the time estimate),
then for each prompt every mode in an order rotated by one per prompt, so drift in machine speed spreads
over all modes. Every mode gets the same prompt ids (the chat template rendered once) and the same seed. A
multi-turn prompt (``BenchPrompt.turns``) runs as one conversation per mode: each later user message follows
that mode's own reply (the same reply in every mode when greedy), and its row sums the turns.
Nothing is cached between runs: every number comes from the generations of this run.

The runner takes a ready :class:`Engine`; where its models come from (a models.yaml pair, or random weights
with real shapes for a synthetic run) is the caller's business.
"""

from __future__ import annotations

import os
import platform
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from datetime import UTC, datetime
from typing import Any, cast

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.bench.hf import hf_generate, quiet_transformers, sdpa_twin
from specchat.backend.bench.llama_server import llama_servers
from specchat.backend.bench.modes import (  # noqa: F401  (re-exported: the bench's callers import them here)
    HF_MODES,
    LLAMACPP_MODES,
    REMOTE_MODE,
    SPECCHAT_DRAFTERS,
    Mode,
    default_modes,
    parse_modes,
)
from specchat.backend.bench.stats import Row, mark_equality
from specchat.backend.bench.suites import BenchPrompt
from specchat.backend.engine.prompting import render
from specchat.backend.errors import RequestError
from specchat.backend.limits import BENCH_SEED, BENCH_TEMPERATURE, DrafterName
from specchat.backend.remote.stats import from_llama_server, remote_stats
from specchat.backend.speculative.stats import StepCounts

WARMUP_TOKENS = 32


@dataclass(slots=True)
class WarmUp:
    """One mode's warm-up generation: its speed feeds the time estimate."""

    mode: str
    prompt_tokens: int
    new_tokens: int
    wall_s: float
    ttft_s: float

    @property
    def decode_tok_s(self) -> float:
        return max(self.new_tokens - 1, 1) / max(self.wall_s - self.ttft_s, 1e-6)

    @property
    def prefill_tok_s(self) -> float:
        return self.prompt_tokens / max(self.ttft_s, 1e-6)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self) | {"decode_tok_s": self.decode_tok_s, "prefill_tok_s": self.prefill_tok_s}


def release_memory() -> None:
    """Collect dropped models now and return cached CUDA blocks, so the next pair finds the memory free."""
    import gc

    import torch

    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


def environment() -> dict[str, Any]:
    """What the numbers were measured on (recorded in bench.json)."""
    import torch
    import transformers

    from specchat import __version__

    return {
        "specchat": __version__,
        "started": datetime.now(UTC).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
        "torch_threads": torch.get_num_threads(),
        "cuda": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


class BenchRunner:
    """Runs modes over prompts with one engine (and transformers twins of its models)."""

    def __init__(
        self,
        engine,
        modes: list[Mode],
        *,
        max_new_tokens: int,
        temperature: float = BENCH_TEMPERATURE,
        seed: int = BENCH_SEED,
        llama_server: str | None = None,
    ) -> None:
        self.engine, self.modes = engine, modes
        # Each prompt is measured alone: with the reply memory on, the suffix drafter would draft a prompt's
        # reply from an earlier mode's identical reply to it.
        engine.use_reply_memory(False)
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.pair_name = engine.pair.name
        self.eos_ids = sorted(engine.eos_ids)
        tokenizer = engine.tokenizer
        pad = tokenizer.pad_token_id
        self.pad_id = int(pad) if pad is not None else self.eos_ids[0]
        needs_hf = any(m.runner == "hf" for m in modes)
        self.hf_target = sdpa_twin(engine.target.model) if needs_hf else None
        needs_assistant = any(m.runner == "hf" and m.drafter == "assisted" for m in modes)
        self.hf_draft = sdpa_twin(engine.draft.model) if needs_assistant else None
        self.llamacpp = _llamacpp(engine, modes)
        self._ids: dict[str, list[int]] = {}
        self.llama_servers = llama_servers(engine, modes, llama_server)  # started now, stopped by close()

    def close(self) -> None:
        """Stop what the runner started (llama-server processes)."""
        for server in self.llama_servers.values():
            server.close()

    def prompt_ids(self, prompt: BenchPrompt) -> list[int]:
        """The chat template rendered once, then the prompt's start of the reply (``assistant_prefix``)."""
        if prompt.id not in self._ids:
            ids = render(self.engine.tokenizer, prompt.message_dicts())
            if prompt.assistant_prefix:
                ids += self.engine.tokenizer.encode(prompt.assistant_prefix, add_special_tokens=False)
            self._ids[prompt.id] = ids
        return self._ids[prompt.id]

    def prompt_length(self, prompt: BenchPrompt) -> int:
        """The prompt's size, for choosing the warm-up prompt (tokens here)."""
        return len(self.prompt_ids(prompt))

    def fits(self, prompt: BenchPrompt) -> bool:
        """Whether the prompt plus max_new_tokens (and a verification step) fits the pair's context; for a
        multi-turn prompt, every turn's reply and message (~4 characters a token, plus the template's)."""
        later = sum(len(turn) // 3 + 16 for turn in prompt.turns)
        replies = (1 + len(prompt.turns)) * (prompt.max_new_tokens or self.max_new_tokens)
        return len(self.prompt_ids(prompt)) + later + replies + 12 <= self.engine.context_length

    # -- one generation ---------------------------------------------------------------------------------

    def _specchat(self, mode: Mode, ids: list[int], max_new: int, seed: int, conversation=None, prompt=None):
        request = GenerationRequest(
            prompt_ids=list(ids),
            sampling=SamplingParams(
                temperature=self.temperature,
                top_k=0,
                top_p=1.0,
                repetition_penalty=1.0,
                max_new_tokens=max_new,
                seed=seed,
                stop=prompt.stop if prompt is not None else (),
            ),
            drafter=cast(DrafterName, mode.drafter),  # a specchat mode's: parse_modes took it from SPECCHAT_DRAFTERS
            gamma=mode.gamma,
            conversation=conversation,
            prediction=prompt.prediction if mode.prediction and prompt is not None else None,
        )
        tokens: list[int] = []
        ttft = None
        last = None
        start = time.perf_counter()
        for event in self.engine.generate(request):
            if ttft is None and event.token_ids:
                ttft = time.perf_counter() - start
            tokens.extend(event.token_ids)
            last = event
        wall = time.perf_counter() - start
        reason = last.finish_reason if last is not None else None
        stats = last.stats if last is not None else None
        # The engine's own step counts (what its RequestStats are computed from), not a recount of the events.
        tally = StepCounts.from_dict(stats.step_counts) if stats is not None and stats.step_counts else StepCounts()
        return tokens, wall, ttft, reason, tally, stats

    def _hf(self, mode: Mode, ids: list[int], max_new: int, seed: int, conversation=None, prompt=None):
        assert self.hf_target is not None  # made in __init__ when a mode runs on transformers
        with quiet_transformers():
            result = hf_generate(
                self.hf_target,
                ids,
                method=mode.drafter,
                max_new_tokens=max_new,
                temperature=self.temperature,
                seed=seed,
                eos_token_ids=self.eos_ids,
                pad_token_id=self.pad_id,
                assistant=self.hf_draft,
            )
        return self._outside(result)

    def _llamacpp(self, mode: Mode, ids: list[int], max_new: int, seed: int, conversation=None, prompt=None):
        assert self.llamacpp is not None  # noqa: S101 - built for every llamacpp mode in __init__
        result = self.llamacpp.generate(
            mode.drafter, ids, max_new_tokens=max_new, temperature=self.temperature, seed=seed, eos_ids=self.eos_ids
        )
        return self._outside(result)

    def _llama_server(self, mode: Mode, ids: list[int], max_new: int, seed: int, conversation=None, prompt=None):
        result = self.llama_servers[mode.drafter].generate(
            ids,
            max_new_tokens=max_new,
            temperature=self.temperature,
            seed=seed,
            stop=prompt.stop if prompt is not None else (),
            eos_ids=frozenset(self.eos_ids),
        )
        figures = from_llama_server({"timings": result.timings})
        stats = remote_stats(
            figures, wall_s=result.wall_s, ttft_s=result.ttft_s, counted_tokens=len(result.token_ids), drafter=mode.name
        )
        return result.token_ids, result.wall_s, result.ttft_s, result.finish_reason, None, stats

    def _outside(self, result):
        """The run tuple of another engine's generation (transformers, llama.cpp): tokens, wall, ttft and why it
        ended, without specchat's step counts and stats."""
        tokens = result.token_ids
        reason = "eos" if tokens and tokens[-1] in self.eos_ids else "length"
        return tokens, result.wall_s, result.ttft_s, reason, None, None

    def run_one(
        self, mode: Mode, prompt: BenchPrompt, *, order: int, seed: int, max_new_tokens: int | None = None
    ) -> Row:
        ids = self.prompt_ids(prompt)
        runners = {"specchat": self._specchat, "hf": self._hf, "llamacpp": self._llamacpp}
        run = self._llama_server if mode.runner == "llama-server" else runners[mode.runner]
        max_new = max_new_tokens or prompt.max_new_tokens or self.max_new_tokens
        if not prompt.turns:
            tokens, wall, ttft, reason, tally, stats = run(mode, ids, max_new, seed, prompt=prompt)
            return Row(
                pair=self.pair_name,
                family=prompt.family,
                category=prompt.category,
                prompt_id=prompt.id,
                mode=mode.name,
                order=order,
                prompt_tokens=len(ids),
                token_ids=tokens,
                wall_s=wall,
                ttft_s=ttft,
                finish_reason=reason,
                tally=tally,
                engine_stats=stats,
            )
        # A multi-turn prompt: one conversation (specchat reuses its cache between turns), each later user
        # message sent after the reply; the row sums the turns (tokens, time, steps), its ttft is the first's.
        messages = prompt.message_dicts()
        key = f"bench:{mode.name}:{prompt.id}"
        all_tokens: list[int] = []
        total_wall, first_ttft, prompt_tokens, tally = 0.0, None, 0, StepCounts()
        try:
            for turn in (None, *prompt.turns):
                if turn is not None:
                    reply = self.engine.tokenizer.decode(tokens, skip_special_tokens=True)
                    messages += [{"role": "assistant", "content": reply}, {"role": "user", "content": turn}]
                    ids = render(self.engine.tokenizer, messages)
                tokens, wall, ttft, reason, turn_tally, stats = run(mode, ids, max_new, seed, key, prompt=prompt)
                all_tokens += tokens
                total_wall += wall
                first_ttft = ttft if first_ttft is None else first_ttft
                prompt_tokens += len(ids)
                if turn_tally is not None:
                    tally.merge(turn_tally)
        finally:
            self.engine.forget(key)
        return Row(
            pair=self.pair_name,
            family=prompt.family,
            category=prompt.category,
            prompt_id=prompt.id,
            mode=mode.name,
            order=order,
            prompt_tokens=prompt_tokens,
            token_ids=all_tokens,
            wall_s=total_wall,
            ttft_s=first_ttft,
            finish_reason=reason,
            tally=tally if mode.runner == "specchat" else None,
            engine_stats=stats,
        )

    # -- the protocol -----------------------------------------------------------------------------------

    def warm_up(self, prompt: BenchPrompt, on_mode: Callable[[Mode], None] | None = None) -> list[WarmUp]:
        """One short generation per mode on ``prompt`` (not recorded as a row); returns their speeds."""
        result = []
        for mode in self.modes:
            if on_mode is not None:
                on_mode(mode)
            row = self.run_one(
                mode, prompt, order=0, seed=self.seed, max_new_tokens=min(WARMUP_TOKENS, self.max_new_tokens)
            )
            ttft = row.ttft_s if row.ttft_s is not None else row.wall_s
            result.append(WarmUp(mode.name, row.prompt_tokens, row.new_tokens, row.wall_s, ttft))
        return result

    def estimate_s(self, prompts: list[BenchPrompt], warm: list[WarmUp]) -> dict[str, float]:
        """Seconds each mode should take on ``prompts``: every prompt prefilled at the mode's warm-up prefill
        rate plus max_new_tokens at its warm-up decode rate (an upper bound: replies may stop earlier)."""
        prompt_tokens = sum(len(self.prompt_ids(p)) for p in prompts)
        new_tokens = sum(p.max_new_tokens or self.max_new_tokens for p in prompts)
        return {w.mode: prompt_tokens / w.prefill_tok_s + new_tokens / w.decode_tok_s for w in warm}

    def run(
        self,
        prompts: list[BenchPrompt],
        *,
        on_start: Callable[[BenchPrompt, Mode], None] | None = None,
        on_row: Callable[[Row], None] | None = None,
        repeats: int = 1,
    ) -> list[Row]:
        """Every mode on every prompt, ``repeats`` times (the same seed each time), mode order rotated per
        prompt and repeat; rows get equality marks."""
        rows: list[Row] = []
        count = len(self.modes)
        for repeat in range(repeats):
            for index, prompt in enumerate(prompts):
                shift = (index + repeat * len(prompts)) % count
                order = self.modes[shift:] + self.modes[:shift]
                for position, mode in enumerate(order):
                    if on_start is not None:
                        on_start(prompt, mode)
                    row = self.run_one(mode, prompt, order=position, seed=self.seed + index)
                    row.repeat = repeat
                    rows.append(row)
                    if on_row is not None:
                        on_row(row)
        mark_equality(rows, greedy=self.temperature <= 0)
        return rows


def _llamacpp(engine, modes: list[Mode]):
    """llama.cpp on the target's GGUF, when a llama.cpp mode is asked for (parse_modes checked it can run)."""
    drafters = tuple(m.drafter for m in modes if m.runner == "llamacpp")
    if not drafters:
        return None
    import torch

    from specchat.backend.bench.llamacpp import LlamaCpp, unavailable
    from specchat.backend.models.loading.pair import gguf_path

    gguf = gguf_path(engine.target.spec)
    reason = unavailable(gguf)
    if reason is not None or gguf is None:
        raise RequestError(f"llama.cpp modes cannot run: {reason}")
    return LlamaCpp(gguf, drafters=drafters, context_length=engine.context_length, threads=torch.get_num_threads())
