"""The boundary probe: a token mixer written with plain tensor ops - a running
mean (``cumsum`` over time) inside an MLP, a decoder layer subclass that adds a prefix sum - holds
nothing the structural scan knows (no convolution, recurrent module, decay parameter, sinks or
declared kind), and ran packed rows, tree rows and the generator 0.4-1.0 off each sequence alone,
with no error. The probe runs one short row of two sequences twice, the first one changed, and
refuses the model where the second one's hidden states move, naming the layer, on every path; a
per-token module passes; the verdict is cached per model; the model and the RNG are left as they
were."""

from __future__ import annotations

import pytest
import torch
from torch import nn
from transformers.models.llama.modeling_llama import LlamaDecoderLayer

from nopad import packing
from nopad.inference import Generator
from nopad.packing.hf import boundary_probe, register_nopad_attention, use_nopad_attention
from nopad.packing.mixers import (
    CONTEXTS,
    MixerSupport,
    UnsupportedMixerError,
    check_model,
    register_mixer_support,
    scan,
    unregister_mixer_support,
)
from nopad.training.sft import use_attention
from tests.packing.test_packing_mixers import packed_call, tree_call
from tests.support.models import random_sequences, tiny_model


class RunningMeanMLP(nn.Module):
    """An MLP followed by a running mean over time: a token mixer in plain tensor ops."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.mlp = mlp

    def forward(self, x):
        y = self.mlp(x)
        steps = torch.arange(1, y.shape[1] + 1, device=y.device, dtype=y.dtype)
        return y.cumsum(1) / steps[:, None]


class ScaledMLP(RunningMeanMLP):
    """An MLP with a learned per-channel scale: per token, mixes nothing."""

    def __init__(self, mlp: nn.Module):
        super().__init__(mlp)
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, mlp.down_proj.out_features))

    def forward(self, x):
        return self.mlp(x) * self.scale


class PrefixSumDecoderLayer(LlamaDecoderLayer):
    """A decoder layer subclass that adds a prefix sum of its output: it still calls attention."""

    def forward(self, hidden_states, *args, **kwargs):
        out = super().forward(hidden_states, *args, **kwargs)
        return out + 0.1 * out.cumsum(1)


def running_mean_model(**overrides):
    model = tiny_model("llama", **overrides)
    model.model.layers[1].mlp = RunningMeanMLP(model.model.layers[1].mlp)
    return model


def prefix_sum_model():
    model = tiny_model("llama")
    model.model.layers[0].__class__ = PrefixSumDecoderLayer
    return model


RUNNING_MEAN = (
    r"layer 1 \(model.layers.1: LlamaDecoderLayer\), first in the output of model.layers.1.mlp "
    r"\(RunningMeanMLP\)"
)


def test_a_running_mean_in_an_mlp_is_refused_on_every_path():
    """Each path with a fresh model, so each one's own probe is what refuses (the verdict is cached)."""
    assert scan(running_mean_model()) == []  # nothing the structural scan could see
    for context in CONTEXTS:
        with pytest.raises(UnsupportedMixerError, match=rf"(?s)probe.*{RUNNING_MEAN}.*docs/models.md"):
            check_model(running_mean_model(), context)
    for tree in (False, True):
        with pytest.raises(UnsupportedMixerError, match=RUNNING_MEAN):
            packing.verify(running_mean_model(), random_sequences((4, 6)), tree=tree)
    with pytest.raises(UnsupportedMixerError, match=RUNNING_MEAN):
        Generator(running_mean_model(), num_blocks=8)
    with pytest.raises(UnsupportedMixerError, match=RUNNING_MEAN):
        use_attention(running_mean_model(), "nopad")  # the SFT recipe's and NopadTrainer's switch
    model = running_mean_model()
    with pytest.raises(UnsupportedMixerError, match=RUNNING_MEAN):
        with use_nopad_attention(model):
            pass
    assert model.config._attn_implementation == "sdpa"  # refused before anything was switched
    register_nopad_attention()
    for call in (packed_call(model), tree_call()):  # the README's bare loop: refused at its first forward
        model = running_mean_model(attn_implementation="nopad")
        with pytest.raises(UnsupportedMixerError, match=RUNNING_MEAN):
            model(**call)
    model = running_mean_model(attn_implementation="nopad")  # probed while dynamo traces
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(UnsupportedMixerError, match=RUNNING_MEAN):
        torch.compile(model, backend="eager")(**packed_call(model))


