"""Several optimizer steps per rollout batch, with each loss: nopad's GRPO recipe vs TRL's
``GRPOTrainer``, same model, prompts, reward, loss_type and schedule, side by side in ONE run.

Model: SmolLM2-135M-Instruct (fp32, CPU; ``--quick``: a tiny random Llama with SmolLM2's tokenizer).
One rollout batch is ``--prompts`` prompts x ``--generations`` completions (<= ``--max-tokens``
tokens; default 2 x 8 x 32: TRL's default group of 8, 4 completions per optimizer step; the earlier
default, 1 x 4 x 16, one completion per optimizer step, is ``--prompts 1 --generations 4
--max-tokens 16``; a SmolLM2 run of one loss and side takes 2-6 CPU minutes), cut into
4 mini-batches: 4 optimizer steps per rollout batch (``steps_per_generation=4``,
``num_iterations=1``), two rollout batches; the second is timed (``--quick``: 1 x 4 x 8, one batch,
timed, one loss).
Tasks (``--task``):

  - ``arithmetic``: the recipe's arithmetic task (chat prompts, ``last_number_match`` reward);
  - ``calculator_chat``: the calculator tool task (``nopad.recipes.tasks.TASKS``): "What is 17 * 23 + 4?"
    after a system turn that shows the call, episodes of up to 4 model turns with a ``calculator``
    tool called as ``<tool_call>{...}</tool_call>`` in nopad's SmolLM2 tool template
    (``nopad.inference.tools.use_tool_template``), on both sides; TRL: ``GRPOTrainer(tools=[calculator])``
    with ``max_tool_calling_iterations=3``, which also writes the tool's schema into the system turn
    (the mean prompt tokens of each side are printed). SmolLM2 without the warm start
    (``bench_tool_warmstart.py``) calls no tool: its episodes are single turns in each tool loop.

Systems:

  - nopad: ``nopad.recipes.grpo.run_grpo`` with ``train.steps_per_generation=4``, batch-invariant mode on
    (the rollout's log-probs are the old policy's, exactly: no old-log-prob forward);
  - TRL: ``GRPOTrainer`` (its own generation) with the same ``loss_type`` (GSPO: ``grpo`` with
    ``importance_sampling_level="sequence"``), ``steps_per_generation=4`` and ``num_iterations=1``;
    TRL then scores the batch once more, without gradients, for the old log-probs.
  - unfused (``--systems nopad,unfused,TRL``): nopad's recipe as it was before its AdamW was fused
    (``nopad.training.optimizer.make_adamw``): torch's default AdamW, a for-loop over the parameters on CPU.

Reported per system and loss, over the timed batch's 4 optimizer steps (rollout included): process
CPU seconds per optimizer step (one torch thread by default, so it is the work done, whatever else
runs on a shared machine) and wall seconds; log-prob forward passes per optimizer step, and those
of them without gradients (old log-probs; nopad: packed rows, TRL: calls of its scoring forward over
one micro-batch); the peak resident memory of the process (each system and loss runs in a fresh
subprocess; ``--quick``: one for all, in turn, so its peak MB accumulate); the mean completion
length and, for the tool task, tool calls per episode. The
speed-up is TRL's CPU seconds over nopad's (and the same for wall seconds). Also the cost of a
nopad GRPO checkpoint (policy or LoRA adapter, optimizer, RNG, progress): seconds per save and
size on disk (full weights from the first loss's nopad run; LoRA with ``--quick`` and
``--checkpoints-only``).

    python benchmarks/bench_grpo_losses.py                          # SmolLM2, arithmetic, 7 losses
    python benchmarks/bench_grpo_losses.py --task calculator_chat   # the calculator tool task
    python benchmarks/bench_grpo_losses.py --quick    # tiny random Llama, dapo, one rollout batch
    python benchmarks/bench_grpo_losses.py --losses grpo,dapo --systems nopad,unfused,TRL  # before/after
    python benchmarks/bench_grpo_losses.py --checkpoints-only   # SmolLM2: the checkpoint cost alone,
                                                      # full weights and LoRA, one rollout batch each
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

STEPS_PER_GENERATION = 4
LOSSES = ("grpo", "dr_grpo", "dapo", "bnpo", "gspo", "cispo", "sapo")
TASKS = ("arithmetic", "calculator_chat")
MAX_TURNS = 4  # the tool task: model turns per episode (TRL: max_tool_calling_iterations = 3)
TRL_LOSS = {
    "gspo": {"loss_type": "grpo", "importance_sampling_level": "sequence"},
    "cispo": {"loss_type": "cispo", "epsilon_high": 5.0},
}
NOPAD_LOSS = {"cispo": ["loss.loss_type=cispo", "loss.epsilon_high=5.0"]}


def load(tiny: bool, task: str):
    import torch

    from benchmarks._workloads import tiny_llama
    from nopad.assets.smollm2 import load_smollm2, load_smollm2_tokenizer
    from nopad.inference.tools import use_tool_template

    torch.manual_seed(0)
    if tiny:
        tok = load_smollm2_tokenizer()
        model = tiny_llama(tokenizer=tok)
    else:
        model, tok = load_smollm2(torch.float32)
        if getattr(model, "is_quantized", False):  # fresh from the GGUF: Trainer refuses it
            model, tok = load_smollm2(torch.float32)
    if task == "calculator_chat":
        tok = use_tool_template(tok, "smollm2")
    return model.train(), tok


class Clock:
    """CPU and wall seconds of the measured spans, one entry per span."""

    def __init__(self):
        self.cpu, self.wall = [], []

    def start(self):
        self._t = (time.process_time(), time.perf_counter())

    def stop(self):
        self.cpu.append(time.process_time() - self._t[0])
        self.wall.append(time.perf_counter() - self._t[1])


# ----------------------------------------------------------------------------- nopad
def run_nopad(spec: dict) -> dict:
    import torch

    from nopad.recipes import grpo as recipe
    from nopad.recipes.config import load_config
    from nopad.training import checkpoint, grpo_minibatch, grpo_step, optimizer

    if spec["system"] == "unfused":  # the recipe before its AdamW was fused: torch's default one
        from nopad.training.lora import trainable_parameters

        optimizer.make_adamw = lambda model, lr, weight_decay: torch.optim.AdamW(
            trainable_parameters(model), lr=lr, weight_decay=weight_decay
        )
    model, tok = load(spec["tiny"], spec["task"])
    if spec.get("lora"):
        from nopad.training.lora import apply_lora

        model = apply_lora(model, rank=16, alpha=32.0, dropout=0.0, target_modules="all-linear", base="smollm2")
    out = Path(tempfile.mkdtemp(prefix="bench_grpo_losses_")) if spec["checkpoint"] else None
    overrides = [
        f"task.name={spec['task']}",
        f"rollout.prompts_per_step={spec['prompts']}",
        f"rollout.num_generations={spec['G']}",
        f"rollout.max_tokens={spec['new_tokens']}",
        f"rollout.max_turns={MAX_TURNS}",
        "rollout.max_prompt_tokens=128",
        "model.chat_template=true",
        f"train.steps={spec['batches']}",
        "train.lr=1e-6",
        "train.batch_invariant=true",
        f"train.steps_per_generation={STEPS_PER_GENERATION}",
        *([f"checkpoint.every={spec['batches']}", f"output_dir={out}"] if out else []),
        *NOPAD_LOSS.get(spec["loss"], [f"loss.loss_type={spec['loss']}"]),
    ]
    cfg = load_config(recipe.GRPORecipeConfig, overrides=overrides)
    saves, clock, scored = [], Clock(), []
    write, step, score = checkpoint.save_training_checkpoint, grpo_step.grpo_step, grpo_step.packed_logprobs

    def timed_save(*args, **kwargs):
        start = time.perf_counter()
        write(*args, **kwargs)
        saves.append(time.perf_counter() - start)

    def timed_step(*args, **kwargs):  # one rollout batch: the rollout and its 4 optimizer steps
        scored.append([0, 0])
        clock.start()
        metrics = step(*args, **kwargs)
        clock.stop()
        return metrics

    def counted_score(*args, **kwargs):  # [forwards, forwards without gradients] per rollout batch
        scored[-1][0] += 1
        scored[-1][1] += not torch.is_grad_enabled()
        return score(*args, **kwargs)

    checkpoint.save_training_checkpoint = timed_save
    grpo_step.grpo_step, grpo_step.packed_logprobs = timed_step, counted_score
    grpo_minibatch.packed_logprobs = counted_score  # the training forwards and the reference's
    try:
        history = recipe.run_grpo(cfg, model=model, tokenizer=tok, progress=False)
    finally:  # a --quick child runs the next spec in the same process
        checkpoint.save_training_checkpoint, grpo_step.grpo_step, grpo_step.packed_logprobs = write, step, score
        grpo_minibatch.packed_logprobs = score
    timed, steps = history[-1], history[-1]["optimizer_steps"]
    result = {
        "cpu_s": clock.cpu[-1] / steps,
        "wall_s": clock.wall[-1] / steps,
        "forwards": scored[-1][0] / steps,
        "old_forwards": scored[-1][1] / steps,
        "mean_len": timed["completion_tokens"] / (spec["prompts"] * spec["G"]),
        "tool_calls": timed.get("tool_calls_per_episode", float("nan")),
    }
    if out is not None:
        size = sum(f.stat().st_size for f in (out / f"step_{spec['batches']}").rglob("*") if f.is_file())
        result.update(checkpoint_s=saves[-1], checkpoint_mb=size / 2**20)
        shutil.rmtree(out, ignore_errors=True)
    return result


# ----------------------------------------------------------------------------- TRL
def trl_dataset(task: str):
    import datasets

    from nopad.recipes.tasks import TASKS as RECIPE_TASKS

    recipe_task = RECIPE_TASKS[task]
    examples = recipe_task.examples(num_prompts=64, seed=0)
    system = [{"role": "system", "content": recipe_task.system}] if recipe_task.system else []
    return datasets.Dataset.from_dict(
        {
            "prompt": [[*system, {"role": "user", "content": e["prompt"]}] for e in examples],
            "answer": [e["answer"] for e in examples],
        }
    ), list(recipe_task.tools.values())


def run_trl(spec: dict) -> dict:
    import torch
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from nopad.recipes.tasks import last_number_match

    model, tok = load(spec["tiny"], spec["task"])
    data, tools = trl_dataset(spec["task"])

    def reward(completions, answer, **kwargs):
        return [last_number_match(c[-1]["content"], {"answer": a}) for c, a in zip(completions, answer)]

    batch = spec["prompts"] * spec["G"]
    out = tempfile.mkdtemp(prefix="bench_grpo_losses_trl_")
    settings = dict(
        output_dir=out,
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
        **({"max_tool_calling_iterations": MAX_TURNS - 1} if tools else {}),
        **TRL_LOSS.get(spec["loss"], {"loss_type": spec["loss"]}),
    )
    clock, forwards = Clock(), []

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kwargs):
            forwards.append([0, 0])
            clock.start()

        def on_step_end(self, args, state, control, **kwargs):
            clock.stop()

    class Counted(GRPOTrainer):
        def _get_per_token_logps_and_entropies(self, *args, **kwargs):
            forwards[-1][0] += 1
            forwards[-1][1] += not torch.is_grad_enabled()
            return super()._get_per_token_logps_and_entropies(*args, **kwargs)

    trainer = Counted(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**settings),
        train_dataset=data,
        processing_class=tok,
        callbacks=[Timer()],
        **({"tools": tools} if tools else {}),
    )
    trainer.train()
    shutil.rmtree(out, ignore_errors=True)
    timed = slice(-STEPS_PER_GENERATION, None)  # the last rollout batch's optimizer steps
    logged = trainer.state.log_history

    def last(key: str) -> float:
        values = [h[key] for h in logged if key in h]
        return values[-1] if values else float("nan")  # logged at the timed batch's generation

    return {
        "cpu_s": sum(clock.cpu[timed]) / STEPS_PER_GENERATION,
        "wall_s": sum(clock.wall[timed]) / STEPS_PER_GENERATION,
        "forwards": sum(f[0] for f in forwards[timed]) / STEPS_PER_GENERATION,
        "old_forwards": sum(f[1] for f in forwards[timed]) / STEPS_PER_GENERATION,
        "mean_len": last("completions/mean_length"),
        "tool_calls": last("tools/call_frequency") if tools else float("nan"),
    }


# ----------------------------------------------------------------------------- optimizer
def run_adamw(spec: dict) -> dict:
    """CPU seconds of one AdamW step over the model's parameters: the recipe's optimizer
    (``make_adamw``), torch's default implementation (the recipe's before) and TRL's
    (``optim="adamw_torch_fused"``), state already made."""
    import torch

    from nopad.training.optimizer import make_adamw

    model, _ = load(spec["tiny"], spec["task"])
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p)
    result = {}
    builders = {
        "nopad": lambda: make_adamw(model, 1e-6, 0.0),
        "default": lambda: torch.optim.AdamW(params, lr=1e-6),
        "fused": lambda: torch.optim.AdamW(params, lr=1e-6, fused=True),
    }
    for name, build in builders.items():
        optimizer = build()
        optimizer.step()  # makes the state
        start = time.process_time()
        for _ in range(3):
            optimizer.step()
        result[name] = (time.process_time() - start) / 3
    return result


# ----------------------------------------------------------------------------- driver
def prompt_tokens(task: str) -> tuple[float, float]:
    """Mean prompt length of the task's 64 prompts as each side renders them: nopad's recipe
    (``build_prompts``) and TRL (``apply_chat_template`` with the tools' schemas, as it prompts)."""
    from nopad.recipes import grpo as recipe
    from nopad.recipes.config import load_config

    _, tok = load(True, task)
    cfg = load_config(
        recipe.GRPORecipeConfig,
        overrides=[
            f"task.name={task}",
            "model.chat_template=true",
            "rollout.max_prompt_tokens=256",
            "rollout.prompts_per_step=1",
        ],
    )
    nopad = [len(ids) for ids in recipe.build_prompts(cfg, tok)[1]]
    data, tools = trl_dataset(task)
    trl = [
        len(
            tok.apply_chat_template(
                p, tools=tools or None, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        )
        for p in data["prompt"]
    ]
    return sum(nopad) / len(nopad), sum(trl) / len(trl)


def child(specs: list[dict]) -> None:
    import torch

    for spec in specs:
        torch.set_num_threads(spec["threads"])
        run = {"nopad": run_nopad, "unfused": run_nopad, "TRL": run_trl, "adamw": run_adamw}[spec["system"]]
        result = run(spec)
        result["peak_rss_mb"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
        print("RESULT " + json.dumps(result), flush=True)


MEASURED: dict[str, dict] = {}  # --quick: results of one child that ran every spec in turn


def measure(spec: dict, timeout: float, *more: dict) -> dict:
    """``spec``'s result, from a fresh child process (``more``: specs that child runs after it,
    results kept in MEASURED for their own ``measure`` call)."""
    from tests.support.launch import run_in_group

    if json.dumps(spec, sort_keys=True) in MEASURED:
        return MEASURED.pop(json.dumps(spec, sort_keys=True))
    cmd = [sys.executable, str(Path(__file__).resolve()), "--child", json.dumps([spec, *more])]
    code, out, err = run_in_group(cmd, timeout, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)})
    found = [json.loads(line[len("RESULT ") :]) for line in out.splitlines() if line.startswith("RESULT ")]
    if code != 0 or len(found) != 1 + len(more):
        raise RuntimeError(f"{spec['system']} / {spec['loss']} failed ({code}):\n{(out + err)[-3000:]}")
    MEASURED.update((json.dumps(s, sort_keys=True), r) for s, r in zip(more, found[1:]))
    return found[0]


def print_rows(loss: str, rows: dict) -> None:
    for system, r in rows.items():
        ratio = ""
        if system in ("nopad", "unfused") and "TRL" in rows:
            trl = rows["TRL"]
            ratio = f"{trl['cpu_s'] / r['cpu_s']:.2f}x / {trl['wall_s'] / r['wall_s']:.2f}x"
        print(
            f"{loss:<8} {system:<7} {r['cpu_s']:>9.2f} {r['wall_s']:>9.2f} {r['forwards']:>9.2f} "
            f"{r['old_forwards']:>9.2f} {r['peak_rss_mb']:>9.0f} {r['mean_len']:>8.1f} "
            f"{r['tool_calls']:>6.2f} {ratio:>16}",
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="tiny random Llama, one loss, one batch")
    parser.add_argument("--task", choices=TASKS, default="arithmetic")
    parser.add_argument("--losses", default=None, help=f"comma-separated (default: {','.join(LOSSES)})")
    parser.add_argument(
        "--systems", default="nopad,TRL", help="comma-separated: nopad, TRL, unfused (nopad with torch's default AdamW)"
    )
    parser.add_argument("--prompts", type=int, default=None, help="prompts per rollout batch (default 2; quick 1)")
    parser.add_argument(
        "--generations", type=int, default=None, help="completions per prompt (default 8, TRL's; quick 4)"
    )
    parser.add_argument("--max-tokens", type=int, default=None, help="per completion (default 32; quick 8)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--checkpoints-only",
        action="store_true",
        help="skip the loss table: one nopad rollout batch with full weights and one with "
        "LoRA, for the checkpoint cost",
    )
    parser.add_argument("--child", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        return child(json.loads(args.child))
    args.prompts = args.prompts or (1 if args.quick else 2)
    args.generations = args.generations or (4 if args.quick else 8)
    if args.prompts * args.generations % STEPS_PER_GENERATION:
        parser.error(f"--prompts x --generations must split into {STEPS_PER_GENERATION} mini-batches")
    losses = (args.losses or ("dapo" if args.quick else ",".join(LOSSES))).split(",")
    unknown = sorted(set(losses) - set(LOSSES))
    systems = args.systems.split(",")
    if unknown or not set(systems) <= {"nopad", "TRL", "unfused"}:
        parser.error(f"losses come from {LOSSES} and systems from nopad, TRL, unfused")
    base = {
        "tiny": args.quick,
        "task": args.task,
        "prompts": args.prompts,
        "G": args.generations,
        "new_tokens": args.max_tokens or (8 if args.quick else 32),
        "threads": args.threads,
        "batches": 1 if args.quick or args.checkpoints_only else 2,
        "checkpoint": False,
    }
    if args.checkpoints_only:
        losses = []
    timeout = 300 if args.quick else 3600
    print(
        f"GRPO on {args.task}, {STEPS_PER_GENERATION} optimizer steps per rollout batch of {base['prompts']} "
        f"prompts x {base['G']} completions (<= {base['new_tokens']} tokens); "
        f"{'tiny random Llama' if args.quick else 'SmolLM2-135M-Instruct'}, fp32, {args.threads} CPU "
        f"thread(s); load average {os.getloadavg()[0]:.1f} at the start"
    )
    print("mean prompt tokens: nopad {:.1f}, TRL {:.1f}".format(*prompt_tokens(args.task)))
    if losses:
        print(
            f"{'loss':<8} {'system':<7} {'CPU s/opt':>9} {'wall s/opt':>9} {'fwd/opt':>9} {'old fwd':>9} "
            f"{'peak MB':>9} {'mean len':>8} {'calls':>6} {'speed-up CPU/wall':>16}"
        )
    if args.quick and losses == ["dapo"] and systems == ["nopad", "TRL"]:
        # one child runs the four in turn (imports were most of a smoke run; its peak MB then
        # accumulate); each measure below takes its result
        quick = {**base, "loss": "dapo", "system": "nopad"}
        first = {**quick, "checkpoint": True}
        MEASURED[json.dumps(first, sort_keys=True)] = measure(
            first,
            timeout,
            {**quick, "system": "TRL"},
            {**quick, "system": "adamw"},
            {**quick, "lora": True, "checkpoint": True},
        )
    # a nopad run's checkpoint: its full-weight save (the first loss's run, or its own run)
    full_weights = None
    for loss in losses:
        rows = {}
        for system in systems:
            save = system == "nopad" and full_weights is None
            rows[system] = measure({**base, "loss": loss, "system": system, "checkpoint": save}, timeout)
            full_weights = rows[system] if save else full_weights
        print_rows(loss, rows)
    if losses:
        adamw = measure({**base, "loss": "dapo", "system": "adamw"}, timeout)
        print(
            f"one AdamW step over the model: nopad's recipe (make_adamw) {adamw['nopad']:.2f} CPU s, "
            f"torch's default (nopad before) {adamw['default']:.2f} CPU s, "
            f"TRL (adamw_torch_fused) {adamw['fused']:.2f} CPU s"
        )
    print(f"load average {os.getloadavg()[0]:.1f} at the end")
    if not (args.quick or args.checkpoints_only or full_weights):
        return
    print("\nnopad GRPO checkpoint (step_N: policy or adapter, optimizer, RNG, progress), written atomically:")
    full_weights = full_weights or measure({**base, "loss": "dapo", "system": "nopad", "checkpoint": True}, timeout)
    lines = [("full weights", full_weights)]
    if args.quick or args.checkpoints_only:
        lora = {**base, "loss": "dapo", "system": "nopad", "lora": True, "checkpoint": True}
        lines.append(("LoRA adapter (r=16)", measure(lora, timeout)))
    for name, r in lines:
        print(f"  {name:<20} {r['checkpoint_s']:6.2f} s per save, {r['checkpoint_mb']:8.1f} MB on disk")


if __name__ == "__main__":
    main()
