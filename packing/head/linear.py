"""The chunked LM head for a plain ``nn.Linear`` head module (tied or not, with or without a bias,
with any of :class:`nopad.packing.head.model_head.LMHead`'s final-logit ops), with its gradients taken chunk by
chunk by hand instead of by autograd over checkpointed chunks.

Why (``benchmarks/bench_lm_head.py``): autograd's way makes and sums one ``V x H`` weight gradient
per chunk, and recomputes every chunk's logits in backward, a fourth ``T x H x V`` GEMM beside the
three of the full-logits path. Here the weight's (and bias's) gradient goes into one fp32 buffer
with ``addmm_``; and for a scalar loss (:class:`LinearHeadNLL`, the SFT loss), whose gradient is
known up to one scale in the forward pass, each chunk's gradients are taken in the forward while
its logits exist: three GEMMs, no recompute. Log-probs (:class:`LinearHeadChunks`, per-token
gradients only known in backward) still recompute, with the one buffer. A bf16 head on a CPU
without bf16 GEMMs takes both gradient GEMMs in fp32 (:func:`_accumulate_fp32`: torch's fallback
bf16 GEMM is 5-30x slower); its forward, so every log-prob, stays the module's own.

The forward values are the ops of :mod:`nopad.packing.head.chunked`'s chunks, in the same order (the module's
``forward``, the final-logit ops, :func:`nopad.packing.head.log_softmax.tempered_log_softmax`, under the
caller's :func:`nopad.packing.batch_invariant` mode), so they are the same bits. A LoRA adapter or any
other head module goes through autograd (:mod:`nopad.packing.head.chunked`).
"""

from __future__ import annotations

import contextlib

import torch

from nopad.packing.head.log_softmax import logits_grad, picked_and_entropy, tempered_log_softmax
from nopad.packing.invariance import batch_invariant


