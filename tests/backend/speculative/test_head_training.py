"""EAGLE-3 training: the training-time test trains exactly what drafting runs, training learns, runs resume."""

from __future__ import annotations

import torch
from tiny_heads import eagle3_config, eagle3_head
from tiny_models import build_tiny, one_thread  # noqa: F401  (one_thread: autouse)

from specchat.backend.speculative.heads import trees
from specchat.backend.speculative.heads.drafter import Eagle3Drafter
from specchat.backend.speculative.heads.training import draft_vocabulary, soft_targets, ttt_logits, ttt_losses
from specchat.backend.training.data import Sample
from specchat.backend.training.loop import fresh_head, train


def _setup(steps_seed: int = 0):
    config = build_tiny("llama").config
    head = eagle3_head(eagle3_config(config, draft_vocab=config.vocab_size), seed=steps_seed, std=0.1)
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    torch.manual_seed(1)
    ids = torch.randint(3, config.vocab_size, (20,))
    taps = torch.randn(20, 3 * config.hidden_size)
    return head, embed, ids, taps


def test_the_training_time_test_trains_what_drafting_runs(monkeypatch):
    """Step j of the training-time test at row t gives the logits the drafter computes for the node at depth j
    along the true path after context position t (its cache of committed positions, its ancestors, itself)."""
    head, embed, ids, taps = _setup()
    with torch.no_grad():
        trained = ttt_logits(head, embed, ids, taps, steps=4)
    n = 12  # context: ids[:n], committed ids[:n - 1] (their features held), pending ids[n - 1]
    drafter = Eagle3Drafter(head, embed, (0, 1, 1))
    drafter.observe_hidden(0, ids[: n - 1].tolist(), taps[: n - 1])
    seen: list[torch.Tensor] = []

    def true_path(root_logits, expand, to_target, rule, first, **_):
        seen.append(root_logits[0])
        tree, parent = trees.Grown(), -1
        for depth in range(1, 4):
            node = tree.add(int(ids[n - 1 + depth]), parent, 0.0, depth)  # the true token at that depth
            seen.append(expand(tree, [node])[0])
            parent = node
        return tree

    monkeypatch.setattr(trees, "grow", true_path)
    drafter.propose(ids[:n].tolist(), 4)
    row = n - 2  # the newest committed position
    assert len(seen) == 4
    for j, logits in enumerate(seen):
        torch.testing.assert_close(logits, trained[j][row], atol=2e-5, rtol=2e-5)


def test_rows_without_a_loss_only_lend_their_keys():
    head, embed, ids, taps = _setup()
    with torch.no_grad():
        full = ttt_logits(head, embed, ids, taps, steps=3)
        part = ttt_logits(head, embed, ids, taps, steps=3, first_row=7)
    for a, b in zip(full, part):
        torch.testing.assert_close(a[7:], b, atol=1e-5, rtol=1e-5)


def test_soft_targets_keep_the_draft_vocabulary_and_renormalise():
    head, *_ = _setup()
    with torch.no_grad():
        head.t2d.zero_()
        head.t2d[[5, 9, 11]] = True  # draft ids 0, 1, 2
    out = soft_targets(head, torch.tensor([[9, 4, 11], [4, 6, 7]]), torch.tensor([[0.5, 0.3, 0.2], [1.0, 0.0, 0.0]]))
    torch.testing.assert_close(out[0, :3], torch.tensor([0.0, 0.5 / 0.7, 0.2 / 0.7]))
    assert float(out[1].sum()) == 0.0  # nothing in the draft vocabulary: the row carries no loss


def test_the_draft_vocabulary_is_the_most_frequent_ids():
    counts = torch.tensor([0.0, 5, 1, 9, 0, 7])
    d2t, t2d = draft_vocabulary(counts, 3)
    assert (torch.arange(3) + d2t).tolist() == [1, 3, 5] and t2d.tolist() == [False, True, False, True, False, True]


def _samples(count: int) -> list[Sample]:
    """Windows where the next token is a fixed function of the current one (learnable from the embedding)."""
    config = build_tiny("llama").config
    out = []
    gen = torch.Generator().manual_seed(0)
    for _ in range(count):
        ids = [int(torch.randint(3, 40, (1,), generator=gen))]
        for _ in range(23):
            ids.append(3 + (ids[-1] * 7 + 1) % 37)
        tensor = torch.tensor(ids)
        nxt = torch.cat([tensor[1:], tensor[-1:]])
        taps = torch.randn(24, 3 * config.hidden_size, generator=gen).to(torch.bfloat16)
        out.append(Sample(tensor, taps, nxt[:, None], torch.ones(24, 1, dtype=torch.float16), torch.ones(24)))
    return out


def test_training_learns_and_a_resumed_run_ends_where_a_straight_one_does(tmp_path):
    config = build_tiny("llama").config
    head_config = eagle3_config(config, draft_vocab=config.vocab_size)
    d2t, t2d = torch.zeros(config.vocab_size, dtype=torch.long), torch.ones(config.vocab_size, dtype=torch.bool)
    samples = _samples(6)
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    lines: list[str] = []

    def fresh():
        torch.manual_seed(0)
        return fresh_head(head_config, d2t, t2d, torch.device("cpu"))

    def loss(head):
        with torch.no_grad():
            s = samples[0]
            return ttt_losses(head, embed, s.ids, s.taps, s.label_ids, s.label_probs, s.weights, steps=3).per_step

    straight = fresh()
    before = loss(straight)
    train(straight, embed, samples, tmp_path / "a", steps=40, batch=2, lr=1e-2, warmup=2, progress=lines.append)
    after = loss(straight)
    assert all(a < b * 0.5 for a, b in zip(after, before)), (before, after)
    assert any(line.startswith("step 40/40 · loss") for line in lines)
    half = fresh()
    stopped = train(half, embed, samples, tmp_path / "b", steps=40, batch=2, lr=1e-2, warmup=2,
                    stop=lambda step: step >= 20, progress=lines.append)  # fmt: skip
    assert stopped == 20 and "stopped at step 20 of 40" in " ".join(lines)
    resumed = fresh()
    train(resumed, embed, samples, tmp_path / "b", steps=40, batch=2, lr=1e-2, warmup=2, resume=True,
          progress=lines.append)  # fmt: skip
    assert "resuming from step 20" in " ".join(lines)
    for (name, a), b in zip(straight.state_dict().items(), resumed.state_dict().values()):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4, msg=name)


def test_a_head_warm_started_from_the_targets_output_layer_keeps_it_frozen_through_training(tmp_path):
    config = build_tiny("llama").config
    head_config = eagle3_config(config, draft_vocab=config.vocab_size)
    d2t, t2d = torch.zeros(config.vocab_size, dtype=torch.long), torch.ones(config.vocab_size, dtype=torch.bool)
    rows, norm = torch.randn(config.vocab_size, config.hidden_size), torch.rand(config.hidden_size) + 0.5
    head = fresh_head(head_config, d2t, t2d, torch.device("cpu"), output_rows=rows, final_norm=norm)
    assert torch.equal(head.lm_head.weight, rows) and torch.equal(head.norm.weight, norm)
    assert not head.lm_head.weight.requires_grad
    fc_before = head.fc.weight.detach().clone()
    embed = torch.nn.Embedding(config.vocab_size, config.hidden_size)
    train(head, embed, _samples(2), tmp_path / "c", steps=3, batch=1, lr=1e-2, warmup=1, progress=lambda _: None)
    assert torch.equal(head.lm_head.weight, rows)  # frozen: the target's rows, as exported
    assert not torch.equal(head.fc.weight, fc_before)  # the rest learns
