"""``nopad.packing.verify``: check that a model gives the same logits, loss and gradients on a packed
row as on each sequence alone — the test a user runs before training a new model family packed.
(The module is named ``verification`` so importing it never shadows the ``nopad.packing.verify``
function.)

    from nopad.packing import verify
    report = verify(model, [tok(t).input_ids for t in texts])
    print(report)          # worst logit diff, relative grad diff, which attention path ran
    assert report.ok()     # within the compute dtype's rounding (see VerifyReport.ok)

    verify(model, [prompt + a, prompt + b, prompt + a + c], tree=True)   # one prefix-tree row

With ``tree=True`` the sequences are laid as one prefix-tree row (:mod:`nopad.packing.bins.tree`:
shared prefixes once, each segment reading its ancestors' keys), the row GRPO and per-turn SFT
train on.
"""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nopad.packing.hf import attention as hf
from nopad.packing.hf.packed_call import check_packed_call
from nopad.packing.mixers import PACKED, TREE, check_model
from nopad.packing.varlen import VarlenMeta

# A tensor's gradient is judged against its own norm, but never against less than this fraction of
# the whole gradient's: a gradient that is mathematically zero (a key bias, which softmax ignores) or
# nearly so (a tiny model's ``A_log``) is pure fp32 cancellation noise, and "off by 100% of nothing"
# is not a packing bug. A tensor wronged by packing moves by far more than this floor times
# ``tensor_rtol`` (1e-5 of the whole gradient at the defaults, 10x tighter than the whole-gradient bound).
TENSOR_FLOOR = 1e-3

# ok()'s defaults by the compute dtype: (logit_rtol, grad_rtol, tensor_rtol as a multiple of grad_rtol).
# fp32's bounds are ~100x its rounding; bf16 / fp16 gradients summed in another order (each sequence's
# backward alone vs one packed backward) move by ~1 unit of their rounding (2^-8, 2^-11): 3e-3 / 4e-4
# on the tiny test models, with logits equal. A packing bug moves the gradient by ~0.5 in either.
TOLERANCES = {
    "float32": (1e-5, 1e-4, 100.0),
    "float64": (1e-5, 1e-4, 100.0),
    "bfloat16": (2e-2, 3e-2, 10.0),
    "float16": (2.5e-3, 5e-3, 10.0),
}


