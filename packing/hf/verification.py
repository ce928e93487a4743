"""``packing.verify``: check that a model gives the same logits, loss and gradients on a packed
row as on each sequence alone — the test a user runs before training a new model family packed.
(The module is named ``verification`` so importing it never shadows the ``packing.verify``
function.)

    from packing import verify
    report = verify(model, [tok(t).input_ids for t in texts])
    print(report)          # worst logit diff, relative grad diff, which attention path ran
    assert report.ok()     # within fp32 rounding (see VerifyReport.ok)
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from packing.hf import attention as hf
from packing.varlen import VarlenMeta


@dataclass(frozen=True)
class VerifyReport:
    """Worst differences between the packed row and the sequences run alone."""

    max_logit_diff: float  # max |packed - alone| over every logit of every sequence
    max_grad_rel_diff: float  # max over parameters of ||dg|| / ||g_alone|| (each tensor's own norm)
    loss_diff: float  # |packed loss - alone loss| (token-mean next-token cross-entropy)
    worst_param: str  # parameter with the largest relative gradient difference
    attention_path: str  # which implementation ran the packed row, and how
    reference_path: str  # which implementation ran the sequences alone
    num_sequences: int
    num_tokens: int

    logit_scale: float = 0.0  # max |logit| of the sequences alone
    grad_rel_diff: float = 0.0  # ||dg|| / ||g_alone|| over all parameters together

    def ok(self, logit_rtol: float = 1e-5, grad_rtol: float = 1e-4, tensor_rtol: float | None = None) -> bool:
        """Within fp32 rounding? Logits within ``logit_rtol * max(1, logit_scale)``; the whole
        gradient within ``grad_rtol`` of its norm; and no parameter's gradient off by more than
        ``tensor_rtol`` (default ``100 * grad_rtol``) of its own norm.

        Why norms, and the looser per-tensor bound: a norm weight's gradient is a sum over every
        token with much cancellation, so reordered fp32 sums (sdpa vs eager on the same sequences,
        no packing at all) move its entries by about ``grad_rtol`` of its largest one, while the
        whole gradient moves far less. A packing bug (attention leaking across sequences, wrong
        positions, a wrong backward) moves the whole gradient by orders of magnitude more.
        ``tests/test_packing_verification.py`` checks both sides on SmolLM2-135M."""
        tensor_rtol = 100 * grad_rtol if tensor_rtol is None else tensor_rtol
        return (self.max_logit_diff <= logit_rtol * max(1.0, self.logit_scale)
                and self.grad_rel_diff <= grad_rtol and self.max_grad_rel_diff <= tensor_rtol)

    def __str__(self) -> str:
        return (
            f"packed ({self.attention_path}) vs alone ({self.reference_path}) on {self.num_sequences} "
            f"sequences / {self.num_tokens} tokens: max logit diff {self.max_logit_diff:.2e} "
            f"(logits up to {self.logit_scale:.1f}), "
            f"loss diff {self.loss_diff:.2e}, relative grad diff {self.grad_rel_diff:.2e} "
            f"(worst tensor {self.max_grad_rel_diff:.2e}: {self.worst_param})"
        )


@contextlib.contextmanager
def _attn_implementation(model, name: str):
    previous = model.config._attn_implementation
    if name != previous:
        model.set_attn_implementation(name)
    try:
        yield
    finally:
        if name != previous:
            model.set_attn_implementation(previous)


def _token_loss_sum(logits: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Summed next-token cross-entropy of one sequence (no prediction across its end)."""
    if ids.numel() < 2:
        return logits.sum() * 0.0
    return F.cross_entropy(logits[:-1].float(), ids[1:], reduction="sum")


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def verify(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int] | torch.Tensor],
    *,
    attn_implementation: str = hf.NOPAD_ATTENTION,
    reference_implementation: str | None = None,
) -> VerifyReport:
    """Run ``sequences`` packed into one row (with ``attn_implementation``, default nopad) and
    each alone (with ``reference_implementation``, default the model's own unless that is nopad,
    then eager), forward and backward, and report the worst differences.

    The model is put in eval mode (no dropout) for the check and restored; its ``.grad`` fields
    are left as they were.
    """
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    if not seqs or any(s.numel() == 0 for s in seqs):
        raise ValueError("verify needs at least one sequence and no empty sequences")
    device = next(model.parameters()).device
    seqs = [s.to(device) for s in seqs]
    hf.register_nopad_attention()
    current = model.config._attn_implementation
    reference = reference_implementation or (current if current != hf.NOPAD_ATTENTION else "eager")
    total_predicted = sum(s.numel() - 1 for s in seqs) or 1
    was_training = model.training
    saved = {n: p.grad for n, p in model.named_parameters()}
    model.eval()
    try:
        model.zero_grad(set_to_none=True)
        with _attn_implementation(model, reference):
            alone_logits, alone_loss = [], 0.0
            for s in seqs:
                logits = model(s[None], use_cache=False).logits[0]
                loss = _token_loss_sum(logits, s) / total_predicted
                loss.backward()
                alone_logits.append(logits.detach())
                alone_loss += float(loss.detach())
        alone_grads = _grads(model)

        model.zero_grad(set_to_none=True)
        meta = VarlenMeta.from_lengths([s.numel() for s in seqs], device=device)
        ids = torch.cat(seqs)[None]
        trace: list = []
        with _attn_implementation(model, attn_implementation):
            kwargs = dict(position_ids=meta.position_ids[None], use_cache=False)
            if attn_implementation == hf.NOPAD_ATTENTION:
                kwargs["nopad_meta"] = meta
                kwargs["nopad_trace"] = trace
            hf.check_packed_call(model, kwargs)
            logits = model(ids, **kwargs).logits[0]
        nopad_calls = len(trace)
        bounds = meta.cu_seqlens_q.tolist()
        packed_loss = sum(
            _token_loss_sum(logits[bounds[i] : bounds[i + 1]], s) for i, s in enumerate(seqs)
        ) / total_predicted
        packed_loss.backward()
        packed_grads = _grads(model)
    finally:
        for n, p in model.named_parameters():
            p.grad = saved[n]
        model.train(was_training)

    packed_logits = logits.detach()
    logit_diff = max(
        float((packed_logits[bounds[i] : bounds[i + 1]] - a).abs().max()) for i, a in enumerate(alone_logits)
    )
    worst, worst_name, diff_sq, ref_sq = 0.0, "", 0.0, 0.0
    for name, g_ref in alone_grads.items():
        g = packed_grads.get(name, torch.zeros_like(g_ref))
        scale = float(g_ref.double().norm())
        diff = float((g.double() - g_ref.double()).norm())
        diff_sq, ref_sq = diff_sq + diff**2, ref_sq + scale**2
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
        if rel >= worst:
            worst, worst_name = rel, name
    for name, g in packed_grads.items():  # a gradient the sequences alone did not produce
        if name not in alone_grads:
            diff_sq += float(g.double().norm()) ** 2
            if float(g.abs().max()) > 0:
                worst, worst_name = float("inf"), name
    total_rel = diff_sq**0.5 / ref_sq**0.5 if ref_sq > 0 else (0.0 if diff_sq == 0 else float("inf"))
    if attn_implementation == hf.NOPAD_ATTENTION:
        path = f"nopad: packing.attention.varlen_attention, {nopad_calls} attention calls"
    else:
        path = f"{attn_implementation}: transformers' packed position_ids path"
    return VerifyReport(
        max_logit_diff=logit_diff,
        max_grad_rel_diff=worst,
        grad_rel_diff=total_rel,
        loss_diff=abs(float(packed_loss.detach()) - alone_loss),
        worst_param=worst_name,
        attention_path=path,
        reference_path=reference,
        num_sequences=len(seqs),
        num_tokens=int(ids.numel()),
        logit_scale=max(float(a.abs().max()) for a in alone_logits),
    )
