"""Whether the batch-invariant mode (:mod:`nopad.packing.invariance`) can make log-probs bitwise
equal for a model on a device: a question about the whole stack (the mode's kernel sets and the
attention backends declared invariant), so it sits above both, and the mode's own module never
imports the attention registry that reads the mode."""

from __future__ import annotations

import os

import torch

from nopad.packing.attention.registry import BACKEND_ENV, invariant_names
from nopad.packing.invariance import check_kernels


def supported(device: torch.device | str, kernels: str | None = None) -> tuple[bool, str]:
    """Whether this mode makes the generator's and the training forward's log-probs bitwise equal
    for a model on ``device`` (with the kernel set ``kernels``, None: chosen by device), and why
    not: it needs an attention backend declared ``invariant`` (none other forced through
    ``NOPAD_ATTN_BACKEND``), and on CUDA (or with ``kernels="triton"``) the Triton kernels."""
    device = torch.device(device)
    forced = os.environ.get(BACKEND_ENV) or "auto"
    kernels = check_kernels(kernels) or ("cpu" if device.type == "cpu" else "triton")
    if device.type not in ("cpu", "cuda"):
        return False, f"the model runs on {device.type}; the batch-invariant kernels run on CPU and CUDA"
    if kernels == "cpu" and device.type != "cpu":
        return False, "kernels='cpu' is nopad's CPU kernel set; the model runs on " + device.type
    if kernels == "triton":
        from nopad.packing import invariant_kernels

        ok, why = invariant_kernels.available()
        if not ok:
            return False, f"the batch-invariant CUDA kernels are Triton kernels and {why}"
    allowed = ("auto", *invariant_names("cpu" if kernels == "cpu" else "cuda"))
    if forced not in allowed:
        return False, f"{BACKEND_ENV}={forced} forces an attention backend without the batch-invariant path"
    return True, ""
