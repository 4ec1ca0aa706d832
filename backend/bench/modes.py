"""`specchat bench`'s modes: their names, which the run takes by default, and ``--modes`` parsed (split from
runner.py, which runs them).

Modes (names used in tables, JSON and ``--modes``):

- specchat: ``plain`` (no drafter), ``prompt-lookup``, ``suffix`` (trees from the conversation; the reply
  memory is off in the bench, so each prompt is measured alone), ``draft-model`` (pairs with a draft), ``auto``
  (the engine picks drafter and γ); a drafter mode may fix γ with a suffix: ``prompt-lookup:4``;
  ``prediction``: the prompt's prediction (``BenchPrompt.prediction``, the ``rewrite`` family's file) drafted
  first, prompt lookup where it does not match (without a prediction it is prompt lookup);
- transformers ``generate()``: ``hf-plain``, ``hf-prompt-lookup`` (``prompt_lookup_num_tokens=10``),
  ``hf-assisted`` (``assistant_model=`` the pair's draft);
- llama.cpp on the pair's GGUF (``llamacpp.py``, the optional extra ``bench``): ``llamacpp-plain``,
  ``llamacpp-prompt-lookup``; in the default modes when llama-cpp-python is installed and the target is a GGUF;
- llama.cpp's own server on the pair's GGUF (``llama_server.py``): ``llama-server`` (plain) and
  ``llama-server-ngram`` (its ``--spec-type ngram-mod``; ``llama-server-ngram:TYPE`` for another of its n-gram
  types); in the ``rewrite`` family's default modes when a ``llama-server`` binary is found.

The ``rewrite`` family (whole files rewritten with a small change, each prompt with its file as prediction)
defaults to plain, prompt-lookup, suffix, prediction (draft-model with a draft) and the llama-server modes:
transformers' and llama-cpp-python's modes do not take the prompts' stop strings.
"""

from __future__ import annotations

from dataclasses import dataclass

from specchat.backend.errors import RequestError
from specchat.backend.inputs import shown
from specchat.backend.limits import DRAFTERS, MAX_GAMMA, Gamma, is_gamma

SPECCHAT_DRAFTERS = tuple("plain" if name == "none" else name for name in DRAFTERS)  # bench mode names
PREDICTION_MODE = "prediction"
PREDICTION_FALLBACK = "prompt-lookup"  # the drafter of the prediction mode where the prediction does not match
HF_MODES = ("hf-plain", "hf-prompt-lookup", "hf-assisted")
LLAMACPP_MODES = ("llamacpp-plain", "llamacpp-prompt-lookup")
LLAMA_SERVER_MODES = ("llama-server", "llama-server-ngram")
NGRAM_TYPES = ("ngram-mod", "ngram-simple", "ngram-map-k", "ngram-map-k4v", "ngram-cache")  # llama-server's
REMOTE_MODE = "server"  # a remote pair: whatever speculation its server runs


@dataclass(frozen=True, slots=True)
class Mode:
    name: str
    runner: str  # "specchat" | "hf" | "llamacpp" | "llama-server" | "remote"
    # specchat: none | prompt-lookup | suffix | draft-model | auto; hf: plain | prompt-lookup | assisted;
    # llama-server: none | an n-gram type (NGRAM_TYPES)
    drafter: str
    gamma: Gamma | None = None  # specchat only; None: the pair's γ
    prediction: bool = False  # specchat only: send the prompt's prediction


def default_modes(has_draft: bool, llamacpp: bool = False, *, rewrite: bool = False, llama_server: bool = False):
    """The modes a run takes without ``--modes`` (see the module docstring)."""
    if rewrite:
        names = ["plain", "prompt-lookup", "suffix", PREDICTION_MODE] + (["draft-model"] if has_draft else [])
        return names + (list(LLAMA_SERVER_MODES) if llama_server else [])
    names = ["plain", "prompt-lookup", "suffix"] + (["draft-model"] if has_draft else []) + ["auto"]
    names += ["hf-plain", "hf-prompt-lookup"] + (["hf-assisted"] if has_draft else [])
    return names + (list(LLAMACPP_MODES) if llamacpp else [])


