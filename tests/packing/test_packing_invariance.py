"""Batch-invariant mode: the generator's raw log-probs equal the packed training forward's bitwise
(``torch.equal``), whatever shares the generator's step or the training row; and the pieces that
make it so (tiled linear, the fixed-order attention kernel, the op audit)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from torch.utils._python_dispatch import TorchDispatchMode

from nopad.inference import Generator, SamplingParams
from nopad.packing import invariance
from nopad.packing.attention import cpu_kernel as kernel_attention
from nopad.packing.attention import sdpa as attention_cpu
from nopad.packing.attention import varlen_attention
from nopad.packing.attention.sdpa import KeySource
from nopad.packing.hf import use_nopad_attention
from nopad.packing.invariance import TILE_ROWS, batch_invariant, invariant_linear, is_enabled
from nopad.packing.varlen import VarlenMeta
from nopad.training.grpo import Rollout, pack_rollouts, packed_logprobs
from tests.support.models import FAMILIES, random_sequences, tiny_model

DTYPES = (torch.float32, torch.bfloat16)
HYPOTHESIS = dict(deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])


# ----------------------------------------------------------------------------- linear
# width 1: a shared-expert gate (Qwen3-Next): fp32 tiles batched into one call took a matrix-vector
# path whose bits depended on the tile count (on an AMX machine)
@pytest.mark.parametrize("width", [80, 1])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_linear_rows_do_not_depend_on_their_batch(dtype, width):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 96, generator=g).to(dtype)
    w, b = torch.randn(width, 96, generator=g).to(dtype), torch.randn(width, generator=g).to(dtype)
    full = invariant_linear(x, w, b)
    for start, count in [(0, 1), (5, 1), (17, 3), (63, 2), (1, 64), (40, 130), (0, 300)]:
        assert torch.equal(invariant_linear(x[start : start + count], w, b), full[start : start + count])
    ref = F.linear(x.float(), w.float(), b.float())
    assert torch.allclose(full.float(), ref, atol=0.5 if dtype != torch.float32 else 1e-4, rtol=2e-2)


# the shapes an MoE expert sees: 1-3 tokens in a decode step, many in a training row (a
# bf16 expert's lone token, K = N = 48, took one GEMM call whose sum order differed from a tile's
# for ~0.15% of rows, after a probe of 22 rows had passed that call). Thousands of rows, so a
# failure rate of 0.1% fails the test; the weight a slice of a 3-D experts tensor, as transformers'.
MOE_SHAPES = [(48, 48, 3072), (64, 32, 3072), (32, 64, 3072), (37, 53, 3072), (512, 384, 768)]


@pytest.mark.parametrize("k,n,rows", MOE_SHAPES, ids=str)
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_moe_sized_gemms_are_bitwise_at_one_to_three_rows(dtype, k, n, rows, one_thread):
    g = torch.Generator().manual_seed(k * n)
    x = torch.randn(rows, k, generator=g).to(dtype)
    w = torch.randn(4, n, k, generator=g).to(dtype)[1]
    with batch_invariant(), torch.no_grad():
        full = F.linear(x, w)
        for m in (1, 2, 3):
            wrong = sum(not torch.equal(F.linear(x[s : s + m], w), full[s : s + m]) for s in range(0, rows - m + 1, m))
            assert wrong == 0, f"{wrong} of {rows // m} calls of {m} rows differ from those rows among {rows}"
        assert torch.equal(F.linear(x[5:], w), full[5:])  # every row at another place in its tile


def test_every_gemm_is_one_aligned_tile_whatever_the_rows():
    """The construction the tiles' invariance rests on: every GEMM call of the mode is one
    TILE_ROWS-row ``mm`` (no call over another row count, no batched call), its input and output
    64-byte aligned, even for rows handed in at an unaligned address."""
    g = torch.Generator().manual_seed(4)
    w = torch.randn(24, 40, generator=g).to(torch.bfloat16)
    for dtype in DTYPES:
        base = torch.randn(200 * 40 + 1, generator=g).to(dtype)
        for rows in (1, 3, 32, 70, 200):
            x = base[1 : 1 + rows * 40].view(rows, 40)  # 2 or 4 bytes past an aligned address
            log = _OpLog()
            with log:
                out = invariant_linear(x, w.to(dtype))
            calls = [(args[0], kwargs["out"]) for func, args, kwargs in log.calls if func in GEMMS]
            assert {func for func, _, _ in log.calls} & GEMMS == {torch.ops.aten.mm.out}
            assert len(calls) == -(-rows // TILE_ROWS)
            for a, dst in calls:
                assert a.shape[0] == dst.shape[0] == TILE_ROWS
                assert a.data_ptr() % invariance.ALIGN_BYTES == dst.data_ptr() % invariance.ALIGN_BYTES == 0
            assert torch.equal(out, invariant_linear(x.clone(), w.to(dtype)))


def test_linear_follows_autocast_and_has_the_ordinary_gradient():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 37, 32, generator=g, requires_grad=True)
    w = torch.randn(16, 32, generator=g, requires_grad=True)
    b = torch.randn(16, generator=g, requires_grad=True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = invariant_linear(x, w, b)
        ref = F.linear(x, w, b)
    assert out.dtype == ref.dtype == torch.bfloat16
    assert torch.allclose(out.float(), ref.float(), rtol=2e-2, atol=0.1)
    grads = torch.autograd.grad(invariant_linear(x, w, b).square().sum(), (x, w, b))
    refs = torch.autograd.grad(F.linear(x, w, b).square().sum(), (x, w, b))
    for got, want in zip(grads, refs):
        assert torch.allclose(got, want, rtol=1e-4, atol=1e-4)


def test_mode_routes_linear_and_is_scoped():
    lin = torch.nn.Linear(8, 4)
    x = torch.randn(5, 8)
    plain = torch.nn.Linear.forward
    assert not is_enabled()
    with batch_invariant():
        with batch_invariant():  # nests
            assert is_enabled()
        assert is_enabled()
        y = lin(x)
    assert not is_enabled() and torch.nn.Linear.forward is plain
    assert torch.equal(y, invariant_linear(x, lin.weight, lin.bias))
    with batch_invariant(enabled=False):
        assert not is_enabled()
    with pytest.raises(RuntimeError), batch_invariant():
        raise RuntimeError("an error inside the block still restores nn.Linear")
    assert not is_enabled() and torch.nn.Linear.forward is plain


def test_gradient_checkpointing_recompute_runs_in_the_mode():
    """The backward's recompute replays the forward's kernels (the engine is started with the mode
    on the stack), so checkpointed gradients equal plain ones, through both backward entry points."""
    from torch.utils.checkpoint import checkpoint

    lin = torch.nn.Linear(8, 8)
    x = torch.randn(3, 5, 8, requires_grad=True)
    grads = []
    for ckpt, call in [(False, "tensor"), (True, "tensor"), (True, "autograd")]:
        x.grad = lin.weight.grad = None
        with batch_invariant():
            y = checkpoint(lin, x, use_reentrant=False) if ckpt else lin(x)
            seed = torch.ones_like(y) * 0.5
            y.backward(seed) if call == "tensor" else torch.autograd.backward([y], [seed])
        grads.append((x.grad.clone(), lin.weight.grad.clone()))
    for got in grads[1:]:
        assert all(torch.equal(a, b) for a, b in zip(got, grads[0]))


def _gemm_rows(fn) -> list[int]:
    """The row counts of the GEMMs ``fn`` runs (in this thread)."""
    log = _OpLog()
    with log:
        fn()
    return [
        (args[1] if func is torch.ops.aten.addmm.default else args[0]).shape[-2]
        for func, args, _ in log.calls
        if func in GEMMS
    ]


def test_mode_belongs_to_its_thread():
    """While one thread is inside batch_invariant(), another runs torch's default kernels and
    attention rule, and the other way round."""
    import threading

    lin = torch.nn.Linear(8, 4)
    x = torch.randn(5, 8)
    inside, outside, entered, done = {}, {}, threading.Event(), threading.Event()

    def invariant_thread():
        with batch_invariant():
            entered.set()
            inside["rows"] = _gemm_rows(lambda: (lin(x), F.linear(x, lin.weight)))
            inside["enabled"] = is_enabled()
            done.wait(30)

    worker = threading.Thread(target=invariant_thread)
    worker.start()
    assert entered.wait(30)
    outside["rows"] = _gemm_rows(lambda: (lin(x), F.linear(x, lin.weight)))
    outside["enabled"] = is_enabled()
    meta = VarlenMeta.from_lengths([4])
    q, k, v = _qkv(4, 4, 2, 2, 8, torch.float32, seed=5)
    varlen_attention(q, k, v, meta, backend="sdpa_loop")  # allowed: the mode is the other thread's
    done.set()
    worker.join(30)
    assert inside == {"rows": [TILE_ROWS, TILE_ROWS], "enabled": True}
    assert outside == {"rows": [5, 5], "enabled": False}
    # and the other way round: this thread in the mode, a plain thread outside it
    with batch_invariant():
        plain = threading.Thread(target=lambda: outside.update(rows=_gemm_rows(lambda: lin(x)), enabled=is_enabled()))
        plain.start()
        plain.join(30)
        assert _gemm_rows(lambda: lin(x)) == [TILE_ROWS]
    assert outside == {"rows": [5], "enabled": False}


# ----------------------------------------------------------------------------- attention kernel
def _qkv(total_q, total_k, heads, kv_heads, dim, dtype, seed):
    g = torch.Generator().manual_seed(seed)
    return (
        torch.randn(total_q, heads, dim, generator=g).to(dtype),
        torch.randn(total_k, kv_heads, dim, generator=g).to(dtype),
        torch.randn(total_k, kv_heads, dim, generator=g).to(dtype),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (None, 20.0), (40, 10.0)])
def test_kernel_matches_sdpa(dtype, window, softcap):
    lengths = [1, 2, 31, 32, 33, 70]
    meta = VarlenMeta.from_lengths(lengths)
    q, k, v = _qkv(meta.total_q, meta.total_k, 6, 2, 16, dtype, seed=2)
    opts = dict(causal=True, scale=0.25, window=window, softcap=softcap)
    got = kernel_attention.forward(q, k, v, meta, **opts)
    ref = torch.cat(attention_cpu.per_sequence(q.float(), KeySource(k.float(), v.float(), meta), **opts))
    tol = {torch.float32: 2e-6, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    assert got.dtype == dtype
    assert (got.float() - ref).abs().max() < tol


@settings(max_examples=10, **HYPOTHESIS)
@given(
    lengths=st.lists(st.integers(1, 70), min_size=1, max_size=4),
    block_size=st.sampled_from([1, 16, 32, 64]),
    chunk=st.integers(1, 40),
    dtype=st.sampled_from(DTYPES),
    window=st.sampled_from([None, 7]),
)
def test_each_query_is_the_same_alone_packed_chunked_and_paged(lengths, block_size, chunk, dtype, window):
    """The same query gets the same bits in a training row, alone, and as part of a prefill chunk
    or a decode token reading a paged cache (blocks in shuffled order)."""
    meta = VarlenMeta.from_lengths(lengths)
    q, k, v = _qkv(meta.total_q, meta.total_k, 4, 2, 16, dtype, seed=sum(lengths))
    opts = dict(causal=True, scale=0.25, window=window, softcap=None)
    packed = kernel_attention.forward(q, k, v, meta, **opts)
    start = 0
    for n in lengths:
        sl = slice(start, start + n)
        alone = kernel_attention.forward(q[sl], k[sl], v[sl], VarlenMeta.from_lengths([n]), **opts)
        assert torch.equal(alone, packed[sl])
        # the sequence's K/V in a paged cache with scattered blocks, queried chunk by chunk
        blocks = -(-n // block_size)
        order = torch.randperm(blocks + 3, generator=torch.Generator().manual_seed(n))[:blocks]
        cache_k = torch.full((blocks + 3, block_size, 2, 16), float("nan")).to(dtype)
        cache_v = cache_k.clone()
        for b in range(blocks):
            rows = slice(b * block_size, min((b + 1) * block_size, n))
            cache_k[order[b], : rows.stop - rows.start] = k[sl][rows]
            cache_v[order[b], : rows.stop - rows.start] = v[sl][rows]
        table = order[None].to(torch.int32)
        for c0 in range(0, n, chunk):
            c1 = min(n, c0 + chunk)
            step = VarlenMeta.for_step([c1 - c0], [c0], block_table=table)
            out = kernel_attention.forward(
                q[sl][c0:c1],
                cache_k.view(-1, 2, 16),
                cache_v.view(-1, 2, 16),
                step,
                table=table,
                block_size=block_size,
                **opts,
            )
            assert torch.equal(out, packed[sl][c0:c1])
        start += n


def test_kernel_training_gradients_are_sdpa_gradients():
    meta = VarlenMeta.from_lengths([3, 40, 17])
    q, k, v = (t.requires_grad_() for t in _qkv(60, 60, 4, 2, 16, torch.float32, seed=3))
    opts = dict(causal=True, softmax_scale=0.25, sliding_window=9, softcap=None)
    with batch_invariant():
        out = varlen_attention(q, k, v, meta, **opts)
    ref = varlen_attention(q, k, v, meta, backend="sdpa_loop", **opts)
    assert torch.allclose(out, ref, atol=1e-5)
    w = torch.randn_like(out)
    grads = torch.autograd.grad((out * w).sum(), (q, k, v))
    refs = torch.autograd.grad((ref * w).sum(), (q, k, v))
    for got, want in zip(grads, refs):
        assert torch.allclose(got, want, atol=1e-5)


def test_pure_pytorch_path_is_invariant_too():
    meta = VarlenMeta.from_lengths([5, 9])
    q, k, v = _qkv(14, 14, 4, 2, 16, torch.bfloat16, seed=4)
    opts = dict(causal=True, scale=0.25, window=None, softcap=None)
    packed = torch.cat(attention_cpu.per_token(q, KeySource(k, v, meta), **opts))
    second = KeySource(k[5:], v[5:], VarlenMeta.from_lengths([9]))
    alone = torch.cat(attention_cpu.per_token(q[5:], second, **opts))
    assert torch.equal(packed[5:], alone)
    ref = torch.cat(attention_cpu.per_sequence(q.float(), KeySource(k.float(), v.float(), meta), **opts))
    assert (packed.float() - ref).abs().max() < 2e-2


def test_mode_refuses_a_backend_without_a_fixed_order():
    meta = VarlenMeta.from_lengths([4])
    q, k, v = _qkv(4, 4, 2, 2, 8, torch.float32, seed=5)
    with batch_invariant(), pytest.raises(ValueError, match="fixed per-query order"):
        varlen_attention(q, k, v, meta, backend="sdpa_loop")


# ----------------------------------------------------------------------------- op audit
class _OpLog(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls.append((func, args, kwargs or {}))
        return func(*args, **(kwargs or {}))


GEMMS = {
    torch.ops.aten.mm.default,
    torch.ops.aten.bmm.default,
    torch.ops.aten.addmm.default,
    torch.ops.aten.matmul.default,
    torch.ops.aten.baddbmm.default,
    torch.ops.aten.mm.out,
    torch.ops.aten.bmm.out,
}
REDUCTIONS = {
    torch.ops.aten.mean.dim,
    torch.ops.aten.sum.dim_IntList,
    torch.ops.aten.amax.default,
    torch.ops.aten._log_softmax.default,
    torch.ops.aten._softmax.default,
    torch.ops.aten.var_mean.correction,
    torch.ops.aten.norm.ScalarOpt_dim,
}


@pytest.mark.parametrize("family", FAMILIES)
def test_op_audit_every_gemm_is_a_fixed_tile_and_every_reduction_is_row_local(family):
    """Every kernel call of the forward: GEMMs run on TILE_ROWS-row tiles (or contract over one
    element, RoPE's outer product, which is exact), reductions run over the last dim only."""
    model = tiny_model(family, attn_implementation="eager")
    ids = random_sequences([7, 20], seed=6)
    row = torch.cat(ids)[None]
    meta = VarlenMeta.from_lengths([7, 20])
    log = _OpLog()
    with use_nopad_attention(model), batch_invariant(), torch.no_grad(), log:
        model(input_ids=row, position_ids=meta.position_ids[None], nopad_meta=meta, use_cache=False)
    seen = set()
    for func, args, kwargs in log.calls:
        seen.add(func)
        if func in GEMMS:
            with_bias = func in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default)
            a = args[1] if with_bias else args[0]
            assert a.shape[-2] == TILE_ROWS or a.shape[-1] == 1, f"{func}: {tuple(a.shape)}"
        elif func in REDUCTIONS:
            dims = args[1] if len(args) > 1 else kwargs.get("dim")
            dims = [dims] if isinstance(dims, int) else list(dims or [])
            last = args[0].dim() - 1
            assert dims and all(d in (-1, last) for d in dims), f"{func} over {dims}"
    assert seen & GEMMS, "the audit saw no GEMM: the forward did not run through the mode"


