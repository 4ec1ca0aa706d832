"""A deterministic fake of the engine API (``generate(request, cancel) -> Iterator[StepEvent]``, ``forget``,
``close``, ``pair``, ``context_length``) for the UI tests, plus fake pairs, a fake engine factory and a fake
``pair_info``.

The fake streams a canned Markdown reply with a code block, split into word/space/punctuation "tokens".
Steps follow ``accept_pattern`` (accepted drafts per step with γ = ``gamma``): accepted tokens are ACCEPTED,
then one RECOVERED (a rejection) or BONUS (all accepted) token; every ``pause_every``-th step is a plain
PAUSED step (one TARGET token). The first event is the prefill (one TARGET token, NO_DRAFT). Every event carries
the request's statistics (with the request's seed, else :data:`FAKE_SEED`), counted by the engine's own
``SpecStats`` (``backend/speculative/stats.py``) on a fake clock when ``wall_s`` fixes the times; the last one carries
``finish_reason``. It honours ``cancel`` between steps and ``max_new_tokens``; it can sleep per step, raise at a
given step, or end with "context". With ``prefill_passes`` it reads a prompt of ``prefill_tokens`` in that many
passes of ``prefill_delay_s`` each, yielding a prefill progress event before each when the request asks
(``prefill_progress``), and honours ``cancel`` between them.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any

from specchat.backend.api import GenerationRequest, PolicyState, StepEvent, TokenSource
from specchat.backend.errors import ModelLoadError, SpecchatError
from specchat.backend.limits import DEFAULT_MAX_NEW_TOKENS
from specchat.backend.speculative.request_stats import SpecStats

CANNED_REPLY = """Here is a function that reverses a string:

```python
def reverse(text: str) -> str:
    return text[::-1]
```

