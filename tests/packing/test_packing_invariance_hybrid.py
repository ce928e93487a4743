"""Batch-invariant mode on hybrid layers (Gated DeltaNet, KDA, short convolutions, Mamba2): the
generator's rollout log-probs equal the trainer's packed log-probs bitwise, on flat and tree rows,
whatever the generator's batch and prefill chunk; and the pieces that make it so (the delta rules
and the Mamba2 scan token by token, the convolution as ordered gathers, pointwise functions in SIMD
lanes)."""

from __future__ import annotations

import inspect

import pytest
import torch
import torch.nn.functional as F

from nopad.inference import Generator, SamplingParams
from nopad.packing import invariant_kernels
from nopad.packing.hf import use_nopad_attention
from nopad.packing.invariance import batch_invariant, lane_pointwise
from nopad.packing.mixers import varlen_causal_conv1d, varlen_delta_rule
from nopad.packing.varlen import VarlenMeta
from nopad.training.grpo import Rollout, pack_rollouts, packed_logprobs, pair_sequences
from tests.support.models import MAMBA2_FAMILIES, random_sequences, tiny_model

DTYPES = (torch.float32, torch.bfloat16)
# the hybrid families the generator serves; MoE experts run eager: transformers' default grouped_mm
# experts are not batch-invariant yet (an attention-only MoE such as DeepSeek-V3 differs the same way)
GENERATOR_FAMILIES = ("qwen3_5", "qwen3_next", "olmo_hybrid", "kimi_linear", "lfm2", "bamba", "nemotron_h")
pytestmark = pytest.mark.usefixtures("one_thread", "nopad_patches")
# the Triton kernel set (what the mode runs on CUDA) on CPU tensors: under Triton's interpreter
needs_triton_set = pytest.mark.skipif(
    torch.cuda.is_available() or not invariant_kernels.available()[0] or not invariant_kernels._interpreted(),
    reason="the Triton kernel set on CPU needs triton and TRITON_INTERPRET=1 (tests/gpu covers CUDA)",
)


def hybrid_model(family: str, dtype: torch.dtype, **overrides):
    # Mamba2 layers: weights 10x the default init, else the scan's term is ~1e-4 of the skip term D x
    # and fp32 rounding of their sum swallows any change in the scan's order (the fp32 case then
    # passed with the generator's side of the mode turned off)
    if family in MAMBA2_FAMILIES:
        overrides.setdefault("initializer_range", 0.2)
    model = tiny_model(family, **overrides).to(dtype)
    if getattr(model.config, "_experts_implementation", None) not in (None, "eager"):
        model.set_experts_implementation("eager")
    return model


