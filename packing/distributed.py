"""The process group and the training engine, asked in one place: world size and rank, sums,
maxima and "any rank?" over all ranks, which engine shards the model (DeepSpeed ZeRO-3, FSDP2),
and the dtype a forward computes in.

Why one module: the data loaders, the loss, the accumulation window and the sharded rollout each
had their own copy, and the copies differed (one summed token counts in float32, one picked the
collective's device from the caller, one from the backend). Every function here is the identity
(or the obvious single-process answer) when ``torch.distributed`` is not initialised, so code
that calls them runs unchanged in one process.
"""

from __future__ import annotations

import sys

import torch
import torch.distributed as dist


# ----------------------------------------------------------------------------- the process group
def is_distributed() -> bool:
    """True when a ``torch.distributed`` process group is up (Accelerate, torchrun, DeepSpeed)."""
    return dist.is_available() and dist.is_initialized()


def world_size(group: dist.ProcessGroup | None = None) -> int:
    """Number of ranks in ``group`` (the default group); 1 without torch.distributed."""
    return dist.get_world_size(group) if is_distributed() else 1


def rank(group: dist.ProcessGroup | None = None) -> int:
    """This process's rank in ``group`` (the default group); 0 without torch.distributed."""
    return dist.get_rank(group) if is_distributed() else 0


def collective_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """Where a small tensor for an all-reduce must live: this rank's GPU under NCCL, else the CPU."""
    if dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _all_reduce(value: float, op: dist.ReduceOp, group: dist.ProcessGroup | None) -> float:
    # float64: token counts of a large run exceed float32's exact integers (2**24)
    t = torch.tensor([float(value)], dtype=torch.float64, device=collective_device(group))
    dist.all_reduce(t, op=op, group=group)
    return float(t.item())


def global_sum(value: float, group: dist.ProcessGroup | None = None) -> float:
    """``value`` summed over all ranks (one all-reduce); the value itself in one process.
    Every rank must call it, in the same order as its other collectives."""
    if world_size(group) == 1:
        return float(value)
    return _all_reduce(value, dist.ReduceOp.SUM, group)


def global_max(value: float, group: dist.ProcessGroup | None = None) -> float:
    """The largest ``value`` over all ranks (one all-reduce); the value itself in one process."""
    if world_size(group) == 1:
        return float(value)
    return _all_reduce(value, dist.ReduceOp.MAX, group)


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True when ``flag`` is True on at least one rank (one all-reduce): lets every rank agree
    before a collective that a rank acting alone would leave the others waiting in."""
    return global_max(1.0 if flag else 0.0, group) > 0


# ----------------------------------------------------------------------------- the engine
def zero_stage(model) -> int | None:
    """The ZeRO stage of ``model`` when it is a DeepSpeed engine, else None."""
    if "deepspeed" not in sys.modules:  # no engine can exist; importing deepspeed takes seconds
        return None
    from deepspeed import DeepSpeedEngine

    return int(model.zero_optimization_stage()) if isinstance(model, DeepSpeedEngine) else None


def zero3_engine(model) -> object | None:
    """The DeepSpeed engine when ``model`` is one running ZeRO stage 3, else None."""
    return model if zero_stage(model) == 3 else None


def fsdp2_modules(model: torch.nn.Module) -> list[torch.nn.Module]:
    """Every ``fully_shard`` module inside ``model`` (empty when it is not FSDP2)."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def _first_floating_parameter(module: torch.nn.Module) -> torch.Tensor | None:
    """The first floating-point parameter of ``module.parameters()``, found without its generator
    chain (named_modules, a memo set, hashing): every attention layer of a forward asks, and the
    generic walk was a fifth of the host work of an attention call in a decode step."""
    for param in module._parameters.values():
        if param is not None and param.is_floating_point():
            return param
    for child in module._modules.values():
        found = None if child is None else _first_floating_parameter(child)
        if found is not None:
            return found
    return None


def compute_dtype(module: torch.nn.Module, like: torch.Tensor | torch.device | str | None = None) -> torch.dtype:
    """The dtype a forward of ``module`` computes in (what q, k, v and the KV cache are cast to),
    chosen as transformers does for flash-attn: the autocast dtype when autocast is on for the
    device of ``like`` (the query, or a device); else the weights' dtype - for weights FSDP2 holds
    sharded, its mixed-precision ``param_dtype`` (the shards keep their storage dtype, which must not
    size the KV cache), for a quantized layer the model's ``config.dtype``; else ``like``'s dtype.
    Cheap enough for every attention call: no walk over the modules unless the weights are sharded."""
    if like is not None:
        device_type = like.device.type if isinstance(like, torch.Tensor) else torch.device(like).type
        if torch.is_autocast_enabled(device_type):
            return torch.get_autocast_dtype(device_type)
    weight = _first_floating_parameter(module)
    if weight is not None and _is_dtensor(weight):
        for fsdp in fsdp2_modules(module):
            for group in fsdp._get_fsdp_state()._fsdp_param_groups:
                if group.mp_policy.param_dtype is not None:
                    return group.mp_policy.param_dtype
    if weight is not None and weight.dtype.itemsize > 1:
        return weight.dtype
    config_dtype = getattr(getattr(module, "config", None), "dtype", None)
    if isinstance(config_dtype, torch.dtype):
        return config_dtype
    if isinstance(like, torch.Tensor):
        return like.dtype
    return torch.get_default_dtype()


def _is_dtensor(tensor: torch.Tensor) -> bool:
    tensor_module = sys.modules.get("torch.distributed.tensor")  # no DTensor exists before it is imported
    return tensor_module is not None and isinstance(tensor, tensor_module.DTensor)
