"""llguidance against xgrammar on the structured family's JSON schemas, with the embedded default's tokenizer: why
specchat's constraints use llguidance (docs/constrained.md).

For each schema of ``backend/bench/data/structured.jsonl``: compile it with both engines (coverage: does each take
it; the compile time), then walk one token sequence through both: at each step llguidance's mask is computed, a
token is drawn from the allowed ones (a seeded random choice, EOS only where the grammar accepts) and fed to both
engines, xgrammar's mask computed too. Reported: schemas each engine took, sequences both accepted to the end,
tokens where the two masks disagree, and the median / mean µs per mask of each (the masks specchat applies, bits
into a preallocated int32 buffer, no torch unpacking). xgrammar is not a dependency of specchat:

    pip install --target /tmp/xg xgrammar apache-tvm-ffi --no-deps
    PYTHONPATH=/tmp/xg python benchmarks/grammar_engines.py [--limit N] [--steps 120]
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import time

import llguidance
import numpy
import torch
import xgrammar

from specchat.backend.bench.structured import load_cases
from specchat.backend.constraint_spec import JSON_OPTIONS
from specchat.backend.speculative.constraint import ll_tokenizer


def _tokenizer():
    from transformers import AutoTokenizer

    from specchat.backend.models.catalog.config import load_pairs
    from specchat.backend.models.loading.loaded import gguf_path

    path = gguf_path(load_pairs()["smollm2-135m"].target)
    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--limit", type=int, default=None)
    parser.add_argument("--steps", type=int, default=120)
    args = parser.parse_args()
    torch.set_num_threads(1)
    tok = _tokenizer()
    vocab, eos = len(tok), [tok.eos_token_id]
    ll_tok = ll_tokenizer(tok, vocab, eos)
    xg_info = xgrammar.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
    xg_compiler = xgrammar.GrammarCompiler(xg_info, max_threads=1)
    words = (vocab + 31) // 32
    ll_bits = torch.zeros(words, dtype=torch.int32)
    xg_bits = xgrammar.allocate_token_bitmask(1, vocab)
    took = {"llguidance": 0, "xgrammar": 0}
    compile_s: dict[str, list[float]] = {"llguidance": [], "xgrammar": []}
    mask_us: dict[str, list[float]] = {"llguidance": [], "xgrammar": []}
    both_to_end = disagree = tokens = 0
    cases = load_cases(limit=args.limit)
    for n, case in enumerate(cases):
        t0 = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(case.schema, JSON_OPTIONS)
        ll = llguidance.LLMatcher(ll_tok, grammar, log_level=0)
        compile_s["llguidance"].append(time.perf_counter() - t0)
        took["llguidance"] += not ll.is_error()
        try:
            t0 = time.perf_counter()
            compiled = xg_compiler.compile_json_schema(
                json.dumps(case.schema), any_whitespace=False, separators=(", ", ": "), strict_mode=True
            )
            compile_s["xgrammar"].append(time.perf_counter() - t0)
            xg = xgrammar.GrammarMatcher(compiled)
            took["xgrammar"] += 1
        except Exception as error:  # noqa: BLE001 - coverage is what is measured
            print(f"{case.id}: xgrammar refused it ({str(error)[:100]})")
            continue
        if ll.is_error():
            print(f"{case.id}: llguidance refused it ({ll.get_error()[:100]})")
            continue
        rng = random.Random(n)
        ended = False
        for _ in range(args.steps):
            t0 = time.perf_counter()
            ll.unsafe_compute_mask_ptr(ll_bits.data_ptr(), words * 4)
            mask_us["llguidance"].append(1e6 * (time.perf_counter() - t0))
            t0 = time.perf_counter()
            xg.fill_next_token_bitmask(xg_bits)
            mask_us["xgrammar"].append(1e6 * (time.perf_counter() - t0))
            a = numpy.unpackbits(ll_bits.numpy().view(numpy.uint8), bitorder="little")[:vocab]
            b = numpy.unpackbits(xg_bits[0].numpy().view(numpy.uint8), bitorder="little")[:vocab]
            disagree += bool((a != b).any())
            tokens += 1
            allowed = numpy.flatnonzero(a)
            token = int(allowed[rng.randrange(len(allowed))])
            if token in eos:
                ended = ll.consume_token(token) and xg.accept_token(token)
                break
            if not (ll.consume_token(token) and xg.accept_token(token)):
                print(f"{case.id}: token {token} ({tok.decode([token])!r}) accepted by one engine only")
                break
        both_to_end += ended
    print(f"schemas: {len(cases)}; taken by llguidance {took['llguidance']}, xgrammar {took['xgrammar']}")
    for name in compile_s:
        print(
            f"{name}: compile median {1e3 * statistics.median(compile_s[name]):.2f} ms; mask median "
            f"{statistics.median(mask_us[name]):.1f} µs, mean {statistics.fmean(mask_us[name]):.1f} µs, "
            f"p99 {numpy.percentile(mask_us[name], 99):.0f} µs over {len(mask_us[name])} masks"
        )
    print(f"walks that reached EOS in both: {both_to_end}; masks that differ: {disagree} of {tokens}")


if __name__ == "__main__":
    main()
