"""One rank of the packed-SFT gradient check under DeepSpeed ZeRO-3 and FSDP2
(tests/training/test_training_sharded.py):

    torchrun --nproc_per_node 2 -m tests.support.sharded_sft_worker OUT_DIR

Each engine takes one optimizer step over this rank's whole epoch of packed rows through the
recipes' own mechanism (:func:`nopad.training.sft.sft_step` on an
:class:`nopad.training.accumulation.OptimizerStepper`: gradient sync on the last row only, the global
loss-token count, the engine's divisions undone), and writes the full gradient that step applies,
read just before it: it must equal unpacked single-process training's.

FSDP2 steps the recipes' fused AdamW (:func:`nopad.training.optimizer.make_adamw`, over the local shards of
its DTensors) twice over the epoch and writes each step's full gradient and the full weights after:
one process stepping the same AdamW with those gradients must reach the same weights.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from nopad.dataloaders.loader import packed_dataloader
from nopad.packing.hf import register_nopad_attention
from nopad.training.accelerator import make_accelerator
from nopad.training.accumulation import OptimizerStepper
from nopad.training.sft import sft_step
from tests.support.models import tiny_model
from tests.training.test_training_loss import _rows

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ADAMW_LR, ADAMW_WEIGHT_DECAY = 1e-2, 0.1


def fsdp2_train(batches) -> dict:
    """The first step's full gradient (``grads``), every step's (``step_grads``), the full weights
    after the last step and whether the AdamW was the fused one."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    from nopad.training.optimizer import make_adamw

    model = tiny_model("llama", attn_implementation="nopad")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert isinstance(model, FSDPModule)
    optimizer = make_adamw(model, ADAMW_LR, ADAMW_WEIGHT_DECAY)
    steps = []
    optimizer.register_step_pre_hook(  # every rank steps, so every rank joins full_tensor's all-gather
        lambda *_: steps.append({k: p.grad.full_tensor() for k, p in model.named_parameters()})
    )
    stepper = OptimizerStepper(model, optimizer)
    assert stepper.fsdp2
    for _ in range(2):
        sft_step(stepper, batches)
    assert stepper.optimizer_steps == 2
    weights = {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}
    return {
        "grads": steps[0],
        "step_grads": steps,
        "weights": weights,
        "fused": all(g["fused"] for g in optimizer.param_groups),
    }


def zero3_grads(batches) -> dict:
    from deepspeed.utils import safe_get_full_grad

    accelerator = make_accelerator(
        os.path.join(ROOT, "recipes/configs/deepspeed_zero3.json"), recipe="tests.support.sharded_sft_worker"
    )
    model = tiny_model("llama", attn_implementation="nopad")
    engine, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert engine.zero_optimization_stage() == 3
    grads, step = {}, engine.step

    def read_then_step(*args, **kwargs):  # Accelerate steps the engine inside the last backward
        grads.update({k: safe_get_full_grad(p).clone() for k, p in engine.module.named_parameters()})
        return step(*args, **kwargs)

    engine.step = read_then_step
    stepper = OptimizerStepper(engine, optimizer, accelerator)
    sft_step(stepper, batches)
    assert stepper.optimizer_steps == 1 and engine.global_steps == 1
    return {"grads": grads}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")  # FSDP2 first, before Accelerate and DeepSpeed set any global state
    register_nopad_attention()
    batches = list(packed_dataloader(_rows(), 64, seed=1))  # rank/world from torch.distributed
    seen = [i for b in batches for i in b["indices"].tolist()]
    for engine, train in (("fsdp2", fsdp2_train), ("zero3", zero3_grads)):
        result = {**train(batches), "seen": seen, "steps": len(batches)}
        torch.save(result, os.path.join(out_dir, f"{engine}_rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