def test_a_decoder_layer_subclass_that_adds_a_prefix_sum_is_refused():
    assert scan(prefix_sum_model()) == []
    layer = r"layer 0 \(model.layers.0: PrefixSumDecoderLayer\), first in the output of model.layers.0 "
    for context in CONTEXTS:
        with pytest.raises(UnsupportedMixerError, match=layer):
            check_model(prefix_sum_model(), context)
    with pytest.raises(UnsupportedMixerError, match=layer):
        packing.verify(prefix_sum_model(), random_sequences((4, 6)))


def test_a_per_token_module_passes_every_path():
    model = tiny_model("llama")
    model.model.layers[1].mlp = ScaledMLP(model.model.layers[1].mlp)
    for context in CONTEXTS:
        check_model(model, context)
    assert packing.verify(model, random_sequences((4, 6))).ok()
    Generator(model, num_blocks=8)


def test_a_support_that_vouches_for_a_mixer_that_crosses_is_overruled():
    """A registered support lifts the scan's refusal, but the probe has the last word."""
    from tests.packing.test_packing_mixers import ToyRecurrence, toy_model

    register_mixer_support(MixerSupport("toy", lambda m: isinstance(m, ToyRecurrence)))
    try:
        for context in CONTEXTS:
            with pytest.raises(UnsupportedMixerError, match=r"boundary probe.*layer 1 .*\(ToyRecurrence\)"):
                check_model(toy_model(), context)
    finally:
        unregister_mixer_support("toy")


def test_the_verdict_is_cached_per_model_and_the_scan_keeps_its_refusals(monkeypatch):
    """One probe per model, whatever the contexts and paths; none for a model the scan refuses,
    whose refusal keeps the scan's words."""
    from tests.packing.test_packing_mixers import toy_model

    runs = []
    probe = boundary_probe.probe
    monkeypatch.setattr(boundary_probe, "probe", lambda model: runs.append(model) or probe(model))
    model = tiny_model("llama")
    for context in CONTEXTS:
        check_model(model, context)
    packing.verify(model, random_sequences((4, 6)))
    Generator(model, num_blocks=8)
    assert len(runs) == 1
    refused = running_mean_model()
    for context in CONTEXTS:
        with pytest.raises(UnsupportedMixerError):
            check_model(refused, context)
    assert len(runs) == 2
    with pytest.raises(UnsupportedMixerError) as structural:
        check_model(toy_model())
    assert len(runs) == 2 and "boundary probe" not in str(structural.value)
    assert "ToyRecurrence" in str(structural.value)


def test_the_probe_leaves_the_model_and_the_rng_as_they_were():
    """Run in training mode with dropout, sdpa attention: the probe runs in eval mode (deterministic,
    no dropout, which nopad's attention refuses), consumes no random numbers, and restores both."""
    model = running_mean_model(attention_dropout=0.5)
    model.train()
    model.model.layers[0].eval()  # a module's own mode is restored, not the model's
    torch.manual_seed(0)
    state = torch.get_rng_state()
    with pytest.raises(UnsupportedMixerError, match=RUNNING_MEAN):
        check_model(model)
    assert torch.equal(torch.get_rng_state(), state)
    assert model.training and not model.model.layers[0].training and model.model.layers[1].training
    assert model.config._attn_implementation == "sdpa"
    result = boundary_probe.probe(tiny_model("llama"))
    assert result.crossing is None and not result.skipped and result.ms > 0


def test_a_sharded_model_inside_its_own_forward_is_probed_at_the_next_entry_point():
    """A nested forward would gather and free ZeRO-3 / FSDP2 parameters under the running one: from
    inside a forward the probe waits (no pass is cached) for the next entry point."""
    model = running_mean_model()
    model.model.embed_tokens.weight.ds_id = 0  # as ZeRO-3 marks its partitioned parameters
    check_model(model, inside_forward=True)
    with pytest.raises(UnsupportedMixerError, match=RUNNING_MEAN):
        check_model(model)
