"""`specchat serve`'s settings: :class:`ServeConfig`, the limits and choices one server runs with (the CLI fills
it from its options; app/serve/server.py builds the server from it, app/serve/routes.py reads it per request).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from specchat.app.serve.boundary import DEFAULT_QUEUE, Limits
from specchat.app.serve.protocol import Guard

DEFAULT_BODY_TIMEOUT_S = 30.0
DEFAULT_KEEP_ALIVE_S = 5
DEFAULT_SHUTDOWN_TIMEOUT_S = 10


@dataclass(frozen=True)
class ServeConfig:
    model: str  # the served pair's name: the only model id
    limits: Limits = field(default_factory=Limits)
    queue_size: int = DEFAULT_QUEUE
    api_key: str | None = None
    blocks_in_use: Any = None  # () -> int, the engine's KV blocks in use (shown in /metrics) when known
    guard: Guard = field(default_factory=Guard)
    body_timeout_s: float = DEFAULT_BODY_TIMEOUT_S
    keep_alive_s: int = DEFAULT_KEEP_ALIVE_S
    shutdown_timeout_s: int = DEFAULT_SHUTDOWN_TIMEOUT_S
    # The operator's opt-in: requests may learn from each other (app/serve/server.py's docstring), and every client's
    # prompts are one prefix-cache scope (off: one scope per client, app/serve/routes.py).
    share_state: bool = False
    log_prompts: bool = False  # the access log shows each request's last user message
    batch: Any = None  # an owner.Batch (`--parallel N` > 1, built by app/cli/serve.py); None: one at a time
    # The served pair's configured γ (vLLM's num_spec_tokens; auto: limits.MAX_GAMMA; 0 without a drafter); None:
    # unknown, and a reply reports the largest γ it used.
    spec_tokens: int | None = None
