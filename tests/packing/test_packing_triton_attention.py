"""nopad's Triton attention kernel (packing/attention/triton_kernel.py), run for real: on CPU under
Triton's interpreter (tests/conftest.py sets ``TRITON_INTERPRET=1`` when there is no CUDA), on a
GPU natively. It equals the exact reference on flat rows, paged decode and mixed prefill chunks; a
query's output is bitwise the same alone, packed, chunked, flat or paged, decoded or static; greedy
generation through it equals HF ``generate``; and the backend rule picks it for paged CUDA steps."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

from nopad.inference import Generator, SamplingParams
from nopad.packing import attention
from nopad.packing.attention import BACKEND_ENV, choose_backend, paged_block_size, triton_kernel, varlen_attention
from nopad.packing.varlen import VarlenMeta
from tests.inference.test_inference_generator import hf_greedy, prompts_of
from tests.packing.test_packing_kernel_attention import _paged_step
from tests.support.flash_standin import reference_attention
from tests.support.models import tiny_model

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
pytestmark = [
    pytest.mark.skipif(triton_kernel.triton is None, reason="triton is not installed"),
    pytest.mark.skipif(
        DEVICE.type == "cpu" and not triton_kernel.interpreted(),
        reason="no CUDA and the Triton interpreter is off (TRITON_INTERPRET=0)",
    ),
]
CUDA = torch.device("cuda")
TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 2e-2}
DTYPES = (torch.float32, torch.float16, torch.bfloat16)


@pytest.fixture(autouse=True)
def _one_thread(one_thread):
    """The interpreter runs numpy on tiny tiles: one thread is fastest and leaves the other cores free."""


def _flat(lengths, heads, kv_heads, dim, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    total = sum(lengths)
    q, k, v = (torch.randn(total, h, dim, generator=g) for h in (heads, kv_heads, kv_heads))
    return [t.to(DEVICE, dtype) for t in (q, k, v)]


def _window(window, causal):
    return (-1 if window is None else window - 1, 0 if causal else -1)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    "heads,kv_heads,dim,causal,window,softcap",
    [
        (4, 2, 24, True, None, None),  # GQA, a head dim padded to 32
        (2, 2, 16, True, 7, 20.0),  # sliding window and softcap
        (3, 1, 80, False, None, 30.0),  # bidirectional, padded to 128
    ],
)
def test_flat_rows_equal_the_reference(dtype, heads, kv_heads, dim, causal, window, softcap):
    lengths = [5, 70, 1, 33]  # 70 tokens span several query tiles and key blocks
    q, k, v = _flat(lengths, heads, kv_heads, dim, dtype)
    meta = VarlenMeta.from_lengths(lengths, device=DEVICE)
    got = triton_kernel.forward(q, k, v, meta, causal=causal, scale=0.3, window=window, softcap=softcap)
    ref = reference_attention(q, k, v, lengths, lengths, 0.3, causal, _window(window, causal), softcap or 0.0)
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), ref.float(), atol=TOL[dtype], rtol=TOL[dtype])


def test_head_dim_256_equals_the_reference():
    q, k, v = _flat([9, 20], 2, 1, 256, torch.float32)
    meta = VarlenMeta.from_lengths([9, 20], device=DEVICE)
    got = triton_kernel.forward(q, k, v, meta, scale=0.1)
    ref = reference_attention(q, k, v, [9, 20], [9, 20], 0.1, True, (-1, 0), 0.0)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("block_size", [16, 32])
def test_paged_steps_read_blocks_in_place_and_equal_the_reference(monkeypatch, dtype, block_size):
    """Decode tokens and prefill chunks in one step, keys read through the block table (no gather),
    GQA, with and without window and softcap."""
    query_lens, context_lens = [1, 1, 12, 1, 40], [0, 47, 20, 16, 5]
    for window, softcap in ((None, None), (9, 30.0)):
        q, k, v, meta, cache = _paged_step(
            query_lens, context_lens, block_size, kv_heads=2, heads=4, dim=24, dtype=dtype
        )
        ref_cache = tuple(c.float() for c in cache)
        opts = dict(sliding_window=window, softcap=softcap, softmax_scale=0.3)
        ref = varlen_attention(q.float(), k.float(), v.float(), meta, kv_cache=ref_cache, backend="sdpa_loop", **opts)
        cache = tuple(c.to(DEVICE) for c in cache)
        with torch.no_grad(), monkeypatch.context() as patch:
            patch.setattr(attention.dispatch, "gather_kv", lambda *a, **k: pytest.fail("gathered K/V"))
            got = varlen_attention(
                q.to(DEVICE), k.to(DEVICE), v.to(DEVICE), meta.to(DEVICE), kv_cache=cache, backend="triton", **opts
            )
        torch.testing.assert_close(got.float().cpu(), ref, atol=TOL[dtype], rtol=TOL[dtype])


# ---- batch invariance: one query, many ways of computing it, the same bits


def _pages(k, v, block_size, seed=0):
    """One sequence's flat K/V written into shuffled blocks of a paged cache (with spare blocks of
    NaN, which a masked read must never touch): ``(k_cache, v_cache), table``."""
    n = k.shape[0]
    need = -(-n // block_size)
    g = torch.Generator().manual_seed(seed)
    blocks = need + 3
    order = torch.randperm(blocks, generator=g)[:need]
    caches = []
    for t in (k, v):
        cache = torch.full((blocks, block_size, *t.shape[1:]), float("nan"), dtype=t.dtype, device=t.device)
        flat = cache.view(-1, *t.shape[1:])
        slots = (
            order.to(t.device)[torch.arange(n, device=t.device) // block_size] * block_size
            + torch.arange(n, device=t.device) % block_size
        )
        flat[slots] = t
        caches.append(cache)
    return tuple(caches), order.to(torch.int32)[None, :].to(k.device)


def _paged_rows(q, k, v, start, stop, block_size, opts):
    """The outputs of queries ``start:stop`` of one sequence, as a prefill chunk (or a decode token)
    over its first ``stop`` keys read from a paged cache."""
    (k_cache, v_cache), table = _pages(k[:stop], v[:stop], block_size)
    meta = VarlenMeta.for_step([stop - start], [start], block_table=table, device=q.device)
    k_flat, v_flat = (c.view(-1, *k.shape[1:]) for c in (k_cache, v_cache))
    return triton_kernel.forward(q[start:stop], k_flat, v_flat, meta, table=table, block_size=block_size, **opts)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window,softcap", [(None, None), (20, 30.0)])
def test_a_query_gives_the_same_bits_alone_packed_chunked_paged_and_decoded(dtype, window, softcap):
    lengths = [70, 9, 41]
    heads, kv_heads, dim = 4, 2, 24
    q, k, v = _flat(lengths, heads, kv_heads, dim, dtype, seed=1)
    opts = dict(causal=True, scale=0.25, window=window, softcap=softcap)
    packed = triton_kernel.forward(q, k, v, VarlenMeta.from_lengths(lengths, device=DEVICE), **opts)
    reversed_order = triton_kernel.forward(
        torch.cat([q[79:], q[70:79], q[:70]]),
        torch.cat([k[79:], k[70:79], k[:70]]),
        torch.cat([v[79:], v[70:79], v[:70]]),
        VarlenMeta.from_lengths(lengths[::-1], device=DEVICE),
        **opts,
    )
    assert torch.equal(torch.cat([reversed_order[50:], reversed_order[41:50], reversed_order[:41]]), packed)
    q0, k0, v0, ref = q[:70], k[:70], v[:70], packed[:70]  # the 70-token sequence, in every other layout
    alone = triton_kernel.forward(q0, k0, v0, VarlenMeta.from_lengths([70], device=DEVICE), **opts)
    assert torch.equal(alone, ref)
    for block_size in (16, 32):
        chunks = [(0, 23), (23, 64), (64, 70)]
        chunked = torch.cat([_paged_rows(q0, k0, v0, a, b, block_size, opts) for a, b in chunks])
        assert torch.equal(chunked, ref), block_size
        for p in (0, 31, 32, 45, 69):  # decode tokens, on and off block boundaries
            decoded = _paged_rows(q0, k0, v0, p, p + 1, block_size, opts)
            assert torch.equal(decoded, ref[p : p + 1]), (block_size, p)
    # a mixed step: this sequence's chunk next to another's decode token and a third's prefill
    (kc, vc), table0 = _pages(k0, v0, 16)
    (kc1, vc1), table1 = _pages(k[70:79], v[70:79], 16, seed=2)
    offset = kc.shape[0]
    k_cache, v_cache = torch.cat([kc, kc1]), torch.cat([vc, vc1])
    table = torch.zeros(2, table0.shape[1], dtype=torch.int32, device=DEVICE)
    table[0], table[1, : table1.shape[1]] = table0[0], table1[0] + offset
    meta = VarlenMeta.for_step([30, 1], [40, 8], block_table=table, device=DEVICE)
    mixed = triton_kernel.forward(
        torch.cat([q0[40:70], q[78:79]]),
        k_cache.view(-1, kv_heads, dim),
        v_cache.view(-1, kv_heads, dim),
        meta,
        table=table,
        block_size=16,
        **opts,
    )
    assert torch.equal(mixed, torch.cat([ref[40:70], packed[78:79]]))
    # the static decode step (lengths on the device, one query per row) gives the same bits
    lens = torch.tensor([46, 9], device=DEVICE)
    static = triton_kernel.paged_decode(
        torch.cat([q0[45:46], q[78:79]]), k_cache, v_cache, table, lens, 0.25, window or 0, softcap or 0.0
    )
    assert torch.equal(static, torch.cat([ref[45:46], packed[78:79]]))


def test_bidirectional_rows_with_three_query_heads_per_kv_head_are_invariant():
    """Rows of (token, head) that do not divide the tile (G = 3), head dim 40 padded to 64: a
    sequence alone equals it packed after another, at a different offset in every tile."""
    lengths = [11, 50]
    q, k, v = _flat(lengths, 3, 1, 40, torch.float16, seed=9)
    opts = dict(causal=False, scale=0.2, softcap=10.0)
    packed = triton_kernel.forward(q, k, v, VarlenMeta.from_lengths(lengths, device=DEVICE), **opts)
    second = VarlenMeta.from_lengths([50], device=DEVICE)
    alone = triton_kernel.forward(q[11:], k[11:], v[11:], second, **opts)
    assert torch.equal(alone, packed[11:])
    ref = reference_attention(q, k, v, lengths, lengths, 0.2, False, (-1, -1), 10.0)
    torch.testing.assert_close(packed.float(), ref.float(), atol=2e-3, rtol=2e-3)


def test_a_fully_masked_key_block_is_skipped_without_a_trace():
    """With a window, a tile's early rows see blocks its late rows do not: rows that see nothing of
    a visited block keep their bits (no NaN from -inf - -inf, no rescaling)."""
    q, k, v = _flat([100], 2, 2, 16, torch.float32, seed=3)
    opts = dict(scale=0.3, window=5)
    meta = VarlenMeta.from_lengths([100], device=DEVICE)
    whole = triton_kernel.forward(q, k, v, meta, **opts)
    assert torch.isfinite(whole).all()
    for p in (3, 33, 64, 99):
        assert torch.equal(_paged_rows(q, k, v, p, p + 1, 16, dict(causal=True, **opts)), whole[p : p + 1])
    ref = reference_attention(q, k, v, [100], [100], 0.3, True, (4, 0), 0.0)
    torch.testing.assert_close(whole, ref, atol=1e-5, rtol=1e-5)


# ---- through the public entry points


@pytest.fixture
def launches(monkeypatch):
    """Every kernel launch's ``decode`` flag (True: the static decode step), in order."""
    calls = []
    launch = triton_kernel._launch

    def counted(*args, decode, **kwargs):
        calls.append(decode)
        return launch(*args, decode=decode, **kwargs)

    monkeypatch.setattr(triton_kernel, "_launch", counted)
    return calls


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2"])
def test_greedy_generation_through_triton_equals_hf_generate(monkeypatch, launches, family):
    """Chunked prefill and decode on the Triton kernel with 16-token blocks read in place; Gemma2 has
    a sliding window on alternate layers and soft-capped logits. fp32."""
    monkeypatch.setattr(attention.dispatch, "gather_kv", lambda *a, **k: pytest.fail("gathered K/V"))
    model = tiny_model(family).to(DEVICE)
    prompts = prompts_of([13, 3, 21], seed=5)
    gen = Generator(model, attn_backend="triton", block_size=16, max_num_batched_tokens=16, num_blocks=32)
    outs = gen.generate(prompts, SamplingParams(max_tokens=6, temperature=0.0), use_tqdm=False)
    assert max(gen.stats()["tokens_per_step"]) <= 16
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 6) for p in prompts]
    assert len(launches) == gen.stats()["steps"] * model.config.num_hidden_layers


