"""Batch-invariant numerics: every token's forward computed the same way whatever shares its batch.

    with nopad.packing.batch_invariant():
        outs = generator.generate(prompts, params)    # rollouts
        logits = model(**packed_row).logits           # training forward: bitwise the same log-probs

Why: a GEMM picks its tiling (and so the order of its sums) from the number of rows, and attention
kernels from the number and length of sequences, so one token gets different bits in a decode step
of 48 sequences and in a training row of 4,096 tokens, and in bf16 rollout and trainer log-probs
differ visibly (``benchmarks/bench_exactness.py`` measures by how much). Under this mode:

- every ``F.linear`` (so every ``nn.Linear``) gives each row the bits of fixed tiles, the same
  by construction: on CPU every GEMM call is one ``torch.mm`` of :data:`TILE_ROWS` rows (the last
  tile zero-padded), each tile 64-byte aligned, with the same strides, weight and thread count, so
  every row meets the identical call (kernel, blocking, thread split, alignment) whatever its
  batch. What is left to the kernel is to sum each row of one call over K in one order wherever
  the row sits in the tile, as GEMM micro-kernels do (every tile position is checked, bf16 and
  fp32, in ``tests/packing/test_packing_invariance.py``). No call of another row count runs:
  torch picks its kernel from the row count, and a one-time probe that one call over all rows gave
  the tiles' bits did not prove it for every row (a bf16 row alone got other bits for ~0.15% of
  rows). In the "triton" set the one-tile Triton matmul of
  :mod:`nopad.packing.invariant_kernels`. Its backward is the ordinary GEMM: only the forward must match.
- in the "triton" set (CUDA), reductions over one dim (``sum``, ``mean``: any dim, moved last) and
  over the last dim (``softmax``, ``log_softmax``) run Triton kernels with one fixed order per
  row too; torch's CUDA reductions choose how to split a row from the tensor's shape, so the
  delta rules' sums over their state and the Mamba2 scan's gave a token other bits in a decode
  step than in a training row. (On CPU they were audited as row-local.)
- nopad attention runs a backend declared ``invariant`` (its per-query order depends on nothing
  but the query's own keys), for training rows, prefill chunks and decode: the compiled CPU kernel
  (:mod:`nopad.packing.attention.cpu_kernel`) or the Triton one (:mod:`nopad.packing.attention.triton_kernel`).
- on CPU, the transcendental pointwise functions (``exp``, ``log``, ``sigmoid``, ``softplus``,
  ``silu``, ...: :data:`_POINTWISE`) run over a buffer padded to whole vector runs: torch computes
  an element in a SIMD lane or, in the tail of the buffer, with a scalar formula whose last bit
  can differ, so a hybrid layer's per-head gate (a few values per token) got different bits in a
  decode step and in a training row. (Widths that are multiples of the run, as an MLP's, were
  already always in the lanes: same bits as before.)
- hybrid layers (Gated DeltaNet, KDA, short convolutions, Mamba2) run one order for every row: the
  delta rules and the Mamba2 scan token by token and the convolution as ordered gathers
  (:mod:`nopad.packing.mixers.delta_rule`, :mod:`nopad.packing.mixers.ssm_steps`, :mod:`nopad.packing.mixers.conv`),
  the order of the generator's decode, so prefill chunks, decode steps and training rows (flat or
  tree) agree bitwise.
- Everything else in the tested families (embedding, RMSNorm's row mean, RoPE, activations,
  ``log_softmax`` over a row) was audited as row-local: see ``tests/packing/test_packing_invariance.py``.

The mode belongs to the thread that enters it: the ops are caught by a
``torch.overrides.TorchFunctionMode``, whose stack is per thread, and :func:`is_enabled` (read by
an attention plan when a forward starts) is thread-local, so another thread keeps torch's default
kernels. On CPU it costs the tiles (a decode step of 48 sequences computes 64 rows, in two calls;
in bf16 many small calls cost more than one large one) and the attention kernel's forward on
training rows (``benchmarks/bench_exactness.py``).
"""

from __future__ import annotations

import contextlib
import threading

import torch
import torch.nn.functional as F
from torch.overrides import TorchFunctionMode

TILE_ROWS = 32
ALIGN_BYTES = 64  # torch's CPU allocator's alignment: every tile starts on it (see _tiled_matmul)
KERNEL_SETS = ("cpu", "triton")

_state = threading.local()  # per thread: ``depth`` of batch_invariant() blocks, ``kernels`` forced


def check_kernels(kernels: str | None) -> str | None:
    if kernels is not None and kernels not in KERNEL_SETS:
        raise ValueError(f"batch_invariant(kernels={kernels!r}): None (by device) or one of {KERNEL_SETS}")
    return kernels


def active_kernels() -> str | None:
    """The kernel set the current thread's mode forces ("cpu" / "triton"), or None (chosen by each
    tensor's device: "cpu" on CPU, "triton" on CUDA)."""
    return getattr(_state, "kernels", None)


def is_enabled() -> bool:
    """True inside :func:`batch_invariant` in this thread (read when an attention plan is made)."""
    return getattr(_state, "depth", 0) > 0


