"""Draft heads: the published layouts load (and misfits are refused before weights), trees are well formed."""

from __future__ import annotations

import json

import pytest
import torch
from tiny_heads import eagle3_config, eagle3_folder, eagle3_head, medusa_folder, save_head
from tiny_models import build_tiny, one_thread  # noqa: F401  (one_thread: autouse)

from specchat.backend.errors import ModelLoadError
from specchat.backend.models.catalog.config_head import HeadSpec
from specchat.backend.models.loading.head_loading import load_head, plan_head
from specchat.backend.speculative.heads import trees
from specchat.backend.speculative.heads.drafter import Eagle3Drafter, MedusaDrafter, head_drafter
from specchat.backend.speculative.heads.eagle3 import Eagle3Config, Eagle3Head, default_taps
from specchat.backend.speculative.heads.medusa import MedusaHeads
from specchat.backend.speculative.sampling import GREEDY, SamplingRule

CPU = torch.device("cpu")


def _spec(folder, **kw) -> HeadSpec:
    return HeadSpec(str(folder), "local", path=str(folder), **kw)


@pytest.fixture(scope="module")
def target_config():
    return build_tiny("llama").config


def test_an_eagle3_head_in_the_published_layout_loads_with_its_keys(tmp_path, target_config):
    folder = eagle3_folder(tmp_path / "h", target_config, seed=3)
    loaded = load_head(_spec(folder), "eagle3", target_config, CPU, target_name="tiny")
    assert isinstance(loaded.module, Eagle3Head) and loaded.taps == (0, 1, 1)
    keys = set(json.loads((folder / "config.json").read_text()))
    assert {"draft_vocab_size", "hidden_size", "num_attention_heads"} <= keys
    from safetensors.torch import load_file

    names = set(load_file(str(folder / "model.safetensors")))
    assert {"fc.weight", "midlayer.self_attn.q_proj.weight", "midlayer.hidden_norm.weight", "norm.weight"} <= names
    assert {"lm_head.weight", "d2t", "t2d", "midlayer.mlp.down_proj.weight"} <= names
    reference = eagle3_head(eagle3_config(target_config), seed=3)
    assert torch.equal(loaded.module.midlayer.self_attn.q_proj.weight, reference.midlayer.self_attn.q_proj.weight)
    assert torch.equal(loaded.module.target_ids(torch.tensor([0, 5])), torch.tensor([3, 8]))  # d2t offsets


def test_a_head_with_its_own_embedding_and_fc_bias_loads(tmp_path, target_config):
    config = eagle3_config(target_config)
    head = Eagle3Head(config, fc_bias=True, own_embedding=True)
    folder = save_head(head, config.to_dict(), tmp_path / "h")
    loaded = load_head(_spec(folder), "eagle3", target_config, CPU, target_name="tiny").module
    assert loaded.embed_tokens is not None and loaded.fc.bias is not None


@pytest.mark.parametrize("legacy", [False, True])
def test_medusa_heads_load_with_and_without_the_prefix(tmp_path, target_config, legacy):
    folder = medusa_folder(tmp_path / "m", target_config, heads=4, layers=2, legacy=legacy)
    loaded = load_head(_spec(folder), None, target_config, CPU, target_name="tiny")
    assert loaded.drafter == "medusa" and isinstance(loaded.module, MedusaHeads)
    assert loaded.taps == (target_config.num_hidden_layers,)  # the final normed state
    assert loaded.module(torch.zeros(target_config.hidden_size)).shape == (4, target_config.vocab_size)


@pytest.mark.parametrize(
    ("field", "value", "named"),
    [
        ("hidden_size", 32, "hidden_size"),
        ("vocab_size", 512, "vocab_size"),
        ("target_num_hidden_layers", 30, "num_hidden_layers"),
        ("eagle_config", {"eagle_aux_hidden_state_layer_ids": [1, 2, 7]}, "num_hidden_layers"),
    ],
)
def test_a_head_that_does_not_fit_is_refused_before_its_weights(tmp_path, target_config, field, value, named):
    folder = eagle3_folder(tmp_path / "h", target_config)
    config = json.loads((folder / "config.json").read_text())
    config.update({field: value, "target_hidden_size": value} if field == "hidden_size" else {field: value})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "model.safetensors").write_bytes(b"not read")  # never opened: the sizes are checked first
    with pytest.raises(ModelLoadError) as error:
        load_head(_spec(folder), "eagle3", target_config, CPU, target_name="tiny-target")
    message = str(error.value)
    assert str(folder) in message and named in message and "tiny-target" in message
    assert str(value if not isinstance(value, dict) else [1, 2, 7]) in message


