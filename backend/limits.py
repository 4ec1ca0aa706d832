"""Every limit and default of specchat, defined once: each layer (engine, models.yaml, the CLI, the chat
settings, `specchat serve`, `specchat bench`) imports them from here, and their checks with them.

Pure constants and checks: no torch, no Textual (it is a leaf, like ``errors.py``). Units: tokens unless a name
says otherwise. Where a layer needs another value of the same quantity (a chat reply's default length, the
server's ceiling), it is a named constant here with the reason it differs.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any, Literal, get_args

from specchat.backend.errors import RequestError

# -- pairs and drafters --------------------------------------------------------------------------------------
DEFAULT_PAIR = "smollm2-135m"  # the pair opened first: the embedded default model

HeadDrafterName = Literal["eagle3", "medusa"]  # the drafters that read the target's features through a head
# the drafters that propose tokens
SpeculativeDrafterName = Literal["prompt-lookup", "suffix", "draft-model", HeadDrafterName]
# what a pair in models.yaml may name (auto: with a head: the engine may pick it)
PairDrafterName = Literal[SpeculativeDrafterName, "auto", "none"]
DrafterName = Literal["none", SpeculativeDrafterName, "auto"]  # what a request may ask for (auto: the engine picks)
HEAD_DRAFTERS: tuple[HeadDrafterName, ...] = get_args(HeadDrafterName)  # eagle3, medusa
PAIR_DRAFTERS: tuple[PairDrafterName, ...] = get_args(PairDrafterName)  # prompt-lookup ... medusa, auto, none
DRAFTERS: tuple[DrafterName, ...] = get_args(DrafterName)  # none, prompt-lookup ... medusa, auto

# -- speculation and the KV cache ----------------------------------------------------------------------------
Gamma = int | Literal["auto"]  # drafted tokens per step: 1 .. MAX_GAMMA, or "auto" (the γ policy chooses)
MAX_GAMMA = 31  # drafted tokens per step: n = γ + 1 <= 32, the largest CUDA-graph bucket
# A prediction's drafts per step (GenerationRequest.prediction): n = 64 rows, what the CPU paths attend row by row
# (kernels/compact.ROWWISE_ROWS); a path that does not (CUDA graphs, eager) keeps MAX_GAMMA (runner.exact_rows).
MAX_PREDICTION_GAMMA = 63
MAX_PREDICTION_CHARS = 1 << 22  # a prediction's text: more than any context holds
KV_BLOCK_SIZE = 16  # tokens per KV cache block (the paged cache's unit of allocation and of rollback)
# `specchat serve --parallel` / `generate --parallel` when not given: streams batched at once (measured on a 2-core
# Zen 4 with the embedded default: benchmarks/RESULTS.md, "Continuous batching").
DEFAULT_PARALLEL = 8
PREFILL_CHUNK = 512  # prompt tokens per prefill pass: bounds the attention scratch of long prompts
# The CPU native model's: its pass buffers (activations, MLP rows, attention scores) are sized by the rows of a pass
# and kept between passes, and its prefill took the same CPU time in passes of 64 rows as of 128 or 512
# (benchmarks/RESULTS.md, "Memory to llama.cpp's level").
NATIVE_PREFILL_CHUNK = 64
MIN_CONTEXT, MAX_CONTEXT = 64, 1 << 20  # a pair's context_length
# A pair's context_length when models.yaml gives none: this, or less where the target model states a shorter one.
DEFAULT_CONTEXT = 8192
# `specchat serve` keeps each client's recent prompts' K/V (backend/engine/prefix_cache.py), so a request resending
# them (an agent sends its whole conversation every turn) prefills only what is new: at most this much K/V memory,
# on top of one context's (`serve --prefix-cache-mb`; 0 turns it off). 512 MiB holds ~23k tokens of the embedded
# default (23 KB a token) or ~4k of a 7B model with 8 K/V heads; on CPU the pages are taken as they are written.
SERVE_PREFIX_CACHE_BYTES = 512 * 2**20
# A kept prompt a new request shares only in part is forked (kept for its own next turn) when its unshared tail is at
# least this long; a shorter tail (a reply the client re-encoded differently, a retried turn) is given up.
PREFIX_FORK_TOKENS = 64

# -- a model's sizes -----------------------------------------------------------------------------------------
# What a model's files (GGUF metadata, config.json) or models.yaml may state: a value outside is not a real model's
# (2**32 - 1 layers, 0 heads: a corrupt or hostile file), refused when the pair is read or added, not at load.
# Generous: the largest published models have ~130 layers, 128 heads, head_dim 256, hidden 32k, vocab 262k.
MODEL_SIZE_LIMITS: dict[str, tuple[int, int]] = {
    "num_layers": (1, 1024),
    "num_attention_heads": (1, 4096),
    "num_kv_heads": (1, 4096),
    "head_dim": (1, 4096),
    "hidden_size": (1, 1 << 18),
    "vocab_size": (1, 1 << 24),
}


def model_size_problem(name: str, value: Any) -> str | None:
    """Why ``value`` cannot be a model's ``name`` (a key of :data:`MODEL_SIZE_LIMITS`), or None."""
    low, high = MODEL_SIZE_LIMITS[name]
    if not is_int(value) or not low <= value <= high:
        return f"{name} = {value!r} is not a real model's (expected {low} to {high:,})"
    return None


