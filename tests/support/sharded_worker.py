"""One rank of the 2-process GRPO runs in tests/training/test_training_sharded.py
(DDP, DeepSpeed ZeRO-2/3, FSDP2; ``*_streaming``: streaming GRPO under ddp, zero3 or fsdp2):

    torchrun --nproc_per_node 2 -m tests.support.sharded_worker fsdp2,fsdp2_streaming,ddp,zero2,zero3 OUT_DIR

The modes of the comma-separated list run in turn in one launch (one start-up for all), each on a
fresh model and a fresh Accelerate state; the FSDP2 modes first, before Accelerate and DeepSpeed set
any global state.

Both ranks train the same tiny model on different prompts whose completions have very different
lengths (rank 0 stops after 1 token, rank 1 runs 12); steps alternate the gather-once and the
lockstep rollout regimes, and the last two steps give rank 1 no prompts at all. Writes the final
full weights, the optimizer steps counted, and greedy rollouts of the sharded model next to the
unsharded model's.
"""

from __future__ import annotations

import os
import sys

import torch
import torch.distributed as dist

from nopad.inference import Generator, SamplingParams
from nopad.inference.sharded import sharded_generate, sharding
from nopad.training.accelerator import make_accelerator
from nopad.training.accumulation import OptimizerStepper
from nopad.training.grpo import resolve_batch_invariant
from nopad.training.grpo_step import GRPOStepConfig, grpo_step
from tests.support.models import IdText, checksum_reward, tiny_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
# (rollout regime, does rank 1 get prompts this step)
STEPS = [("gather", True), ("lockstep", True), ("gather", False), ("lockstep", False)]
LR, MAX_GRAD_NORM = 0.5, 0.5  # SGD: the clip really shapes the update
PROMPTS = [[3 + (7 * i + 5 * j) % 120 for j in range(2 + i % 5)] for i in range(16)]


def full_weights(model, mode: str) -> dict[str, torch.Tensor]:
    if mode == "zero3":
        import deepspeed

        params = dict(model.module.named_parameters())
        with deepspeed.zero.GatheredParameters(list(params.values())):
            return {k: p.detach().clone() for k, p in params.items()}
    if mode == "fsdp2":
        return {k: p.full_tensor().detach().clone() for k, p in model.named_parameters()}
    return {k: p.detach().clone() for k, p in model.module.named_parameters()}


def shard(model) -> None:
    """FSDP2 with ``fully_shard`` used directly (each decoder layer, then the root), over gloo."""
    from torch.distributed.fsdp import FSDPModule, fully_shard

    if not dist.is_initialized():
        dist.init_process_group("gloo")
    for layer in model.model.layers:
        fully_shard(layer)
    fully_shard(model)
    assert all(isinstance(m, FSDPModule) for m in [model, *model.model.layers])


def main(modes: str, out_dir: str) -> None:
    from accelerate.state import AcceleratorState, GradientState

    torch.set_num_threads(1)
    for mode in modes.split(","):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        (run_streaming if mode.endswith("_streaming") else run)(mode, out_dir)
    dist.destroy_process_group()