def trainer_logprobs(model, rollouts, capacity: int, shared_prefix: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """The trainer's packed log-probs of ``rollouts`` and the generator's, in the same order."""
    with use_nopad_attention(model), torch.no_grad():
        rows = pack_rollouts(rollouts, capacity, shared_prefix=shared_prefix)
        trainer = torch.cat([packed_logprobs(model, row) for row in rows])
    return trainer, torch.cat([row.token_values["gen_logprobs"] for row in rows])


@pytest.mark.parametrize("family", GENERATOR_FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_rollout_logprobs_equal_the_trainers_bitwise(family, dtype):
    model = hybrid_model(family, dtype)
    prompts = [p.tolist() for p in random_sequences([3, 23, 1, 30], seed=8)]
    params = SamplingParams(temperature=1.0, n=2, max_tokens=6, seed=1)
    runs = []
    with batch_invariant():
        # a small token budget (prefill in chunks of 7, mixed prefill/decode steps) and a large one
        for budget, seqs in ((7, 3), (256, 10)):
            gen = Generator(model, max_num_batched_tokens=budget, max_num_seqs=seqs, num_blocks=48, block_size=16)
            outs = gen.generate(prompts, params, use_tqdm=False)
            runs.append(
                [
                    Rollout(list(p), list(c.token_ids), list(c.logprobs))
                    for p, o in zip(prompts, outs)
                    for c in o.outputs
                    if c.token_ids
                ]
            )
        assert [r.completion_ids for r in runs[0]] == [r.completion_ids for r in runs[1]]
        for rollouts in runs:
            for shared_prefix, capacity in ((False, 64), (True, 128)):  # flat rows, tree rows
                trainer, generator = trainer_logprobs(model, rollouts, capacity, shared_prefix)
                assert trainer.numel() == generator.numel() > 0
                assert torch.equal(trainer, generator), (
                    f"shared_prefix={shared_prefix}: max gap {(trainer - generator).abs().max():.3g}"
                )


def test_kimi_linear_bf16_experts_fed_one_to_three_tokens_equal_the_trainer_bitwise():
    """Decode steps of at most 3 sequences hand an expert 1-3 tokens, a training row tens.
    In bf16 a one-row GEMM call gave some rows other bits than the tiles (13 of 128 log-probs
    differed here, by up to 2e-3, when a probe had passed that call), so every call is a tile."""
    model = hybrid_model("kimi_linear", torch.bfloat16)
    prompts = [p.tolist() for p in random_sequences([3, 23, 1, 30], seed=5)]
    params = SamplingParams(temperature=1.0, n=2, max_tokens=16, seed=5)
    with batch_invariant():
        gen = Generator(model, max_num_batched_tokens=7, max_num_seqs=3, num_blocks=48, block_size=16)
        rollouts = [
            Rollout(list(p), list(c.token_ids), list(c.logprobs))
            for p, o in zip(prompts, gen.generate(prompts, params, use_tqdm=False))
            for c in o.outputs
            if c.token_ids
        ]
        trainer, generator = trainer_logprobs(model, rollouts, 64, shared_prefix=False)
    assert trainer.numel() == generator.numel() > 100
    gap = (trainer - generator).abs()
    assert torch.equal(trainer, generator), f"{(gap > 0).sum()} of {gap.numel()} differ, by {gap.max():.3g}"


# one layer of each kind (the interpreter runs every Triton program in Python)
TWO_LAYERS = {
    "qwen3_5": dict(layer_types=["linear_attention", "full_attention"]),
    "bamba": dict(attn_layer_indices=[1]),
}


@needs_triton_set
@pytest.mark.parametrize("family,dtype", [("qwen3_5", torch.bfloat16), ("bamba", torch.float32)], ids=str)
def test_rollout_logprobs_equal_the_trainers_bitwise_in_the_triton_set(family, dtype):
    """The kernel set CUDA runs, on CPU tensors under Triton's interpreter: Triton GEMMs, row
    reductions (the state sums of the delta rule and the Mamba2 scan among them) and attention;
    chunked prefill and decode steps against flat and tree training rows. (Both dtypes of both
    families passed at 4 layers and longer prompts, ~4 min each: kept small for the suite.)"""
    model = hybrid_model(family, dtype, num_hidden_layers=2, **TWO_LAYERS[family])
    prompts = [p.tolist() for p in random_sequences([3, 7], seed=8)]
    params = SamplingParams(temperature=1.0, n=2, max_tokens=3, seed=1)
    with batch_invariant(kernels="triton"):
        gen = Generator(model, max_num_batched_tokens=5, max_num_seqs=3, num_blocks=24, block_size=16)
        rollouts = [
            Rollout(list(p), list(c.token_ids), list(c.logprobs))
            for p, o in zip(prompts, gen.generate(prompts, params, use_tqdm=False))
            for c in o.outputs
            if c.token_ids
        ]
        for shared_prefix, capacity in ((False, 64), (True, 128)):
            trainer, generator = trainer_logprobs(model, rollouts, capacity, shared_prefix)
            assert trainer.numel() == generator.numel() > 0
            assert torch.equal(trainer, generator), (
                f"shared_prefix={shared_prefix}: max gap {(trainer - generator).abs().max():.3g}"
            )


@pytest.mark.parametrize("family", ["bamba", "nemotron_h"])
@pytest.mark.parametrize("dtype", DTYPES)
def test_mamba2_packed_rows_equal_each_sequence_alone_bitwise(family, dtype):
    """In the mode a Mamba2 sequence's training log-probs do not depend on what shares its packed
    row."""
    model = tiny_model(family).to(dtype)
    seqs = [s.tolist() for s in random_sequences([9, 3, 17, 6, 12], seed=3)]
    rollouts = [Rollout(s[:2], s[2:], [0.0] * (len(s) - 2)) for s in seqs]
    with batch_invariant(), use_nopad_attention(model), torch.no_grad():
        rows = pack_rollouts(rollouts, 40, shared_prefix=False)
        assert max(len(row["indices"]) for row in rows) > 1
        packed = {}
        for row in rows:
            logps, seqs = packed_logprobs(model, row), pair_sequences(row)
            packed.update({i: logps[seqs == k] for k, i in enumerate(row["indices"].tolist())})
        for i, rollout in enumerate(rollouts):
            alone = packed_logprobs(model, pack_rollouts([rollout], 40, shared_prefix=False)[0])
            assert torch.equal(packed[i], alone), f"rollout {i}: gap {(packed[i] - alone).abs().max():.3g}"


def _scan_inputs(lengths, seed=0):
    """A Mamba2 scan's inputs over a row: 4 heads of 8, 2 groups, a state of 16."""
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    x = torch.randn(total, 4, 8, generator=g)
    dt = torch.randn(total, 4, generator=g)
    B, C = (torch.randn(total, 2, 16, generator=g) for _ in range(2))
    scan = dict(D=torch.rand(4, generator=g), dt_bias=torch.rand(4, generator=g), dt_softplus=True, dt_limit=(0.0, 2.0))
    return (x, dt, -torch.rand(4, generator=g) * 4, B, C), scan


def test_mamba2_steps_equal_the_whole_row_bitwise_and_the_chunk_scan_within_rounding():
    """The mode's token-by-token scan: a sequence run as part of a packed row equals it run in
    steps of any size from the carried state (the generator's prefill chunks and decode steps),
    and equals transformers' chunk scan within rounding (the same scan in another order)."""
    from transformers.models.bamba.modeling_bamba import mamba2_chunk_scan

    from nopad.packing.mixers.ssm_steps import token_scan

    lengths = [5, 70, 1, 33]
    (x, dt, A, B, C), scan = _scan_inputs(lengths)
    cu = [0, 5, 75, 76, 109]
    with batch_invariant():
        row, finals = token_scan(x, dt, A, B, C, list(zip(cu[:-1], cu[1:])), None, **scan)
        for steps in ([1] * 70, [16, 1, 3, 50], [70]):
            state, outs, start = None, [], 5
            for size in steps:
                out, state = token_scan(x, dt, A, B, C, [(start, start + size)], state, **scan)
                outs.append(out)
                start += size
            assert torch.equal(torch.cat(outs), row[5:75]) and torch.equal(state[0], finals[1])
    chunked = inspect.unwrap(mamba2_chunk_scan)
    for i, (start, end) in enumerate(zip(cu[:-1], cu[1:])):
        rows = slice(start, end)
        ref, final = chunked(
            x[None, rows],
            dt[None, rows],
            A,
            B[None, rows],
            C[None, rows],
            chunk_size=16,
            return_final_states=True,
            **scan,
        )
        torch.testing.assert_close(row[rows], ref[0], atol=1e-5, rtol=1e-5)
        torch.testing.assert_close(finals[i], final[0], atol=1e-5, rtol=1e-5)


@needs_triton_set
def test_mamba2_steps_equal_the_whole_row_bitwise_in_the_triton_set():
    """The kernel set CUDA runs (here under Triton's interpreter): the scan's sum over the state
    goes to the row kernel, and a sequence's steps still equal its packed row bitwise."""
    from nopad.packing.mixers.ssm_steps import token_scan

    (x, dt, A, B, C), scan = _scan_inputs([3, 12, 5])
    with batch_invariant(kernels="triton"):
        row, finals = token_scan(x, dt, A, B, C, [(0, 3), (3, 15), (15, 20)], None, **scan)
        state, outs = None, []
        for start, end in ((3, 4), (4, 9), (9, 15)):
            out, state = token_scan(x, dt, A, B, C, [(start, end)], state, **scan)
            outs.append(out)
    assert torch.equal(torch.cat(outs), row[3:15]) and torch.equal(state[0], finals[1])
    with batch_invariant():
        cpu_row, _ = token_scan(x, dt, A, B, C, [(0, 3), (3, 15), (15, 20)], None, **scan)
    torch.testing.assert_close(row, cpu_row, atol=1e-5, rtol=1e-5)


def test_mamba2_rows_in_the_mode_equal_the_chunked_rows_within_rounding():
    """The mode changes the order of a Mamba2 layer's sums, not what it computes."""
    model = tiny_model("bamba")
    seqs = [s.tolist() for s in random_sequences([9, 3, 17], seed=4)]
    rollouts = [Rollout(s[:2], s[2:], [0.0] * (len(s) - 2)) for s in seqs]
    with use_nopad_attention(model), torch.no_grad():
        row = pack_rollouts(rollouts, 40, shared_prefix=False)[0]
        chunked = packed_logprobs(model, row)
        with batch_invariant():
            ordered = packed_logprobs(model, row)
    torch.testing.assert_close(ordered, chunked, atol=1e-5, rtol=1e-5)


def _rule_inputs(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k = (torch.randn(1, total, 2, 8, generator=g) for _ in range(2))
    v = torch.randn(1, total, 4, 8, generator=g)
    return q, k, v, -torch.rand(1, total, 4, generator=g), torch.rand(1, total, 4, generator=g)


@needs_triton_set
def test_delta_rule_steps_equal_the_whole_row_bitwise_in_the_triton_set():
    """The delta rule token by token in the kernel set CUDA runs: its sums over the state (dim -2)
    and the q/k L2 norms go to the row kernel; steps == the packed row, bitwise."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    chunk = inspect.unwrap(torch_chunk_gated_delta_rule)
    kwargs = dict(
        use_qk_l2norm_in_kernel=True, chunk_size=16, recurrent=inspect.unwrap(torch_recurrent_gated_delta_rule)
    )
    lengths = [2, 9, 4]
    tensors = _rule_inputs(lengths)
    with batch_invariant(kernels="triton"):
        row, _ = varlen_delta_rule(chunk, *tensors, meta=VarlenMeta.from_lengths(lengths), **kwargs)
        state, outs = torch.zeros(1, 4, 8, 8), []
        for start, end in ((2, 3), (3, 7), (7, 11)):
            piece = [t[:, start:end] for t in tensors]
            out, state = varlen_delta_rule(
                chunk,
                *piece,
                meta=VarlenMeta.from_lengths([end - start]),
                initial_state=state,
                output_final_state=True,
                **kwargs,
            )
            outs.append(out)
    assert torch.equal(torch.cat(outs, 1), row[:, 2:11])
    with batch_invariant():
        cpu_row, _ = varlen_delta_rule(chunk, *tensors, meta=VarlenMeta.from_lengths(lengths), **kwargs)
    torch.testing.assert_close(row, cpu_row, atol=1e-5, rtol=1e-5)


def test_delta_rule_steps_equal_the_whole_row_bitwise_in_the_mode():
    """A sequence run as one packed row equals it run in steps of any size from the carried state
    (what the generator's prefill chunks and decode steps do), and the chunked rule, outside the
    mode, does not - the reason the mode picks the recurrent order."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    chunk = inspect.unwrap(torch_chunk_gated_delta_rule)
    recurrent = inspect.unwrap(torch_recurrent_gated_delta_rule)
    lengths = [5, 70, 1, 33]
    tensors = _rule_inputs(lengths)
    kwargs = dict(use_qk_l2norm_in_kernel=True, chunk_size=16, recurrent=recurrent)

    def stepped(step_sizes):
        state, outs, start = torch.zeros(1, 4, 8, 8), [], sum(lengths[:1])
        for size in step_sizes:
            piece = [t[:, start : start + size] for t in tensors]
            out, state = varlen_delta_rule(
                chunk,
                *piece,
                meta=VarlenMeta.from_lengths([size]),
                initial_state=state,
                output_final_state=True,
                **kwargs,
            )
            outs.append(out)
            start += size
        return torch.cat(outs, 1)

    whole = {}
    for mode in (False, True):
        with batch_invariant(mode):
            row, _ = varlen_delta_rule(chunk, *tensors, meta=VarlenMeta.from_lengths(lengths), **kwargs)
            whole[mode] = row[:, 5:75]
            in_steps = stepped([1] * 70) if mode else stepped([7] * 10)
            assert torch.equal(whole[mode], in_steps) == mode
            if mode:
                assert torch.equal(whole[mode], stepped([16, 1, 3, 50]))
    assert torch.allclose(whole[False], whole[True], atol=1e-5)  # the same rule, another order


def test_one_token_pieces_take_the_token_by_token_rule_outside_the_mode():
    """A decode step's one-token pieces run the recurrent rule (as HF's decode does), not the
    chunked one padded to a whole chunk; the row is the same within rounding."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import (
        torch_chunk_gated_delta_rule,
        torch_recurrent_gated_delta_rule,
    )

    chunk = inspect.unwrap(torch_chunk_gated_delta_rule)
    recurrent = inspect.unwrap(torch_recurrent_gated_delta_rule)
    calls = []

    def counted(*tensors, **kwargs):
        calls.append(tensors[0].shape[:2])
        return recurrent(*tensors, **kwargs)

    lengths = [1, 9, 1, 1]
    tensors, meta = _rule_inputs(lengths), VarlenMeta.from_lengths(lengths)
    state = torch.randn(len(lengths), 4, 8, 8, generator=torch.Generator().manual_seed(2))
    kwargs = dict(meta=meta, initial_state=state, output_final_state=True, use_qk_l2norm_in_kernel=True, chunk_size=16)
    ours, ours_state = varlen_delta_rule(chunk, *tensors, recurrent=counted, **kwargs)
    assert calls == [(3, 1)]  # the three one-token pieces, one batch of one step
    ref, ref_state = varlen_delta_rule(chunk, *tensors, **kwargs)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(ours_state, ref_state, atol=1e-5, rtol=1e-5)


def test_the_mode_refuses_a_delta_rule_without_a_token_by_token_rule():
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    chunk, tensors = inspect.unwrap(torch_chunk_gated_delta_rule), _rule_inputs([4, 6])
    meta = VarlenMeta.from_lengths([4, 6])
    with batch_invariant(), pytest.raises(ValueError, match="token by token"):
        varlen_delta_rule(chunk, *tensors, meta=meta)


@pytest.mark.parametrize("dtype", DTYPES)
def test_conv_decode_steps_equal_the_packed_row_bitwise_in_the_mode(dtype):
    g = torch.Generator().manual_seed(0)
    lengths, channels, width = [5, 17, 9], 24, 4
    x = torch.randn(1, sum(lengths), channels, generator=g).to(dtype)
    weight = torch.randn(channels, width, generator=g).to(dtype)
    bias = torch.randn(channels, generator=g).to(dtype)
    with batch_invariant():
        row = varlen_causal_conv1d(x, weight, bias, "silu", meta=VarlenMeta.from_lengths(lengths))[:, 5:22]
        state, steps = torch.zeros(1, channels, width - 1, dtype=dtype), []
        for t in range(5, 22):
            out, state = varlen_causal_conv1d(
                x[:, t : t + 1],
                weight,
                bias,
                "silu",
                initial_states=state,
                meta=VarlenMeta.from_lengths([1]),
                return_final_states=True,
            )
            steps.append(out)
    assert torch.equal(row, torch.cat(steps, 1))


@pytest.mark.parametrize("func", [F.softplus, torch.log1p, torch.exp, torch.sigmoid, F.silu])
@pytest.mark.parametrize("dtype", DTYPES)
def test_pointwise_rows_do_not_depend_on_their_batch(func, dtype):
    """A gate of 4 values per token: outside the lanes, torch rounds the buffer's tail its own way."""
    x = (torch.rand(37, 4, generator=torch.Generator().manual_seed(1)) * 6 - 0.9).to(dtype)  # log1p: > -1
    batch = lane_pointwise(func, x)
    assert all(torch.equal(lane_pointwise(func, x[i : i + 1]), batch[i : i + 1]) for i in range(len(x)))
    assert torch.allclose(batch.float(), func(x).float(), rtol=1e-2 if dtype == torch.bfloat16 else 1e-6)
    with batch_invariant():
        assert torch.equal(func(x), batch)