def test_static_decode_through_triton_equals_hf_generate(monkeypatch, launches):
    monkeypatch.setenv(BACKEND_ENV, "triton")
    model = tiny_model("qwen2").to(DEVICE)
    prompts = prompts_of([5, 11], seed=6)
    gen = Generator(model, block_size=16, num_blocks=16, static_decode=True)
    outs = gen.generate(prompts, SamplingParams(max_tokens=5, temperature=0.0), use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == [hf_greedy(model, p, 5) for p in prompts]
    assert any(launches) and not all(launches)  # prefill on the varlen path, decode steps static


def test_training_rows_run_the_kernel_forward_and_a_recomputed_backward():
    """A packed training row with gradients: the forward is the kernel's own bits, the backward
    the differentiable backend's (dispatch's RecomputeBackward); shared-prefix rows gather keys."""
    lengths = [7, 20]
    q, k, v = (t.requires_grad_() for t in _flat(lengths, 4, 2, 16, torch.float32, seed=7))
    meta = VarlenMeta.from_lengths(lengths, device=DEVICE)
    out = varlen_attention(q, k, v, meta, sliding_window=5, softcap=20.0, backend="triton")
    with torch.no_grad():
        kernel = triton_kernel.forward(q, k, v, meta, scale=0.25, window=5, softcap=20.0)
    assert torch.equal(out, kernel)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    ref = varlen_attention(q, k, v, meta, sliding_window=5, softcap=20.0, backend="sdpa_loop")
    for got, want in zip(grads, torch.autograd.grad(ref.square().sum(), (q, k, v))):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    shared = VarlenMeta.shared_prefix([(6, [3, 4])], device=DEVICE)
    qs, ks, vs = _flat([13], 4, 2, 16, torch.float32, seed=8)
    got = varlen_attention(qs, ks, vs, shared, backend="triton")
    torch.testing.assert_close(got, varlen_attention(qs, ks, vs, shared, backend="sdpa_loop"), atol=1e-5, rtol=1e-5)


@pytest.fixture
def no_flash_no_torch_varlen(monkeypatch):
    """A CUDA machine (faked) with neither flash-attn nor torch's varlen kernel."""
    import torch.nn.attention.varlen as varlen_module

    from nopad.packing.attention import flash

    monkeypatch.delenv(BACKEND_ENV, raising=False)
    monkeypatch.setattr(flash, "flash_attn_info", lambda: None)
    monkeypatch.delattr(varlen_module, "varlen_attn", raising=False)
    attention.registry._said.clear()
    yield
    attention.registry._said.clear()


def test_the_rule_picks_triton_for_paged_cuda_steps(no_flash_no_torch_varlen):
    for dtype in DTYPES:
        assert choose_backend(CUDA, dtype, paged=True, block_size=16) == "triton"
        assert choose_backend(CUDA, dtype, paged=True, block_size=32, softcap=50.0, sliding_window=8) == "triton"
    assert paged_block_size(CUDA, torch.bfloat16) == 16  # the generator allocates what triton reads
    with pytest.warns(RuntimeWarning, match="sdpa_loop"):  # 8-token blocks: gathered, per-sequence SDPA
        assert choose_backend(CUDA, torch.bfloat16, paged=True, block_size=8) == "sdpa_loop"
    assert choose_backend("cpu", torch.float32, paged=True, block_size=16) == "kernel"  # CUDA only under auto


def test_missing_triton_says_what_to_install(monkeypatch, no_flash_no_torch_varlen):
    monkeypatch.setattr(triton_kernel, "triton", None)
    with pytest.raises(RuntimeError, match=r"triton is not installed \(pip install triton\)"):
        choose_backend(CUDA, torch.bfloat16, paged=True, block_size=16, override="triton")
    q = torch.zeros(1, 1, 16)
    with pytest.raises(RuntimeError, match=r"triton is not installed \(pip install triton\)"):
        triton_kernel.forward(q, q, q, VarlenMeta.from_lengths([1]), scale=1.0)


def test_bad_input_is_a_clear_error():
    meta = VarlenMeta.from_lengths([2], device=DEVICE)
    q = torch.zeros(2, 2, 16, device=DEVICE)
    with pytest.raises(ValueError, match="share dtype"):
        triton_kernel.forward(q, q.half(), q, meta, scale=1.0)
    with pytest.raises(ValueError, match="fp32, bf16 or fp16"):
        triton_kernel.forward(q.double(), q.double(), q.double(), meta, scale=1.0)
    big = torch.zeros(2, 1, 320, device=DEVICE)
    with pytest.raises(ValueError, match="head_dim <= 256"):
        triton_kernel.forward(big, big, big, meta, scale=1.0)
    with pytest.raises(ValueError, match="multiple of kv heads"):
        triton_kernel.forward(torch.zeros(2, 3, 16, device=DEVICE), q, q, meta, scale=1.0)
    with pytest.raises(ValueError, match="blocks of >= 16"):
        table = torch.zeros(1, 1, dtype=torch.int32, device=DEVICE)
        triton_kernel.forward(q, q, q, meta, table=table, block_size=2, scale=1.0)


_COMPILE = """
import os, sys
os.environ.pop("TRITON_INTERPRET", None)
import torch
try:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
except ImportError as error:
    print("SKIP", error)
    sys.exit(0)
from nopad.packing.attention import triton_kernel as tk

kernel = tk._attention_kernel
pointer = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
for dtype, dim, paged, decode, capability in ((torch.bfloat16, 128, True, True, 90),
                                              (torch.float16, 24, True, False, 80),
                                              (torch.float32, 256, False, False, 80)):
    signature = {}
    for name in kernel.arg_names:
        if name in ("Q", "K", "V", "OUT"):
            signature[name] = pointer[dtype]
        elif name in ("CU_Q", "KEYS", "TABLE"):
            signature[name] = "*i64" if decode and name != "TABLE" else "*i32"
        elif name in ("scale", "softcap"):
            signature[name] = "fp32"
        elif name.startswith("stride") or name == "window":
            signature[name] = "i32"
        else:
            signature[name] = "constexpr"
    tile = tk.tile_config(dim, dtype)
    constants = dict(G=2, HEAD_DIM=dim, D_PAD=tk._padded(dim), BLOCK_M=tile.block_m, BLOCK_N=tile.block_n,
                     PAGE=16, PAGED=paged, DECODE=decode, CAUSAL=True, SOFTCAP=True, INTERPRETED=False,
                     FP32=dtype == torch.float32)
    target = GPUTarget("cuda", capability, 32)
    compiled = triton.compile(ASTSource(kernel, signature, constants), target=target,
                              options={"num_warps": tile.warps, "num_stages": tile.stages})
    print(dtype, dim, capability, "shared", compiled.metadata.shared)
    assert compiled.metadata.shared <= 99 * 1024, "the tile does not fit 99 KB of shared memory"
print("OK")
"""


def test_the_gpu_kernel_compiles_without_a_gpu():
    """The real (not interpreted) kernel compiles for Ampere and Hopper, with Triton's own ptxas, and
    each tile fits consumer Ampere's shared memory: what the interpreter cannot check, checked on CPU."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    run = subprocess.run(
        [sys.executable, "-c", _COMPILE], capture_output=True, text=True, timeout=240, env=env, cwd=root
    )
    if run.stdout.startswith("SKIP"):
        pytest.skip(run.stdout)
    assert run.returncode == 0 and run.stdout.strip().endswith("OK"), run.stdout + run.stderr[-3000:]