Call it as `reverse("abc")`; it returns `"cba"`.
"""


FAKE_SEED = 1234567  # the seed a request without one reports (the engine draws one)


def split_tokens(text: str) -> list[str]:
    return re.findall(r"\s+|\w+|[^\w\s]", text)


@dataclass(frozen=True)
class FakeSpec:
    source: str
    kind: str = "packaged"
    revision: str | None = None
    download_bytes: int = 0
    gated: bool = False


@dataclass(frozen=True)
class FakePair:
    name: str
    description: str = "a fake pair"
    drafter: str = "prompt-lookup"
    target: FakeSpec = FakeSpec("packaged:fake-target")
    draft: FakeSpec | None = None
    gamma: int | str = "auto"
    context_length: int = 2048
    sampling: dict = field(default_factory=dict)


def fake_pairs() -> dict[str, FakePair]:
    return {
        "smollm2-135m": FakePair("smollm2-135m", "embedded default, prompt lookup"),
        "big-pair": FakePair(
            "big-pair",
            "a big hub pair",
            drafter="draft-model",
            target=FakeSpec("Org/Big-7B", kind="hub", download_bytes=15_000_000_000, gated=True),
            draft=FakeSpec("Org/Small-0.5B", kind="hub", download_bytes=1_000_000_000),
            gamma=5,
        ),
        "plain": FakePair("plain", "no drafter", drafter="none", gamma=1),
    }


def fake_pair_info(pair: Any) -> dict[str, Any]:
    big = pair.name == "big-pair"
    return {
        "memory_bytes": 18_000_000_000 if big else 600_000_000,
        "free_bytes": 16_000_000_000,
        "fits": not big,
        "download_bytes": pair.target.download_bytes + (pair.draft.download_bytes if pair.draft else 0),
        "gated": pair.target.gated,
    }


class FakeEngine:
    def __init__(
        self,
        pair: Any,
        *,
        reply: str | Callable[[GenerationRequest], str] = CANNED_REPLY,
        gamma: int = 4,
        accept_pattern: tuple[int, ...] = (4, 2, 0, 3, 1),
        pause_every: int = 0,
        step_delay_s: float = 0.0,
        fail_at_step: int | None = None,
        error: BaseException | None = None,
        end_with_context: bool = False,
        notice_at_step: int | None = None,
        expected_speedup: float | None = 1.8,
        wall_s: float | None = None,
        prefill_passes: int = 0,
        prefill_tokens: int = 5000,
        prefill_delay_s: float = 0.0,
    ) -> None:
        self.pair, self.context_length, self.tokenizer = pair, pair.context_length, None
        self.reply, self.gamma, self.accept_pattern, self.pause_every = reply, gamma, accept_pattern, pause_every
        self.step_delay_s, self.fail_at_step, self.error = step_delay_s, fail_at_step, error
        self.end_with_context, self.notice_at_step = end_with_context, notice_at_step
        self.expected_speedup = expected_speedup
        self.wall_s = wall_s  # fixed stats times (snapshot tests); None: measured
        self.prefill_passes, self.prefill_tokens, self.prefill_delay_s = prefill_passes, prefill_tokens, prefill_delay_s
        self.requests: list[GenerationRequest] = []
        self.forgotten: list[str] = []
        self.closed = False
        self.active = threading.Event()  # set while generate() runs (tests check one owner at a time)
        self.started = threading.Event()  # set once the first event has been yielded

    def use_reply_memory(self, enabled: bool, replies: Any = ()) -> int:
        """As Engine.use_reply_memory: records what the CLI gave the suffix drafter's memory."""
        self.reply_memory = (enabled, list(replies))
        return 0

    def forget(self, conversation: str) -> None:
        self.forgotten.append(conversation)

    def close(self) -> None:
        self.closed = True

    def _event(
        self,
        tokens: list[str],
        sources: list[TokenSource],
        *,
        gamma: int,
        accepted: int,
        policy: PolicyState,
        drafter: str,
        **extra: Any,
    ) -> StepEvent:
        return StepEvent(
            token_ids=list(range(len(tokens))),
            sources=sources,
            token_texts=tokens,
            text="".join(tokens),
            gamma=gamma,
            accepted=accepted,
            draft_s=0.001 * gamma,
            verify_s=0.01,
            overhead_s=0.001,
            policy=policy,
            drafter=drafter,
            **extra,
        )

    def generate(self, request: GenerationRequest, cancel: threading.Event | None = None) -> Iterator[StepEvent]:
        if self.active.is_set():
            raise AssertionError("two generate() calls at once: the UI must wait for the first to end")
        self.active.set()
        try:
            yield from self._generate(request, cancel or threading.Event())
        finally:
            self.active.clear()

    def _generate(self, request: GenerationRequest, cancel: threading.Event) -> Iterator[StepEvent]:
        self.requests.append(request)
        if self.fail_at_step == 0:
            raise self.error or SpecchatError("fake failure before the first token")
        text = self.reply(request) if callable(self.reply) else self.reply
        pieces = split_tokens(text)
        drafter = request.drafter or self.pair.drafter
        passes = (
            range(0, self.prefill_tokens, -(-self.prefill_tokens // self.prefill_passes))
            if self.prefill_passes
            else range(0)
        )
        for done in passes:
            if cancel.is_set():
                yield self._event(
                    [],
                    [],
                    gamma=0,
                    accepted=0,
                    policy=PolicyState.OFF,
                    drafter=drafter,
                    finish_reason="cancelled",
                    stats=SpecStats().report(drafter=drafter),
                )
                return
            if request.prefill_progress:
                yield self._event(
                    [],
                    [],
                    gamma=0,
                    accepted=0,
                    policy=PolicyState.OFF,
                    drafter=drafter,
                    prefill_tokens=self.prefill_tokens,
                    prefill_done=done,
                )
            cancel.wait(self.prefill_delay_s)
        limit = request.sampling.max_new_tokens or DEFAULT_MAX_NEW_TOKENS
        drafter = request.drafter or self.pair.drafter
        fixed = request.gamma if isinstance(request.gamma, int) else None
        now = [0.0]  # the fake clock when wall_s fixes the times: the prefill at 0.01 s, the last token at wall_s
        clock = (lambda: now[0]) if self.wall_s else time.monotonic
        seed = request.sampling.seed if request.sampling.seed is not None else FAKE_SEED
        stats = SpecStats(clock=clock, seed=seed)
        if request.prediction is not None:  # counted as the engine does: the steps of the drafter "prediction"
            stats.prediction = ("prediction", len(split_tokens(request.prediction)))
            drafter = "prediction"
        steps = 0
        first_policy = PolicyState.OFF if drafter == "none" else PolicyState.NO_DRAFT  # the prefill drafts nothing
        now[0] = 0.01
        stats.observe_prefill(tokens=17, seconds=0.01, policy=first_policy)
        yield self._event(
            pieces[:1],
            [TokenSource.TARGET],
            gamma=0,
            accepted=0,
            policy=first_policy,
            drafter=drafter,
            is_prefill=True,
            prefill_tokens=17,
            stats=stats.report(drafter=drafter),
        )
        self.started.set()
        emitted = 1
        finish = "eos"
        last: StepEvent | None = None  # the step that emitted the final token carries the finish
        while emitted < len(pieces):
            if cancel.is_set():
                finish = "cancelled"
                break
            if self.step_delay_s:
                cancel.wait(self.step_delay_s)
                if cancel.is_set():
                    finish = "cancelled"
                    break
            if self.fail_at_step is not None and steps + 1 >= self.fail_at_step:
                raise self.error or SpecchatError("fake failure mid-reply")
            if emitted >= limit:
                finish = "length"
                break
            if self.end_with_context and steps >= 3:
                finish = "context"
                break
            steps += 1
            message = "fake notice: drafter switched off" if self.notice_at_step == steps else None
            if drafter == "none" or (self.pause_every and steps % self.pause_every == 0):
                chunk = pieces[emitted : emitted + 1]
                gamma, acc, sources = 0, 0, [TokenSource.TARGET]
                policy = PolicyState.OFF if drafter == "none" else PolicyState.PAUSED
            else:
                gamma = fixed or self.gamma
                acc = min(self.accept_pattern[(steps - 1) % len(self.accept_pattern)], gamma)
                chunk = pieces[emitted : emitted + acc + 1]
                acc = min(acc, len(chunk) - 1)  # the reply's end cuts the draft short
                sources = [TokenSource.ACCEPTED] * acc + [TokenSource.BONUS if acc == gamma else TokenSource.RECOVERED]
                policy = PolicyState.SPECULATING
            event = self._event(
                chunk, sources, gamma=gamma, accepted=acc, policy=policy, drafter=drafter, message=message
            )
            emitted += len(chunk)
            if self.wall_s and emitted >= len(pieces):
                now[0] = self.wall_s
            stats.observe_step(
                drafter=drafter,
                gamma=gamma,
                accepted=acc,
                emitted=len(chunk),
                policy=policy,
                draft_s=event.draft_s,
                verify_s=event.verify_s,
                overhead_s=event.overhead_s,
            )
            event.stats = stats.report(prompt_tokens=30, drafter=drafter)
            if emitted >= len(pieces):
                last = event
                break
            yield event
        if self.wall_s:
            now[0] = self.wall_s
        if self.expected_speedup is not None:
            stats.set_policy(self.expected_speedup, None)
        final = stats.report(prompt_tokens=30, drafter=drafter)
        if last is not None:
            last.finish_reason, last.stats = finish, final
            yield last
        else:
            message = "fake: the conversation is longer than the context" if finish == "context" else None
            yield self._event(
                [],
                [],
                gamma=0,
                accepted=0,
                policy=first_policy,
                drafter=drafter,
                finish_reason=finish,
                stats=final,
                message=message,
            )


class FakeEngineFactory:
    """An ``EngineFactory`` (app/tui/seams.py): ``factory(pair, progress, confirm_download) -> FakeEngine``;
    records calls, can fail per pair, be slow, or need a download (then asks ``confirm_download``)."""

    def __init__(
        self,
        *,
        load_delay_s: float = 0.0,
        fail: dict[str, BaseException] | None = None,
        downloads: dict[str, int] | None = None,
        **engine_kwargs: Any,
    ) -> None:
        self.load_delay_s, self.fail, self.engine_kwargs = load_delay_s, dict(fail or {}), engine_kwargs
        self.downloads = dict(downloads or {})  # pair -> bytes still to download (asks confirm_download)
        self.confirmations: list[tuple[str, bool]] = []
        self.calls: list[str] = []
        self.engines: list[FakeEngine] = []
        self.release = threading.Event()  # set to let a load with load_delay_s < 0 finish
        self.release.set()

    def __call__(
        self, pair: Any, progress: Callable[[str, float | None], None], confirm_download: Callable[[int], bool]
    ) -> FakeEngine:
        self.calls.append(pair.name)
        if (
            pair.name in self.downloads
        ):  # as backend/models/loading/pair.py: ask once for the total, refuse when declined
            ok = confirm_download(self.downloads[pair.name])
            self.confirmations.append((pair.name, ok))
            if not ok:
                raise ModelLoadError(f"pair '{pair.name}': the download was declined; nothing was downloaded")
        progress(f"loading {pair.name}", None)
        for i in range(3):
            time.sleep(self.load_delay_s / 3)
            progress(f"loading {pair.name} weights", (i + 1) / 3)
        self.release.wait(10)
        print("stray library output from the loader thread")  # must never reach the screen
        if pair.name in self.fail:
            raise self.fail[pair.name]
        engine = FakeEngine(pair, **self.engine_kwargs)
        self.engines.append(engine)
        return engine