@dataclass(frozen=True)
class VerifyReport:
    """Worst differences between the packed row and the sequences run alone."""

    max_logit_diff: float  # max |packed - alone| over every logit of every sequence
    max_grad_rel_diff: float  # max over parameters of ||dg|| / max(||g_alone||, TENSOR_FLOOR * whole norm)
    loss_diff: float  # |packed loss - alone loss| (token-mean next-token cross-entropy)
    worst_param: str  # parameter with the largest relative gradient difference
    attention_path: str  # which implementation ran the packed row, and how
    reference_path: str  # which implementation ran the sequences alone
    num_sequences: int
    num_tokens: int

    logit_scale: float = 0.0  # max |logit| of the sequences alone
    grad_rel_diff: float = 0.0  # ||dg|| / ||g_alone|| over all parameters together
    dtype: str = "float32"  # the compute dtype (autocast's, else the weights'): it picks ok()'s defaults

    def tolerances(
        self, logit_rtol: float | None = None, grad_rtol: float | None = None, tensor_rtol: float | None = None
    ) -> tuple[float, float, float]:
        """The ``(logit_rtol, grad_rtol, tensor_rtol)`` :meth:`ok` uses: those given, the rest the
        compute dtype's (:data:`TOLERANCES`; a dtype not listed gets fp32's)."""
        logit, grad, factor = TOLERANCES.get(self.dtype, TOLERANCES["float32"])
        grad = grad if grad_rtol is None else grad_rtol
        return (
            logit if logit_rtol is None else logit_rtol,
            grad,
            factor * grad if tensor_rtol is None else tensor_rtol,
        )

    def ok(
        self, logit_rtol: float | None = None, grad_rtol: float | None = None, tensor_rtol: float | None = None
    ) -> bool:
        """Within the compute dtype's rounding? Logits within ``logit_rtol * max(1, logit_scale)``;
        the whole gradient within ``grad_rtol`` of its norm; and no parameter's gradient off by more
        than ``tensor_rtol`` of its own norm, floored at ``TENSOR_FLOOR`` of the whole gradient's (a
        true gradient of about 0 is judged against that, not its noise). Defaults by dtype
        (:meth:`tolerances`): fp32 ``1e-5``, ``1e-4``, ``100 * grad_rtol``; bf16 ``2e-2``, ``3e-2``,
        ``10 * grad_rtol``; fp16 ``2.5e-3``, ``5e-3``, ``10 * grad_rtol``. ``str(report)`` prints them.

        Why norms, and the looser per-tensor bound: a norm weight's gradient is a sum over every
        token with much cancellation, so reordered fp32 sums (sdpa vs eager on the same sequences,
        no packing at all) move its entries by about ``grad_rtol`` of its largest one, while the
        whole gradient moves far less. A packing bug (attention leaking across sequences, wrong
        positions, a wrong backward) moves the whole gradient by orders of magnitude more.
        ``tests/packing/test_packing_verification.py`` checks both sides on SmolLM2-135M."""
        logit_rtol, grad_rtol, tensor_rtol = self.tolerances(logit_rtol, grad_rtol, tensor_rtol)
        return (
            self.max_logit_diff <= logit_rtol * max(1.0, self.logit_scale)
            and self.grad_rel_diff <= grad_rtol
            and self.max_grad_rel_diff <= tensor_rtol
        )

    def __str__(self) -> str:
        return (
            f"packed ({self.attention_path}) vs alone ({self.reference_path}) on {self.num_sequences} "
            f"sequences / {self.num_tokens} tokens: max logit diff {self.max_logit_diff:.2e} "
            f"(logits up to {self.logit_scale:.1f}), "
            f"loss diff {self.loss_diff:.2e}, relative grad diff {self.grad_rel_diff:.2e} "
            f"(worst tensor {self.max_grad_rel_diff:.2e}: {self.worst_param}); ok() = {self.ok()} at "
            "{} tolerances: logit_rtol {:.1e}, grad_rtol {:.1e}, tensor_rtol {:.1e}".format(
                self.dtype, *self.tolerances()
            )
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


def _flat_forward(model, seqs, attn_implementation: str, trace: list):
    """Logits of the sequences packed flat, their summed token loss, and each one's rows."""
    device = seqs[0].device
    meta = VarlenMeta.from_lengths([s.numel() for s in seqs], device=device)
    kwargs = dict(position_ids=meta.position_ids[None], use_cache=False)
    if attn_implementation == hf.NOPAD_ATTENTION:
        kwargs["nopad_meta"] = meta
        kwargs["nopad_trace"] = trace
    check_packed_call(model, kwargs)
    logits = model(torch.cat(seqs)[None], **kwargs).logits[0]
    bounds = meta.cu_seqlens_q.tolist()
    loss = sum(_token_loss_sum(logits[bounds[i] : bounds[i + 1]], s) for i, s in enumerate(seqs))
    rows = [torch.arange(bounds[i], bounds[i + 1], device=device) for i in range(len(seqs))]
    return logits, loss, rows


def _tree_forward(model, seqs, trace: list):
    """Logits of the sequences as one prefix-tree row, the summed loss of every (sequence, token)
    pair, and the rows that predict each sequence's tokens 1, 2, ... (its positions but the last)."""
    from nopad.packing.bins.tree import TreePath, pack_tree_rows

    paths = [TreePath(s.tolist(), [False] + [True] * (s.numel() - 1)) for s in seqs]
    (row,) = pack_tree_rows(paths, capacity=sum(s.numel() for s in seqs))
    row = row.to(seqs[0].device)
    kwargs = dict(row.model_kwargs(), use_cache=False, nopad_trace=trace)
    check_packed_call(model, kwargs)
    logits = model(**kwargs).logits[0]
    predict_at, targets = row.loss_tokens()
    loss = row.per_pair(F.cross_entropy(logits[predict_at].float(), targets, reduction="none")).sum()
    rows = [predict_at[:0]] * len(seqs)
    pair_rows = row.per_pair(predict_at)
    for k, i in enumerate(row.indices.tolist()):
        rows[i] = pair_rows[row.pair_seqs == k]
    return logits, loss, rows


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


def _compare_grads(alone: dict[str, torch.Tensor], packed: dict[str, torch.Tensor]) -> tuple[float, str, float]:
    """(worst tensor's relative difference, its name, the whole gradient's relative difference)."""
    worst, worst_name, diff_sq, ref_sq = 0.0, "", 0.0, 0.0
    diffs = {
        name: float((packed.get(name, torch.zeros_like(g_ref)).double() - g_ref.double()).norm())
        for name, g_ref in alone.items()
    }
    norms = {name: float(g_ref.double().norm()) for name, g_ref in alone.items()}
    floor = TENSOR_FLOOR * sum(n**2 for n in norms.values()) ** 0.5
    for name, diff in diffs.items():
        diff_sq, ref_sq = diff_sq + diff**2, ref_sq + norms[name] ** 2
        scale = max(norms[name], floor)
        rel = diff / scale if scale > 0 else (0.0 if diff == 0 else float("inf"))
        if rel >= worst:
            worst, worst_name = rel, name
    for name, g in packed.items():  # a gradient the sequences alone did not produce
        if name not in alone:
            diff_sq += float(g.double().norm()) ** 2
            if float(g.abs().max()) > 0:
                worst, worst_name = float("inf"), name
    total_rel = diff_sq**0.5 / ref_sq**0.5 if ref_sq > 0 else (0.0 if diff_sq == 0 else float("inf"))
    return worst, worst_name, total_rel


def _sequences(model, sequences, tree: bool, attn_implementation: str) -> list[torch.Tensor]:
    """The sequences as token-id tensors on the model's device, checked: a token id outside the
    vocabulary failed deep in the embedding with an IndexError that named no sequence."""
    seqs = [torch.as_tensor(s, dtype=torch.long).reshape(-1) for s in sequences]
    if not seqs or any(s.numel() == 0 for s in seqs):
        raise ValueError("verify needs at least one sequence and no empty sequences")
    vocab = model.get_input_embeddings().num_embeddings
    for i, s in enumerate(seqs):
        bad = ((s < 0) | (s >= vocab)).nonzero()
        if bad.numel():
            j = int(bad[0, 0])
            raise ValueError(
                f"verify: sequence {i} has token id {int(s[j])} at position {j}, outside the "
                f"model's vocabulary [0, {vocab}) (its input embedding's rows); pass token ids "
                "from this model's own tokenizer"
            )
    if tree and attn_implementation != hf.NOPAD_ATTENTION:
        raise ValueError(
            f"tree=True needs attn_implementation={hf.NOPAD_ATTENTION!r}: a tree row's segments "
            f"read their ancestors' keys through nopad_meta.key_index, which "
            f"{attn_implementation!r} does not take"
        )
    device = next(model.parameters()).device
    return [s.to(device) for s in seqs]


def _alone(model, seqs, reference: str, total_predicted: int) -> tuple[list[torch.Tensor], float, dict]:
    """The reference side of :func:`verify`: each sequence in a row of its own with the
    ``reference`` attention, forward and backward (from zeroed grads, the loss over the packed
    run's denominator). Returns its logits, the summed loss and the parameters' grads."""
    model.zero_grad(set_to_none=True)
    with _attn_implementation(model, reference):
        alone_logits, alone_loss = [], 0.0
        for s in seqs:
            logits = model(s[None], use_cache=False).logits[0]
            loss = _token_loss_sum(logits, s) / total_predicted
            loss.backward()
            alone_logits.append(logits.detach())
            alone_loss += float(loss.detach())
    return alone_logits, alone_loss, _grads(model)


def _compute_dtype(model, device: torch.device) -> torch.dtype:
    """The dtype the check computes in: autocast's when it is on, else the weights' (the first
    floating-point parameter's, the embedding's in an HF model)."""
    if torch.is_autocast_enabled(device.type):
        return torch.get_autocast_dtype(device.type)
    return next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)


