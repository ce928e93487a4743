"""Never silent: a model with a layer that mixes tokens in a way nopad does not
compute exactly - a recurrent state, a convolution over time, sinks, or a mixer nopad cannot see -
is refused, naming the layer class, on every path: the check itself, ``verify`` (flat and tree),
``use_nopad_attention``, the ``Generator``, the SFT/Trainer switch, and a bare packed or tree
forward after ``model.set_attn_implementation("nopad")``."""

from __future__ import annotations

import re

import pytest
import torch
from torch import nn

from nopad import packing
from nopad.inference import Generator, SamplingParams
from nopad.inference.state_cache import layer_states
from nopad.packing.bins.tree import TreePath, pack_tree_rows
from nopad.packing.hf import register_nopad_attention, use_nopad_attention
from nopad.packing.mixers import (
    CONTEXTS,
    GENERATE,
    PACKED,
    TREE,
    MixerSupport,
    UnsupportedMixerError,
    check_model,
    register_mixer_support,
    scan,
    unregister_mixer_support,
)
from nopad.packing.varlen import VarlenMeta
from nopad.training.sft import use_attention
from tests.support.models import (
    CHUNKED_FAMILIES,
    FAMILIES,
    HYBRID_FAMILIES,
    MAMBA2_FAMILIES,
    POSITION_FAMILIES,
    SINK_FAMILIES,
    UNKNOWN_ATTENTION_FAMILIES,
    random_sequences,
    tiny_model,
)

# the class each family's refusal must name (its token mixer)
MIXER_CLASS = {
    "qwen3_5": "Qwen3_5GatedDeltaNet",
    "qwen3_next": "Qwen3NextGatedDeltaNet",
    "olmo_hybrid": "OlmoHybridGatedDeltaNet",
    "lfm2": "Lfm2ShortConv",
    "nemotron_h": "NemotronHMamba2Mixer",
    "granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "bamba": "BambaMixer",
    "falcon_h1": "FalconH1Mixer",
    "jamba": "JambaMambaMixer",
    "kimi_linear": "KimiLinearDeltaAttention",
}


class ToyRecurrence(nn.Module):
    """A made-up token mixer nopad has never heard of: an exponential moving average over time
    with learned projections. No convolution, no decay parameter, no config declaration, no call
    to the attention interface: only its layer's missing attention call gives it away."""

    def __init__(self, hidden: int):
        super().__init__()
        self.inp, self.out = nn.Linear(hidden, hidden), nn.Linear(hidden, hidden)

    def forward(self, hidden_states, **kwargs):
        x, state, outs = self.inp(hidden_states), torch.zeros_like(hidden_states[:, 0]), []
        for t in range(x.shape[1]):
            state = 0.5 * state + x[:, t]
            outs.append(state)
        return self.out(torch.stack(outs, dim=1)), None


class RestartingToyRecurrence(ToyRecurrence):
    """The same average, restarted where a flat row's positions restart (each sequence's first
    token): a mixer that keeps a packed row's sequences apart, as a registered support must."""

    def forward(self, hidden_states, position_ids=None, **kwargs):
        x, state, outs = self.inp(hidden_states), torch.zeros_like(hidden_states[:, 0]), []
        for t in range(x.shape[1]):
            state = 0.5 * state * (position_ids[:, t, None] != 0) + x[:, t]
            outs.append(state)
        return self.out(torch.stack(outs, dim=1)), None


def toy_model(mixer=ToyRecurrence):
    model = tiny_model("llama")
    model.model.layers[1].self_attn = mixer(model.config.hidden_size)
    return model


def packed_call(model, lengths=(5, 7)):
    seqs = random_sequences(lengths)
    meta = VarlenMeta.from_lengths([len(s) for s in seqs])
    return dict(input_ids=torch.cat(seqs)[None], position_ids=meta.position_ids[None], nopad_meta=meta, use_cache=False)


def tree_call():
    prompt, a, b = random_sequences((4, 3, 5))
    paths = [TreePath(torch.cat([prompt, c]).tolist(), [False] + [True] * (len(prompt) + len(c) - 1)) for c in (a, b)]
    (row,) = pack_tree_rows(paths, capacity=64)
    return dict(row.model_kwargs(), use_cache=False)


