"""GRPO on the live policy: generate with the in-flight generator on the very parameters the
optimizer updates (no copy, no weight sync), score, pack prompt+completion sequences into varlen
rows, recompute the log-probs with the training forward and take one optimizer step: each step is
:func:`nopad.training.grpo_step.grpo_step`, the code the tests and the sharded runs call too.

    python -m nopad.recipes.grpo [recipes/configs/grpo.yaml] output_dir=runs/grpo [key=value ...]
    accelerate launch --config_file recipes/configs/accelerate_zero3.yaml -m nopad.recipes.grpo [...]

Under ZeRO-3 / FSDP2 the rollout gathers the full weights once or keeps the ranks in lockstep
(``generator.sharded_rollout``, :mod:`nopad.inference.sharded`), and every rank trains on the same number
of packed rows with exactly one optimizer step per GRPO step (:mod:`nopad.training.accumulation`).

Both sides score the policy the rollouts were sampled from, ``softmax(logits / rollout.temperature)``
(``rollout.logprobs=tempered``, TRL's; ``raw``: temperature 1, docs/rl.md). Generator and trainer
run the same attention core, so in the batch-invariant mode the generator's sampled-token
log-probs equal the training forward's bitwise (the gap is reported every step), and
several optimizer steps per rollout batch (``train.num_iterations``, ``train.steps_per_generation``)
take the rollout's log-probs as the old policy's with no extra forward. When they are not equal
(the mode off), ``train.old_logprobs=recompute`` scores the batch once with the trainer, and
``loss.is_correction`` re-weights each token or sequence (TRL's four modes). The loss is
``loss.loss_type`` (TRL's names: :mod:`nopad.training.policy_loss`).

With ``model.lora`` set only a LoRA adapter trains (peft), the generator runs the adapted model as
it is, and ``output_dir`` receives the adapter alone; ``model.path`` may itself be an adapter.

``checkpoint.every=N`` writes ``output_dir/step_N`` atomically every N GRPO steps (through SFT's
:func:`nopad.training.checkpoint.save_training_checkpoint`: policy or adapter, optimizer, RNG and
:class:`nopad.recipes.grpo_checkpoint.GRPOProgress`), and ``checkpoint.resume_from=latest`` continues
exactly (docs/rl.md).
"""

from __future__ import annotations

import copy
import json
import logging
from pathlib import Path
from typing import TYPE_CHECKING

from nopad.inference.chat import encode_prompt
from nopad.recipes.cli import run_recipe
from nopad.recipes.config import ConfigError, parse_cli, setup_logging
from nopad.recipes.env_tasks import resolve_reward
from nopad.recipes.grpo_checkpoint import (
    Checkpointer,
    GRPOProgress,
    reference_identity,
    resume_settings,
)
from nopad.recipes.grpo_config import GRPORecipeConfig
from nopad.recipes.grpo_rollouts import (
    StepRollouts,
    environment_tools,
    make_generator,
    tool_episodes,
)
from nopad.recipes.models import load_model
from nopad.recipes.reward_calls import with_timeout
from nopad.recipes.tasks import (
    TASKS,
    check_prompts_per_step,
    example_fields,
    load_examples,
    tool_task,
)
from nopad.recipes.tool_tasks import chat_tool_prompt

if TYPE_CHECKING:  # torch and training/ are imported where they run, so --help answers without them
    from nopad.training.grpo_step import GRPOStepConfig

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo.yaml"  # these defaults, with comments
CURVES = ("reward_mean", "loss", "logprob_gap_max")  # plotted to curves.png and sent to the trackers
# streaming adds: staleness per trained token, tokens dropped, generator occupancy, the trainer's wait
STREAMING_CURVES = ("staleness_mean", "dropped_tokens", "decode_rows_mean", "rollout_s")