def run(mode: str, out_dir: str) -> None:
    model = tiny_model("llama")
    if mode == "fsdp2":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

        shard(model)
        # the KV cache follows FSDP2's compute dtype, not the fp32 storage of the shards
        bf16 = fully_shard(tiny_model("llama"), mp_policy=MixedPrecisionPolicy(param_dtype=torch.bfloat16))
        assert Generator(bf16, num_blocks=4).live.dtype == torch.bfloat16
        accelerator, rank = None, dist.get_rank()
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        engine = policy = model
    else:
        rank = int(os.environ["RANK"])
        ds_config = None
        if mode in ("zero2", "zero3"):
            ds_config = os.path.join(ROOT, f"recipes/configs/deepspeed_{mode}.json")
        accelerator = make_accelerator(ds_config, max_grad_norm=MAX_GRAD_NORM, recipe="tests.support.sharded_worker")
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        engine, optimizer = accelerator.prepare(model, optimizer)
        policy = accelerator.unwrap_model(engine)
        expected = "DistributedDataParallel" if mode == "ddp" else "DeepSpeedEngine"
        assert type(engine).__name__ == expected, type(engine)
    assert sharding(engine) == {"ddp": None, "zero2": None, "zero3": "zero3", "fsdp2": "fsdp2"}[mode]
    if mode in ("zero2", "zero3"):
        assert engine.zero_optimization_stage() == int(mode[-1])
    if mode == "zero3":
        assert all(p.numel() == 0 for p in policy.parameters())  # really partitioned
    prompt_ids = PROMPTS
    generator = Generator(policy, block_size=16, num_blocks=64, max_num_batched_tokens=256)

    # greedy rollouts of the sharded model, both regimes, against the unsharded model's
    greedy = SamplingParams(temperature=0.0, max_tokens=4 if rank == 0 else 10)
    mine = prompt_ids[4 * rank : 4 * rank + 3]
    reference = [
        o.outputs[0].token_ids
        for o in Generator(tiny_model("llama"), num_blocks=64).generate(mine, greedy, use_tqdm=False)
    ]
    rollouts = {}
    for regime in ("gather", "lockstep"):
        outs = sharded_generate(generator, engine, mine, greedy, mode=regime)
        generator.release()
        rollouts[regime] = [o.outputs[0].token_ids for o in outs]

    # a bad prompt on one rank: every rank gets an error before any collective, none hangs
    errors = []
    for regime in ("gather", "lockstep"):
        try:
            sharded_generate(generator, engine, [[5] * 2000] if rank == 1 else mine, greedy, mode=regime)
        except (ValueError, RuntimeError) as err:
            errors.append(str(err))
        generator.release()

    # the plain generator on sharded weights, ranks of unequal lengths: refused at once, no hang
    try:
        generator.generate(mine, greedy, use_tqdm=False)
        plain_error = None
    except RuntimeError as err:
        plain_error = str(err)
    generator.release()

    stepper = OptimizerStepper(engine, optimizer, accelerator, max_grad_norm=MAX_GRAD_NORM)
    loss = GRPOStepConfig(batch_invariant=resolve_batch_invariant("auto", torch.device("cpu")))
    history = []
    for step, (regime, rank1_has_prompts) in enumerate(STEPS):
        picks = [(4 * step + 2 * rank + j) % len(PROMPTS) for j in range(2)]
        if rank == 1 and not rank1_has_prompts:
            picks = []
        params = SamplingParams(n=4, max_tokens=1 if rank == 0 else 12, seed=step)
        history.append(
            grpo_step(
                stepper,
                generator,
                [{} for _ in picks],
                [PROMPTS[i] for i in picks],
                checksum_reward,
                IdText(),
                params,
                loss,
                step=step,
                rollout_mode=regime,
            )
        )
    result = {
        "weights": full_weights(engine, mode),
        "optimizer_steps": stepper.optimizer_steps,
        "grpo_steps": len(STEPS),
        "history": history,
        "greedy": rollouts,
        "reference": reference,
        "global_steps": getattr(engine, "global_steps", None),
        "bad_prompt_errors": errors,
        "plain_generate_error": plain_error,
    }
    torch.save(result, os.path.join(out_dir, f"{mode}_rank{rank}.pt"))
    dist.barrier()


def run_streaming(mode: str, out_dir: str) -> None:
    """Streaming GRPO under DDP, ZeRO-3 or FSDP2: each rank streams its own groups, rank 1's 12 times
    longer than rank 0's; the optimizer step stays collective (ZeRO-3 / FSDP2: the weights gathered
    once a step for the rollouts), so both ranks take the same steps on one model, and neither hangs."""
    from nopad.inference.sharded import sharding
    from nopad.training.streaming import StreamingRollouts, streaming_step

    rank = int(os.environ["RANK"])
    model = tiny_model("llama")
    engine_kind = mode.removesuffix("_streaming")
    if engine_kind == "fsdp2":
        shard(model)
        accelerator, engine = None, model
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    else:
        ds_config = os.path.join(ROOT, "recipes/configs/deepspeed_zero3.json") if engine_kind == "zero3" else None
        accelerator = make_accelerator(ds_config, max_grad_norm=MAX_GRAD_NORM, recipe="tests.support.sharded_worker")
        engine, optimizer = accelerator.prepare(model, torch.optim.SGD(model.parameters(), lr=LR))
    assert sharding(engine) == {"ddp": None, "zero3": "zero3", "fsdp2": "fsdp2"}[engine_kind]
    policy = engine if accelerator is None else accelerator.unwrap_model(engine)
    generator = Generator(policy, block_size=16, num_blocks=64, max_num_seqs=8, max_num_batched_tokens=256)

    def source(i):
        return PROMPTS[(2 * i + rank) % len(PROMPTS)], SamplingParams(
            n=2, max_tokens=2 if rank == 0 else 24, seed=i, ignore_eos=True
        )

    stream = StreamingRollouts(generator, source, groups_per_step=2, max_staleness=1, total_groups=8)
    stepper = OptimizerStepper(engine, optimizer, accelerator, max_grad_norm=MAX_GRAD_NORM)
    loss = GRPOStepConfig(batch_invariant=resolve_batch_invariant("auto", torch.device("cpu")))
    history = [
        streaming_step(
            stepper, stream, lambda g: ({}, source(g)[0]), checksum_reward, IdText(), loss, step=step, temperature=1.0
        )
        for step in range(4)
    ]
    fence_error = None
    if engine_kind != "ddp":  # decoding outside the step's gather: an error on every rank, no collective
        try:
            stream.next_groups()
        except RuntimeError as err:
            fence_error = str(err)
    stream.close()
    torch.save(
        {
            "weights": full_weights(engine, engine_kind),
            "optimizer_steps": stepper.optimizer_steps,
            "history": history,
            "policy_version": generator.policy_version,
            "fence_error": fence_error,
        },
        os.path.join(out_dir, f"{mode}_rank{rank}.pt"),
    )
    dist.barrier()


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