def test_sizes_are_checked_against_models_yaml_before_the_target_loads(tmp_path, target_config):
    folder = eagle3_folder(tmp_path / "h", target_config)
    with pytest.raises(ModelLoadError, match="hidden_size is 576"):
        plan_head(_spec(folder), "eagle3", (576, 30, 49152), target_name="SmolLM2")


def test_the_wrong_kind_and_pickles_without_permission_are_refused(tmp_path, target_config):
    folder = medusa_folder(tmp_path / "m", target_config)
    with pytest.raises(ModelLoadError, match="medusa head"):
        load_head(_spec(folder), "eagle3", target_config, CPU, target_name="tiny")
    head = eagle3_head(eagle3_config(target_config))
    pickled = tmp_path / "p"
    pickled.mkdir()
    (pickled / "config.json").write_text(json.dumps(eagle3_config(target_config).to_dict()))
    torch.save(head.state_dict(), pickled / "pytorch_model.bin")
    with pytest.raises(ModelLoadError, match="allow_pickle"):
        load_head(_spec(pickled), "eagle3", target_config, CPU, target_name="tiny")
    loaded = load_head(_spec(pickled, allow_pickle=True), "eagle3", target_config, CPU, target_name="tiny")
    assert torch.equal(loaded.module.fc.weight, head.fc.weight)


def test_missing_keys_are_named(tmp_path, target_config):
    folder = eagle3_folder(tmp_path / "h", target_config)
    from safetensors.torch import load_file, save_file

    state = load_file(str(folder / "model.safetensors"))
    del state["midlayer.mlp.up_proj.weight"]
    save_file(state, str(folder / "model.safetensors"))
    with pytest.raises(ModelLoadError, match="midlayer.mlp.up_proj.weight"):
        load_head(_spec(folder), "eagle3", target_config, CPU, target_name="tiny")


def test_published_config_fields_are_read():
    """The fields of the EAGLE authors' Llama-3.1-8B EAGLE-3 config (values as published)."""
    config = Eagle3Config.from_dict(
        {
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "vocab_size": 128256,
            "draft_vocab_size": 32000,
            "rms_norm_eps": 1e-05,
            "rope_theta": 500000.0,
            "rope_scaling": {
                "factor": 8.0,
                "high_freq_factor": 4.0,
                "low_freq_factor": 1.0,
                "original_max_position_embeddings": 8192,
                "rope_type": "llama3",
            },
        },
        "test",
    )
    assert (config.head_dim, config.target_hidden_size, config.taps) == (128, 4096, None)
    assert default_taps(32) == (2, 16, 29)
    # Llama 3's rope scaling, as transformers computes it for the target
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import _compute_llama3_parameters

    from specchat.backend.speculative.heads.eagle3 import _scaled_frequencies

    llama = LlamaConfig(hidden_size=4096, num_attention_heads=32, rope_theta=500000.0, rope_scaling=config.rope_scaling)
    expected, _ = _compute_llama3_parameters(llama)
    inv = 1.0 / (500000.0 ** (torch.arange(0, 128, 2, dtype=torch.float64) / 128))
    torch.testing.assert_close(_scaled_frequencies(inv, config.rope_scaling).float(), expected.float())


def _depths(parents: list[int]) -> list[int]:
    out: list[int] = []
    for p in parents:
        out.append(1 if p < 0 else out[p] + 1)
    return out


