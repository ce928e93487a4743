"""packing.verify: packed logits, loss and every parameter gradient equal each sequence alone for
every supported family, and a path that leaks attention across sequences is caught."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
import transformers

from packing.hf.verification import VerifyReport, verify
from tests.models import FAMILIES, SLIDING_WINDOW, random_sequences, tiny_model

CAPACITY = 32


pytestmark = pytest.mark.usefixtures("one_thread")



@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize(
    "lengths",
    [[1, 9, 2 * SLIDING_WINDOW + 5, 1, 3], [CAPACITY]],
    ids=["mixed_with_len1_and_longer_than_window", "exactly_capacity"],
)
def test_nopad_packed_equals_alone(family, lengths):
    report = verify(tiny_model(family), random_sequences(lengths))
    assert report.max_logit_diff <= 1e-5, report
    assert report.max_grad_rel_diff <= 1e-5, report
    assert report.loss_diff <= 1e-5, report
    assert report.ok()
    assert report.attention_path.startswith("nopad: packing.attention.varlen_attention")
    assert report.num_sequences == len(lengths) and report.num_tokens == sum(lengths)


@pytest.mark.parametrize("family", ["llama", "mistral"])
def test_transformers_sdpa_packed_path_also_checked(family):
    report = verify(tiny_model(family), random_sequences([4, 11, 1]), attn_implementation="sdpa")
    assert report.ok(), report
    assert report.attention_path == "sdpa: transformers' packed position_ids path"


def _leaky_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """Plain causal attention over the whole row: what SDPA does when packing is ignored."""
    groups = query.shape[1] // key.shape[1]
    key, value = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling)
    return out.transpose(1, 2), None


def test_verify_catches_attention_leaking_across_sequences():
    transformers.AttentionInterface.register("leaky_test", _leaky_attention)
    model = tiny_model("llama")
    report = verify(model, random_sequences([5, 7]), attn_implementation="leaky_test")
    assert not report.ok()
    assert report.max_logit_diff > 1e-3 and report.max_grad_rel_diff > 1e-3
    assert model.config._attn_implementation == "sdpa"  # restored


def test_verify_leaves_model_state_alone():
    model = tiny_model("qwen2").train()
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    report = verify(model, random_sequences([3, 6]))
    assert isinstance(report, VerifyReport) and report.ok()
    assert model.training
    assert all(torch.equal(p.grad, torch.ones_like(p)) for p in model.parameters())
    assert "max logit diff" in str(report)


def test_verify_rejects_empty_input():
    with pytest.raises(ValueError, match="no empty sequences"):
        verify(tiny_model("llama"), [[5, 6], []])


def _branched(seed=0):
    """A prompt longer than a window, forked twice, a fork forked again, a duplicate, a sequence
    that ends inside another, one that shares nothing and a single token."""
    lengths = [2 * SLIDING_WINDOW + 3, 6, 4, 5, 9]
    prompt, a, b, c, d = (s.tolist() for s in random_sequences(lengths, seed=seed))
    return [prompt + a, prompt + b, prompt + a + c, prompt + b, prompt[:5], d, d[:1]]


@pytest.mark.parametrize("family", FAMILIES)
def test_a_tree_row_equals_each_path_alone(family):
    seqs = _branched()
    report = verify(tiny_model(family), seqs, tree=True)
    assert report.max_logit_diff <= 1e-5, report
    assert report.max_grad_rel_diff <= 1e-5, report
    assert report.loss_diff <= 1e-5, report
    assert report.attention_path.endswith("one prefix-tree row")
    assert report.num_sequences == len(seqs) and report.num_tokens < sum(len(s) for s in seqs)


def test_a_tree_row_needs_nopad_attention():
    with pytest.raises(ValueError, match="tree=True needs attn_implementation='nopad'"):
        verify(tiny_model("llama"), _branched(), attn_implementation="sdpa", tree=True)
