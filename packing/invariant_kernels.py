"""Batch-invariant Triton ops for :func:`nopad.packing.batch_invariant` on CUDA (the "triton" kernel set).

Each op's reduction order depends only on the row it computes, never on how many rows share the
call or where the row sits:

- :func:`linear`: one tile configuration (``BLOCK_M x BLOCK_N x BLOCK_K``) for every M, no split-K,
  K visited in one fixed order, fp32 accumulation. (cuBLAS picks its tiling and split-K from M.)
- :func:`softmax`, :func:`log_softmax`: one program per row, which walks the row in fixed
  ``BLOCK`` chunks into a ``BLOCK``-wide fp32 accumulator and sums it once at the end;
  :func:`row_sum`, :func:`row_mean` the same for ``SUM_ROWS`` rows per program, each row in the
  same order whichever program holds it. (torch's CUDA reductions choose how to split a row from
  the tensor's shape.)

Under Triton's interpreter (CPU tensors, ``TRITON_INTERPRET=1`` set before import: how the tests run
it) ``tl.dot`` is numpy's BLAS matmul, neither exact in bf16 nor row-invariant, so the matmul's dot
is then an fp32 multiply and ``tl.sum`` instead. Backwards are the ordinary formulas in torch: only
the forward has to match between the generator and the trainer.
"""

from __future__ import annotations

import torch

try:
    import triton
    import triton.language as tl
except ImportError:  # the CPU kernel set needs no triton
    triton = None

BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 32  # the one matmul tile, whatever M is
BLOCK = 256  # the row reductions' chunk width
# sum / mean: SUM_ROWS rows per program, each walked in SUM_BLOCK chunks (the reduced dims are short:
# a recurrent state's 16-256, a hidden size's thousands); a row's order is the same in every program
SUM_ROWS, SUM_BLOCK = 16, 128

if triton is not None:

    @triton.jit
    def _matmul_kernel(
        X,
        W,
        B,
        OUT,
        M,
        N,
        K,
        stride_xm,
        stride_wn,
        stride_om,
        HAS_BIAS: tl.constexpr,
        INTERPRETED: tl.constexpr,
        FP32: tl.constexpr,
        BM: tl.constexpr,
        BN: tl.constexpr,
        BK: tl.constexpr,
    ):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rows = pid_m * BM + tl.arange(0, BM)
        cols = pid_n * BN + tl.arange(0, BN)
        ks = tl.arange(0, BK)
        acc = tl.zeros((BM, BN), dtype=tl.float32)
        for k0 in range(0, K, BK):  # one K order for every row
            k_ok = (k0 + ks) < K
            x = tl.load(
                X + rows[:, None] * stride_xm + (k0 + ks)[None, :], mask=(rows[:, None] < M) & k_ok[None, :], other=0.0
            )
            w = tl.load(
                W + cols[None, :] * stride_wn + (k0 + ks)[:, None], mask=(cols[None, :] < N) & k_ok[:, None], other=0.0
            )
            if INTERPRETED:
                acc += tl.sum(x.to(tl.float32)[:, :, None] * w.to(tl.float32)[None, :, :], 1)
            elif FP32:  # IEEE fp32, not TF32
                acc += tl.dot(x, w, input_precision="ieee")
            else:
                acc += tl.dot(x, w)
        if HAS_BIAS:
            acc += tl.load(B + cols, mask=cols < N, other=0.0).to(tl.float32)
        tl.store(
            OUT + rows[:, None] * stride_om + cols[None, :],
            acc.to(OUT.dtype.element_ty),
            mask=(rows[:, None] < M) & (cols[None, :] < N),
        )

    @triton.jit
    def _row_sum_kernel(X, OUT, M, N, stride_x, MEAN: tl.constexpr, ROWS: tl.constexpr, BLOCK: tl.constexpr):
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        offs = tl.arange(0, BLOCK)
        acc = tl.zeros((ROWS, BLOCK), dtype=tl.float32)
        for n0 in range(0, N, BLOCK):
            ok = (rows[:, None] < M) & (n0 + offs[None, :] < N)
            x = tl.load(X + rows[:, None] * stride_x + n0 + offs[None, :], mask=ok, other=0.0)
            acc += x.to(tl.float32)
        total = tl.sum(acc, 1)
        if MEAN:
            total = total / N
        tl.store(OUT + rows, total.to(OUT.dtype.element_ty), mask=rows < M)

    @triton.jit
    def _softmax_kernel(X, OUT, N, stride_x, stride_o, LOG: tl.constexpr, BLOCK: tl.constexpr):
        row = tl.program_id(0)
        offs = tl.arange(0, BLOCK)
        top = tl.full((BLOCK,), float("-inf"), tl.float32)
        for n0 in range(0, N, BLOCK):
            x = tl.load(X + row * stride_x + n0 + offs, mask=n0 + offs < N, other=float("-inf"))
            top = tl.maximum(top, x.to(tl.float32))
        row_max = tl.max(top, 0)
        total = tl.zeros((BLOCK,), dtype=tl.float32)
        for n0 in range(0, N, BLOCK):
            x = tl.load(X + row * stride_x + n0 + offs, mask=n0 + offs < N, other=float("-inf"))
            total += tl.exp(x.to(tl.float32) - row_max)
        log_total = tl.log(tl.sum(total, 0))
        for n0 in range(0, N, BLOCK):
            ok = n0 + offs < N
            x = tl.load(X + row * stride_x + n0 + offs, mask=ok, other=0.0).to(tl.float32)
            y = x - row_max - log_total
            if not LOG:
                y = tl.exp(y)
            tl.store(OUT + row * stride_o + n0 + offs, y.to(OUT.dtype.element_ty), mask=ok)


