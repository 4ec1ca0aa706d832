"""Draft heads on the CPU native model, the path the embedded default runs: what `specchat train-head` learns from
is what the head reads while drafting, and the reply is plain decoding's.

The trainer's features (``training/data.extract_features``: the runner's pass over prompt + reply with the head's
taps, in prefill chunks) must be exactly the rows the engine hands the drafter while it generates (a prefill,
then a pass per step whose accepted rows are kept). A different tap index, a norm on one side only, a row of
the wrong position or a cast on one side would each make a head trained on one set read another at inference:
its acceptance then falls far below its training top-1 without any error.
"""

from __future__ import annotations

import pytest
import torch
from engine_fixtures import tiny_pair
from native_fixtures import native_ready, tiny_native_loaded  # noqa: F401  (native_ready: a fixture)
from tiny_heads import eagle3_config, eagle3_head
from tiny_models import build_tiny, one_thread  # noqa: F401  (one_thread: autouse)

from specchat.backend.api import GenerationRequest, SamplingParams
from specchat.backend.engine.engine import Engine
from specchat.backend.models.loading.head_loading import LoadedHead
from specchat.backend.training import data

# The tiny targets have two layers: the stream entering layer 1, and the final norm's output (transformers'
# hidden_states indices; the native model has no tap of the embeddings, index 0).
NATIVE_TAPS = (1, 1, 2)
MESSAGES = [{"role": "user", "content": "w10 w11 w12 w13 w14 w15 w16"}]
GREEDY = SamplingParams(temperature=0.0, max_new_tokens=40)


def _native_engine(tmp_path, drafter: str) -> Engine:
    loaded = tiny_native_loaded(tmp_path)
    engine = Engine(loaded, None, tiny_pair(drafter=drafter), head=None)
    engine.eos_ids = frozenset()  # a random tiny model says EOS often: run every reply to its limit
    assert engine.runner.native is not None, "the tiny target must run on the native model"
    return engine


def _reply(engine: Engine, drafter: str) -> list[int]:
    request = GenerationRequest(messages=MESSAGES, sampling=GREEDY, drafter=drafter)
    return [t for e in engine.generate(request) for t in e.token_ids]


def test_the_trainers_features_are_the_rows_the_drafter_reads_on_the_native_model(tmp_path, native_ready):  # noqa: F811
    engine = _native_engine(tmp_path, "eagle3")
    config = engine.target.model.config
    head = eagle3_head(eagle3_config(config, draft_vocab=config.vocab_size, taps=NATIVE_TAPS), seed=3, std=0.1)
    engine.attach_head(LoadedHead("eagle3", head, NATIVE_TAPS, "tiny"))
    plain = _reply(_native_engine(tmp_path / "plain", "none"), "none")
    reply = _reply(engine, "eagle3")
    assert reply == plain  # taps in every pass change no token

    drafter = engine.drafters["eagle3"]
    held = len(drafter.tokens)  # every committed position: the prompt and the reply but its pending last token
    paths = data.Paths(tmp_path / "train")
    data.extract_features(
        engine, [("p", MESSAGES)], {"p": reply}, paths, NATIVE_TAPS, max_len=4096, progress=lambda _: None
    )
    [(_, sample)] = data.load_samples(paths)
    assert sample.ids[:held].tolist() == drafter.tokens
    assert held == sample.ids.numel() - 1
    # bit for bit: a row's taps do not depend on the pass it shared (the trainer stores them in bfloat16)
    assert torch.equal(sample.taps[:held], drafter.features[:held].to(torch.bfloat16))


def test_the_native_model_refuses_a_head_reading_the_embeddings(tmp_path, native_ready):  # noqa: F811
    engine = _native_engine(tmp_path, "eagle3")
    config = engine.target.model.config
    head = eagle3_head(eagle3_config(config, taps=(0, 1, 2)))
    engine.attach_head(LoadedHead("eagle3", head, (0, 1, 2), "tiny"))
    with pytest.raises(Exception, match="tap 0"):
        _reply(engine, "eagle3")
