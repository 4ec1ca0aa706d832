"""A request's sampling settings, resolved: the request's, else the pair's defaults, else the model's
generation_config, checked against the limits of ``backend/limits.py``. A request without a seed gets one drawn
from OS entropy; it is reported with the reply's statistics, so any reply can be replayed.
"""

from __future__ import annotations

import secrets
from dataclasses import dataclass

from specchat.backend.api import SamplingParams
from specchat.backend.limits import DEFAULT_MAX_NEW_TOKENS, check_sampling_value
from specchat.backend.speculative.sampling import SamplingRule


@dataclass(slots=True, frozen=True)
class Sampling:
    temperature: float
    top_k: int | None
    top_p: float | None
    repetition_penalty: float | None
    max_new_tokens: int
    seed: int  # the request's, or one drawn for it (reported, so the reply can be replayed)
    stop: tuple[str, ...]

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0

    @property
    def rule(self) -> SamplingRule:
        return SamplingRule(self.temperature, self.top_k, self.top_p, self.repetition_penalty, self.seed)


def draw_seed() -> int:
    """A fresh seed from OS entropy, below 2**53 so a JSON reader that parses numbers as doubles keeps it."""
    return secrets.randbits(53)


def resolve_sampling(params: SamplingParams, pair, generation_config: dict) -> Sampling:
    """Request settings, else the pair's defaults, else the model's generation_config; validated."""
    defaults = dict(pair.sampling or {})

    def setting(name: str, fallback):
        value = getattr(params, name)
        if value is None:
            value = defaults.get(name, generation_config.get(name, fallback))
        return value

    do_sample = generation_config.get("do_sample", False)
    temperature = setting("temperature", 0.7 if do_sample else 0.0)
    top_k, top_p = setting("top_k", None), setting("top_p", None)
    penalty = setting("repetition_penalty", None)
    max_new = (
        params.max_new_tokens
        if params.max_new_tokens is not None
        else defaults.get("max_new_tokens", DEFAULT_MAX_NEW_TOKENS)
    )
    for name, value in (
        ("temperature", temperature),
        ("top_k", top_k),
        ("top_p", top_p),
        ("repetition_penalty", penalty),
        ("max_new_tokens", max_new),
    ):
        check_sampling_value(name, value)  # the pair's and the model's defaults pass the request's limits too
    seed = params.seed if params.seed is not None else draw_seed()
    return Sampling(
        float(temperature),
        top_k or None,
        top_p if top_p and top_p < 1 else None,
        penalty if penalty and penalty != 1 else None,
        max_new,
        seed,
        tuple(params.stop),
    )