@pytest.mark.parametrize("family", FAMILIES)
def test_op_audit_triton_set_leaves_no_gemm_or_row_reduction_to_torch(family):
    """With the Triton (CUDA) kernel set forced (interpreted on CPU): no GEMM but RoPE's exact
    one-element contraction and no reduction reaches torch's kernels; they all run in Triton."""
    from nopad.packing import invariant_kernels

    if not torch.cuda.is_available() and not invariant_kernels._interpreted():
        pytest.skip("needs CUDA or TRITON_INTERPRET=1")
    model = tiny_model(family, attn_implementation="eager")
    ids = random_sequences([7, 20], seed=6)
    row = torch.cat(ids)[None]
    meta = VarlenMeta.from_lengths([7, 20])
    log = _OpLog()
    with use_nopad_attention(model), batch_invariant(kernels="triton"), torch.no_grad(), log:
        logits = model(input_ids=row, position_ids=meta.position_ids[None], nopad_meta=meta, use_cache=False).logits
        torch.log_softmax(logits, dim=-1)
    for func, args, _ in log.calls:
        if func in GEMMS:
            with_bias = func in (torch.ops.aten.addmm.default, torch.ops.aten.baddbmm.default)
            a = args[1] if with_bias else args[0]
            assert a.shape[-1] == 1, f"{func}: {tuple(a.shape)} left to torch"
        assert func not in REDUCTIONS, f"{func} left to torch"


