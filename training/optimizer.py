"""The recipes' optimizer: one AdamW over the trainable parameters, for SFT and GRPO alike.

Why fused: torch's default AdamW (a for-loop over the parameters on CPU, ``foreach`` on CUDA) cost
0.93-1.21 CPU s per step on SmolLM2-135M, against 0.24-0.25 s for the fused kernel that TRL
(transformers' ``adamw_torch_fused``) steps with: the largest fixed cost of a GRPO step
(``benchmarks/bench_grpo_losses.py``). Fused and unfused steps agree to rounding, not bitwise.

torch has the fused kernel for floating-point parameters on CPU, CUDA, XPU, MPS and more; where it
refuses the parameters (another device, an integer tensor) the optimizer is torch's default one,
and the log says why. DeepSpeed ZeRO and FSDP2 step this optimizer as a client one: ZeRO over its
flat fp32 partitions, FSDP2 over the local shards of its DTensors.

A checkpoint keeps the implementation it was written with: torch's ``load_state_dict`` restores
each parameter group's ``fused`` flag, so a run resumed from a checkpoint of the unfused optimizer
steps as it did before (its resume stays exact), and a new run is fused.
"""

from __future__ import annotations

import logging

import torch

from nopad.training.lora import trainable_parameters

logger = logging.getLogger(__name__)


def make_adamw(model, lr: float, weight_decay: float) -> torch.optim.AdamW:
    """AdamW over ``model``'s trainable parameters (a LoRA adapter's alone), fused where torch has
    the kernel for them, else torch's default implementation."""
    params = trainable_parameters(model)
    refusal = fused_refusal(params)
    if refusal is None:
        return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=True)
    logger.info("AdamW: torch's default implementation, not the fused one (%s)", refusal)
    return torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay)


def fused_refusal(params: list[torch.Tensor]) -> str | None:
    """Why torch's fused AdamW would refuse ``params``, or None. torch checks only at the first
    step, so this runs its own check (private: the one rule, not a copy that could drift) now."""
    from torch.optim.optimizer import _device_dtype_check_for_fused

    for p in params:
        try:
            _device_dtype_check_for_fused(p)
        except RuntimeError as err:
            return f"{p.device.type}/{p.dtype}: {err}"
    return None
