"""Hybrid layers on packed and prefix-tree rows: Gated DeltaNet (Qwen3.5,
Qwen3-Next, OLMo-hybrid), Kimi's KDA and LFM2's short convolution compute on a packed row what
each sequence computes alone, and on a tree row what each path computes flat, through
transformers' own kernel functions (packing/mixers/hf_kernels.py); the varlen convolution and
delta rule against the per-sequence torch functions with initial and final states; the fla /
causal-conv1d dispatch through strict stand-ins; a GRPO step on tree rows of Qwen3.5."""

from __future__ import annotations

import importlib.machinery
import subprocess
import sys
import types
import warnings
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

from nopad import packing
from nopad.packing.mixers import (
    check_model,
    delta_rule,
    kernels,
    patches,
    recurrence_plan,
    varlen_causal_conv1d,
    varlen_delta_rule,
)
from nopad.packing.mixers.kernels import KERNELS_ENV
from nopad.packing.varlen import VarlenMeta
from tests.support.models import random_sequences, tiny_model

SERVED = ("qwen3_5", "qwen3_next", "olmo_hybrid", "lfm2", "kimi_linear")
patches.install()  # importing nopad patches nothing; these tests read the kernel functions it wraps
TORCH_RULE = qwen.torch_chunk_gated_delta_rule.__wrapped__  # transformers' own torch function


def exact(report) -> bool:
    """The bar: logits within 1e-5, the whole gradient within 1e-5 relative, and verify's own
    per-tensor bound (which floors a tensor's scale at 1e-3 of the whole gradient: in these tiny random
    models some decay parameters, ``dt_bias`` / ``A_log``, get a gradient 1e-8 of the whole one)."""
    return report.max_logit_diff <= 1e-5 * max(1.0, report.logit_scale) and report.grad_rel_diff <= 1e-5 and report.ok()


def tree_sequences(depth: int, seed: int = 0) -> list[torch.Tensor]:
    """A prompt with several continuations, the first forked again, down to ``depth`` levels;
    one path ends at an inner node, one prompt is longer than a 64-token chunk (depth >= 3)."""
    g = torch.Generator().manual_seed(seed)

    def ids(n):
        return torch.randint(3, 128, (n,), generator=g)

    prompt = ids(70 if depth >= 3 else 9)
    paths, stem = [], prompt
    for level in range(depth):
        branches = [torch.cat([stem, ids(n)]) for n in (3 + level, 1, 5)]
        paths += branches[1:]
        stem = branches[0]
    paths.append(stem)
    paths.append(prompt[:4])  # a path that ends inside another's first node
    return paths


@pytest.mark.parametrize("family", SERVED)
def test_packed_rows_equal_each_sequence_alone(family, one_thread):
    model = tiny_model(family)
    report = packing.verify(model, random_sequences((1, 70, 5, 13, 64)))
    assert exact(report), str(report)


@pytest.mark.parametrize("family", SERVED)
@pytest.mark.parametrize("depth", [1, 2, 4])
def test_tree_rows_equal_each_path_flat(family, depth, one_thread):
    if family != "qwen3_5" and depth == 2:
        pytest.skip("depth 2 on the other families adds time, not coverage")
    report = packing.verify(tiny_model(family), tree_sequences(depth), tree=True)
    assert exact(report), str(report)


def test_a_tree_row_cuts_segments_where_a_branch_leaves_them():
    """Depth 3: the first child of each node continues its parent's segment, its siblings branch
    off half-way; the plan cuts there, and each level of branches is one wave."""
    from nopad.packing.bins.tree import TreePath, pack_tree_rows

    (row,) = pack_tree_rows([TreePath(s.tolist()) for s in tree_sequences(3)], capacity=512)
    plan = recurrence_plan(row.nopad_meta)
    assert len(plan.pieces) > row.nopad_meta.num_seqs  # segments cut at the forks
    assert len(plan.waves) == 4  # the prompt's first 4 tokens; the rest of the prompt; 3 levels
    ends = {p.end - 1 for p in plan.pieces}
    assert all(plan.pieces[p.parent].end - 1 in ends for p in plan.pieces if p.parent >= 0)