# ----------------------------------------------------------------------------- generator == trainer
def _gaps(model, prompts, params, gen_kwargs, capacity=512, kernels=None):
    with batch_invariant(kernels=kernels):
        gen = Generator(model, **gen_kwargs)
        outs = gen.generate(prompts, params, use_tqdm=False)
        rollouts = [
            Rollout(list(p), list(c.token_ids), list(c.logprobs))
            for p, o in zip(prompts, outs)
            for c in o.outputs
            if c.token_ids
        ]
        with use_nopad_attention(model), torch.no_grad():
            rows = pack_rollouts(rollouts, capacity)
            trainer = torch.cat([packed_logprobs(model, row) for row in rows])
            generator = torch.cat([row.token_values["gen_logprobs"] for row in rows])
    return trainer, generator, gen.stats()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_generator_logprobs_equal_training_forward_bitwise(family, dtype, one_thread):
    model = tiny_model(family).to(dtype)
    shared = random_sequences([20], seed=7)[0].tolist()
    prompts = [p.tolist() for p in random_sequences([3, 41, 17, 1, 60], seed=8)]
    prompts += [shared + [5], shared + [9, 9]]  # prefix-cache hits
    params = SamplingParams(temperature=1.0, n=3, max_tokens=10, seed=1)
    # small token budget (chunked prefill), few blocks (preemption), 16-token blocks
    trainer, generator, stats = _gaps(
        model,
        prompts,
        params,
        dict(max_num_batched_tokens=19, max_num_seqs=6, num_blocks=9, block_size=16),
        capacity=128,
    )
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert trainer.numel() == generator.numel() > 0
    assert torch.equal(trainer, generator), f"max gap {(trainer - generator).abs().max():.3g}"