def kernel_set(device: torch.device) -> str:
    """The kernel set the current mode runs for a tensor on ``device``."""
    return active_kernels() or ("cpu" if device.type == "cpu" else "triton")


def _tiled_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for 2-D contiguous ``x``, every row computed by the identical GEMM call: one
    ``torch.mm`` per ``TILE_ROWS`` rows (the last tile zero-padded), each tile's input and output
    starting on an :data:`ALIGN_BYTES` boundary (a tile spans a multiple of it, so tiles of an
    aligned buffer are aligned: MKL's sum order may follow the alignment). Why not fewer, larger
    calls: a batched GEMM or one call over all rows picks its path from the row or tile count."""
    rows, k = x.shape
    n = weight.shape[0]
    if x.data_ptr() % ALIGN_BYTES:
        x = x.clone()  # a fresh buffer: aligned
    out = x.new_empty(rows, n)
    w = weight.t()
    full = rows - rows % TILE_ROWS
    for s in range(0, full, TILE_ROWS):
        torch.mm(x[s : s + TILE_ROWS], w, out=out[s : s + TILE_ROWS])
    if full < rows:
        last = x.new_zeros(TILE_ROWS, k)
        last[: rows - full] = x[full:]
        tail = x.new_empty(TILE_ROWS, n)
        torch.mm(last, w, out=tail)
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
    """``F.linear`` whose every output row is independent of the other rows' count and position,
    on the kernel set of :func:`kernel_set` (outside the mode: by device). Under autocast the
    inputs are cast first, as autocast's own ``linear`` does."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        dtype = torch.get_autocast_dtype(device)
        x, weight = x.to(dtype), weight.to(dtype)
        bias = None if bias is None else bias.to(dtype)
    with torch.autocast(device, enabled=False):
        if kernel_set(x.device) == "triton":
            from nopad.packing import invariant_kernels

            return invariant_kernels.Linear.apply(x, weight, bias)
        return _TiledLinear.apply(x, weight, bias)


_MEANS = {torch.mean, torch.Tensor.mean}
_SUMS = {torch.sum, torch.Tensor.sum}
_POINTWISE = {
    torch.exp,
    torch.Tensor.exp,
    torch.expm1,
    torch.Tensor.expm1,
    torch.log,
    torch.Tensor.log,
    torch.log1p,
    torch.Tensor.log1p,
    torch.sigmoid,
    torch.Tensor.sigmoid,
    torch.tanh,
    torch.Tensor.tanh,
    F.softplus,
    F.silu,
    F.gelu,
    F.logsigmoid,
}
VECTOR_RUN = 64  # elements: a whole number of torch's unrolled SIMD steps (2 x 16 fp32 lanes, 2 x 32 bf16)
SERIAL_ELEMENTS = 16384  # a multiple of VECTOR_RUN below torch's parallel grain (32768): one thread, no split
_SOFTMAXES = {
    F.softmax: False,
    torch.softmax: False,
    torch.Tensor.softmax: False,
    F.log_softmax: True,
    torch.log_softmax: True,
    torch.Tensor.log_softmax: True,
}


def _backward_in_mode(func, args, kwargs) -> None:
    """``loss.backward()`` / ``torch.autograd.backward`` with this mode still on the stack: a
    handler runs with its mode popped, and the autograd engine keeps the stack it is started with,
    so a gradient-checkpointing recompute would otherwise replay the forward on torch's kernels."""
    names = (
        ("gradient", "retain_graph", "create_graph", "inputs")
        if func is torch.Tensor.backward
        else ("grad_tensors", "retain_graph", "create_graph", "grad_variables", "inputs")
    )
    tensors = args[0]
    bound = dict(zip(names, _bound(func, args[1:], kwargs, names)))
    tensors = (tensors,) if isinstance(tensors, torch.Tensor) else tuple(tensors)
    inputs = bound.get("inputs")
    inputs = () if inputs is None else (inputs,) if isinstance(inputs, torch.Tensor) else tuple(inputs)
    create_graph = bool(bound.get("create_graph"))
    retain_graph = create_graph if bound.get("retain_graph") is None else bound["retain_graph"]
    with _InvariantOps():
        grads = torch.autograd._tensor_or_tensors_to_tuple(
            bound.get("gradient", bound.get("grad_tensors")), len(tensors)
        )
        grads = torch.autograd._make_grads(tensors, grads, is_grads_batched=False)
        torch.autograd.graph._engine_run_backward(
            tensors, grads, retain_graph, create_graph, inputs, allow_unreachable=True, accumulate_grad=True
        )


def _one_dim(x: torch.Tensor, dim) -> int | None:
    """``dim`` as one non-negative dim of ``x``, or None (all dims, several, or out of range: left
    to torch, which says what is wrong)."""
    if isinstance(dim, (list, tuple)):
        dim = dim[0] if len(dim) == 1 else None
    if not isinstance(dim, int) or not -x.dim() <= dim < x.dim():
        return None
    return dim % x.dim()


def _bound(func, args, kwargs, names):
    """``func``'s arguments ``names`` by position or keyword (None where not given)."""
    return [args[i] if i < len(args) else kwargs.get(n) for i, n in enumerate(names)]


def lane_pointwise(func, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    """``func(x, *args, **kwargs)`` (a pointwise function) with every element computed in a SIMD
    lane: over ``x`` flattened and zero-padded to whole :data:`VECTOR_RUN` runs, in serial pieces,
    so no element falls in the scalar tail of a loop (which rounds some functions differently).
    Differentiable; an ``inplace=True`` call writes the result back into ``x``."""
    inplace = kwargs.pop("inplace", False)
    flat = x.reshape(-1)
    n = flat.numel()
    if n % VECTOR_RUN:
        flat = torch.cat([flat, flat.new_zeros(VECTOR_RUN - n % VECTOR_RUN)])
    if flat.numel() <= SERIAL_ELEMENTS:
        out = func(flat, *args, **kwargs)
    else:
        out = torch.cat([func(piece, *args, **kwargs) for piece in flat.split(SERIAL_ELEMENTS)])
    out = out[:n].view(x.shape)
    return x.copy_(out) if inplace else out


class _InvariantOps(TorchFunctionMode):
    """Routes this thread's ``F.linear`` (and, in the "triton" set, one-dim ``sum`` / ``mean`` and
    last-dim ``softmax`` / ``log_softmax`` of floating tensors) to the batch-invariant kernels;
    every other call runs
    as usual (elementwise ops and the attention core need no routing: the core reads
    :func:`is_enabled`)."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is F.linear:
            x, weight, bias = _bound(func, args, kwargs, ("input", "weight", "bias"))
            return invariant_linear(x, weight, bias)
        if func is torch._log_softmax:  # the sampler's (into a reused buffer)
            routed = self._reduction(torch.log_softmax, args[:2], {})
            if routed is not None and not (args[2] if len(args) > 2 else kwargs.get("half_to_float")):
                out = kwargs.get("out")
                return routed if out is None else out.resize_(routed.shape).copy_(routed)
        if func in _POINTWISE:
            x = args[0] if args else kwargs.get("input")
            if isinstance(x, torch.Tensor) and x.is_floating_point() and x.device.type == "cpu":
                rest = {k: v for k, v in kwargs.items() if k not in ("input", "out")}
                routed = lane_pointwise(func, x, *args[1:], **rest)
                out = kwargs.get("out")
                return routed if out is None else out.resize_(routed.shape).copy_(routed)
        if func is torch.Tensor.backward or func is torch.autograd.backward:
            return _backward_in_mode(func, args, kwargs)
        if func in _MEANS or func in _SUMS or func in _SOFTMAXES:
            routed = self._reduction(func, args, kwargs)
            if routed is not None:
                return routed
        return func(*args, **kwargs)

    @staticmethod
    def _reduction(func, args, kwargs):
        x = args[0] if args else kwargs.get("input")
        if (
            not isinstance(x, torch.Tensor)
            or not x.is_floating_point()
            or kernel_set(x.device) != "triton"
            or kwargs.get("out") is not None
        ):
            return None
        from nopad.packing import invariant_kernels

        if (
            func not in _MEANS
            and x.dtype in (torch.float16, torch.bfloat16)
            and x.device.type == "cuda"
            and torch.is_autocast_enabled("cuda")
        ):
            x = x.float()  # CUDA autocast runs sum / softmax / log_softmax in fp32: so do these kernels
        if func in _MEANS or func in _SUMS:
            _, dim, keepdim, dtype = _bound(func, args, kwargs, ("input", "dim", "keepdim", "dtype"))
            dim = _one_dim(x, dim)
            if dtype is not None or dim is None:
                return None
            return invariant_kernels.RowSum.apply(x, dim, bool(keepdim), func in _MEANS)
        names = (
            ("input", "dim", "_stacklevel", "dtype")
            if func in (F.softmax, F.log_softmax)
            else ("input", "dim", "dtype")
        )
        bound = dict(zip(names, _bound(func, args, kwargs, names)))
        if _one_dim(x, bound["dim"]) != x.dim() - 1:
            return None
        if bound["dtype"] is not None:
            x = x.to(bound["dtype"])
        return invariant_kernels.Softmax.apply(x, _SOFTMAXES[func])


@contextlib.contextmanager
def batch_invariant(enabled: bool = True, kernels: str | None = None):
    """Run the block with batch-invariant numerics in this thread (see module docstring).
    ``kernels``: None picks the set by each tensor's device ("cpu" on CPU, "triton" on CUDA);
    "triton" forces the Triton set (on CPU under ``TRITON_INTERPRET=1``, as the tests run it).
    ``enabled=False`` is a no-op, so callers can write ``with batch_invariant(cfg_flag):``. Blocks
    may nest; the innermost ``kernels`` applies."""
    if not enabled:
        yield
        return
    check_kernels(kernels)
    outer = (getattr(_state, "depth", 0), getattr(_state, "kernels", None))
    _state.depth, _state.kernels = outer[0] + 1, kernels
    try:
        with _InvariantOps():
            yield
    finally:
        _state.depth, _state.kernels = outer
