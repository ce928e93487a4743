"""One rank of the FSDP2 test of the TRL rollout (tests/training/test_training_trl.py):

    torchrun --nproc_per_node 2 -m tests.support.trl_fsdp2_worker gather,lockstep OUT_DIR

Each mode in the comma-separated list runs in turn in the same launch (one start-up for both).
A fresh tiny Llama is ``fully_shard``-ed over 2 CPU processes (gloo); each rank calls the nopad
``rollout_func`` on its own prompts with a different ``max_completion_length`` (1 vs 12 tokens),
which deadlocks a plain loop of sharded forwards. Writes every rank's completions and their
log-probs next to the unsharded model's teacher-forced log-probs of the same tokens.
"""

from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import torch
import torch.distributed as dist


def main(modes: str, out_dir: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    for mode in modes.split(","):
        run(mode, out_dir)
    dist.destroy_process_group()


def run(mode: str, out_dir: str) -> None:
    from accelerate import Accelerator
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor
    from trl import GRPOTrainer

    from nopad.training.trl.rollout import nopad_rollout_func
    from tests.support.models import tiny_model
    from tests.training.test_training_trl import make_tokenizer

    rank = dist.get_rank()
    reference = tiny_model("llama")
    model = tiny_model("llama")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    tok = make_tokenizer()
    args = SimpleNamespace(
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        min_p=0.0,
        repetition_penalty=1.0,
        max_completion_length=1 if rank == 0 else 12,
        generation_kwargs=None,
        generation_batch_size=8,
        ds3_gather_for_generation=True,
        gradient_checkpointing_kwargs=None,
        chat_template_kwargs=None,
    )
    # a GRPOTrainer (the rollout checks TRL's class it runs in) with only what the rollout reads
    trainer = GRPOTrainer.__new__(GRPOTrainer)
    vars(trainer).update(
        args=args,
        processing_class=tok,
        accelerator=Accelerator(cpu=True),
        model=model,
        model_wrapped=model,
        eos_token_ids=[tok.eos_token_id],
        state=SimpleNamespace(global_step=0),
    )
    prompts = ["w10 w11 w12"] * 4 + [f"w{20 + rank} w3{rank}"] * 4
    out = nopad_rollout_func(sharded_rollout=mode, max_num_batched_tokens=64)(prompts, trainer)
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert isinstance(weight, DTensor) and weight.to_local().shape[0] < weight.shape[0], "not resharded"
    expected = []
    with torch.no_grad():
        for prompt, completion in zip(out["prompt_ids"], out["completion_ids"]):
            logits = reference(input_ids=torch.tensor([prompt + completion])).logits[0, len(prompt) - 1 : -1]
            expected.append(
                torch.log_softmax(logits.float(), -1)[torch.arange(len(completion)), torch.tensor(completion)].tolist()
            )
    torch.save({"out": out, "expected": expected}, os.path.join(out_dir, f"trl_{mode}_rank{rank}.pt"))


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
