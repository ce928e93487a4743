"""The batch-invariant mode's Triton kernel set (what runs on CUDA), forced on CPU and run by
Triton's interpreter (``TRITON_INTERPRET=1``, set by conftest.py before nopad is imported): the
Triton ops are row-invariant, and the generator's raw log-probs equal the packed training
forward's bitwise across batchings, chunk sizes and preemption."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from nopad.inference import SamplingParams
from nopad.packing import invariant_kernels
from nopad.packing.invariance import active_kernels, batch_invariant, kernel_set
from tests.packing.test_packing_invariance import _gaps
from tests.support.models import random_sequences, tiny_model

pytestmark = pytest.mark.skipif(
    not torch.cuda.is_available()
    and not invariant_kernels.available()[0]
    or not torch.cuda.is_available()
    and not invariant_kernels._interpreted(),
    reason="needs triton, and TRITON_INTERPRET=1 without CUDA",
)
DTYPES = (torch.float32, torch.float16)


@pytest.mark.parametrize("dtype", DTYPES + (torch.bfloat16,))
def test_triton_ops_rows_do_not_depend_on_their_batch(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(100, 72, generator=g).to(dtype)
    w, b = torch.randn(40, 72, generator=g).to(dtype), torch.randn(40, generator=g).to(dtype)
    full = invariant_kernels.matmul(x, w, b)
    for start, count in [(0, 1), (3, 5), (63, 2), (10, 90)]:
        assert torch.equal(invariant_kernels.matmul(x[start : start + count], w, b), full[start : start + count])
    tol = dict(atol=1e-4, rtol=1e-4) if dtype == torch.float32 else dict(atol=0.2, rtol=2e-2)
    assert torch.allclose(full.float(), F.linear(x.float(), w.float(), b.float()), **tol)
    y = torch.randn(9, 300, generator=g).to(dtype) * 4
    for fn, ref in [
        (invariant_kernels.row_mean, lambda t: t.mean(-1)),
        (invariant_kernels.softmax, lambda t: t.softmax(-1)),
        (lambda t: invariant_kernels.softmax(t, log=True), lambda t: t.log_softmax(-1)),
    ]:
        out = fn(y)
        assert all(torch.equal(fn(y[i : i + 2]), out[i : i + 2]) for i in range(0, 8, 3))
        assert torch.allclose(out.float(), ref(y.float()), **tol)


@pytest.mark.parametrize("dtype", (torch.float32, torch.bfloat16), ids=str)
def test_sums_over_any_one_dim_are_row_invariant_in_the_triton_set(dtype):
    """A recurrent layer's state sums (over dim -2 in the delta rule, -1 in the Mamba2 scan) and
    any other one-dim sum: each output's bits do not depend on how many others share the call."""
    g = torch.Generator().manual_seed(2)
    x = torch.randn(4, 3, 10, 6, generator=g).to(dtype)
    tol = dict(atol=1e-4, rtol=1e-5) if dtype == torch.float32 else dict(atol=0.1, rtol=1e-2)
    with batch_invariant(kernels="triton"):
        for dim, keepdim in ((-2, False), (-1, True), (2, True)):
            full = x.sum(dim, keepdim=keepdim)
            assert full.dtype == dtype and full.shape == x.float().sum(dim, keepdim=keepdim).shape
            assert torch.equal(torch.sum(x[1:3], dim=(dim,), keepdim=keepdim), full[1:3])
            torch.testing.assert_close(full.float(), x.float().sum(dim, keepdim=keepdim), **tol)
        assert torch.equal(x[:, 1:2].sum(0), x.sum(0)[1:2])
        assert torch.equal(x[:, 1:2].mean(-2), x.mean(-2)[:, 1:2])
        torch.testing.assert_close(x.sum(-1, dtype=torch.float32), x.float().sum(-1), **tol)  # torch's own
        with pytest.raises(IndexError, match="out of range"):  # torch's own error, not a wrapped dim
            x.sum(4)
        leaf = x.float().requires_grad_()
        (leaf.sum(-2) * torch.arange(6.0)).sum().backward()
    torch.testing.assert_close(leaf.grad, torch.arange(6.0).expand_as(leaf))