@pytest.mark.parametrize(("budget", "depth", "top_k"), [(1, 1, 1), (6, 6, 1), (4, 3, 2), (16, 6, 4), (31, 8, 8)])
def test_dynamic_trees_keep_the_best_budget_with_parents_first(budget, depth, top_k):
    torch.manual_seed(budget)
    vocab = 40
    table = torch.randn(vocab, vocab) * 3  # a fake head: the next token's logits depend on the last token

    def expand(tree, nodes):
        return table[torch.tensor([tree.tokens[n] for n in nodes])]

    grown = trees.grow(table[:1], expand, lambda ids: ids, GREEDY, 0, budget=budget, depth=depth, top_k=top_k)
    tokens, parents = grown.best(budget)
    assert len(tokens) == min(budget, len(grown.tokens))
    assert all(-1 <= p < i for i, p in enumerate(parents))
    assert max(_depths(parents)) <= depth
    kept = sorted(range(len(grown.scores)), key=lambda i: -grown.scores[i])[: len(tokens)]
    assert sorted(round(grown.scores[i], 5) for i in kept) == sorted(
        round(s, 5) for s in sorted(grown.scores, reverse=True)[: len(tokens)]
    )


def test_a_chain_when_the_head_is_sure():
    table = torch.full((10, 10), -20.0)
    for t in range(9):
        table[t, t + 1] = 20.0  # token t is followed by t+1, surely

    grown = trees.grow(
        table[:1], lambda tree, nodes: table[[tree.tokens[n] for n in nodes]], lambda i: i, GREEDY, 0,
        budget=5, depth=6, top_k=3,
    )  # fmt: skip
    assert grown.best(5) == ([1, 2, 3, 4, 5], [-1, 0, 1, 2, 3])


def test_sampled_children_start_with_the_coupled_token():
    """Under sampling the first child is the Gumbel-max choice with the target's noise at that position."""
    from specchat.backend.speculative.sampling import pick

    logits = torch.randn(3, 50)
    rule = SamplingRule(temperature=0.8, seed=11)
    ids, _ = trees.ranked_children(logits, lambda i: i, rule, [4, 5, 6], 3)
    assert ids[:, 0].tolist() == pick(logits, SamplingRule(temperature=0.8, top_k=32, seed=11), [4, 5, 6])


def test_static_trees_are_prefix_closed():
    paths = trees.static_paths(4, 40)
    assert paths[0] == (0,) and len(paths) == 40 and len(set(paths)) == 40
    seen = set()
    for path in paths:
        assert len(path) == 1 or path[:-1] in seen
        seen.add(path)
    chosen, parents = trees.select_static([(0,), (1, 0), (0, 0), (1,), (1, 0)], 4)
    assert chosen == [(0,), (0, 0), (1,), (1, 0)] and parents == [-1, 0, -1, 2]


def test_drafters_need_features_of_every_committed_token(target_config):
    head = eagle3_head(eagle3_config(target_config, draft_vocab=target_config.vocab_size))
    embed = build_tiny("llama").get_input_embeddings()
    drafter = head_drafter("eagle3", head, (0, 1, 1), embed, [2])
    assert isinstance(drafter, Eagle3Drafter)
    context = [5, 6, 7, 8]
    assert drafter.propose(context, 4).token_ids == []  # no features yet: nothing to draft
    width = 3 * target_config.hidden_size
    drafter.observe_hidden(0, context[:3], torch.randn(3, width))
    draft = drafter.propose(context, 4)
    assert 1 <= len(draft) <= 4 and drafter.features_for([5, 6, 7, 9]) == 3
    drafter.observe_hidden(2, [70], torch.randn(1, width))  # the conversation changed at position 2
    assert drafter.tokens == [5, 6, 70] and drafter.propose(context, 4).token_ids == []
    drafter.observe_hidden(5, [1], torch.randn(1, width))  # a gap: features of positions 3, 4 never came
    assert drafter.tokens == [] and drafter.features_for(context) == 0
    medusa = head_drafter("medusa", MedusaHeads(_medusa_config(target_config)), (2,), embed, [2])
    assert isinstance(medusa, MedusaDrafter)


def _medusa_config(target_config):
    from specchat.backend.speculative.heads.medusa import MedusaConfig

    return MedusaConfig(3, 1, target_config.hidden_size, target_config.vocab_size, None)