# ----------------------------------------------------------------------------- config -> objects
def grpo_loss(cfg: GRPORecipeConfig, device) -> GRPOStepConfig:
    """The step's loss settings from ``loss`` and ``train``, with ``batch_invariant`` resolved for
    ``device``."""
    from nopad.training.grpo import resolve_batch_invariant
    from nopad.training.grpo_step import GRPOStepConfig

    tr, lc = cfg.train, cfg.loss
    invariant = resolve_batch_invariant(tr.batch_invariant, device, "train.batch_invariant")
    return GRPOStepConfig(
        max_tokens_per_batch=tr.max_tokens_per_batch,
        shared_prefix=tr.shared_prefix,
        policy=lc.policy(cfg.rollout.max_tokens),
        scale_rewards=lc.scale_rewards,
        mask_truncated_completions=lc.mask_truncated_completions,
        num_iterations=tr.num_iterations,
        steps_per_generation=tr.steps_per_generation,
        old_logprobs=tr.old_logprobs,
        logprobs=cfg.rollout.logprobs,
        batch_invariant=invariant,
    )


def task_examples(cfg: GRPORecipeConfig) -> list[dict]:
    """The task's examples: ``task.prompts``' records, checked for what the reward reads, or the
    built-in task's."""
    task = cfg.task
    if task.prompts is None:
        return TASKS[task.name].examples(num_prompts=task.num_prompts, seed=task.seed)
    reader = f"reward={cfg.reward}" if isinstance(cfg.reward, str) else "the reward"
    return load_examples(
        task.prompts,
        task.prompt_field,
        key="task.prompts",
        needs=example_fields(resolve_reward(cfg.reward, task.environment)),
        reader=reader,
    )


def build_prompts(
    cfg: GRPORecipeConfig, tokenizer, examples: list[dict] | None = None
) -> tuple[list[dict], list[list[int]]]:
    """The task's examples (:func:`task_examples` unless given) and their prompt token ids (chat
    template when configured)."""
    task = cfg.task
    examples = task_examples(cfg) if examples is None else examples
    limit = cfg.rollout.max_prompt_tokens
    system = TASKS[task.name].system if task.prompts is None else None
    env_format = environment_tools(cfg, tokenizer) if tool_task(task.name, task.prompts) is None else None
    ids = []
    for i, ex in enumerate(examples):
        if system is not None:  # a chat-format tool task: its system turn, then the question
            tokens = chat_tool_prompt(tokenizer, system, str(ex[task.prompt_field]), task.name)
        elif env_format is not None:  # the question, with the environment's tools in the template
            tokens = env_format.prompt_ids([{"role": "user", "content": str(ex[task.prompt_field])}])
        else:
            tokens = encode_prompt(tokenizer, str(ex[task.prompt_field]), chat=cfg.model.chat_template)
        if not tokens:
            raise ValueError(
                f"prompt {i} is empty: it encodes to no tokens, so there is nothing to generate from; give it text"
            )
        if len(tokens) > limit:
            raise ValueError(
                f"prompt {i} has {len(tokens)} tokens; rollout.max_prompt_tokens={limit} "
                "(raise it, or shorten the prompt)"
            )
        ids.append(tokens)
    return examples, ids


def make_accelerator(cfg: GRPORecipeConfig):
    """The run's Accelerator (:func:`nopad.training.accelerator.make_accelerator`)."""
    from nopad.training.accelerator import make_accelerator as build_accelerator

    return build_accelerator(
        cfg.accelerate.deepspeed_config,
        max_grad_norm=cfg.train.max_grad_norm,
        recipe="nopad.recipes.grpo",
        log_with=cfg.accelerate.log_with,
        project_dir=cfg.output_dir,
    )


def load_policy(cfg: GRPORecipeConfig, model=None, tokenizer=None):
    """``(model, tokenizer)``: the given ones, or ``model.path`` loaded (then ``output_dir`` is
    required: the trained policy is saved there)."""
    if model is None:
        if not cfg.output_dir:
            raise ConfigError(
                "output_dir",
                "is required: the trained policy is saved there (and metrics.jsonl); set output_dir=runs/grpo",
            )
        return load_model(cfg.model)
    if tokenizer is None:
        raise ValueError("pass the tokenizer together with the model")
    return model, tokenizer


def reference_model(model):
    """The frozen initial policy of the KL term, on nopad's attention (it scores packed rows too)."""
    from nopad.packing.hf import NOPAD_ATTENTION, register_nopad_attention

    register_nopad_attention()
    ref_model = copy.deepcopy(model).eval().requires_grad_(False)
    ref_model.set_attn_implementation(NOPAD_ATTENTION)
    return ref_model