@settings(max_examples=12, **HYPOTHESIS)
@given(
    lengths=st.lists(st.integers(1, 50), min_size=1, max_size=5),
    n=st.integers(1, 3),
    budget=st.integers(4, 80),
    cache_blocks=st.integers(8, 40),
    block_size=st.sampled_from([4, 16]),
    capacity=st.sampled_from([64, 100, 400]),
    dtype=st.sampled_from(DTYPES),
    seed=st.integers(0, 99),
)
def test_bitwise_whatever_the_batch(lengths, n, budget, cache_blocks, block_size, capacity, dtype, seed, one_thread):
    model = tiny_model("llama").to(dtype)
    prompts = [p.tolist() for p in random_sequences(lengths, seed=seed)]
    params = SamplingParams(temperature=1.0, n=n, max_tokens=8, seed=seed)
    blocks = max(cache_blocks, -(-(max(lengths) + 8) // block_size) + 1)
    trainer, generator, _ = _gaps(
        model,
        prompts,
        params,
        dict(max_num_batched_tokens=budget, max_num_seqs=4, num_blocks=blocks, block_size=block_size),
        capacity=capacity,
    )
    assert torch.equal(trainer, generator)


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_bitwise_with_fp32_weights_under_bf16_autocast(family, one_thread):
    """What Accelerate's mixed_precision="bf16" runs: fp32 weights, bf16 compute, bf16 KV cache."""
    model = tiny_model(family)
    prompts = [p.tolist() for p in random_sequences([3, 41, 17, 60], seed=8)]
    params = SamplingParams(temperature=1.0, n=3, max_tokens=10, seed=1)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        trainer, generator, stats = _gaps(
            model,
            prompts,
            params,
            dict(max_num_batched_tokens=19, max_num_seqs=6, num_blocks=12, block_size=16),
            capacity=128,
        )
    assert stats["preemptions"] > 0
    assert torch.equal(trainer, generator), f"max gap {(trainer - generator).abs().max():.3g}"
