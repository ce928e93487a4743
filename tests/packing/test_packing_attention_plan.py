"""The attention plan: a forward decides each kind of layer's backend once, reads the environment
and the batch-invariant mode when it is made, and the registry's declarations drive the rest."""

from __future__ import annotations

import pytest
import torch

from nopad.packing import invariance_support
from nopad.packing.attention import BACKEND_ENV, registry
from nopad.packing.attention import plan as plan_module
from nopad.packing.attention.plan import AttentionPlan
from nopad.packing.hf import use_nopad_attention
from nopad.packing.invariance import batch_invariant
from nopad.packing.varlen import VarlenMeta
from tests.support.models import tiny_model

CPU = torch.device("cpu")


@pytest.fixture
def rule_runs(monkeypatch):
    """The calls the registry's rule sees, in order."""
    seen = []

    def counting(call, requested="auto"):
        seen.append((call, requested))
        return registry.choose(call, requested)

    monkeypatch.setattr(plan_module, "choose", counting)
    return seen


@pytest.mark.parametrize("family,kinds", [("llama", 1), ("gemma2", 2)])  # gemma2: sliding + full layers
def test_one_decision_per_kind_of_layer_per_forward(family, kinds, rule_runs, monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    model = tiny_model(family, num_hidden_layers=6)
    meta = VarlenMeta.from_lengths([5, 7, 3])
    ids = torch.randint(3, 100, (1, 15))
    with use_nopad_attention(model), torch.no_grad():
        model(input_ids=ids, position_ids=meta.position_ids[None], nopad_meta=meta)  # warm-up: the
        rule_runs.clear()  # model's first check runs the boundary probe, whose forwards plan too
        model(input_ids=ids, position_ids=meta.position_ids[None], nopad_meta=meta)
        assert len(rule_runs) == kinds
        position_ids = meta.position_ids[None].clone()
        model(input_ids=ids, position_ids=position_ids)  # boundaries derived from the positions
    assert len(rule_runs) == 2 * kinds  # one more plan: a new forward decides again
    assert not hasattr(position_ids, "_nopad_meta")  # nothing written onto the caller's tensor


def test_the_environment_is_read_when_the_plan_is_made(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "sdpa_dense")
    plan = AttentionPlan()
    monkeypatch.setenv(BACKEND_ENV, "sdpa_padded")
    assert plan.decide(CPU, torch.float32).backend.name == "sdpa_dense"
    assert AttentionPlan().decide(CPU, torch.float32).backend.name == "sdpa_padded"
    assert plan.decide(CPU, torch.float32, override="sdpa_loop").backend.name == "sdpa_loop"  # keyword wins
    monkeypatch.setenv(BACKEND_ENV, "fast")
    with pytest.raises(ValueError, match="NOPAD_ATTN_BACKEND='fast'"):
        AttentionPlan().decide(CPU, torch.float32)


def test_a_plan_keeps_the_mode_it_was_made_in(monkeypatch):
    monkeypatch.delenv(BACKEND_ENV, raising=False)
    outside = AttentionPlan()
    with batch_invariant():
        inside = AttentionPlan()
        assert outside.decide(CPU, torch.float32).backend.name == "sdpa_loop"
    assert inside.decide(CPU, torch.float32).backend.name in registry.invariant_names("cpu")
    assert inside.decide(CPU, torch.float32).call.invariant and inside.decisions == 1  # reused


def test_the_invariant_set_comes_from_the_declarations(monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, "sdpa_loop")
    assert invariance_support.supported("cpu") == (
        False,
        f"{BACKEND_ENV}=sdpa_loop forces an attention backend without the batch-invariant path",
    )
    table = dict(registry.backends())
    twin = table["per_token"]
    table["twin"] = registry.Backend("twin", twin.forward, devices=("cpu",), dtypes=twin.dtypes, invariant=True)
    monkeypatch.setattr(registry, "_registry", table)
    assert registry.invariant_names("cpu") == ("kernel", "per_token", "twin")
    monkeypatch.setenv(BACKEND_ENV, "twin")
    assert invariance_support.supported("cpu") == (True, "")


def test_use_nopad_attention_restores_the_model_on_error():
    model = tiny_model("llama")
    model.config._attn_implementation = "sdpa"
    model.train()
    with pytest.raises(RuntimeError, match="inside"), use_nopad_attention(model, eval_mode=True):
        assert model.config._attn_implementation == "nopad" and not model.training
        raise RuntimeError("inside")
    assert model.config._attn_implementation == "sdpa" and model.training
    assert not model._forward_pre_hooks  # the packed-forward guard is gone too


def test_derived_values_are_cached_properties_of_the_record():
    meta = VarlenMeta.shared_prefix([(3, [2, 1])])
    assert meta.key_positions is meta.key_positions and meta.without_key_index is meta.without_key_index
    assert meta.without_key_index.key_index is None
    seq, pos = meta.key_positions
    assert seq.tolist() == [0, 0, 0, 1, 1, 1, 1, 1, 2, 2, 2, 2]
    assert pos.tolist() == [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 2, 3]
    cu_q, lens_k, starts = meta.host_boundaries
    assert cu_q.tolist() == [0, 3, 5, 6] and lens_k.tolist() == [3, 5, 4] and starts.tolist() == [0, 3, 8]
    assert meta.host_key_index.tolist() == [[0, 1, 2, 0, 0], [0, 1, 2, 3, 4], [0, 1, 2, 5, 0]]
    layout = VarlenMeta.from_lengths([2, 3]).padded_layout
    assert layout.key_rows.tolist() == [[0, 1, 0], [2, 3, 4]]
    assert layout.query_rows.tolist() == [[0, 1, 0], [2, 3, 4]]
    assert layout.query_valid.tolist() == [[True, True, False], [True, True, True]]


def test_a_model_that_uses_the_mask_itself_is_told_why_it_cannot_run():
    """Doge reads its mask's ``.dtype`` and GIT adds to it, outside the attention interface: under
    nopad the mask is the plan, and they died on "no attribute 'dtype'" / "unsupported operand"
    (found by benchmarks/sweep_families.py). The errors now say what the model did and what to do; a plan still has no
    attributes it lacks (``hasattr`` is False) and copies as before."""
    import copy

    plan = AttentionPlan()
    with pytest.raises(AttributeError, match=r"uses its attention mask itself.*\(it asked for \.dtype\)"):
        _ = plan.dtype
    with pytest.raises(TypeError, match=r"uses its attention mask itself.*\(it added to it\)"):
        torch.zeros(2) + plan
    assert not hasattr(plan, "shape")
    assert copy.copy(plan).default == plan.default
