"""Several optimizer steps per rollout batch, with each loss: nopad's GRPO recipe vs TRL's
``GRPOTrainer``, same model, prompts, reward, loss_type and schedule, side by side in ONE run.

Model: SmolLM2-135M-Instruct (fp32, CPU; ``--quick``: a tiny random Llama with SmolLM2's tokenizer).
Task: the recipe's arithmetic task (chat prompts, ``last_number_match`` reward). One rollout batch is
``prompts`` prompts x ``G`` completions, cut into 4 mini-batches: 4 optimizer steps per rollout batch
(``steps_per_generation=4``, ``num_iterations=1``), two rollout batches; the second is timed
(``--quick``: one, timed, and one loss).

  - nopad: ``recipes.grpo.run_grpo`` with ``train.steps_per_generation=4``, batch-invariant mode on
    (the rollout's log-probs are the old policy's, exactly: no old-log-prob forward);
  - TRL: ``GRPOTrainer`` (its own generation) with the same ``loss_type`` (GSPO: ``grpo`` with
    ``importance_sampling_level="sequence"``), ``steps_per_generation=4`` and ``num_iterations=1``;
    TRL then scores the batch once more for the old log-probs.

Reported per system and loss: seconds per optimizer step (rollout included, averaged over the
timed batch's 4 steps), log-prob forward passes per optimizer step (nopad: packed rows; TRL: calls
of its scoring forward over one micro-batch), and the peak resident memory of the process (each
system runs in a fresh subprocess). Also the cost of a nopad GRPO checkpoint (policy or LoRA
adapter, optimizer, RNG, progress): seconds per save and size on disk.

    python benchmarks/bench_grpo_losses.py            # SmolLM2, 4 losses (minutes on 2 CPU cores)
    python benchmarks/bench_grpo_losses.py --quick    # tiny random Llama, dapo, one rollout batch
    python benchmarks/bench_grpo_losses.py --checkpoints-only   # SmolLM2: the checkpoint cost alone,
                                                      # full weights and LoRA, one rollout batch each
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

STEPS_PER_GENERATION = 4
TRL_LOSS = {
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
}
NOPAD_LOSS = {"cispo": ["loss.loss_type=cispo", "loss.epsilon_high=5.0"]}


def load(tiny: bool):
    import torch

    from assets.smollm2 import load_smollm2, load_smollm2_tokenizer
    from benchmarks._workloads import tiny_llama

    torch.manual_seed(0)
    if tiny:
        tok = load_smollm2_tokenizer()
        return tiny_llama(tokenizer=tok).train(), tok
    model, tok = load_smollm2(torch.float32)
    if getattr(model, "is_quantized", False):  # fresh from the GGUF: Trainer refuses it
        model, tok = load_smollm2(torch.float32)
    return model.train(), tok


# ----------------------------------------------------------------------------- nopad
def run_nopad(spec: dict) -> dict:
    from recipes import grpo as recipe
    from recipes.config import load_config
    from training import checkpoint

    model, tok = load(spec["tiny"])
    if spec.get("lora"):
        from training.lora import apply_lora

        model = apply_lora(
            model, rank=16, alpha=32.0, dropout=0.0, target_modules="all-linear", base="smollm2"
        )
    out = Path(tempfile.mkdtemp(prefix="bench_grpo_losses_"))
    overrides = [
        f"rollout.prompts_per_step={spec['prompts']}",
        f"rollout.num_generations={spec['G']}",
        f"rollout.max_tokens={spec['new_tokens']}",
        "rollout.max_prompt_tokens=128",
        "model.chat_template=true",
        f"train.steps={spec['batches']}",
        "train.lr=1e-6",
        "train.batch_invariant=true",
        f"train.steps_per_generation={STEPS_PER_GENERATION}",
        f"checkpoint.every={spec['batches']}",
        f"output_dir={out}",
        *NOPAD_LOSS.get(spec["loss"], [f"loss.loss_type={spec['loss']}"]),
    ]
    cfg = load_config(recipe.GRPORecipeConfig, overrides=overrides)
    saves = []
    write = checkpoint.save_training_checkpoint

    def timed_save(*args, **kwargs):
        start = time.perf_counter()
        write(*args, **kwargs)
        saves.append(time.perf_counter() - start)

    checkpoint.save_training_checkpoint = timed_save
    history = recipe.run_grpo(cfg, model=model, tokenizer=tok, progress=False)
    timed = history[-1]
    size = sum(f.stat().st_size for f in (out / f"step_{spec['batches']}").rglob("*") if f.is_file())
    return {
        "s_per_opt_step": (timed["rollout_s"] + timed["train_s"]) / timed["optimizer_steps"],
        "forwards_per_opt_step": timed["forwards_per_optimizer_step"],
        "mean_len": timed["completion_tokens"] / (spec["prompts"] * spec["G"]),
        "checkpoint_s": saves[-1],
        "checkpoint_mb": size / 2**20,
    }


# ----------------------------------------------------------------------------- TRL
def run_trl(spec: dict) -> dict:
    import datasets
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from recipes.tasks import arithmetic_task, last_number_match

    model, tok = load(spec["tiny"])
    examples = arithmetic_task(num_prompts=64, seed=0)
    data = datasets.Dataset.from_dict(
        {
            "prompt": [[{"role": "user", "content": e["prompt"]}] for e in examples],
            "answer": [e["answer"] for e in examples],
        }
    )

    def reward(completions, answer, **kwargs):
        return [last_number_match(c[-1]["content"], {"answer": a}) for c, a in zip(completions, answer)]

    batch = spec["prompts"] * spec["G"]
    settings = dict(
        output_dir=tempfile.mkdtemp(prefix="bench_grpo_losses_trl_"),
        per_device_train_batch_size=batch // STEPS_PER_GENERATION,
        steps_per_generation=STEPS_PER_GENERATION,
        num_iterations=1,
        gradient_accumulation_steps=1,
        num_generations=spec["G"],
        max_completion_length=spec["new_tokens"],
        max_steps=spec["batches"] * STEPS_PER_GENERATION,
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        beta=0.0,
        temperature=1.0,
        **TRL_LOSS.get(spec["loss"], {"loss_type": spec["loss"]}),
    )
    times, forwards = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            self.start = time.perf_counter()
            forwards.append(0)

        def on_step_end(self, args, state, control, **kwargs):
            times.append(time.perf_counter() - self.start)

    class Counted(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            forwards[-1] += 1
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    trainer = Counted(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**settings),
        train_dataset=data,
        processing_class=tok,
        callbacks=[Clock()],
    )
    trainer.train()
    timed = slice(-STEPS_PER_GENERATION, None)  # the last rollout batch's optimizer steps
    lengths = [
        h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h
    ]
    return {
        "s_per_opt_step": sum(times[timed]) / len(times[timed]),
        "forwards_per_opt_step": sum(forwards[timed]) / len(forwards[timed]),
        "mean_len": lengths[-1] if lengths else float("nan"),
    }


# ----------------------------------------------------------------------------- driver
def child(spec: dict) -> None:
    import torch

    torch.set_num_threads(spec["threads"])
    result = run_nopad(spec) if spec["system"] == "nopad" else run_trl(spec)
    result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    print("RESULT " + json.dumps(result), flush=True)


def measure(spec: dict, timeout: float) -> dict:
    from tests.support.launch import run_in_group

    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps(spec)]
    code, out, err = run_in_group(
        cmd, timeout, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    )
    found = [line for line in out.splitlines() if line.startswith("RESULT ")]
    if code != 0 or not found:
        raise RuntimeError(f"{spec['system']} / {spec['loss']} failed ({code}):\n{(out + err)[-3000:]}")
    return json.loads(found[-1][len("RESULT ") :])


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="tiny random Llama, one loss, one batch")
    parser.add_argument("--losses", default=None, help="comma-separated (default: dapo,grpo,gspo,cispo)")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--checkpoints-only", action="store_true",
                        help="skip the loss table: one nopad rollout batch with full weights and one with "
                             "LoRA, for the checkpoint cost")
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    losses = (args.losses or ("dapo" if args.quick else "dapo,grpo,gspo,cispo")).split(",")
    base = {
        "tiny": args.quick,
        "prompts": 2,
        "G": 4,
        "new_tokens": 8 if args.quick else 32,
        "threads": args.threads,
        "batches": 1 if args.quick or args.checkpoints_only else 2,
    }
    if args.checkpoints_only:
        losses = []
    timeout = 300 if args.quick else 1800
    print(
        f"GRPO, {STEPS_PER_GENERATION} optimizer steps per rollout batch of {base['prompts']} prompts x "
        f"{base['G']} completions (<= {base['new_tokens']} tokens); "
        f"{'tiny random Llama' if args.quick else 'SmolLM2-135M-Instruct'}, fp32, {args.threads} CPU threads"
    )
    if losses:
        print(
            f"{'loss':<7} {'system':<6} {'s/opt step':>11} {'fwd/opt step':>13} {'peak RSS MB':>12} "
            f"{'mean len':>9} {'nopad speed-up':>15}"
        )
    # a nopad run's checkpoint: its full-weight save (its own run when the loss table is skipped)
    full_weights = None if losses else measure({**base, "loss": "dapo", "system": "nopad"}, timeout)
    for loss in losses:
        rows = {
            system: measure({**base, "loss": loss, "system": system}, timeout) for system in ("nopad", "TRL")
        }
        full_weights = full_weights or rows["nopad"]
        for system, r in rows.items():
            speedup = rows["TRL"]["s_per_opt_step"] / r["s_per_opt_step"] if system == "nopad" else None
            print(
                f"{loss:<7} {system:<6} {r['s_per_opt_step']:>11.3f} {r['forwards_per_opt_step']:>13.2f} "
                f"{r['peak_rss_mb']:>12.0f} {r['mean_len']:>9.1f} "
                f"{'' if speedup is None else f'{speedup:.2f}x':>15}",
                flush=True,
            )
    print(
        "\nnopad GRPO checkpoint (step_N: policy or adapter, optimizer, RNG, progress), written atomically:"
    )
    for lora in (False, True):
        r = (
            measure({**base, "loss": "dapo", "system": "nopad", "lora": True}, timeout)
            if lora
            else full_weights
        )
        print(
            f"  {'LoRA adapter (r=16)' if lora else 'full weights':<20} {r['checkpoint_s']:6.2f} s per save, "
            f"{r['checkpoint_mb']:8.1f} MB on disk"
        )


if __name__ == "__main__":
    main()