def test_the_model_without_a_nopad_row_is_unchanged(one_thread):
    """HF's own call (no nopad_meta) goes to transformers' function as before."""
    model = tiny_model("qwen3_5")
    ids = random_sequences((9,))[0][None]
    assert qwen.torch_chunk_gated_delta_rule._nopad_kernel == "chunk_gated_delta_rule"
    with torch.no_grad():
        got = model(ids, use_cache=False).logits
        for name in ("torch_chunk_gated_delta_rule", "causal_conv1d_fn"):
            setattr(qwen, name, getattr(qwen, name).__wrapped__)
        try:
            want = model(ids, use_cache=False).logits
        finally:
            import nopad.packing.mixers.hf_kernels as hf_kernels

            hf_kernels.install()
    assert torch.equal(got, want)


# ----------------------------------------------------------------------------- the varlen functions
def _conv_alone(x, weight, bias, activation, state):
    """One sequence (C, L) after conv state ``state`` (C, K - 1): output and its final state."""
    full = torch.cat([state, x], dim=1)
    out = F.conv1d(full[None], weight[:, None], bias, groups=x.shape[0])[0]
    out = F.silu(out) if activation else out
    return out, full[:, -(weight.shape[1] - 1) :]


@pytest.mark.parametrize("layout", ["(1, T, C)", "(C, T)"])
def test_varlen_conv_with_initial_and_final_states(layout):
    torch.manual_seed(0)
    lengths, channels, kernel = [5, 1, 0, 2, 9], 6, 4
    x = torch.randn(channels, sum(lengths))
    weight, bias = torch.randn(channels, kernel), torch.randn(channels)
    init = torch.randn(len(lengths), channels, kernel - 1)
    cu = torch.tensor(np.concatenate(([0], np.cumsum(lengths))), dtype=torch.int32)
    arg = x.t()[None] if layout == "(1, T, C)" else x
    out, final = varlen_causal_conv1d(
        arg, weight, bias, "silu", cu_seqlens=cu, initial_states=init, return_final_states=True
    )
    out = out[0].t() if layout == "(1, T, C)" else out
    for i in range(len(lengths)):
        a, b = int(cu[i]), int(cu[i + 1])
        if a == b:  # an empty sequence keeps its state
            assert torch.equal(final[i], init[i])
            continue
        want, want_state = _conv_alone(x[:, a:b], weight, bias, True, init[i])
        torch.testing.assert_close(out[:, a:b], want, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(final[i], want_state, rtol=0, atol=0)
    zero = varlen_causal_conv1d(x, weight, None, None, meta=VarlenMeta.from_lengths(lengths))
    want = torch.cat(
        [
            _conv_alone(x[:, int(cu[i]) : int(cu[i + 1])], weight, None, False, torch.zeros(channels, kernel - 1))[0]
            for i in range(len(lengths))
            if lengths[i]
        ],
        dim=1,
    )
    torch.testing.assert_close(zero, want, rtol=1e-6, atol=1e-6)


def test_varlen_conv_refuses_bad_input():
    x, w = torch.randn(4, 6), torch.randn(4, 3)
    meta = VarlenMeta.from_lengths([2, 4])
    with pytest.raises(ValueError, match="exactly one of meta or cu_seqlens"):
        varlen_causal_conv1d(x, w)
    with pytest.raises(ValueError, match="row has 6 tokens"):
        varlen_causal_conv1d(x, w, meta=VarlenMeta.from_lengths([2, 3]))
    with pytest.raises(ValueError, match="weight must be"):
        varlen_causal_conv1d(x, torch.randn(5, 3), meta=meta)
    with pytest.raises(ValueError, match="activation"):
        varlen_causal_conv1d(x, w, activation="gelu", meta=meta)
    with pytest.raises(ValueError, match="initial_states must be"):
        varlen_causal_conv1d(x, w, meta=meta, initial_states=torch.zeros(2, 4, 3))
    with pytest.raises(ValueError, match="in a cache"):
        varlen_causal_conv1d(x, w, meta=VarlenMeta.for_step([2, 4], [1, 0]))


def _rule_inputs(lengths, heads=2, value_heads=4, dim=8, seed=0):
    torch.manual_seed(seed)
    total = sum(lengths)
    q, k = torch.randn(1, total, heads, dim), torch.randn(1, total, heads, dim)
    v = torch.randn(1, total, value_heads, dim)
    g, beta = -torch.rand(1, total, value_heads), torch.rand(1, total, value_heads)
    return q, k, v, g, beta


def test_varlen_delta_rule_with_initial_and_final_states():
    lengths = [70, 1, 0, 64, 3]
    q, k, v, g, beta = tensors = _rule_inputs(lengths)
    init = torch.randn(len(lengths), 4, 8, 8)
    out, final = varlen_delta_rule(
        TORCH_RULE,
        *tensors,
        meta=VarlenMeta.from_lengths(lengths),
        initial_state=init,
        output_final_state=True,
        use_qk_l2norm_in_kernel=True,
    )
    cu = np.concatenate(([0], np.cumsum(lengths)))
    for i in range(len(lengths)):
        a, b = cu[i], cu[i + 1]
        if a == b:
            assert torch.equal(final[i], init[i])
            continue
        want, want_state = TORCH_RULE(
            *(t[:, a:b] for t in tensors),
            initial_state=init[i : i + 1],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        torch.testing.assert_close(out[:, a:b], want, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(final[i], want_state[0], rtol=1e-5, atol=1e-5)


def test_own_chunked_rule_equals_transformers_per_piece_with_gradients():
    """nopad's chunk-major varlen rule (every piece at once, in any order in the row, each from
    its own state) computes what transformers' function computes on each piece alone, forward
    and backward, with pieces of 1 to 3 chunks and one that fills its chunk exactly."""
    from nopad.packing.mixers.chunked_delta_rule import chunked_gated_delta_rule

    lengths, starts = [40, 1, 16, 33, 7], [60, 0, 2, 18, 51]  # out of row order; rows 1, 58, 59 unused
    tensors = [t.requires_grad_() for t in _rule_inputs([sum(lengths) + 3])]
    init = torch.randn(len(lengths), 4, 8, 8, requires_grad=True)
    out, final = chunked_gated_delta_rule(
        *tensors, starts, lengths, initial_state=init, chunk_size=16, use_qk_l2norm_in_kernel=True
    )
    weights = torch.randn_like(out), torch.randn_like(final)
    grads = torch.autograd.grad((out * weights[0]).sum() + (final * weights[1]).sum(), [*tensors, init])
    want_out, want_final = [], []
    for i, (start, n) in enumerate(zip(starts, lengths)):
        o, f = TORCH_RULE(
            *(t[:, start : start + n] for t in tensors),
            chunk_size=16,
            initial_state=init[i : i + 1],
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )
        want_out.append(o[0])
        want_final.append(f[0])
    want_out, want_final = torch.cat(want_out), torch.stack(want_final)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, want_final, rtol=1e-5, atol=1e-5)
    want_grads = torch.autograd.grad((want_out * weights[0]).sum() + (want_final * weights[1]).sum(), [*tensors, init])
    for got, want in zip(grads, want_grads):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_own_chunked_rule_flushes_subnormal_decays_without_moving_the_output():
    """A strong decay (log decay -3 a token, as random and trained Qwen3.5 heads reach) puts
    exp(cumulative decay) in the subnormal range within a chunk, which a CPU multiplies tens of
    times slower; nopad's rule flushes those terms to 0 and still equals transformers' function."""
    from nopad.packing.mixers.chunked_delta_rule import chunked_gated_delta_rule
    from nopad.packing.mixers.chunks import flushed_exp

    q, k, v, g, beta = _rule_inputs([128])
    g = torch.full_like(g, -3.0)
    decays = flushed_exp(torch.arange(0, -130, -3.0))
    tiny = torch.finfo(torch.float32).tiny
    assert not ((decays > 0) & (decays < tiny)).any() and decays[-1] == 0
    out, final = chunked_gated_delta_rule(q, k, v, g, beta, [0], [128], use_qk_l2norm_in_kernel=True)
    want, want_final = TORCH_RULE(
        q, k, v, g, beta, initial_state=None, output_final_state=True, use_qk_l2norm_in_kernel=True
    )
    torch.testing.assert_close(out, want[0], rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(final, want_final, rtol=1e-5, atol=1e-6)


def test_own_ssd_scan_equals_transformers_per_piece_with_gradients():
    """nopad's chunk-major Mamba2 scan (every piece at once, each from its own state, dt
    discretised with bias, softplus and D's skip) computes what transformers' ``mamba2_chunk_scan``
    computes on each piece alone, forward and backward."""
    import inspect

    from transformers.models.bamba import modeling_bamba

    from nopad.packing.mixers.chunked_ssd import chunked_ssd_scan

    scan = inspect.unwrap(modeling_bamba.mamba2_chunk_scan)
    torch.manual_seed(0)
    pieces = [(60, 100), (0, 1), (2, 18), (18, 51), (51, 58)]
    x, dt = torch.randn(100, 4, 8, requires_grad=True), torch.randn(100, 4, requires_grad=True)
    B, C = torch.randn(100, 2, 6, requires_grad=True), torch.randn(100, 2, 6, requires_grad=True)
    init = torch.randn(len(pieces), 4, 8, 6, requires_grad=True)
    options = dict(A=-3 * torch.rand(4), D=torch.randn(4), dt_bias=torch.randn(4), dt_softplus=True)
    out, final = chunked_ssd_scan(
        x, dt, options["A"], B, C, pieces, init, chunk_size=16, **{k: v for k, v in options.items() if k != "A"}
    )
    want_out, want_final = [], []
    for i, (a, b) in enumerate(pieces):
        o, f = scan(
            x[None, a:b],
            dt[None, a:b],
            options["A"],
            B[None, a:b],
            C[None, a:b],
            16,
            initial_states=init[i : i + 1],
            return_final_states=True,
            **{k: v for k, v in options.items() if k != "A"},
        )
        want_out.append(o[0])
        want_final.append(f[0])
    want_out, want_final = torch.cat(want_out), torch.stack(want_final)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(final, want_final, rtol=1e-5, atol=1e-5)
    weights = torch.randn_like(out), torch.randn_like(final)
    inputs = [x, dt, B, C, init]
    got = torch.autograd.grad((out * weights[0]).sum() + (final * weights[1]).sum(), inputs)
    want = torch.autograd.grad((want_out * weights[0]).sum() + (want_final * weights[1]).sum(), inputs)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-5)


def test_a_chunked_scan_refuses_no_pieces_or_a_negative_length():
    from nopad.packing.mixers.chunks import chunk_layout

    for lengths in ([], [3, -1]):
        with pytest.raises(ValueError, match="at least one piece of length >= 0"):
            chunk_layout([0] * len(lengths), lengths, total=8, chunk_size=4)


def test_a_delta_rule_that_computes_otherwise_runs_itself(caplog):
    """nopad's own chunked rule stands in for functions made under the kernel name
    ``chunk_gated_delta_rule`` only once it is seen to compute what the function does; one that
    computes otherwise (here: its output scaled) runs itself on the row, reported once."""
    from nopad.packing.mixers import chunked_delta_rule

    assert chunked_delta_rule.matches(TORCH_RULE)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # a forward under autocast: the probe stays fp32
        assert chunked_delta_rule.matches(lambda *args, **kwargs: TORCH_RULE(*args, **kwargs))
    assert not chunked_delta_rule.matches(lambda *args: None)  # one that cannot run the probe

    def scaled(*args, **kwargs):
        out, state = TORCH_RULE(*args, **kwargs)
        return 1.5 * out, state

    lengths = [70, 5, 20]
    tensors = _rule_inputs(lengths)
    with caplog.at_level("WARNING", logger="nopad.packing.mixers.chunked_delta_rule"):
        out, _ = varlen_delta_rule(
            scaled, *tensors, meta=VarlenMeta.from_lengths(lengths), use_qk_l2norm_in_kernel=True
        )
    assert "computes other than nopad's chunked gated delta rule" in caplog.text
    cu = np.concatenate(([0], np.cumsum(lengths)))
    for a, b in zip(cu[:-1], cu[1:]):
        want, _ = scaled(*(t[:, a:b] for t in tensors), use_qk_l2norm_in_kernel=True)
        torch.testing.assert_close(out[:, a:b], want, rtol=1e-5, atol=1e-5)


def test_a_decode_step_updates_the_slots_in_place_with_the_token_by_token_rules_bits():
    """A generator decode step of the gated delta rule (one token per sequence, ``in_place``) runs
    the ops of transformers' token-by-token rule on the slots themselves: the same bits as that
    function called as HF's decode calls it, the state updated where it lies. A token-by-token
    rule that computes otherwise (here: its output scaled) runs itself, out of place."""
    recurrent = qwen.torch_recurrent_gated_delta_rule.__wrapped__
    tensors = _rule_inputs([1, 1, 1])
    meta = VarlenMeta.from_lengths([1, 1, 1])
    state = torch.randn(3, 4, 8, 8, generator=torch.Generator().manual_seed(3))  # (seqs, value heads, K, V)
    rows = [t.transpose(0, 1) for t in tensors]  # each sequence a batch row of one token
    want, want_state = recurrent(*rows, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True)

    def step(rule, slots):
        return varlen_delta_rule(
            TORCH_RULE,
            *tensors,
            meta=meta,
            initial_state=slots,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
            recurrent=rule,
            in_place=True,
        )

    slots = state.clone()
    out, final = step(recurrent, slots)
    assert final is slots and torch.equal(slots, want_state) and torch.equal(out, want.transpose(0, 1))

    def scaled(*args, **kwargs):
        out, state = recurrent(*args, **kwargs)
        return 1.5 * out, state

    slots = state.clone()
    out, final = step(scaled, slots)
    assert torch.equal(slots, state) and torch.equal(final, want_state)
    assert torch.equal(out, 1.5 * want.transpose(0, 1))


# ----------------------------------------------------------------------------- fla / causal-conv1d stand-ins
class KernelStandIns:
    """Strict CPU stand-ins for fla's ``chunk_gated_delta_rule`` and causal-conv1d's
    ``causal_conv1d_fn``, written to their signatures and checks (fla 0.6.0's, argument for
    argument: ``(B=1, T, H, K)`` q/k, ``(1, T, HV, V)`` v, log-space decay ``g`` and post-sigmoid
    ``beta`` ``(1, T, HV)``, int64 ``cu_seqlens``, ``initial_state`` and final state ``(N, HV,
    K, V)`` (K first: ``state_v_first=False``), query head ``i // (HV // H)`` for value head ``i``
    (checked against real fla by the interpreter test below); causal-conv1d: ``(B, C, T)``
    channel-last with int32 ``seq_idx`` ``(B, T)``, no initial states beside ``seq_idx``,
    activation None/silu/swish), computing per sequence with transformers' torch functions. Every
    call is recorded. ``backward_error``: a message the stand-in's backward raises, as fla 0.6
    does on Hopper under Triton 3.4 to 3.7.0 (only once the forward has run)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        self.backward_error: str | None = None
        fla = types.ModuleType("fla")
        ops = types.ModuleType("fla.ops")
        rule = types.ModuleType("fla.ops.gated_delta_rule")
        rule.chunk_gated_delta_rule = self.chunk_gated_delta_rule
        conv = types.ModuleType("causal_conv1d")
        conv.causal_conv1d_fn = self.causal_conv1d_fn
        self.modules = {"fla": fla, "fla.ops": ops, "fla.ops.gated_delta_rule": rule, "causal_conv1d": conv}
        for name, module in self.modules.items():
            module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)

    def chunk_gated_delta_rule(
        self,
        q,
        k,
        v,
        g,
        beta,
        scale=None,
        initial_state=None,
        output_final_state=False,
        use_qk_l2norm_in_kernel=False,
        use_beta_sigmoid_in_kernel=False,
        allow_neg_eigval=False,
        state_v_first=False,
        cu_seqlens=None,
        cu_seqlens_cpu=None,
        chunk_indices=None,
        cp_context=None,
        **kwargs,
    ):
        assert q.shape[0] == 1 and cu_seqlens is not None, "fla varlen: batch 1 and cu_seqlens"
        assert cu_seqlens.dtype == torch.long and cu_seqlens.dim() == 1 and int(cu_seqlens[-1]) == q.shape[1]
        heads, v_heads = q.shape[2], v.shape[2]
        assert k.shape == q.shape and v_heads % heads == 0 and v.shape[:2] == q.shape[:2]
        assert g.shape == beta.shape == v.shape[:3], "fla's gated delta rule: g and beta (B, T, HV)"
        assert bool((g <= 0).all()), "g is the decay in log space"
        n = cu_seqlens.numel() - 1
        if initial_state is not None:
            assert initial_state.shape == (n, v_heads, k.shape[-1], v.shape[-1]), initial_state.shape
        assert scale is None and not (use_beta_sigmoid_in_kernel or allow_neg_eigval or state_v_first)
        assert cu_seqlens_cpu is None and chunk_indices is None and cp_context is None
        assert set(kwargs) <= {"chunk_size"} and kwargs.get("chunk_size", 64) in (16, 32, 64), kwargs
        self.calls.append(("fla", dict(seqs=n, initial=initial_state is not None)))
        outs, finals = [], []
        for i in range(n):
            a, b = int(cu_seqlens[i]), int(cu_seqlens[i + 1])
            init = None if initial_state is None else initial_state[i : i + 1]
            out, final = TORCH_RULE(
                *(t[:, a:b] for t in (q, k, v, g, beta)),
                initial_state=init,
                output_final_state=True,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
            )
            outs.append(out)
            finals.append(final)
        out = torch.cat(outs, dim=1)
        if self.backward_error is not None:
            out = _RefusingBackward.apply(out, self.backward_error)
        return out, torch.cat(finals) if output_final_state else None

    def causal_conv1d_fn(
        self,
        x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None,
    ):
        if activation not in (None, "silu", "swish"):
            raise NotImplementedError("activation must be None, silu, or swish")
        if seq_idx is not None:
            assert x.stride(1) == 1, "seq_idx is only supported for channel last layout"
            assert initial_states is None and not return_final_states
            assert seq_idx.dtype == torch.int32 and seq_idx.shape == (x.shape[0], x.shape[2])
        self.calls.append(("causal_conv1d", dict(seq_idx=seq_idx is not None)))
        bounds = torch.nonzero(torch.diff(seq_idx[0]), as_tuple=False).flatten() + 1
        cuts = [0, *bounds.tolist(), x.shape[2]]
        zero = x.new_zeros(x.shape[1], weight.shape[1] - 1)
        return torch.cat(
            [
                _conv_alone(x[0, :, a:b], weight, bias, activation is not None, zero)[0]
                for a, b in zip(cuts[:-1], cuts[1:])
            ],
            dim=1,
        )[None]


class _RefusingBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, out, message):
        ctx.message = message
        return out.view_as(out)

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError(ctx.message)


@pytest.fixture
def kernel_standins(monkeypatch):
    monkeypatch.setattr(delta_rule, "_BACKWARD_RUNS", set())  # each test sees fla's backward tried once
    monkeypatch.setattr(kernels, "_BROKEN", set())
    standins = KernelStandIns()
    for name, module in standins.modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setenv(KERNELS_ENV, "package")
    return standins


def probed(model, standins):
    """``model`` once its boundary probe ran (nopad.packing.hf.boundary_probe: once per model, at the first
    check), with the probe's own kernel calls cleared: they are not the ones a test counts."""
    check_model(model)
    standins.calls.clear()
    return model


def test_packed_rows_go_to_fla_and_causal_conv1d_with_their_boundaries(kernel_standins, one_thread):
    report = packing.verify(probed(tiny_model("qwen3_5"), kernel_standins), random_sequences((1, 70, 5)))
    assert exact(report), str(report)
    calls = [name for name, _ in kernel_standins.calls]
    fla = [c for name, c in kernel_standins.calls if name == "fla"]
    assert fla[0] == dict(seqs=2, initial=False)  # fla's backward tried once, on a tiny row, before training
    assert len(fla) == 3 and calls.count("causal_conv1d") == 2  # then one call per linear-attention layer
    assert all(c == dict(seqs=3, initial=False) for c in fla[1:])


HOPPER_REFUSAL = (
    "Triton >= 3.4.0 and < 3.7.1 on Hopper GPUs produces incorrect results for gated "
    "chunk_bwd_dqkwg (see #640). Please upgrade Triton to >= 3.7.1 or install tilelang"
)


def test_a_fla_whose_backward_refuses_here_leaves_training_to_the_reference(kernel_standins, one_thread):
    """fla 0.6 on an H200 with Triton 3.6 (the lent machines'): its gated backward raises once
    the forward has run. nopad tries the backward first, reports fla's message once, and trains
    on the reference (exact); a call with no gradient (the generator) is refused fla too."""
    kernel_standins.backward_error = HOPPER_REFUSAL
    with pytest.warns(
        RuntimeWarning,
        match="chunk_gated_delta_rule is installed but its backward fails on this device .*Hopper.*upgrade Triton",
    ):
        report = packing.verify(probed(tiny_model("qwen3_5"), kernel_standins), random_sequences((1, 70, 5)))
    assert exact(report), str(report)
    with warnings.catch_warnings(), torch.no_grad():
        warnings.simplefilter("error")  # reported once
        q, k, v = torch.randn(1, 7, 2, 8), torch.randn(1, 7, 2, 8), torch.randn(1, 7, 2, 8)
        varlen_delta_rule(
            TORCH_RULE, q, k, v, -torch.rand(1, 7, 2), torch.rand(1, 7, 2), meta=VarlenMeta.from_lengths([3, 4])
        )
    assert [c for name, c in kernel_standins.calls if name == "fla"] == [dict(seqs=2, initial=False)]


def test_fla_backward_error_says_why_fla_cannot_train_here(kernel_standins):
    """The probe benchmarks and the GPU tests use to give HF's own layer its torch rule where fla
    cannot train (transformers calls fla whenever it is installed)."""
    assert delta_rule.fla_backward_error(torch.device("cpu")) is None
    kernel_standins.backward_error = HOPPER_REFUSAL
    assert delta_rule.fla_backward_error(torch.device("cpu")) == f"RuntimeError: {HOPPER_REFUSAL}"


def test_tree_rows_go_to_fla_wave_by_wave_with_the_parents_states(kernel_standins, one_thread):
    report = packing.verify(probed(tiny_model("qwen3_5"), kernel_standins), tree_sequences(2), tree=True)
    assert exact(report), str(report)
    fla = [c for name, c in kernel_standins.calls if name == "fla"]
    assert len(fla) > 2 and any(c["initial"] for c in fla)  # several waves per layer, later ones from states
    # tree windows stay on the reference
    assert not any(name == "causal_conv1d" for name, _ in kernel_standins.calls)


@pytest.mark.skipif(not kernels.installed("fla"), reason="fla is not installed (opt-in: fla-core)")
def test_real_fla_under_the_triton_interpreter_equals_the_torch_rule(tmp_path):
    """fla itself, not a stand-in: its varlen Gated DeltaNet with initial states and grouped value
    heads, on the CPU under the Triton interpreter, and nopad's dispatch to it, against
    transformers' torch function per sequence (tests/support/fla_interpret.py; about a minute)."""
    script = Path(__file__).resolve().parents[1] / "support" / "fla_interpret.py"
    done = subprocess.run([sys.executable, str(script), str(tmp_path)], capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stdout + done.stderr[-3000:]


def test_a_kernel_package_that_fails_to_import_is_reported_once(monkeypatch, tmp_path):
    """An installed causal-conv1d built for another torch: one warning, then the reference runs."""
    from tests.support.flash_standin import broken_package

    monkeypatch.syspath_prepend(str(broken_package(tmp_path, "causal_conv1d")))
    monkeypatch.delitem(sys.modules, "causal_conv1d", raising=False)
    monkeypatch.setattr(kernels, "_BROKEN", set())
    x, weight = torch.randn(1, 9, 3), torch.randn(3, 4)
    cu = torch.tensor([0, 4, 9])
    monkeypatch.setenv(KERNELS_ENV, "reference")
    want = varlen_causal_conv1d(x, weight, cu_seqlens=cu)
    monkeypatch.setenv(KERNELS_ENV, "package")
    with pytest.warns(
        RuntimeWarning, match="causal_conv1d.causal_conv1d_fn is installed but does not import.*libcudart"
    ):
        assert torch.equal(varlen_causal_conv1d(x, weight, cu_seqlens=cu), want)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # reported once: no second warning, no second import
        assert kernels.package_function("causal_conv1d", "causal_conv1d_fn", x) is None


def test_a_grpo_step_on_tree_rows_of_a_hybrid_model_equals_flat_packing(one_thread):
    from nopad.packing.hf import use_nopad_attention
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.grpo_step import GRPOStepConfig, train_on_rollouts
    from tests.training.test_training_tree import _grad_recorder, forked_rollouts

    rollouts = forked_rollouts()

    def step(shared_prefix, capacity):
        model = tiny_model("qwen3_5")
        loss = GRPOStepConfig(max_tokens_per_batch=capacity, shared_prefix=shared_prefix)
        optimizer = _grad_recorder(model.parameters())
        with use_nopad_attention(model):
            metrics = train_on_rollouts(OptimizerStepper(model, optimizer), rollouts, loss)
        return dict(zip((n for n, _ in model.named_parameters()), optimizer.grads)), metrics

    want, flat = step(False, 256)
    for capacity in (256, 40):  # every tree in one row; trees split across rows
        grads, tree = step(True, capacity)
        assert tree["train_tokens"] < flat["train_tokens"]
        assert tree["loss"] == pytest.approx(flat["loss"], rel=1e-5)
        total = torch.cat([w.flatten() for w in want.values()])
        diff = torch.cat([(grads[n] - w).flatten() for n, w in want.items()])
        assert float(diff.norm()) <= 1e-5 * float(total.norm())
