"""The LM head, written once for the trainer and the generator: hidden states at the positions that
need them -> the log-prob of one chosen token each (and the entropy when asked), chunked over
tokens and recomputed in backward, so a packed row never holds its ``T x V`` logits.

    logps, entropies = token_logprobs(model, row.model_kwargs(), predict_at, targets, entropy=True)

Why: with vocabularies of 150k-262k, one 8,192-token row of fp32 logits is 5-8 GB, before
``log_softmax`` and its backward copy it. Here the backbone runs once (the model's own forward,
so DDP / DeepSpeed / FSDP / peft wrappers and their hooks all see an ordinary call) with the head
given one row only, and the head then runs on :data:`CHUNK_TOKENS` positions at a time: peak
memory is O(chunk x V), not O(T x V) (``benchmarks/bench_lm_head.py`` measures it).

Exact, not fused: each chunk is the model's own head module (tied embeddings, a bias, a peft LoRA
on ``lm_head`` run as they do in the model), the model's own final-logit ops (:class:`LMHead`:
Gemma's softcap, Granite's and Cohere's scales, checked at every call against the model's logits
of one position), then ``log_softmax(logits.float() / temperature)`` gathered at the target: the
expression the generator's sampler computes, so under :func:`packing.batch_invariant` (whose
linear and log-softmax are row-local) the chunking changes no bit, and the chunks start at token
0 with a fixed size whatever the number of tokens.

Why not torch's ``F.linear_cross_entropy`` (torch 2.13): it takes a weight and a bias, not the
head module, so a LoRA adapter on ``lm_head``, a softcap or a logit scale cannot go through it; it
returns the NLL alone (no entropy); and its chunked path sizes chunks from the batch's row count
unless one is fixed. Using it for the plain case would be a second copy of the math, which is
what drifts (TRL#7063, verl#2656), so nopad has this one.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from torch.utils.checkpoint import checkpoint

from packing.invariance import active_kernels, batch_invariant, is_enabled

CHUNK_TOKENS = 128  # head rows per chunk; fixed, so chunk bounds never depend on the row's length


@dataclass(frozen=True)
class LMHead:
    """The model's output embedding module and the final-logit ops its forward applies after it,
    in the model's order: ``* multiplier`` (Cohere ``logit_scale``, Falcon-H1
    ``lm_head_multiplier``), ``/ divisor`` (Granite ``logits_scaling``), then the softcap
    (Gemma2/3/4 ``final_logit_softcapping``: ``tanh(x / cap) * cap``)."""

    module: torch.nn.Module
    softcap: float | None = None
    multiplier: float | None = None
    divisor: float | None = None

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's logits of ``hidden``, op for op as its forward computes them."""
        x = self.module(hidden)
        if self.multiplier is not None:
            x = x * self.multiplier
        if self.divisor is not None:
            x = x / self.divisor
        if self.softcap is not None:
            x = x / self.softcap
            x = torch.tanh(x)
            x = x * self.softcap
        return x


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The causal LM inside a DDP / DeepSpeed engine wrapper (peft models answer for themselves)."""
    while not hasattr(model, "get_output_embeddings") and isinstance(getattr(model, "module", None),
                                                                     torch.nn.Module):
        model = model.module
    return model


def head_of(model: torch.nn.Module) -> LMHead:
    """The :class:`LMHead` of an HF causal LM (or a wrapper of one), read from its config and
    modules in one place."""
    lm = unwrap(model)
    module = lm.get_output_embeddings() if hasattr(lm, "get_output_embeddings") else None
    if module is None:
        raise ValueError(f"{type(lm).__name__} has no output embeddings (get_output_embeddings() is None); "
                         "the LM head needs a causal LM with a head module")
    config = lm.config.get_text_config() if hasattr(lm.config, "get_text_config") else lm.config
    softcap = getattr(config, "final_logit_softcapping", None) or getattr(lm, "final_logit_softcapping", None)
    multiplier = getattr(lm, "logit_scale", None)  # Cohere: set from config.logit_scale on the model
    inner = getattr(lm, "model", None)
    if multiplier is None and inner is not None:
        multiplier = getattr(inner, "lm_head_multiplier", None)  # Falcon-H1
    divisor = getattr(config, "logits_scaling", None)  # Granite
    if not isinstance(multiplier, (int, float)):
        multiplier = None
    return LMHead(module, softcap=softcap, multiplier=multiplier, divisor=divisor)


def hidden_states(model: torch.nn.Module, model_kwargs: dict[str, Any],
                  positions: torch.Tensor) -> tuple[torch.Tensor, LMHead]:
    """``(hidden, head)``: the head's input ``(len(positions), hidden)`` at ``positions`` of one
    packed row (``model_kwargs``: the row's ``input_ids``, ``position_ids``, ``nopad_meta``), from
    one call of ``model`` whose head computes the first position only; that one row of the model's
    own logits is checked against :meth:`LMHead.logits`, so a model whose forward does something
    after its head that :func:`head_of` does not read fails here instead of training on wrong
    log-probs."""
    head = head_of(model)
    captured = []

    def one_row(module, args, kwargs):
        captured.append(args[0])
        return (args[0][..., :1, :], *args[1:]), kwargs

    handle = head.module.register_forward_pre_hook(one_row, with_kwargs=True)
    try:
        out = model(**model_kwargs, logits_to_keep=positions, use_cache=False)
    finally:
        handle.remove()
    if len(captured) != 1 or captured[0].shape[-2] != positions.numel():
        raise RuntimeError(f"{type(unwrap(model)).__name__}'s forward called its output embeddings "
                           f"{len(captured)} times (or not with logits_to_keep's positions); the LM head "
                           "needs the usual causal-LM forward: backbone, then head once")
    hidden = captured[0].reshape(-1, captured[0].shape[-1])
    if positions.numel():
        _check_head(head, hidden[:1], out.logits.reshape(-1, out.logits.shape[-1])[:1], model)
    return hidden, head


def _check_head(head: LMHead, hidden: torch.Tensor, theirs: torch.Tensor, model) -> None:
    """The same ops on the same row give the same bits; a few ulps are allowed for kernels that
    differ by call site, nothing like a missing scale or softcap."""
    with torch.no_grad():
        ours = head.logits(hidden)
        eps = torch.finfo(theirs.dtype).eps if theirs.is_floating_point() else 0.0
        ours, theirs = ours.float(), theirs.float()
        scale = float(theirs.abs().max())
        err = float((ours - theirs).abs().max())
    if not err <= 4 * eps * scale:
        raise ValueError(f"{type(unwrap(model)).__name__}'s logits differ from its head's output by up to "
                         f"{err:.3g} (logits up to {scale:.3g}) after the final-logit ops nopad reads "
                         f"({head.multiplier=}, {head.divisor=}, {head.softcap=}): its forward transforms "
                         "the logits in a way packing.lm_head does not know; add it to LMHead")


class _TargetLogprobs(torch.autograd.Function):
    """``log_softmax(z)`` gathered at ``targets`` (and the entropy of each row), saving only the
    log-softmax for backward, whose gradient is written into one ``(rows, V)`` buffer in place."""

    @staticmethod
    def forward(ctx, z, targets, want_entropy):
        logp = torch.log_softmax(z, dim=-1)
        picked = logp.gather(1, targets[:, None]).squeeze(1)
        ent = -(logp.exp() * logp).sum(-1) if want_entropy else z.new_empty(0)
        ctx.save_for_backward(logp, targets, ent)
        ctx.want_entropy = want_entropy
        return picked, ent

    @staticmethod
    def backward(ctx, g_picked, g_ent):
        logp, targets, ent = ctx.saved_tensors
        grad = torch.exp(logp)  # p
        g_picked = torch.zeros_like(ent if ctx.want_entropy else logp[:, 0]) if g_picked is None else g_picked
        if ctx.want_entropy and g_ent is not None:
            # d(-sum p log p)/dz = -p (log p + H);  d(log p_t)/dz = onehot_t - p
            coef = (logp + ent[:, None]).mul_(g_ent[:, None]).add_(g_picked[:, None])
            grad.mul_(coef).neg_()
        else:
            grad.mul_(-g_picked[:, None])
        grad[torch.arange(grad.shape[0], device=grad.device), targets] += g_picked
        return grad, None, None


def _chunk(head: LMHead, hidden: torch.Tensor, targets: torch.Tensor, temperature: float,
           want_entropy: bool, invariant: tuple[bool, str | None]) -> tuple[torch.Tensor, torch.Tensor]:
    # the recompute in backward runs the forward's numerics (batch-invariant or not), whatever mode
    # the backward is called in: the same ops, so the same tensors saved and the same logits
    with batch_invariant(*invariant):
        z = head.logits(hidden).float()
        if temperature != 1.0:
            z = z / temperature
        return _TargetLogprobs.apply(z, targets, want_entropy)


def head_logprobs(head: LMHead, hidden: torch.Tensor, targets: torch.Tensor, *, temperature: float = 1.0,
                  entropy: bool = False, chunk_tokens: int | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 ``(log-probs of targets, entropies or None)`` of ``hidden`` ``(N, H)`` under
    ``softmax(head.logits(hidden) / temperature)``, computed ``chunk_tokens`` rows at a time from
    row 0; with grad enabled each chunk's logits are recomputed in backward (activation
    checkpointing), so no ``(N, V)`` tensor is ever kept. ``chunk_tokens`` None: :data:`CHUNK_TOKENS`."""
    chunk_tokens = CHUNK_TOKENS if chunk_tokens is None else chunk_tokens
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    if targets.shape != hidden.shape[:1]:
        raise ValueError(f"{hidden.shape[0]} hidden states but targets of shape {tuple(targets.shape)}")
    targets = targets.to(hidden.device)
    if hidden.shape[0] == 0:  # still connected to the model, so backward reaches every parameter
        zero = hidden.sum() * 0.0
        empty = zero.float().expand(0)
        return empty, (empty if entropy else None)
    grad = torch.is_grad_enabled()
    invariant = (is_enabled(), active_kernels())
    parts, ents = [], []
    for start in range(0, hidden.shape[0], chunk_tokens):
        h, t = hidden[start: start + chunk_tokens], targets[start: start + chunk_tokens]
        if grad:
            lp, ent = checkpoint(_chunk, head, h, t, temperature, entropy, invariant, use_reentrant=False)
        else:
            lp, ent = _chunk(head, h, t, temperature, entropy, invariant)
        parts.append(lp)
        ents.append(ent)
    logps = torch.cat(parts)
    return logps, (torch.cat(ents) if entropy else None)


def token_logprobs(model: torch.nn.Module, model_kwargs: dict[str, Any], positions: torch.Tensor,
                   targets: torch.Tensor, *, temperature: float = 1.0, entropy: bool = False,
                   chunk_tokens: int | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The log-prob of ``targets[i]`` predicted at row position ``positions[i]`` (and the entropy
    there when asked) under ``model``, fp32, from one backbone forward and the chunked head
    (:func:`hidden_states`, :func:`head_logprobs`)."""
    hidden, head = hidden_states(model, model_kwargs, positions)
    return head_logprobs(head, hidden, targets, temperature=temperature, entropy=entropy,
                         chunk_tokens=chunk_tokens)
