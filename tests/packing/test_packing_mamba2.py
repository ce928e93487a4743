"""Mamba2 layers (Nemotron-H, Granite-4 hybrid, Bamba, Falcon-H1) on packed and prefix-tree rows
(:mod:`nopad.packing.mixers.mamba2`): every sequence equals itself alone, a
tree path its flat sequence, forward and backward, fp32; the CUDA kernels (causal-conv1d,
mamba_ssm) get ``seq_idx`` through strict stand-ins; a step with cached context and no generator
state cache is refused (the generator: tests/inference/test_inference_hybrid.py)."""

from __future__ import annotations

import math
import sys

import numpy as np
import pytest
import torch

from nopad import packing
from nopad.packing.bins.tree import TreePath, pack_tree_rows
from nopad.packing.hf import use_nopad_attention
from nopad.packing.mixers import GENERATE, PACKED, TREE, UnsupportedMixerError, check_model, mamba2, recurrence_plan
from nopad.packing.mixers.kernels import KERNELS_ENV
from nopad.packing.varlen import VarlenMeta
from tests.support.mamba_standin import MambaKernelsStandIn
from tests.support.models import MAMBA2_FAMILIES, random_sequences, tiny_model

CHUNK = 4  # a small SSM chunk, so runs span several chunks and end inside one
pytestmark = pytest.mark.usefixtures("one_thread", "nopad_patches")


def mamba_model(family):
    """A tiny model of ``family`` whose SSM state decays slowly (about 0.9 a token, as trained
    models' small time steps give), so a state that went missing or leaked would show."""
    key = "chunk_size" if family == "nemotron_h" else "mamba_chunk_size"
    model = tiny_model(family, **{key: CHUNK})
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, mamba2.mixers()):
                module.A_log.fill_(math.log(0.1))
    return model


def probed(model, kernels):
    """``model`` once its boundary probe ran (nopad.packing.hf.boundary_probe: once per model, at the first
    check), with the probe's own kernel calls cleared: they are not the ones a test counts."""
    check_model(model, PACKED)
    kernels.calls.clear()
    return model


def tree_sequences(depth, seed=0):
    """Sequences sharing prefixes ``depth`` levels deep: a root, then at each level two children
    (lengths 1..6, not multiples of the chunk) of the previous level's first child, every node
    ending a sequence of its own. The first child continues its parent's segment in the row, so
    the second branches from the middle of a segment."""
    rng = np.random.default_rng(seed)
    node = rng.integers(3, 128, 5).tolist()
    out = []
    for _ in range(depth):
        out.append(node)
        children = [node + rng.integers(3, 128, int(rng.integers(1, 7))).tolist() for _ in range(2)]
        out.append(children[1])
        node = children[0]
    return [torch.tensor(s) for s in out + [node]]


def mamba_layers(model):
    return sum(isinstance(m, mamba2.mixers()) for m in model.modules())


@pytest.fixture
def mamba_kernels(monkeypatch):
    """Stand-ins for causal-conv1d and mamba_ssm on ``sys.modules``, used on CPU tensors too."""
    standin = MambaKernelsStandIn()
    for name, module in standin.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv(KERNELS_ENV, "package")
    return standin


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_packed_rows_equal_each_sequence_alone(family):
    model = mamba_model(family)
    report = packing.verify(model, random_sequences((1, 7, 4, 13, 2, 9)))
    assert report.ok(), report


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
@pytest.mark.parametrize("depth", (1, 2, 3, 4))
def test_tree_rows_equal_each_path_alone(family, depth):
    model = mamba_model(family)
    seqs = tree_sequences(depth, seed=depth)
    report = packing.verify(model, seqs, tree=True)
    assert report.ok(), report
    assert report.num_tokens < sum(len(s) for s in seqs)  # the prefixes were laid once


def test_split_trees_repeat_their_context_and_stay_exact():
    """A tree too large for one row is split; each piece repeats its path from the root."""
    model = mamba_model("bamba")
    paths = [TreePath(s.tolist(), [False] + [True] * (len(s) - 1)) for s in tree_sequences(4, seed=5)]
    rows = pack_tree_rows(paths, capacity=max(len(p.ids) for p in paths) + 2)
    assert len(rows) > 1
    logps = {}
    with use_nopad_attention(model):
        for row in rows:
            predict_at, targets = row.loss_tokens()
            logits = model(**row.model_kwargs(), use_cache=False).logits[0]
            lp = torch.log_softmax(logits, -1)[predict_at].gather(1, targets[:, None])[:, 0]
            pairs = row.per_pair(lp.detach())  # one log-prob per (path, loss token)
            for k, p in enumerate(row.indices.tolist()):
                logps[p] = pairs[row.pair_seqs == k]
    for p, path in enumerate(paths):
        ids = torch.tensor(path.ids)
        alone = torch.log_softmax(model(ids[None], use_cache=False).logits[0], -1)
        want = alone[:-1].gather(1, ids[1:, None])[:, 0]
        assert torch.allclose(logps[p], want, atol=1e-5), p