def available() -> tuple[bool, str]:
    """Whether these kernels can run here, and what to install when not."""
    if triton is None:
        return False, "triton is not installed (pip install triton)"
    return True, ""


def _interpreted() -> bool:
    from triton.runtime.interpreter import InterpretedFunction

    return isinstance(_matmul_kernel, InterpretedFunction)


def _check(x: torch.Tensor) -> None:
    if triton is None:
        raise RuntimeError("the batch-invariant Triton kernels need triton (pip install triton)")
    if x.device.type == "cpu" and not _interpreted():
        raise RuntimeError(
            "batch_invariant(kernels='triton'): the batch-invariant Triton kernels run CPU "
            "tensors only under Triton's interpreter: set TRITON_INTERPRET=1 before nopad is "
            "imported (for tests), use CUDA, or on CPU leave kernels=None for nopad's CPU set"
        )


def matmul(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` for 2-D ``x``; each output row's bits independent of the other rows."""
    _check(x)
    x = x.contiguous()
    weight = weight.contiguous()
    m, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(m, n)
    if m == 0 or n == 0:
        return out
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N))
    _matmul_kernel[grid](
        x,
        weight,
        bias if bias is not None else x,
        out,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        out.stride(0),
        HAS_BIAS=bias is not None,
        INTERPRETED=x.device.type == "cpu",
        FP32=x.dtype == torch.float32,
        BM=BLOCK_M,
        BN=BLOCK_N,
        BK=BLOCK_K,
    )
    return out


def _rows(x: torch.Tensor) -> torch.Tensor:
    return x.reshape(-1, x.shape[-1]).contiguous()


def row_sum(x: torch.Tensor, mean: bool = False) -> torch.Tensor:
    """``x.sum(-1)`` (or ``x.mean(-1)``) in ``x``'s dtype, fp32 sums, in a fixed per-row order."""
    _check(x)
    flat = _rows(x)
    out = x.new_empty(flat.shape[0])
    if flat.shape[0]:
        _row_sum_kernel[(triton.cdiv(flat.shape[0], SUM_ROWS),)](
            flat, out, flat.shape[0], flat.shape[1], flat.stride(0), MEAN=mean, ROWS=SUM_ROWS, BLOCK=SUM_BLOCK
        )
    return out.view(x.shape[:-1])


def row_mean(x: torch.Tensor) -> torch.Tensor:
    """``x.mean(-1)`` (in ``x``'s dtype, fp32 sums) in a fixed per-row order."""
    return row_sum(x, mean=True)


def softmax(x: torch.Tensor, log: bool = False) -> torch.Tensor:
    """``softmax`` / ``log_softmax`` over the last dim (fp32 inside, ``x``'s dtype out), one fixed
    order per row."""
    _check(x)
    flat = _rows(x)
    out = torch.empty_like(flat)
    if flat.shape[0]:
        _softmax_kernel[(flat.shape[0],)](flat, out, flat.shape[1], flat.stride(0), out.stride(0), LOG=log, BLOCK=BLOCK)
    return out.view(x.shape)


class Linear(torch.autograd.Function):
    """:func:`matmul` forward, the ordinary GEMM backward."""

    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        out = matmul(x.reshape(-1, x.shape[-1]), weight, bias)
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = (g @ weight).view(x.shape) if ctx.needs_input_grad[0] else None
        grad_w = g.t() @ x.reshape(-1, x.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad_x, grad_w, grad_b


class RowSum(torch.autograd.Function):
    """:func:`row_sum` forward over ``dim`` (moved last for the kernel); backward spreads ``grad``
    (``grad / N`` for a mean) over the reduced dim."""

    @staticmethod
    def forward(ctx, x, dim, keepdim, mean):
        ctx.dim, ctx.n, ctx.keepdim, ctx.mean = dim, x.shape[dim], keepdim, mean
        out = row_sum(x.movedim(dim, -1), mean)
        return out.unsqueeze(dim) if keepdim else out

    @staticmethod
    def backward(ctx, grad):
        g = grad if ctx.keepdim else grad.unsqueeze(ctx.dim)
        if ctx.mean:
            g = g / ctx.n
        shape = list(g.shape)
        shape[ctx.dim] = ctx.n
        return g.expand(shape), None, None, None


class Softmax(torch.autograd.Function):
    """:func:`softmax` forward; the ordinary softmax / log-softmax backward."""

    @staticmethod
    def forward(ctx, x, log):
        out = softmax(x, log)
        ctx.save_for_backward(out)
        ctx.log = log
        return out

    @staticmethod
    def backward(ctx, grad):
        (out,) = ctx.saved_tensors
        if ctx.log:
            return grad - out.exp() * grad.sum(-1, keepdim=True), None
        return out * (grad - (grad * out).sum(-1, keepdim=True)), None