# ----------------------------------------------------------------------------- the run
def run_grpo(cfg: GRPORecipeConfig, model=None, tokenizer=None, progress: bool = True) -> list[dict]:
    """Train for ``train.steps`` GRPO steps; returns (and logs) one metrics dict per step.
    Pass ``model``/``tokenizer`` to train objects you already hold (then ``model.path`` is unused
    and ``output_dir`` optional); else the trained policy is saved to ``output_dir``."""
    import torch
    from tqdm.auto import tqdm

    from nopad.packing.hf import use_nopad_attention
    from nopad.training import checkpoint
    from nopad.training.accelerator import engine_info
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.curves import finish_trackers, tracker_config, write_curves
    from nopad.training.optimizer import make_adamw

    reward_fn = with_timeout(
        resolve_reward(cfg.reward, cfg.task.environment), cfg.reward_timeout, "reward_timeout", cfg.task.prompt_field
    )
    examples = task_examples(cfg)  # before the model loads: a prompt set the reward cannot score fails now
    model, tokenizer = load_policy(cfg, model, tokenizer)
    examples, prompt_ids = build_prompts(cfg, tokenizer, examples)
    tr, per_step = cfg.train, cfg.rollout.prompts_per_step
    ref_model = reference_model(model) if cfg.loss.beta else None
    accelerator = make_accelerator(cfg)
    optimizer = make_adamw(model, tr.lr, tr.weight_decay)  # fused where torch can
    model, optimizer = accelerator.prepare(model, optimizer)
    logger.info("training with %s on %d process(es)", engine_info(model, accelerator), accelerator.num_processes)
    stepper = OptimizerStepper(model, optimizer, accelerator, max_grad_norm=tr.max_grad_norm, nonfinite=tr.nonfinite)
    loss = grpo_loss(cfg, accelerator.device)
    accelerator.init_trackers("nopad-grpo", config=tracker_config(cfg.to_dict()))
    policy = accelerator.unwrap_model(model)  # the same parameters: the generator reads them live
    episodes = tool_episodes(cfg, tokenizer)
    generator = make_generator(policy, cfg, tokenizer if episodes is not None else None)

    torch.manual_seed(tr.seed)
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(tr.seed)).tolist()
    rank, world = accelerator.process_index, accelerator.num_processes
    check_prompts_per_step(len(examples), per_step, world)
    run = GRPOProgress(order, resume_settings(cfg), reference_identity(cfg, ref_model))
    accelerator.register_for_checkpointing(run)
    save = Checkpointer(cfg, accelerator, model, tokenizer, run)
    out = save.start(run)
    history, saved_at = [], None
    show = progress and accelerator.is_main_process
    bar = tqdm(range(run.step, tr.steps), desc="grpo", disable=not show)
    rollouts = StepRollouts(cfg, generator, examples, prompt_ids, order, rank, world, episodes, progress)
    save.resume_stream(rollouts.stream)
    curves = CURVES + (STREAMING_CURVES if rollouts.stream is not None else ())
    with use_nopad_attention(policy):  # packed training rows; the generator switches to paged itself
        for step in bar:
            metrics = rollouts.train_step(stepper, step, reward_fn, tokenizer, loss, ref_model)
            history.append(metrics)
            logger.info("grpo step %d: %s", step, json.dumps({k: round(v, 6) for k, v in metrics.items()}))
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", gap=f"{metrics['logprob_gap_max']:.1e}")
            accelerator.log({k: metrics[k] for k in curves}, step=step)  # to the log_with trackers
            if out is not None and accelerator.is_main_process:
                checkpoint.append_metrics(out, metrics)
            run.step = step + 1
            if cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0:
                save(run.step)
                saved_at = run.step
    if out is not None and accelerator.is_main_process:
        write_curves(out / checkpoint.METRICS_FILE, curves, "nopad GRPO")
    finish_trackers(accelerator)
    rollouts.close()
    save.finish(run.step, saved_at)
    return history


def main(argv: list[str] | None = None) -> list[dict]:
    cfg = parse_cli(GRPORecipeConfig, argv, "nopad.recipes.grpo", __doc__)  # --help: before torch loads
    setup_logging("%(message)s")
    return run_grpo(cfg)


def cli() -> None:
    """The ``nopad-grpo`` console script: the recipe from any directory once nopad is installed."""
    run_recipe(main, "nopad.recipes.grpo")


if __name__ == "__main__":
    cli()