def test_nemotron_mlp_only_layers_keep_passing():
    model = mamba_model("nemotron_h")
    assert [type(layer.mixer).__name__ for layer in model.model.layers][2] == "NemotronHMLP"
    assert packing.verify(model, random_sequences((3, 8))).ok()


@pytest.mark.parametrize("family", MAMBA2_FAMILIES)
def test_supported_in_every_context_with_the_generator_state_sized(family):
    model = mamba_model(family)
    for context in (PACKED, TREE, GENERATE):
        check_model(model, context)
    mixer = next(m for m in model.modules() if isinstance(m, mamba2.mixers()))
    state = mamba2.layer_state(mixer)
    assert state.shape("conv") == (mixer.conv_dim, mixer.conv_kernel_size - 1)
    assert state.shape("recurrent") == (mixer.num_heads, mixer.head_dim, mixer.ssm_state_size)


def test_a_mamba2_layer_whose_state_nopad_cannot_size_is_refused_in_the_generator_only():
    model = mamba_model("bamba")
    model.model.layers[0].mamba.head_dim = 7  # heads x head_dim no longer covers the layer's width
    check_model(model, PACKED)
    check_model(model, TREE)
    with pytest.raises(UnsupportedMixerError, match=r"(?s)generator.*BambaMixer \(model.layers.0"):
        check_model(model, GENERATE)


def test_a_step_with_cached_context_is_refused():
    meta = VarlenMeta.for_step([1, 1], [4, 2])
    with pytest.raises(ValueError, match="in a cache"):
        mamba2.packed_conv(torch.randn(1, 8, 2), torch.randn(8, 4), None, "silu", meta)
    x = torch.randn(1, 2, 1, 1)  # (batch, tokens, heads, dim): the scan refuses before it reads them
    with pytest.raises(ValueError, match="in a cache"):
        mamba2.packed_chunk_scan(x, x, None, x, x, CHUNK, meta)


def test_a_padded_batch_with_nopad_meta_is_refused():
    meta = VarlenMeta.from_lengths([3, 3])
    with pytest.raises(ValueError, match="one row of 6 tokens"):
        mamba2.packed_conv(torch.randn(2, 8, 3), torch.randn(8, 4), None, "silu", meta)


def test_tree_pieces_are_cut_where_a_segment_branches_off():
    # rows 0-5: a chain [0..3] + [4, 5]; segment 2 (rows 6-7) branches from row 3
    meta = VarlenMeta.for_step([6, 2], [0, 4]).with_key_lists([np.arange(6), np.array([0, 1, 2, 3, 6, 7])])
    plan = recurrence_plan(meta)
    assert [(p.start, p.end, p.parent) for p in plan.pieces] == [(0, 4, -1), (4, 6, 0), (6, 8, 0)]


@pytest.mark.parametrize("family", ("nemotron_h", "falcon_h1"))
def test_cuda_kernels_get_seq_idx_on_packed_rows(family, mamba_kernels):
    model = probed(mamba_model(family), mamba_kernels)
    assert packing.verify(model, random_sequences((1, 6, 3))).ok()
    names, layers = mamba_kernels.names(), mamba_layers(model)
    assert names.count("causal_conv1d_fn") == names.count("mamba_chunk_scan_combined") == layers
    seq_idx = mamba_kernels.calls[0][1]["seq_idx"]
    assert seq_idx.tolist() == [[0] + [1] * 6 + [2] * 3]


def test_the_fused_training_kernel_gets_seq_idx(mamba_kernels):
    model = probed(mamba_model("bamba"), mamba_kernels)
    seqs = random_sequences((5, 2, 7))
    alone = [model(s[None], use_cache=False).logits[0] for s in seqs]  # eval: transformers' torch path
    meta = VarlenMeta.from_lengths([len(s) for s in seqs])
    model.train()
    with use_nopad_attention(model):
        packed = model(
            torch.cat(seqs)[None], position_ids=meta.position_ids[None], nopad_meta=meta, use_cache=False
        ).logits[0]
    assert mamba_kernels.names() == ["mamba_split_conv1d_scan_combined"] * mamba_layers(model)
    assert torch.allclose(packed, torch.cat(alone), atol=1e-5)