# families whose mixers nopad serves on packed and tree rows (tests/packing/test_packing_hybrid.py,
# tests/packing/test_packing_mamba2.py) and in the generator, with per-sequence state slots
# (tests/inference/test_inference_hybrid.py)
SERVED = ("qwen3_5", "qwen3_next", "olmo_hybrid", "lfm2", "kimi_linear", *MAMBA2_FAMILIES)


@pytest.mark.parametrize("family", [f for f in HYBRID_FAMILIES if f not in SERVED])
def test_every_unserved_hybrid_family_is_refused_naming_its_mixer(family):
    model = tiny_model(family)
    for context in CONTEXTS:
        with pytest.raises(UnsupportedMixerError, match=MIXER_CLASS[family]) as err:
            check_model(model, context)
    assert "docs/models.md" in str(err.value) and type(model).__name__ in str(err.value)
    with pytest.raises(UnsupportedMixerError, match=MIXER_CLASS[family]):
        packing.verify(model, random_sequences((4, 6)))
    with pytest.raises(UnsupportedMixerError, match=MIXER_CLASS[family]):
        Generator(model, num_blocks=8)


@pytest.mark.parametrize("family", SERVED)
def test_served_hybrid_families_pass_every_context_with_their_state_sized(family):
    model = tiny_model(family)
    for context in CONTEXTS:
        check_model(model, context)
    states = layer_states(model)
    assert states and all(MIXER_CLASS[family] == type(model.get_submodule(s.path)).__name__ for s in states)


def test_a_served_layer_whose_state_nopad_cannot_size_is_refused_in_the_generator_only():
    model = tiny_model("qwen3_5")
    del model.model.layers[0].linear_attn.num_v_heads  # the recurrent state's head count is unknown
    check_model(model, PACKED)
    check_model(model, TREE)
    with pytest.raises(UnsupportedMixerError, match=r"(?s)generator.*Qwen3_5GatedDeltaNet \(model.layers.0"):
        check_model(model, GENERATE)
    with pytest.raises(UnsupportedMixerError, match="Qwen3_5GatedDeltaNet"):
        Generator(model, num_blocks=8)


@pytest.mark.parametrize("family", ("qwen3_5", "lfm2"))
def test_a_bare_packed_or_tree_forward_of_a_served_hybrid_family_runs(family):
    register_nopad_attention()
    model = tiny_model(family)
    model.set_attn_implementation("nopad")
    for call in (packed_call(model), tree_call()):
        model(**call)


@pytest.mark.parametrize("family", ("qwen3_5", "lfm2", "kimi_linear", "bamba"))
@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
def test_a_row_packed_by_position_ids_alone_is_refused_on_a_hybrid_family(family, compiled):
    """The nopad attention derives a row's boundaries from position_ids that restart at 0 (HF's
    flattening convention), but a convolution or recurrent layer gets none and would run across
    them (Qwen3.5's logits 4e-2 off, LFM2's 5e-4, no error): refused, eager and under
    torch.compile, naming what to pass; one sequence per row still runs."""
    register_nopad_attention()
    model = tiny_model(family)
    model.set_attn_implementation("nopad")
    call = packed_call(model)
    del call["nopad_meta"]
    forward = torch.compile(model, backend="eager") if compiled else model
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(ValueError, match="without nopad_meta|nopad_meta=meta"):
        forward(**call)
    model(input_ids=random_sequences((6,))[0][None], position_ids=torch.arange(6)[None], use_cache=False)


