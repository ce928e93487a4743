"""One rank of the packed-SFT gradient check under DeepSpeed ZeRO-3 and FSDP2
(tests/training/test_training_sharded.py):

    torchrun --nproc_per_node 2 -m tests.support.sharded_sft_worker OUT_DIR

Each engine accumulates one optimizer step over this rank's whole epoch of packed rows (gradient
sync on the last row only) with :class:`training.loss.PackedLoss`, then writes the full
gradients, which must equal unpacked single-process training's.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from dataloaders.loader import packed_dataloader
from packing.hf import register_nopad_attention
from tests.support.models import tiny_model
from tests.training.test_training_loss import _rows
from training.loss import PackedLoss

ZERO3 = {"train_micro_batch_size_per_gpu": 1, "zero_allow_untested_optimizer": True,
         "zero_optimization": {"stage": 3, "stage3_param_persistence_threshold": 0}, "steps_per_print": 10**6}


def forward_loss(model, loss_fn, batch):
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                   nopad_meta=batch["nopad_meta"], use_cache=False).logits
    return loss_fn(logits, batch)


def fsdp2_grads(batches) -> dict:
    from torch.distributed.fsdp import FSDPModule, fully_shard

    model = tiny_model("llama", attn_implementation="nopad")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert isinstance(model, FSDPModule)
    loss_fn = PackedLoss("token")  # FSDP2's reduce-scatter averages over ranks, as DDP does
    loss_fn.start_step(batches)
    for i, batch in enumerate(batches):
        model.set_requires_gradient_sync(i == len(batches) - 1)
        forward_loss(model, loss_fn, batch).backward()
    return {k: p.grad.full_tensor() for k, p in model.named_parameters()}


def zero3_grads(batches) -> dict:
    import deepspeed
    from deepspeed.utils import safe_get_full_grad

    model = tiny_model("llama", attn_implementation="nopad")
    gas = len(batches)
    engine, *_ = deepspeed.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                      config={**ZERO3, "gradient_accumulation_steps": gas})
    assert engine.zero_optimization_stage() == 3
    loss_fn = PackedLoss("token")
    loss_fn.start_step(batches)
    for i, batch in enumerate(batches):
        engine.set_gradient_accumulation_boundary(i == len(batches) - 1)
        engine.backward(forward_loss(engine, loss_fn, batch) * gas)  # DeepSpeed divides by its gas
    return {k: safe_get_full_grad(p).clone() for k, p in engine.module.named_parameters()}


def main(out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    register_nopad_attention()
    batches = list(packed_dataloader(_rows(), 64, seed=1))  # rank/world from torch.distributed
    seen = [i for b in batches for i in b["indices"].tolist()]
    for engine, grads in (("fsdp2", fsdp2_grads), ("zero3", zero3_grads)):
        result = {"grads": grads(batches), "seen": seen, "steps": len(batches)}
        torch.save(result, os.path.join(out_dir, f"{engine}_rank{dist.get_rank()}.pt"))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main(sys.argv[1])