def parse_modes(
    names: list[str] | None,
    *,
    has_draft: bool,
    pair_name: str,
    remote_kind: str | None = None,
    llamacpp_missing: str | None = "not checked",
    llama_server_missing: str | None = "not checked",
    rewrite: bool = False,
) -> list[Mode]:
    """Modes from ``--modes`` names (None: the defaults, llama.cpp's when ``llamacpp_missing`` is None and
    llama-server's for ``rewrite`` when ``llama_server_missing`` is None). RequestError names a bad one, and why a
    llama.cpp mode cannot run.

    A remote pair (``remote_kind``: its server's kind) runs mode ``server``; `specchat serve` also takes the
    specchat drafter modes (sent with the request); transformers modes run in this process and are refused."""
    if remote_kind is not None:
        return _remote_modes(names, pair_name, remote_kind)
    default = default_modes(
        has_draft, llamacpp_missing is None, rewrite=rewrite, llama_server=llama_server_missing is None
    )
    modes: list[Mode] = []
    for name in names or default:
        base, _, suffix = name.partition(":")
        if base in LLAMA_SERVER_MODES:
            mode = _llama_server_mode(name, base, suffix, llama_server_missing)
        elif base == PREDICTION_MODE and not suffix:
            mode = Mode(name, "specchat", PREDICTION_FALLBACK, prediction=True)
        else:
            mode = _local_mode(name, base, suffix, llamacpp_missing)
        if base in ("draft-model", "hf-assisted") and not has_draft:
            raise RequestError(
                f"mode {shown(name)} needs a draft model, and pair {pair_name!r} has none; leave it "
                "out or pick a pair with a draft (see `specchat models`)"
            )
        if any(m.name == name for m in modes):
            raise RequestError(f"mode {shown(name)} is listed twice in --modes")
        modes.append(mode)
    return modes


def _local_mode(name: str, base: str, gamma_text: str, llamacpp_missing: str | None) -> Mode:
    gamma: Gamma | None = None
    if gamma_text:
        if base not in SPECCHAT_DRAFTERS or base == "plain":
            raise RequestError(
                f"mode {shown(name)}: only prompt-lookup, suffix, draft-model and auto take a :GAMMA suffix "
                "(llama-server-ngram takes :TYPE)"
            )
        if gamma_text != "auto" and not (
            gamma_text.isascii() and gamma_text.isdigit() and len(gamma_text) < 4 and is_gamma(int(gamma_text))
        ):
            raise RequestError(f"mode {shown(name)}: gamma must be 1..{MAX_GAMMA} or 'auto', got {shown(gamma_text)}")
        gamma = "auto" if gamma_text == "auto" else int(gamma_text)
    if base in SPECCHAT_DRAFTERS:
        drafter = "none" if base == "plain" else base
        return Mode(name, "specchat", drafter, "auto" if base == "auto" and gamma is None else gamma)
    if base in HF_MODES and not gamma_text:
        return Mode(name, "hf", base.removeprefix("hf-"))
    if base in LLAMACPP_MODES and not gamma_text:
        if llamacpp_missing is not None and llamacpp_missing != "not checked":
            raise RequestError(f"mode {shown(name)}: {llamacpp_missing}")
        return Mode(name, "llamacpp", base.removeprefix("llamacpp-"))
    known = ", ".join((*SPECCHAT_DRAFTERS, PREDICTION_MODE, *HF_MODES, *LLAMACPP_MODES, *LLAMA_SERVER_MODES))
    raise RequestError(f"unknown bench mode {shown(name)}; use {known} (a drafter mode may add :GAMMA)")


def _llama_server_mode(name: str, base: str, spec_type: str, missing: str | None) -> Mode:
    if base == "llama-server" and spec_type:
        raise RequestError(f"mode {shown(name)}: llama-server takes no suffix (llama-server-ngram:TYPE does)")
    if base == "llama-server-ngram" and spec_type and spec_type not in NGRAM_TYPES:
        raise RequestError(f"mode {shown(name)}: llama-server's n-gram types are {', '.join(NGRAM_TYPES)}")
    if missing is not None and missing != "not checked":
        raise RequestError(f"mode {shown(name)}: {missing}")
    return Mode(name, "llama-server", "none" if base == "llama-server" else (spec_type or NGRAM_TYPES[0]))


def _remote_modes(names: list[str] | None, pair_name: str, kind: str) -> list[Mode]:
    modes = []
    for name in names or [REMOTE_MODE]:
        base = name.partition(":")[0]
        if base in HF_MODES or base in LLAMA_SERVER_MODES:
            where = "transformers in" if base in HF_MODES else "llama-server beside"
            raise RequestError(
                f"mode {name!r} runs {where} this process, and pair {pair_name!r} is remote "
                f"(its model is on its server); leave {name} out"
            )
        if name == REMOTE_MODE:
            modes.append(Mode(name, "remote", REMOTE_MODE))
        elif base in SPECCHAT_DRAFTERS and kind == "specchat":
            local = parse_modes([name], has_draft=True, pair_name=pair_name)[0]
            modes.append(Mode(name, "remote", local.drafter, local.gamma))
        elif base in SPECCHAT_DRAFTERS:
            raise RequestError(
                f"mode {name!r}: pair {pair_name!r} runs on a {kind} server, which speculates as it "
                f"was started; use --modes {REMOTE_MODE} (or kind: specchat for `specchat serve`)"
            )
        else:
            raise RequestError(f"unknown bench mode {name!r} for remote pair {pair_name!r}; use {REMOTE_MODE}")
        if sum(m.name == name for m in modes) > 1:
            raise RequestError(f"mode {name!r} is listed twice in --modes")
    return modes