def test_mode_routes_to_the_triton_set_and_keeps_the_ordinary_gradients():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(3, 7, 16, generator=g, requires_grad=True)
    w = torch.randn(12, 16, generator=g, requires_grad=True)
    with batch_invariant(kernels="triton"):
        assert active_kernels() == "triton" and kernel_set(x.device) == "triton"
        h = F.linear(x, w)
        out = (h.mean(-1, keepdim=True) + torch.log_softmax(h, dim=-1) + h.softmax(-1)).square().sum()
    assert torch.equal(h, invariant_kernels.matmul(x.detach().reshape(-1, 16), w.detach()).view(3, 7, 12))
    got = torch.autograd.grad(out, (x, w))
    h = F.linear(x, w)
    want = torch.autograd.grad(
        (h.mean(-1, keepdim=True) + torch.log_softmax(h, dim=-1) + h.softmax(-1)).square().sum(), (x, w)
    )
    for a, b in zip(got, want):
        assert torch.allclose(a, b, rtol=1e-4, atol=1e-4)
    assert active_kernels() is None and kernel_set(x.device) == "cpu"
    with pytest.raises(ValueError, match="kernels="), batch_invariant(kernels="gpu"):
        pass


@pytest.mark.parametrize("family,dtype", [("llama", torch.float32), ("qwen2", torch.float16)])
def test_generator_logprobs_equal_training_forward_bitwise_triton(family, dtype, one_thread):
    model = tiny_model(family).to(dtype)
    shared = random_sequences([20], seed=7)[0].tolist()
    prompts = [p.tolist() for p in random_sequences([3, 25, 1], seed=8)]
    prompts += [shared + [5], shared + [9, 9]]  # prefix-cache hits
    params = SamplingParams(temperature=1.0, n=2, max_tokens=6, seed=1)
    # small token budget (chunked prefill), few blocks (preemption), 4-token blocks
    trainer, generator, stats = _gaps(
        model,
        prompts,
        params,
        dict(max_num_batched_tokens=19, max_num_seqs=6, num_blocks=12, block_size=4),
        capacity=128,
        kernels="triton",
    )
    assert stats["preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0
    assert trainer.numel() == generator.numel() > 0
    assert torch.equal(trainer, generator), f"max gap {(trainer - generator).abs().max():.3g}"


@pytest.mark.parametrize("budget,blocks,capacity,block_size", [(7, 40, 64, 4), (64, 12, 400, 16)])
def test_bitwise_whatever_the_batch_triton(budget, blocks, capacity, block_size, one_thread):
    """Gathered keys (4-token blocks) and pages read in place by the Triton kernel (16-token)."""
    model = tiny_model("mistral").to(torch.float16)
    prompts = [p.tolist() for p in random_sequences([5, 30, 12], seed=budget)]
    params = SamplingParams(temperature=1.0, n=2, max_tokens=5, seed=budget)
    trainer, generator, _ = _gaps(
        model,
        prompts,
        params,
        dict(max_num_batched_tokens=budget, max_num_seqs=3, num_blocks=blocks, block_size=block_size),
        capacity=capacity,
        kernels="triton",
    )
    assert torch.equal(trainer, generator)


def test_the_triton_set_on_cpu_without_the_interpreter_says_what_to_do(monkeypatch):
    """An fp32 model on CPU under ``kernels="triton"`` without ``TRITON_INTERPRET``: the refusal
    names the mode asked for, the model's own dtype (not the bf16 the generator's block size is
    first decided for) and what to do."""
    from nopad.inference import Generator
    from nopad.packing.attention import triton_kernel

    monkeypatch.setattr(triton_kernel, "interpreted", lambda: False)
    monkeypatch.setattr(invariant_kernels, "_interpreted", lambda: False)
    model = tiny_model("llama")
    with batch_invariant(kernels="triton"):
        refusal = r"kernels='triton'.*torch\.float32 on cpu.*kernels=None"
        with pytest.raises(ValueError, match=refusal) as refused:
            Generator(model, num_blocks=8)
        assert "bfloat16" not in str(refused.value)
        with pytest.raises(RuntimeError, match=r"kernels='triton'.*TRITON_INTERPRET=1.*kernels=None"):
            model(torch.tensor([[3, 4, 5]]))
