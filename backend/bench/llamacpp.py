"""llama.cpp (through llama-cpp-python) on the pair's own GGUF: the engine users compare specchat with on a CPU.

Modes ``llamacpp-plain`` (greedy or sampled decoding) and ``llamacpp-prompt-lookup`` (llama-cpp-python's own
``LlamaPromptLookupDecoding`` drafter) run in `specchat bench`'s interleaved protocol beside specchat's modes
(``runner.py``). They need the optional extra ``bench`` (``pip install 'specchat[bench]'``, which builds
llama.cpp from source: minutes) and a pair whose target is a GGUF (packaged or a ``.gguf`` path); otherwise
:func:`unavailable` says why and how to fix it, and the bench refuses the mode with that message.

Contract: :class:`LlamaCpp` loads the file once per drafter (a plain instance, and one built with the drafter,
which llama-cpp-python needs to keep every position's logits). :meth:`LlamaCpp.generate` feeds the prompt ids
specchat rendered (the GGUF's own vocabulary: the same ids), with the KV cache reset first so nothing is
reused between runs, stops at the pair's EOS ids or ``max_new_tokens``, and returns the tokens with the
wall time and time to first token measured around the whole call, as the bench times specchat. Threads:
torch's intra-op thread count, so both engines use the same cores.
"""

from __future__ import annotations

import importlib.util
import time
from dataclasses import dataclass
from pathlib import Path

INSTALL_HINT = (
    "install the optional extra: pip install 'specchat[bench]' (llama-cpp-python builds llama.cpp "
    "from source, a few minutes; CMAKE_ARGS='-DGGML_NATIVE=ON' for this CPU)"
)
PROMPT_LOOKUP_TOKENS = 10  # llama-cpp-python's default num_pred_tokens
DRAFTERS = ("plain", "prompt-lookup")


def unavailable(gguf: Path | None) -> str | None:
    """Why llama.cpp modes cannot run (None when they can)."""
    if importlib.util.find_spec("llama_cpp") is None:
        return f"llama-cpp-python is not installed; {INSTALL_HINT}"
    if gguf is None:
        return "the pair's target is not a GGUF file (packaged or a .gguf path), which llama.cpp needs"
    return None


@dataclass(slots=True)
class Generation:
    token_ids: list[int]
    wall_s: float
    ttft_s: float | None


class LlamaCpp:
    """The pair's GGUF in llama.cpp, one instance per drafter asked for."""

    def __init__(
        self, gguf: Path, *, drafters: tuple[str, ...], context_length: int, threads: int, seed: int = 0
    ) -> None:
        import llama_cpp

        self.gguf = gguf
        self.instances = {}
        for drafter in drafters:
            draft = (
                llama_cpp.llama_speculative.LlamaPromptLookupDecoding(num_pred_tokens=PROMPT_LOOKUP_TOKENS)
                if drafter == "prompt-lookup"
                else None
            )
            # logits_all with a drafter: llama-cpp-python keeps every position's logits when it speculates, but
            # sizes that array from the argument (n_batch = 512 rows without it), so a prompt past 512 tokens
            # failed inside its eval ("could not broadcast ... into shape (0,)"; llama_cpp/llama.py 0.3.36).
            self.instances[drafter] = llama_cpp.Llama(
                model_path=str(gguf),
                n_ctx=context_length,
                n_threads=threads,
                n_threads_batch=threads,
                seed=seed,
                draft_model=draft,
                logits_all=draft is not None,
                verbose=False,
            )

    def generate(
        self,
        drafter: str,
        prompt_ids: list[int],
        *,
        max_new_tokens: int,
        temperature: float,
        seed: int,
        eos_ids: list[int],
    ) -> Generation:
        llm = self.instances[drafter]
        llm.reset()  # no prefix reuse between runs: every run prefills its whole prompt
        llm.set_seed(seed)
        tokens: list[int] = []
        ttft = None
        start = time.perf_counter()
        greedy = temperature <= 0
        stream = llm.generate(
            prompt_ids,
            temp=temperature if not greedy else 0.0,
            top_k=1 if greedy else 0,
            top_p=1.0,
            min_p=0.0,
            repeat_penalty=1.0,
            reset=True,
        )
        for token in stream:
            if ttft is None:
                ttft = time.perf_counter() - start
            tokens.append(int(token))
            if token in eos_ids or len(tokens) >= max_new_tokens:
                break
        return Generation(tokens, time.perf_counter() - start, ttft)