def test_tree_rows_do_not_use_the_kernels(mamba_kernels):
    """A tree segment starts from its parent's state, which the kernels take per batch row only."""
    model = probed(mamba_model("bamba"), mamba_kernels)
    assert packing.verify(model, tree_sequences(2), tree=True).ok()
    assert mamba_kernels.calls == []


def test_without_nopad_meta_transformers_runs_unchanged():
    model = mamba_model("granitemoehybrid")
    ids = random_sequences((9,))[0][None]
    module = sys.modules[type(model.model.layers[0].mamba).__module__]
    assert module.mamba2_chunk_scan.nopad_original is not module.mamba2_chunk_scan
    logits = model(ids, use_cache=False).logits
    for name in mamba2.HOOK_PARAMETERS:
        hooked = getattr(module, name)
        setattr(module, name, hooked.nopad_original)
    try:
        assert torch.equal(model(ids, use_cache=False).logits, logits)
    finally:
        mamba2.install()


def test_a_nopad_packed_row_without_nopad_meta_is_refused():
    """The attention layers could derive the boundaries from position_ids; the Mamba2 layers read
    nopad_meta only, so a packed row without it is refused rather than run across them."""
    model = mamba_model("nemotron_h")
    seqs = random_sequences((4, 5))
    meta = VarlenMeta.from_lengths([4, 5])
    with use_nopad_attention(model):
        with pytest.raises(ValueError, match="without nopad_meta"):
            model(torch.cat(seqs)[None], position_ids=meta.position_ids[None], use_cache=False)
        packed = model(
            torch.cat(seqs)[None], position_ids=meta.position_ids[None], nopad_meta=meta, use_cache=False
        ).logits[0]
        alone = model(seqs[0][None], use_cache=False).logits[0]  # one sequence: nothing to refuse
    assert torch.allclose(packed[:4], alone, atol=1e-5)


def test_a_release_whose_scan_computes_otherwise_leaves_its_family_refused(monkeypatch):
    """nopad runs its own chunked scan for transformers' ``mamba2_chunk_scan``; every family's scan
    is checked to compute the same once, and one that does not (here: its ``dt_limit`` ignored)
    leaves the family refused, as a changed signature does, rather than computed differently."""
    import importlib
    import inspect

    from nopad.packing.mixers import chunked_ssd

    for module_name, mixer_name in mamba2.FAMILIES.items():
        module = importlib.import_module(module_name)
        assert mamba2._fence(module, mixer_name) is None
    module = importlib.import_module("transformers.models.bamba.modeling_bamba")
    scan = inspect.unwrap(module.mamba2_chunk_scan.nopad_original)

    def without_dt_limit(
        hidden_states, dt, A, B, C, chunk_size, initial_states=None, return_final_states=False, dt_limit=None, **kwargs
    ):
        return scan(
            hidden_states,
            dt,
            A,
            B,
            C,
            chunk_size,
            initial_states=initial_states,
            return_final_states=return_final_states,
            **kwargs,
        )

    assert not chunked_ssd.matches(without_dt_limit)
    monkeypatch.setattr(module, "mamba2_chunk_scan", without_dt_limit)
    assert "computes other than nopad's chunked scan" in mamba2._fence(module, "BambaMixer")


def test_a_release_whose_decode_step_computes_otherwise_leaves_generation_refused():
    """nopad's decode step runs the arithmetic of transformers' ``mamba2_selective_state_update``
    in place in the state slots; every family's step is checked to compute the same once, and one
    that does not (here: no skip term) leaves the family refused in the generator."""
    import importlib

    from nopad.packing.mixers import mamba2_steps

    for module_name in mamba2.FAMILIES:
        assert mamba2_steps.matches(importlib.import_module(module_name).mamba2_selective_state_update)
    step = importlib.import_module("transformers.models.bamba.modeling_bamba").mamba2_selective_state_update

    def without_skip(state, hidden_states, dt, A, B, C, D=None, **kwargs):
        return step(state, hidden_states, dt, A, B, C, None, **kwargs)

    assert not mamba2_steps.matches(without_skip)
    assert not mamba2_steps.matches(lambda *args: None)  # one that cannot run the probe