@pytest.mark.parametrize("family", FAMILIES + SINK_FAMILIES)  # sinks: inside the attention call
def test_an_attention_only_family_packed_by_position_ids_alone_runs_as_alone(family):
    register_nopad_attention()
    model = tiny_model(family)
    seqs = random_sequences((5, 7))
    with torch.no_grad():
        alone = torch.cat([model(input_ids=s[None], use_cache=False).logits[0] for s in seqs])
        model.set_attn_implementation("nopad")
        call = packed_call(model)
        del call["nopad_meta"]
        packed = model(**call).logits[0]
    torch.testing.assert_close(packed, alone, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("family", ("jamba",))
def test_a_bare_packed_or_tree_forward_is_refused_at_its_first_attention_layer(family):
    register_nopad_attention()
    model = tiny_model(family)
    model.set_attn_implementation("nopad")
    for call in (packed_call(model), tree_call()):
        with pytest.raises(ValueError, match=MIXER_CLASS[family]):
            model(**call)
    model(input_ids=random_sequences((6,))[0][None], use_cache=False)  # one sequence per row: as alone


@pytest.mark.parametrize("family", SINK_FAMILIES)
def test_sink_attention_that_passes_s_aux_is_supported_in_every_context(family):
    """nopad.packing.mixers.sinks: gpt-oss hands its sinks to the attention interface as ``s_aux``, which
    every nopad path computes exactly (tests/packing/test_packing_sinks.py proves it)."""
    model = tiny_model(family)
    assert {f.cls for f in scan(model)} == {"GptOssAttention"}  # still found by what it holds ...
    for context in CONTEXTS:
        check_model(model, context)  # ... and handled


def test_a_sink_parameter_used_any_other_way_is_still_refused():
    model = tiny_model("llama")  # LlamaAttention never passes s_aux: its sinks would be dropped
    model.model.layers[0].self_attn.sinks = nn.Parameter(torch.zeros(model.config.num_attention_heads))
    for context in CONTEXTS:
        with pytest.raises(UnsupportedMixerError, match=r"LlamaAttention .*attention sinks"):
            check_model(model, context)


def test_a_made_up_recurrent_layer_is_refused_on_every_path():
    model = toy_model()
    for context in CONTEXTS:
        with pytest.raises(UnsupportedMixerError, match=r"LlamaDecoderLayer.*layers \[1\].*ToyRecurrence"):
            check_model(model, context)
    for tree in (False, True):
        with pytest.raises(UnsupportedMixerError, match="ToyRecurrence"):
            packing.verify(model, random_sequences((4, 6)), tree=tree)
    with pytest.raises(UnsupportedMixerError, match="ToyRecurrence"):
        Generator(model, num_blocks=8)
    previous = model.config._attn_implementation
    with pytest.raises(UnsupportedMixerError, match="ToyRecurrence"):
        with use_nopad_attention(model):
            pass
    assert model.config._attn_implementation == previous  # refused before anything was switched
    with pytest.raises(UnsupportedMixerError, match="ToyRecurrence"):
        use_attention(model, "nopad")  # the SFT recipe's and NopadTrainer's switch
    register_nopad_attention()
    model.set_attn_implementation("nopad")  # the README's bare loop: refused at the first forward
    positions_only = packed_call(model)
    del positions_only["nopad_meta"]
    for call in (packed_call(model), tree_call(), positions_only):
        with pytest.raises(UnsupportedMixerError, match="ToyRecurrence"):
            model(**call)
    # and under a bare torch.compile, whose traced forward has no call stack to find the model by
    # (it ran across the boundaries with no error)
    for call in (packed_call(model), tree_call(), positions_only):
        torch._dynamo.reset()
        with torch.no_grad(), pytest.raises(UnsupportedMixerError, match="ToyRecurrence"):
            torch.compile(model, backend="eager")(**call)


def test_a_refused_family_is_refused_under_a_bare_compile():
    """Jamba's Mamba1 layer, refused eager, ran across the boundaries under torch.compile."""
    register_nopad_attention()
    model = tiny_model("jamba")
    model.set_attn_implementation("nopad")
    torch._dynamo.reset()
    with torch.no_grad(), pytest.raises(UnsupportedMixerError, match=MIXER_CLASS["jamba"]):
        torch.compile(model, backend="eager")(**packed_call(model))


def test_the_compiled_check_costs_no_graph_break():
    """The check a traced forward runs is a constant of the graph: a bare compiled forward of an
    attention-only model is one graph (no break at all), and gives the eager logits."""
    register_nopad_attention()
    model = tiny_model("llama")
    model.set_attn_implementation("nopad")
    call = packed_call(model)
    torch._dynamo.reset()
    with torch.no_grad():
        explained = torch._dynamo.explain(model)(**call)
        breaks = [
            f"{frame.filename}:{frame.lineno}" for reason in explained.break_reasons for frame in reason.user_stack
        ]
        assert explained.graph_break_count == 0, breaks
        compiled = torch.compile(model, backend="eager")(**call).logits
        torch.testing.assert_close(compiled, model(**call).logits, rtol=0, atol=0)


def test_a_made_up_convolution_beside_attention_is_refused():
    model = tiny_model("llama")
    layer = model.model.layers[0]
    layer.mlp.smooth = nn.Conv1d(64, 64, kernel_size=3, groups=64, padding=2)  # never called: held is enough
    with pytest.raises(UnsupportedMixerError, match=r"LlamaMLP \(model.layers.0.mlp, layers \[0\]\): a conv"):
        check_model(model)


def test_a_made_up_convolution_beside_a_served_mixer_is_refused():
    """A served Gated DeltaNet does not vouch for another mixer of its layer: Qwen4-Exp's n-gram
    block (a dilated convolution over time beside its delta rule) ran across the boundaries, 3e-2
    off with no error, because its layer held a served mixer (the family sweep)."""
    model = tiny_model("qwen3_5")
    layer = model.model.layers[0]
    layer.ngram = nn.Sequential(nn.Conv1d(64, 64, kernel_size=3, groups=64, padding=2))
    for context in CONTEXTS:
        with pytest.raises(UnsupportedMixerError, match=r"Sequential \(model.layers.0.ngram, layers \[0\]\)"):
            check_model(model, context)


def test_a_stateful_model_with_nothing_else_to_show_is_refused():
    model = tiny_model("llama")

    class StatefulLlama(type(model)):
        _is_stateful = True

    model.__class__ = StatefulLlama
    with pytest.raises(UnsupportedMixerError, match="_is_stateful"):
        check_model(model)


@pytest.mark.parametrize("family", FAMILIES)
def test_attention_only_families_pass_every_context(family):
    model = tiny_model(family)
    assert scan(model) == []
    for context in CONTEXTS:
        check_model(model, context)


def test_a_declared_position_wise_layer_is_not_named():
    findings = scan(tiny_model("nemotron_h"))  # layers: mamba, attention, mlp, mamba
    assert sorted({f.layer for f in findings}) == [0, 3]


def test_a_registered_support_lifts_the_refusal_only_where_it_declares():
    model = toy_model(RestartingToyRecurrence)  # a support for a mixer that crosses is overruled by
    # the boundary probe (tests/packing/test_packing_boundary_probe.py)
    support = MixerSupport("toy", lambda m: isinstance(m, ToyRecurrence), frozenset({PACKED, TREE}))
    register_mixer_support(support)
    try:
        check_model(model, PACKED)
        check_model(model, TREE)
        with pytest.raises(UnsupportedMixerError, match="the generator"):
            check_model(model, GENERATE)
    finally:
        unregister_mixer_support("toy")
    with pytest.raises(UnsupportedMixerError):
        check_model(model, PACKED)
    with pytest.raises(ValueError, match="unknown contexts"):
        register_mixer_support(MixerSupport("bad", lambda m: False, frozenset({"decode"})))


@pytest.mark.parametrize("family", UNKNOWN_ATTENTION_FAMILIES)
def test_an_attention_of_a_kind_nopad_does_not_know_is_refused_on_every_path(family):
    """DeepSeek-V4 pools K/V over windows of the row (its compressed layers) and has sinks;
    DeepSeek-V3.2's indexer picks each query's keys. Both call the attention interface, and V4's
    sinks are ones nopad serves, so only the kind the config declares tells: before, V4's packed
    row died in nopad's attention on a key count (its pooled keys appended to the row's) and its
    generator on a cache shape, neither saying why; V3.2's sliding-window-free indexer would pick
    keys from other sequences of the row."""
    model = tiny_model(family)
    layer = type(model.model.layers[1]).__name__
    for context in CONTEXTS:
        with pytest.raises(UnsupportedMixerError, match=rf"{layer} .*declared as '\w+_attention'"):
            check_model(model, context)
    with pytest.raises(UnsupportedMixerError, match=layer):
        packing.verify(model, random_sequences((5, 40, 9)))
    with pytest.raises(UnsupportedMixerError, match=layer):
        Generator(model, block_size=16, max_num_batched_tokens=64, max_num_seqs=2, num_blocks=16)


def test_sinks_do_not_vouch_for_a_layer_declared_as_another_kind_of_attention():
    """gpt-oss as it is passes (its sinks are served); the same layer declared as a kind nopad
    does not know is refused, though the sinks it holds are still ones nopad serves."""
    model = tiny_model("gpt_oss")
    for context in CONTEXTS:
        check_model(model, context)
    kinds = list(model.config.layer_types)
    kinds[1] = "heavily_compressed_attention"  # DeepSeek-V4's kind on a gpt-oss layer
    model = tiny_model("gpt_oss", layer_types=kinds)
    for context in CONTEXTS:
        with pytest.raises(UnsupportedMixerError, match=r"GptOssDecoderLayer .*'heavily_compressed_"):
            check_model(model, context)


@pytest.mark.parametrize("family", POSITION_FAMILIES)
def test_positions_nopad_cannot_set_are_refused_on_every_path(family):
    """BART's decoder takes no position_ids (it counts positions on from the row's start) and
    Roberta's learned position table starts past its padding index: both ran packed rows with each
    later sequence at positions that are not its own, logits 0.6 off, with no error (the
    sweep of every causal LM in transformers 5.24)."""
    model = tiny_model(family)
    for context in CONTEXTS:
        with pytest.raises(UnsupportedMixerError, match="position"):
            check_model(model, context)
    with pytest.raises(UnsupportedMixerError, match="position"):
        packing.verify(model, random_sequences((5, 40, 9)))
    with pytest.raises(UnsupportedMixerError, match="position"):
        Generator(model, block_size=16, max_num_batched_tokens=64, max_num_seqs=2, num_blocks=16)


@pytest.mark.parametrize("family", CHUNKED_FAMILIES)
def test_chunked_attention_and_attention_that_counts_its_own_positions_are_refused(family):
    """Llama4's chunked layers attend within chunks of ``attention_chunk_size`` by a mask that
    transformers builds and nopad's attention replaces; its NoPE layers scale queries by a
    temperature of positions they count from the row's start. Its packed rows were 0.7 off with no
    error (the family sweep); both are refused, each by what it is."""
    model = tiny_model(family)
    for context in CONTEXTS:
        with pytest.raises(UnsupportedMixerError, match=r"declared as 'chunked_attention'") as refused:
            check_model(model, context)
        assert re.search(r"Llama4TextAttention .*positions of its own", str(refused.value))


def test_bidirectional_attention_with_a_window_or_in_the_generator_is_refused():
    """Gemma3 with ``use_bidirectional_attention``: nopad's window over a bidirectional layer kept
    the whole future (transformers': ``|q - k| < window``), 0.77 off even for one sequence alone, and
    the generator ran it causally; both with no error (the family sweep)."""
    import transformers

    from tests.support.models import _COMMON

    config = transformers.Gemma3TextConfig(
        **_COMMON,
        head_dim=16,
        sliding_window=8,
        layer_types=["sliding_attention", "full_attention"],
        use_bidirectional_attention=True,
    )
    torch.manual_seed(0)
    model = transformers.Gemma3ForCausalLM(config).eval()
    with pytest.raises(UnsupportedMixerError, match=r"Gemma3Attention \(layer 0\) is bidirectional"):
        packing.verify(model, random_sequences((20,)))
    gen = Generator(model, block_size=4, num_blocks=32)
    with pytest.raises(UnsupportedMixerError, match=r"is bidirectional .*a paged generator step"):
        gen.generate([[5, 6, 7]], SamplingParams(max_tokens=2, temperature=0.0), use_tqdm=False)


@pytest.mark.parametrize("kind", ["longrope", "dynamic"])
def test_a_rotary_scaling_switched_by_the_longest_sequence_is_kept_on_one_side(kind, caplog):
    """LongRoPE (Phi-3.5, Phi-4-mini) and dynamic NTK pick their factors from the whole call's
    largest position: a packed row with a sequence on each side of the switch gave the short one the
    long factors, 0.13 off with no error (the family sweep). Such a row is refused; a row under the
    switch is exact; the generator keeps every sequence under it."""
    import transformers

    from tests.support.models import _COMMON

    if kind == "longrope":
        rope = {
            "rope_type": "longrope",
            "rope_theta": 1e4,
            "short_factor": [1.0] * 8,
            "long_factor": [4.0] * 8,
            "original_max_position_embeddings": 16,
        }
        config = transformers.Phi3Config(
            **{**_COMMON, "max_position_embeddings": 64}, original_max_position_embeddings=16, rope_parameters=rope
        )
        model_cls = transformers.Phi3ForCausalLM
    else:
        dynamic = {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}
        config = transformers.LlamaConfig(**{**_COMMON, "max_position_embeddings": 16}, rope_parameters=dynamic)
        model_cls = transformers.LlamaForCausalLM
    torch.manual_seed(0)
    model = model_cls(config).eval()
    with pytest.raises(UnsupportedMixerError, match=r"switches its factors at 16 tokens"):
        packing.verify(model, random_sequences((5, 20)))
    assert packing.verify(model, random_sequences((5, 12))).ok()
    with caplog.at_level("WARNING"):
        assert Generator(model, block_size=4, num_blocks=32).max_model_len == 16
