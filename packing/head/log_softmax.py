"""The log-softmax of a token's logits, its value at the chosen token, the entropy, and their
gradient with respect to the logits: written once, for the chunked LM head's every path
(:mod:`nopad.packing.head.chunked`, :mod:`nopad.packing.head.linear`) and the generator's sampler, so the trainer
and the generator compute a log-prob with the same kernels (under :func:`nopad.packing.batch_invariant`,
the same bits)."""

from __future__ import annotations

import torch


def tempered_log_softmax(
    logits: torch.Tensor,
    temperature: float = 1.0,
    *,
    out: torch.Tensor | None = None,
    tempered_out: torch.Tensor | None = None,
    overwrite: bool = False,
) -> torch.Tensor:
    """``log_softmax(logits.float() / temperature)`` over the vocabulary: the one expression of a
    token's log-prob in nopad, for the trainer's chunks and the generator's sampler alike (so under
    :func:`nopad.packing.batch_invariant` their bits agree). ``out`` / ``tempered_out``: buffers to reuse
    for the result and the divided logits (the sampler's). ``overwrite``: ``logits`` are the
    caller's to lose; the result is written over them (fp32) or over their fp32 copy, so the chunked
    head holds one ``(rows, V)`` buffer, not two (the same kernel in place: each row is read before
    it is written, as the sampler's ``out=x`` already relies on)."""
    z = logits.float()
    if overwrite:
        out = tempered_out = z
    if temperature != 1.0:
        z = torch.div(z, float(temperature), out=tempered_out)
    if out is None:
        return torch.log_softmax(z, dim=-1)
    return torch._log_softmax(z, -1, False, out=out)  # the same kernel as log_softmax, into ``out``


def picked_and_entropy(
    logp: torch.Tensor, targets: torch.Tensor, want_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``logp`` ``(rows, V)`` at ``targets``, and each row's entropy (an empty tensor when not wanted)."""
    picked = logp.gather(1, targets[:, None]).squeeze(1)
    ent = -(logp.exp() * logp).sum(-1) if want_entropy else logp.new_empty(0)
    return picked, ent


def logits_grad(
    logp: torch.Tensor,
    targets: torch.Tensor,
    ent: torch.Tensor | None,
    g_picked: torch.Tensor | None,
    g_ent: torch.Tensor | None,
    temperature: float,
    *,
    reuse: bool = False,
) -> torch.Tensor:
    """The fp32 gradient, with respect to the logits, of ``logp`` (the tempered log-softmax)
    gathered at ``targets`` and of the entropy ``ent`` (None: not asked), given theirs. ``reuse``:
    ``logp`` is the caller's to overwrite (one ``(rows, V)`` buffer fewer)."""
    with_entropy = ent is not None and g_ent is not None
    grad = logp.exp_() if reuse and not with_entropy else torch.exp(logp)  # p
    g_picked = torch.zeros_like(grad[:, 0]) if g_picked is None else g_picked
    if with_entropy:
        # d(-sum p log p)/dz = -p (log p + H);  d(log p_t)/dz = onehot_t - p
        coef = (logp.add_(ent[:, None]) if reuse else logp + ent[:, None]).mul_(g_ent[:, None])
        grad.mul_(coef.add_(g_picked[:, None])).neg_()
    else:
        grad.mul_(-g_picked[:, None])
    grad[torch.arange(grad.shape[0], device=grad.device), targets] += g_picked
    if temperature != 1.0:
        grad.div_(temperature)
    return grad
