"""SFT on multi-turn chats with every assistant turn its own sample (``data.per_turn_samples``):
each sample renders the history as the chat template does at its turn, and the samples are packed
as prefix trees (dataloaders/trees.py). Loss and gradients equal the flat per-turn samples', in
fewer tokens; the recipe trains, shards and resumes on them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nopad.dataloaders.collator import PackedCollator
from nopad.dataloaders.trees import tree_dataloader
from nopad.packing.hf import use_nopad_attention
from nopad.packing.row import IGNORE_INDEX
from nopad.training.loss import row_loss_sum
from nopad.training.sft_data import per_turn_samples
from tests.recipes.test_recipes_sft import _cfg, _reset_accelerate
from tests.support.models import tiny_model
from tests.training.test_training_trl import make_tokenizer

# earlier assistant turns keep only their last word (their "answer"): a template that drops past
# reasoning, so each turn's sample renders the history differently from the turn before
TEMPLATE = (
    "{% for m in messages %}{{ m['role'] }} "
    "{% if m['role'] == 'assistant' and not loop.last %}{{ m['content'].split(' ')[-1] }}"
    "{% else %}{{ m['content'] }}{% endif %} {% endfor %}"
    "{% if add_generation_prompt %}assistant {% endif %}"
)


def _words(rng, lo, hi):
    return " ".join(f"w{int(t)}" for t in rng.integers(6, 120, int(rng.integers(lo, hi + 1))))


def conversations(n=6, seed=0):
    """``n`` chats of 2-3 exchanges after a shared system prompt."""
    rng = np.random.default_rng(seed)
    system = {"role": "system", "content": _words(rng, 12, 12)}
    out = []
    for _ in range(n):
        messages = [system]
        for _ in range(int(rng.integers(2, 4))):
            messages += [
                {"role": "user", "content": _words(rng, 2, 8)},
                {"role": "assistant", "content": _words(rng, 2, 9)},
            ]
        out.append({"messages": messages})
    return out


@pytest.fixture(scope="module")
def tok():
    tok = make_tokenizer()
    tok.chat_template = TEMPLATE
    return tok


def test_each_turn_is_a_sample_with_its_own_rendering_of_the_history(tok):
    chat = [
        {"role": "user", "content": "w1 w2"},
        {"role": "assistant", "content": "w3 w4 w5"},
        {"role": "user", "content": "w6"},
        {"role": "assistant", "content": "w7 w8"},
    ]
    first, second = per_turn_samples([{"messages": chat}], tok)
    words = lambda ids: tok.convert_ids_to_tokens(list(ids))  # noqa: E731
    assert words(first.ids) == ["user", "w1", "w2", "assistant", "w3", "w4", "w5"]
    assert words(second.ids) == ["user", "w1", "w2", "assistant", "w5", "user", "w6", "assistant", "w7", "w8"]
    assert list(first.loss_mask) == [False] * 4 + [True] * 3  # the turn's own tokens only
    assert list(second.loss_mask) == [False] * 8 + [True] * 2
    with pytest.raises(ValueError, match="no assistant turn"):
        per_turn_samples([{"messages": chat[:1]}], tok)
    with pytest.raises(ValueError, match="no conversation in 'messages'"):
        per_turn_samples([{"prompt": "w1"}], tok)


def _flat_loss(model, samples, weighting):
    row = PackedCollator()(
        [
            {"input_ids": list(s.ids), "labels": [t if m else IGNORE_INDEX for t, m in zip(s.ids, s.loss_mask)]}
            for s in samples
        ]
    )
    return row, row_loss_sum(model(**row.model_kwargs()).logits, row, weighting=weighting), row.num_loss_seqs


@pytest.mark.parametrize("weighting", ["token", "sequence"])
def test_tree_rows_give_the_flat_per_turn_samples_loss_and_gradients(tok, weighting, one_thread):
    samples = per_turn_samples(conversations(), tok)
    model = tiny_model("llama")
    with use_nopad_attention(model):
        flat_row, flat, flat_count = _flat_loss(model, samples, weighting)
        flat.backward()
        want = {n: p.grad.clone() for n, p in model.named_parameters()}
        model.zero_grad(set_to_none=True)
        rows = list(tree_dataloader(samples, 96, num_replicas=1, rank=0, shuffle=False))
        total = sum(row_loss_sum(model(**r.model_kwargs()).logits, r, weighting=weighting) for r in rows)
        total.backward()
    assert len(rows) > 1  # trees split across rows (shared system prompt and history repeated there)
    assert sum(r.num_tokens for r in rows) < flat_row.num_tokens
    key = "num_loss_tokens" if weighting == "token" else "num_loss_seqs"
    assert sum(getattr(r, key) for r in rows) == getattr(flat_row, key)
    assert sum(r.num_loss_seqs for r in rows) == flat_count == len(samples)
    assert float(total.detach()) == pytest.approx(float(flat.detach()), rel=1e-5)
    for name, p in model.named_parameters():
        err = float((p.grad - want[name]).abs().max())
        assert err <= 1e-5 * float(want[name].abs().max()) + 1e-12, f"grad of {name}: max error {err:.3g}"


def test_the_loader_shards_pads_and_resumes(tok):
    samples = per_turn_samples(conversations(9, seed=1), tok)
    ranks = [tree_dataloader(samples, 64, num_replicas=2, rank=r, steps_multiple_of=2, seed=3) for r in (0, 1)]
    assert len(ranks[0]) == len(ranks[1]) and len(ranks[0]) % 2 == 0
    owned = [i for loader in ranks for row in loader for i in row.indices.tolist() if row.num_loss_tokens]
    assert sorted(owned) == list(range(len(samples)))  # every sample trained once per epoch
    again = tree_dataloader(samples, 64, num_replicas=2, rank=0, steps_multiple_of=2, seed=3)
    it = iter(again)
    next(it)
    state = again.state_dict()
    rest = [r.input_ids.tolist() for r in it]
    resumed = tree_dataloader(samples, 64, num_replicas=2, rank=0, steps_multiple_of=2, seed=3)
    resumed.load_state_dict(state)
    assert [r.input_ids.tolist() for r in resumed] == rest
    with pytest.raises(ValueError, match="raise the budget"):
        tree_dataloader(samples, 8)


def test_the_recipe_trains_on_per_turn_samples(tok, tmp_path, one_thread):
    from nopad.recipes.sft import train

    cfg = _cfg(tmp_path, "data.per_turn_samples=true", "data.tokens_per_batch=128", "train.max_steps=2")
    try:
        result = train(cfg, model=tiny_model("llama"), tokenizer=tok, rows=conversations())
    finally:
        _reset_accelerate()
    assert result["steps"] == 2 and all(np.isfinite(result["losses"]))
    assert result["stats"] and result["stats"][0]["unit"] == "prefix-tree pieces"
    with pytest.raises(ValueError, match="per_turn_samples packs whole prefix trees"):
        _cfg(tmp_path, "data.per_turn_samples=true", "data.streaming=true")


def test_a_padding_rows_batch_trains_nothing(tok):
    from nopad.dataloaders.dataset import PackedItem
    from nopad.dataloaders.trees import TreeCollator, TreePieces

    samples = per_turn_samples(conversations(2), tok)
    pieces = TreePieces(samples, 256)
    row = TreeCollator(samples)([pieces[PackedItem(0, 0, 0, False)]])
    assert row.num_loss_tokens == 0 and bool((row.labels == IGNORE_INDEX).all()) and row.num_tokens > 0
    assert torch.equal(row.input_ids, TreeCollator(samples)([pieces[PackedItem(0, 0, 0, True)]]).input_ids)