def verify(
    model: torch.nn.Module,
    sequences: Sequence[Sequence[int] | torch.Tensor],
    *,
    attn_implementation: str = hf.NOPAD_ATTENTION,
    reference_implementation: str | None = None,
    tree: bool = False,
) -> VerifyReport:
    """Run ``sequences`` packed into one row (with ``attn_implementation``, default nopad) and
    each alone (with ``reference_implementation``, default the model's own unless that is nopad,
    then eager), forward and backward, and report the worst differences.

    ``tree``: one prefix-tree row, every token the sequences share laid once (nopad attention
    only). Its loss counts a shared token once per sequence, as the sequences alone do; the logits
    compared are those of every position that predicts a token (a sequence's last position
    predicts nothing, and several sequences may end on one position).

    The model is put in eval mode (no dropout) for the check and restored; its ``.grad`` fields
    are left as they were. A model with a layer that mixes tokens in a way nopad does not handle
    (a recurrent state, a convolution over time, sinks: :mod:`nopad.packing.mixers`) is refused before
    anything runs, naming the layer.
    """
    seqs = _sequences(model, sequences, tree, attn_implementation)
    check_model(model, TREE if tree else PACKED)  # a layer nopad cannot keep sequences apart in
    hf.register_nopad_attention()
    current = model.config._attn_implementation
    reference = reference_implementation or (current if current != hf.NOPAD_ATTENTION else "eager")
    total_predicted = sum(s.numel() - 1 for s in seqs) or 1
    was_training = model.training
    saved = {n: p.grad for n, p in model.named_parameters()}
    model.eval()
    try:
        alone_logits, alone_loss, alone_grads = _alone(model, seqs, reference, total_predicted)

        model.zero_grad(set_to_none=True)
        trace: list = []
        with _attn_implementation(model, attn_implementation):
            if tree:
                logits, packed_loss, rows_of = _tree_forward(model, seqs, trace)
            else:
                logits, packed_loss, rows_of = _flat_forward(model, seqs, attn_implementation, trace)
        nopad_calls = len(trace)
        (packed_loss / total_predicted).backward()
        packed_grads = _grads(model)
    finally:
        for n, p in model.named_parameters():
            p.grad = saved[n]
        model.train(was_training)

    packed_logits = logits.detach()
    logit_diff = max(
        (
            float((packed_logits[rows] - a[: rows.numel()]).abs().max())
            for rows, a in zip(rows_of, alone_logits)
            if rows.numel()
        ),
        default=0.0,
    )
    worst, worst_name, total_rel = _compare_grads(alone_grads, packed_grads)
    if attn_implementation == hf.NOPAD_ATTENTION:
        path = f"nopad: nopad.packing.attention.varlen_attention, {nopad_calls} attention calls"
        path += ", one prefix-tree row" if tree else ""
    else:
        path = f"{attn_implementation}: transformers' packed position_ids path"
    return VerifyReport(
        max_logit_diff=logit_diff,
        max_grad_rel_diff=worst,
        grad_rel_diff=total_rel,
        loss_diff=abs(float(packed_loss.detach()) / total_predicted - alone_loss),
        worst_param=worst_name,
        attention_path=path,
        reference_path=reference,
        num_sequences=len(seqs),
        num_tokens=int(logits.shape[0]),
        logit_scale=max(float(a.abs().max()) for a in alone_logits),
        dtype=str(_compute_dtype(model, seqs[0].device)).removeprefix("torch."),
    )