def _chunk(
    head,
    h: torch.Tensor,
    t: torch.Tensor,
    temperature: float,
    want_entropy: bool,
    invariant: tuple[bool, str | None],
    g_picked: torch.Tensor | None = None,
    g_ent: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """One chunk: the log-probs of ``t`` and the entropies (empty when not wanted); given their
    gradients ``g_picked`` (and ``g_ent``), also the gradient with respect to the module's output."""
    with_grad = g_picked is not None and head.final_ops  # autograd through the final-logit ops only
    with torch.no_grad(), batch_invariant(*invariant):
        out = head.module.forward(h)
        with torch.enable_grad() if with_grad else contextlib.nullcontext():
            z = head.finish(out.requires_grad_() if with_grad else out)
        # without autograd through the final ops nothing else reads z: the log-softmax overwrites
        # it, and the chunk holds one (chunk, V) buffer from here to its gradient
        logp = tempered_log_softmax(z.detach(), temperature, overwrite=not with_grad)
        if not with_grad:
            del out, z
        picked, ent = picked_and_entropy(logp, t, want_entropy)
        if g_picked is None:
            return picked, ent, None
        g_z = logits_grad(logp, t, ent if want_entropy else None, g_picked, g_ent, temperature, reuse=True)
        del logp
    if not with_grad:  # fp32: _accumulate casts it to the GEMMs' dtype
        return picked, ent, g_z
    g_z = g_z.to(out.dtype)
    with torch.enable_grad():
        return picked, ent, torch.autograd.grad(z, out, g_z)[0]


def _gradient_buffers(hidden, weight, bias, needs) -> list[torch.Tensor | None]:
    """The hidden states' gradient, and the weight's and bias's as one fp32 buffer each."""
    return [
        torch.empty_like(hidden) if needs[0] else None,
        torch.zeros(weight.shape, dtype=torch.float32, device=weight.device) if needs[1] else None,
        torch.zeros(bias.shape, dtype=torch.float32, device=bias.device) if needs[2] else None,
    ]


def _accumulate(grads: list, g_out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, rows: slice) -> None:
    grad_h, grad_w, grad_b = grads
    if not _native_gemm(h):
        _accumulate_fp32(grads, g_out, h, weight, rows)
        return
    g_out = g_out.to(h.dtype)
    if grad_h is not None:
        grad_h[rows] = g_out @ weight
    if grad_w is not None:
        if g_out.dtype == h.dtype == torch.float32:
            grad_w.addmm_(g_out.t(), h)
        else:  # addmm_ wants one dtype; the sum stays fp32
            grad_w += g_out.t() @ h
    if grad_b is not None:
        grad_b += g_out.sum(0, dtype=torch.float32)


def _native_gemm(t: torch.Tensor) -> bool:
    """Whether ``t``'s device runs GEMMs in its dtype at speed. Not bf16 / fp16 on a CPU without
    oneDNN's kernels for them (no AVX512-BF16 / AVX512-FP16 / AMX): torch's fallback GEMM runs
    them 5-10x slower than fp32, and 30x when the reduction runs over the vocabulary with the
    weight row-major, as ``g @ weight`` does (``benchmarks/bench_lm_head.py``, docs/benchmarks.md)."""
    if t.device.type != "cpu" or t.dtype == torch.float32:
        return True
    if t.dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    if t.dtype == torch.float16:
        return torch.ops.mkldnn._is_mkldnn_fp16_supported()
    return True


_VOCAB_SLICE_ELEMENTS = 1 << 22  # weight elements converted to fp32 at a time (16 MiB)


def _accumulate_fp32(grads: list, g_out: torch.Tensor, h: torch.Tensor, weight: torch.Tensor, rows: slice) -> None:
    """:func:`_accumulate` in fp32, for a reduced-precision head on a CPU without native GEMMs for
    it (:func:`_native_gemm`): ``g_out`` stays the fp32 gradient it was computed as (not rounded to
    bf16 first), and the weight goes to fp32 one vocabulary slice at a time, so no ``V x H`` copy of
    it is held; the sums are as exact as the bf16 GEMM's fp32 accumulator, or more."""
    grad_h, grad_w, grad_b = grads
    g_out, h32 = g_out.float(), h.float()
    acc_h = h32.new_zeros(h32.shape) if grad_h is not None else None
    step = max(1, _VOCAB_SLICE_ELEMENTS // weight.shape[1])
    for start in range(0, weight.shape[0], step):
        vocab = slice(start, start + step)
        if acc_h is not None:
            acc_h.addmm_(g_out[:, vocab], weight[vocab].float())
        if grad_w is not None:
            grad_w[vocab].addmm_(g_out[:, vocab].t(), h32)
    if grad_h is not None:
        grad_h[rows] = acc_h
    if grad_b is not None:
        grad_b += g_out.sum(0)


def _as_params(grads: list, weight: torch.Tensor, bias: torch.Tensor | None, scale: torch.Tensor | None = None) -> list:
    """The gradients in their parameters' dtypes, each multiplied by ``scale`` in fp32 first."""
    grad_h, grad_w, grad_b = grads
    if scale is not None:
        scale = scale.float()
        grad_h = None if grad_h is None else (grad_h.float() * scale).to(grad_h.dtype)
        grad_w = None if grad_w is None else grad_w.mul_(scale)
        grad_b = None if grad_b is None else grad_b.mul_(scale)
    return [
        grad_h,
        None if grad_w is None else grad_w.to(weight.dtype),
        None if grad_b is None else grad_b.to(bias.dtype),
    ]


def _rows(n: int, chunk_tokens: int):
    return (slice(start, start + chunk_tokens) for start in range(0, n, chunk_tokens))


class LinearHeadChunks(torch.autograd.Function):
    """``(log-probs of targets, entropies or an empty tensor)`` of ``hidden`` ``(N, H)`` under the
    head, as one autograd node. Backward, chunk by chunk: the logits recomputed (the forward's
    numerics), their gradient written over the recomputed log-softmax, the hidden states' gradient
    into one ``(N, H)`` tensor and the weight's (and bias's) into one fp32 buffer."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, head, temperature, entropy, chunk_tokens, invariant):
        ctx.save_for_backward(hidden, targets)
        ctx.args = (head, temperature, entropy, chunk_tokens, invariant)
        scores = [
            _chunk(head, hidden[rows], targets[rows], temperature, entropy, invariant)
            for rows in _rows(hidden.shape[0], chunk_tokens)
        ]
        return torch.cat([s[0] for s in scores]), torch.cat([s[1] for s in scores])

    @staticmethod
    def backward(ctx, g_logps, g_ents):
        hidden, targets = ctx.saved_tensors
        head, temperature, entropy, chunk_tokens, invariant = ctx.args
        # the weights as the module holds them now: ZeRO-3 and FSDP2 have gathered them again (the
        # chunks' result is tied to the module's output, whose pre-backward hooks ran first)
        weight, bias = head.module.weight, head.module.bias
        grads = _gradient_buffers(hidden, weight, bias, ctx.needs_input_grad)
        for rows in _rows(hidden.shape[0], chunk_tokens):
            _, _, g_out = _chunk(
                head,
                hidden[rows],
                targets[rows],
                temperature,
                entropy,
                invariant,
                g_logps[rows],
                g_ents[rows] if entropy else None,
            )
            _accumulate(grads, g_out, hidden[rows], weight, rows)
            del g_out  # not held while the next chunk computes its logits: one (chunk, V) buffer
        return (*_as_params(grads, weight, bias), None, None, None, None, None, None)


class LinearHeadNLL(torch.autograd.Function):
    """``-(weights * log-probs of targets).sum()`` of ``hidden`` ``(N, H)`` under the head
    (temperature 1), as one autograd node whose gradients are taken in the forward, chunk by chunk,
    for a unit scale; backward multiplies them by the loss's gradient. The log-probs are those of
    :class:`LinearHeadChunks` and the sum is taken over all of them at once, as the log-prob path
    takes it, so both give the same loss."""

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, weights, head, chunk_tokens, invariant):
        grads = _gradient_buffers(hidden, weight, bias, ctx.needs_input_grad)
        picked = []
        for rows in _rows(hidden.shape[0], chunk_tokens):
            lp, _, g_out = _chunk(head, hidden[rows], targets[rows], 1.0, False, invariant, -weights[rows].float())
            _accumulate(grads, g_out, hidden[rows], weight, rows)
            del g_out  # not held while the next chunk computes its logits: one (chunk, V) buffer
            picked.append(lp)
        ctx.grads, ctx.params = grads, (weight, bias)  # the fp32 buffers, scaled in backward
        return -(weights * torch.cat(picked)).sum()

    @staticmethod
    def backward(ctx, g_loss):
        if ctx.grads is None:
            raise RuntimeError(
                "nopad.packing.head.linear.LinearHeadNLL's backward ran twice (retain_graph): "
                "its gradients were taken in the forward and are spent"
            )
        grads, ctx.grads = ctx.grads, None
        return (*_as_params(grads, *ctx.params, scale=g_loss), None, None, None, None, None)