# -- remote pairs ------------------------------------------------------------------------------------------
# A remote request ends with a clear error when its server sends no new token for REMOTE_NO_PROGRESS_S (the first
# token included: a long prompt's prefill on a large model; keep-alive comments and empty chunks do not count), or
# has not finished within REMOTE_DEADLINE_S. Both per pair (models.yaml target.no_progress_s / deadline_s).
REMOTE_NO_PROGRESS_S = 120.0
REMOTE_DEADLINE_S = 900.0
MIN_REMOTE_TIMEOUT_S, MAX_REMOTE_TIMEOUT_S = 0.1, 86400.0  # what models.yaml may set for either

# -- sampling ------------------------------------------------------------------------------------------------
MAX_TEMPERATURE = 10.0  # 0 is greedy
# Temperatures below this are greedy: the argmax, lowest id on ties (as vLLM's _SAMPLING_EPS). At such a temperature
# p' holds every id tied at the largest logit with equal mass and nothing else (a logit 1e-3 lower weighs
# e^-100); sampling would break those ties by noise. A request must say 0 for that: a temperature in (0, this)
# (1e-320, a denormal) is refused rather than quietly read as greedy.
GREEDY_TEMPERATURE = 1e-5
MIN_TEMPERATURE = GREEDY_TEMPERATURE  # the smallest temperature above 0 a request may give
MAX_REPETITION_PENALTY = 10.0  # 1 is none; values in (0, 1) favour repeats
# Below this a penalty multiplies a repeated token's odds past anything else's (1e-320 repeats one token forever):
# the same extreme as MAX_REPETITION_PENALTY the other way.
MIN_REPETITION_PENALTY = 1 / MAX_REPETITION_PENALTY
MIN_TOP_P = 1e-5  # a smaller top-p keeps only the most likely token, as this one does (1e-320 is a denormal)
MAX_TOP_K = MODEL_SIZE_LIMITS["vocab_size"][1]  # past any vocabulary: 2**70 is no top-k, mistyped
MAX_SEED = 2**64 - 1  # seeds are 0 .. MAX_SEED

# -- new tokens per reply ------------------------------------------------------------------------------------
MAX_NEW_TOKENS = 1 << 20  # what a request may ask for; the pair's context length is the practical bound
DEFAULT_MAX_NEW_TOKENS = 512  # when neither the request nor the pair says
# The chat UI always sends its setting (so it overrides a pair's default): longer than the engine's fallback
# because a chat reply may be code or a whole edited file, and bounded lower than MAX_NEW_TOKENS so that a slip
# in the settings dialog (an extra digit or two) is refused there rather than run until the context is full.
CHAT_MAX_NEW_TOKENS = 1024
CHAT_MAX_NEW_TOKENS_LIMIT = 32768
# `specchat serve` answers other programs with one engine: a request asking for MAX_NEW_TOKENS would hold it for
# every other client, so the server's ceiling is lower (its --max-tokens raises it).
SERVE_MAX_TOKENS = 4096
# `specchat bench` runs every prompt in every mode, twice: 128 tokens a reply keeps a whole run to minutes while
# each reply still takes enough steps for its acceptance figures.
BENCH_MAX_NEW_TOKENS = 128
# The bench compares modes token for token: greedy, and one seed, unless --temperature / --seed say otherwise.
BENCH_TEMPERATURE = 0.0
BENCH_SEED = 0


