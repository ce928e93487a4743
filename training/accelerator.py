"""One way to build the Accelerator for a recipe run, and to say what actually trains the model.

Why one: the SFT and GRPO recipes each had their own copy, and they drifted (only one refused
``ACCELERATE_USE_CPU`` next to DeepSpeed, which silently turns DeepSpeed into DDP).
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

import torch

from nopad.packing.distributed import zero_stage
from nopad.training.accumulation import check_engine_engaged, set_deepspeed_clipping

logger = logging.getLogger(__name__)


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes")


def make_accelerator(
    deepspeed_config: str | None = None,
    *,
    grad_accum: int = 1,
    max_grad_norm: float | None = None,
    recipe: str = "nopad.recipes.sft",
    log_with: str | list[str] | None = None,
    project_dir: str | None = None,
):
    """An Accelerator for the launch at hand (DDP, DeepSpeed ZeRO-1/2/3, FSDP from ``accelerate
    launch``), or DeepSpeed from ``deepspeed_config``; gloo on a CPU, with ``DS_ACCELERATOR=cpu``
    for DeepSpeed. Asking for DeepSpeed and getting something else is an error, never a silent
    fallback to DDP. DeepSpeed clips inside its own step, so its ``"auto"`` gradient_clipping is
    set to ``max_grad_norm`` (else it would clip at 1.0). ``log_with`` names Accelerate trackers
    ("tensorboard", "wandb", "all", ...), writing under ``project_dir``."""
    from accelerate import Accelerator
    from accelerate.utils import DeepSpeedPlugin, DistributedType, InitProcessGroupKwargs

    cpu = not torch.cuda.is_available()
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    use_deepspeed = bool(deepspeed_config) or _env_flag("ACCELERATE_USE_DEEPSPEED")
    if deepspeed_config and not Path(deepspeed_config).is_file():
        raise FileNotFoundError(f"accelerate.deepspeed_config={deepspeed_config!r} does not exist")
    if use_deepspeed and _env_flag("ACCELERATE_USE_CPU"):
        raise ValueError(
            "DeepSpeed was asked for (accelerate.deepspeed_config or an Accelerate DeepSpeed config), but "
            "ACCELERATE_USE_CPU=1 makes Accelerate drop DeepSpeed and run plain DDP. On a CPU, unset it and "
            f"launch: accelerate launch --config_file recipes/configs/accelerate_deepspeed.yaml -m {recipe}"
        )
    if use_deepspeed and cpu:
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    kwargs = {}
    if deepspeed_config:
        kwargs["deepspeed_plugin"] = DeepSpeedPlugin(
            hf_ds_config=str(deepspeed_config), gradient_accumulation_steps=grad_accum
        )
    accelerator = Accelerator(
        cpu=cpu and not use_deepspeed,  # cpu=True would silently drop DeepSpeed
        gradient_accumulation_steps=grad_accum,
        kwargs_handlers=[InitProcessGroupKwargs(backend="gloo")] if cpu and distributed else [],
        log_with=log_with,
        project_dir=project_dir,
        **kwargs,
    )
    if use_deepspeed and accelerator.distributed_type != DistributedType.DEEPSPEED:
        raise RuntimeError(
            f"DeepSpeed was asked for but Accelerate runs {accelerator.distributed_type}; "
            "check the launcher's environment (ACCELERATE_USE_CPU, the config file)"
        )
    check_engine_engaged(accelerator)
    set_deepspeed_clipping(accelerator, max_grad_norm)
    return accelerator


def engine_info(model, accelerator) -> dict:
    """What actually trains the model, for the log and the result file (DeepSpeed engaged or not)."""
    stage = zero_stage(model)
    return {
        "distributed_type": str(accelerator.distributed_type),
        "deepspeed_engine": stage is not None,
        "zero_stage": stage,
    }
