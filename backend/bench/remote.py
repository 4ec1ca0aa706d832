"""`specchat bench` on a remote pair: the same protocol as runner.py (warm-up, every mode on every prompt in
rotated order, equality marks), over a :class:`~specchat.backend.remote.client.RemoteEngine`.

Differences from a local pair, because the model is on the server: requests carry messages (the server applies
its chat template), so prompt token counts come from the server's ``usage``; rows carry the server's token ids
when it sends them (vLLM, `specchat serve`), else only its token count (``Row.reported_tokens``; greedy equality
marks then compare counts only where ids exist); no step tally (the server reports totals, kept in
``Row.engine_stats``); every prompt "fits" (the server refuses what does not). Time is measured here, around
the whole request, as for local modes: tok/s include the network. On a vLLM server the run also records vLLM's
per-position acceptance between its ``/metrics`` counters before and after the run (server-wide counters: exact
when nothing else used the server meanwhile).
"""

from __future__ import annotations

import time
from typing import Any, cast

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.bench.runner import BenchRunner, Mode, WarmUp
from specchat.backend.bench.stats import Row
from specchat.backend.bench.suites import BenchPrompt
from specchat.backend.limits import BENCH_SEED, BENCH_TEMPERATURE, DrafterName
from specchat.backend.remote.stats import vllm_counters


class RemoteBenchRunner(BenchRunner):
    """BenchRunner over a remote engine (see the module docstring)."""

    def __init__(
        self,
        engine: Any,
        modes: list[Mode],
        *,
        max_new_tokens: int,
        temperature: float = BENCH_TEMPERATURE,
        seed: int = BENCH_SEED,
    ) -> None:
        self.engine, self.modes = engine, modes
        self.max_new_tokens, self.temperature, self.seed = max_new_tokens, temperature, seed
        self.pair_name = engine.pair.name
        self._prompt_tokens: dict[str, int] = {}

    def close(self) -> None:
        """Nothing to stop: the remote server is not the bench's."""

    def prompt_ids(self, prompt: BenchPrompt) -> list[int]:
        raise TypeError("a remote pair's prompts are sent as messages; the server tokenizes them")

    def prompt_length(self, prompt: BenchPrompt) -> int:
        """Characters (the server tokenizes; the order is what matters)."""
        return sum(len(content) for _, content in prompt.messages)

    def fits(self, prompt: BenchPrompt) -> bool:
        return True

    def run_one(
        self, mode: Mode, prompt: BenchPrompt, *, order: int, seed: int, max_new_tokens: int | None = None
    ) -> Row:
        request = GenerationRequest(
            messages=prompt.message_dicts(),
            sampling=SamplingParams(
                temperature=self.temperature,
                top_k=0,
                top_p=1.0,
                repetition_penalty=1.0,
                max_new_tokens=max_new_tokens or self.max_new_tokens,
                seed=seed,
            ),
            # a specchat server's mode names a drafter (runner._remote_modes); "server": the server's own
            drafter=None if mode.drafter == "server" else cast(DrafterName, mode.drafter),
            gamma=mode.gamma,
        )
        tokens: list[int] = []
        ttft, last = None, None
        start = time.perf_counter()
        for event in self.engine.generate(request):
            if ttft is None and (event.token_ids or event.text):
                ttft = time.perf_counter() - start
            tokens.extend(event.token_ids)
            last = event
        wall = time.perf_counter() - start
        stats = last.stats if last is not None else None
        prompt_tokens = stats.prompt_tokens if stats is not None else 0
        self._prompt_tokens[prompt.id] = prompt_tokens
        return Row(
            pair=self.pair_name,
            family=prompt.family,
            category=prompt.category,
            prompt_id=prompt.id,
            mode=mode.name,
            order=order,
            prompt_tokens=prompt_tokens,
            token_ids=tokens,
            wall_s=wall,
            ttft_s=ttft,
            finish_reason=last.finish_reason if last is not None else None,
            tally=None,
            engine_stats=stats,
            reported_tokens=None if tokens or stats is None else stats.new_tokens,
        )

    def server_counters(self) -> dict[str, Any] | None:
        """vLLM's speculation counters now (``/metrics``), for the run's per-position acceptance; None for other
        servers or when there is no /metrics."""
        if self.engine.spec.server_kind != "vllm":
            return None
        text = self.engine.metrics_text()
        return vllm_counters(text) if text is not None else None

    def estimate_s(self, prompts: list[BenchPrompt], warm: list[WarmUp]) -> dict[str, float]:
        """Seconds per mode: each prompt at the warm-up's time to first token plus max_new_tokens at its decode
        rate (the server's prefill rate is not known per token here)."""
        return {w.mode: len(prompts) * (w.ttft_s + self.max_new_tokens / w.decode_tok_s) for w in warm}