def is_number(value: Any) -> bool:
    """A finite int or float (never a bool)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def is_int(value: Any) -> bool:
    """An int (never a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


# name -> (check, what to use instead); a value None is "unset" and never checked here.
SAMPLING_LIMITS: dict[str, tuple[Callable[[Any], bool], str]] = {
    "temperature": (
        lambda v: is_number(v) and (v == 0 or MIN_TEMPERATURE <= v <= MAX_TEMPERATURE),
        f"0 (greedy) or a number from {MIN_TEMPERATURE:g} to {MAX_TEMPERATURE:g}",
    ),
    "top_k": (lambda v: is_int(v) and 0 <= v <= MAX_TOP_K, f"a whole number from 0 (no top-k) to {MAX_TOP_K}"),
    "top_p": (lambda v: is_number(v) and MIN_TOP_P <= v <= 1, f"a number from {MIN_TOP_P:g} to 1 (1: no top-p)"),
    "repetition_penalty": (
        lambda v: is_number(v) and MIN_REPETITION_PENALTY <= v <= MAX_REPETITION_PENALTY,
        f"a number from {MIN_REPETITION_PENALTY:g} to {MAX_REPETITION_PENALTY:g} (1: no penalty)",
    ),
    "max_new_tokens": (lambda v: is_int(v) and 1 <= v <= MAX_NEW_TOKENS, f"a whole number from 1 to {MAX_NEW_TOKENS}"),
    "seed": (lambda v: is_int(v) and 0 <= v <= MAX_SEED, "a whole number from 0 to 2**64 - 1"),
}


def check_sampling_value(name: str, value: Any) -> None:
    """Raise :class:`RequestError` naming ``name``, ``value`` and the accepted range unless ``value`` is None or
    within :data:`SAMPLING_LIMITS`. The one check behind the CLI, the settings, models.yaml and the engine."""
    if value is None:
        return
    ok, what = SAMPLING_LIMITS[name]
    if not ok(value):
        raise RequestError(f"sampling setting {name}={value!r} is out of range: use {what}")


def check_seed_range(seed: int | None, samples: int, option: str = "--seed") -> None:
    """Samples i = 0 .. samples - 1 of a run use seed + i (``generate --samples``, the replay bench): refuse a
    ``seed`` whose last sample's seed would pass MAX_SEED (wrapping would silently replay seed 0), naming the
    largest seed that fits. ``seed`` None: each sample draws its own; a seed itself out of range is left to the
    sampling check (``SAMPLING_LIMITS``), which names the field."""
    if seed is not None and 0 <= seed <= MAX_SEED < seed + samples - 1:
        raise RequestError(
            f"{option} {seed} with {samples} samples uses seeds {seed} .. {seed + samples - 1}, past the largest "
            f"seed 2**64 - 1; use {option} {MAX_SEED - samples + 1} or lower"
        )


def is_gamma(value: Any) -> bool:
    """Whether ``value`` is a γ: "auto" or a whole number 1 .. MAX_GAMMA (never a bool)."""
    return value == "auto" or (is_int(value) and 1 <= value <= MAX_GAMMA)


def check_gamma(value: Any) -> Gamma:
    """``value`` as a γ ("auto" or 1 .. MAX_GAMMA); RequestError naming it otherwise."""
    if is_gamma(value):
        return value
    raise RequestError(f"gamma must be 'auto' or a number from 1 to {MAX_GAMMA}, got {value!r}")
