"""Batch-invariant numerics: every token's forward computed the same way whatever shares its batch.

    with packing.batch_invariant():
        outs = generator.generate(prompts, params)    # rollouts
        logits = model(**packed_row).logits           # training forward: bitwise the same log-probs

Why: a GEMM picks its tiling (and so the order of its sums) from the number of rows, and attention
kernels from the number and length of sequences, so one token gets different bits in a decode step
of 48 sequences and in a training row of 4,096 tokens; in bf16 that made rollout and trainer
log-probs differ by up to 0.31. Under this mode:

- every ``nn.Linear`` runs on fixed
  tiles of :data:`TILE_ROWS` rows (the last one zero-padded), so each row meets the same GEMM
  shape, hence the same kernel and sum order, wherever it sits (measured bitwise on every offset
  and row count tried, fp32/bf16/fp16). Its backward is the ordinary GEMM: only the forward must
  match. (A model calling ``F.linear`` directly would escape it; the op audit in the tests checks
  every GEMM of each tested family.)
- nopad attention runs a kernel whose per-query order depends on nothing but the query's own keys,
  for training rows, prefill chunks and decode: the compiled CPU kernel
  (:mod:`packing.attention.cpu_kernel`), or with ``kernels="triton"`` the Triton kernel
  (:mod:`packing.attention.triton_kernel`; on CPU tensors it runs under ``TRITON_INTERPRET=1``).
- Everything else in the tested families (embedding, RMSNorm's row mean, RoPE, activations,
  ``log_softmax`` over a row) was audited as row-local: see ``tests/test_packing_invariance.py``.

The mode belongs to the thread that entered it (a thread-local flag that ``nn.Linear`` and the
attention core read); another thread (a data-loader thread, a second model) keeps the default
numerics. A ``TorchFunctionMode`` would also catch direct ``F.linear`` calls, but PyTorch pops a
mode while it handles ``Tensor.backward``, so activation checkpointing would recompute the forward
with the default GEMMs and fail its own metadata check. It costs the padding of
the last tile (32 rows: a decode step of 48 sequences computes 64 rows), the mode's per-op
dispatch, and the attention kernel's forward on training rows (``bench_exactness.py``).
"""

from __future__ import annotations

import contextlib
import threading

import torch

TILE_ROWS = 32

def supported(device: torch.device | str) -> tuple[bool, str]:
    """Whether this mode makes the generator's and the training forward's log-probs bitwise equal
    for a model on ``device``, and why not: its batch-invariant attention is nopad's CPU kernel, so
    it needs a CPU model and no other attention backend forced through ``NOPAD_ATTN_BACKEND``."""
    import os

    from packing.attention.registry import BACKEND_ENV

    device = torch.device(device)
    forced = os.environ.get(BACKEND_ENV) or "auto"
    if device.type != "cpu":
        return False, (f"the model runs on {device.type}: its kernel set (Triton attention, fixed-tile "
                       "GEMMs) is proven only under Triton's interpreter so far, and the GPU's row "
                       "reductions are not yet replaced, so bitwise equality on a GPU is not promised")
    if forced not in ("auto", "kernel", "per_token"):
        return False, f"{BACKEND_ENV}={forced} forces an attention backend without the batch-invariant path"
    return True, ""


KERNEL_SETS = ("cpu", "triton")


_local = threading.local()  # this thread's stack of active kernel choices (one entry per open block)


def _stack() -> list:
    if not hasattr(_local, "stack"):
        _local.stack = []
    return _local.stack


def active_kernels() -> str | None:
    """The kernel set the current mode forces ("cpu" / "triton"), or None (chosen by device)."""
    stack = _stack()
    return stack[-1] if stack else None


def is_enabled() -> bool:
    """True inside :func:`batch_invariant` in this thread."""
    return bool(_stack())


def _tiled_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for 2-D contiguous ``x``, every row computed by the same GEMM call shape:
    ``TILE_ROWS`` rows (the last tile zero-padded), written straight into one output buffer."""
    rows, k = x.shape
    n = weight.shape[0]
    out = x.new_empty(rows, n)
    w = weight.t()
    batched = x.dtype == torch.float32  # batched GEMMs are as fast as plain ones in fp32 only

    def gemm(src: torch.Tensor, dst: torch.Tensor) -> None:
        if batched:
            tiles = src.shape[0] // TILE_ROWS
            torch.bmm(src.view(tiles, TILE_ROWS, k), w.unsqueeze(0).expand(tiles, k, n),
                      out=dst.view(tiles, TILE_ROWS, n))
        else:  # bf16/fp16 batched GEMMs take a slow path on CPU: one plain GEMM per tile
            for s in range(0, src.shape[0], TILE_ROWS):
                torch.mm(src[s : s + TILE_ROWS], w, out=dst[s : s + TILE_ROWS])

    full = rows - rows % TILE_ROWS
    if full:
        gemm(x[:full], out[:full])
    if full < rows:
        last = x.new_zeros(TILE_ROWS, k)
        last[: rows - full] = x[full:]
        tail = x.new_empty(TILE_ROWS, n)
        gemm(last, tail)
        out[full:] = tail[: rows - full]
    return out


class _TiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, bias):
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        flat = x.reshape(-1, x.shape[-1])
        out = _tiled_matmul(flat.contiguous(), weight)
        if bias is not None:
            out = out + bias
        return out.view(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        g = grad.reshape(-1, grad.shape[-1])
        grad_x = grad_w = grad_b = None
        if ctx.needs_input_grad[0]:
            grad_x = (g @ weight).view(x.shape)
        if ctx.needs_input_grad[1]:
            grad_w = g.t() @ x.reshape(-1, x.shape[-1])
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_b = g.sum(0)
        return grad_x, grad_w, grad_b


def invariant_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear`` whose every output row is independent of the other rows' count and position.
    Under autocast the inputs are cast first, as autocast's own ``linear`` does."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device, enabled=False):
        return _TiledLinear.apply(x, weight, bias)


_plain_linear_forward = torch.nn.Linear.forward


def _linear_forward(self: torch.nn.Linear, input: torch.Tensor) -> torch.Tensor:
    """nn.Linear's forward: the plain one, or the fixed-tile one in a thread inside the mode."""
    if getattr(_local, "stack", None):
        return invariant_linear(input, self.weight, self.bias)
    return _plain_linear_forward(self, input)


# Installed once, on import: it changes nothing for a thread outside the mode (one attribute
# check), and unlike a swap for the duration of a block it never leaks into another thread.
torch.nn.Linear.forward = _linear_forward


@contextlib.contextmanager
def batch_invariant(enabled: bool = True, kernels: str | None = None):
    """Run the block with batch-invariant numerics (see module docstring), in this thread.
    ``enabled=False`` is a no-op, so callers can write ``with batch_invariant(cfg_flag):``.
    ``kernels="triton"`` forces the Triton attention kernel (the CUDA set; on CPU tensors it runs
    interpreted, which is how the tests prove it); None picks by device. Blocks may nest."""
    if kernels is not None and kernels not in KERNEL_SETS:
        raise ValueError(f"kernels must be one of {KERNEL_SETS} or None (by device), got {kernels!r}")
    if not enabled:
        yield
        return
    stack = _stack()
    stack.append(kernels if kernels is not None else (stack[-1] if stack else None))
    try:
        yield
    finally:
        stack.pop()
