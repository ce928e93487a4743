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
from nopad.recipes.env_tasks import environment_format, load_environment, resolve_reward
from nopad.recipes.grpo_checkpoint import (
    Checkpointer,
    GRPOProgress,
    reference_identity,
    resume_settings,
)
from nopad.recipes.grpo_config import GRPORecipeConfig
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
    from nopad.training.grpo_step import GRPOStepConfig, ToolEpisodes

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
    return GRPOStepConfig(max_tokens_per_batch=tr.max_tokens_per_batch, shared_prefix=tr.shared_prefix,
                    policy=lc.policy(cfg.rollout.max_tokens), scale_rewards=lc.scale_rewards,
                    mask_truncated_completions=lc.mask_truncated_completions,
                    num_iterations=tr.num_iterations, steps_per_generation=tr.steps_per_generation,
                    old_logprobs=tr.old_logprobs, logprobs=cfg.rollout.logprobs, batch_invariant=invariant)


def sampling_params(cfg: GRPORecipeConfig, step: int):
    from nopad.inference import SamplingParams

    ro = cfg.rollout
    task = tool_task(cfg.task.name, cfg.task.prompts)
    return SamplingParams(n=ro.num_generations, max_tokens=ro.max_tokens, temperature=ro.temperature,
                          top_p=ro.top_p, seed=ro.seed * 1_000_003 + step, stop=task.stop if task else None)


def task_examples(cfg: GRPORecipeConfig) -> list[dict]:
    """The task's examples: ``task.prompts``' records, checked for what the reward reads, or the
    built-in task's."""
    task = cfg.task
    if task.prompts is None:
        return TASKS[task.name].examples(num_prompts=task.num_prompts, seed=task.seed)
    reader = f"reward={cfg.reward}" if isinstance(cfg.reward, str) else "the reward"
    return load_examples(task.prompts, task.prompt_field, key="task.prompts",
                         needs=example_fields(resolve_reward(cfg.reward, task.environment)), reader=reader)


def build_prompts(cfg: GRPORecipeConfig, tokenizer,
                  examples: list[dict] | None = None) -> tuple[list[dict], list[list[int]]]:
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
            raise ValueError(f"prompt {i} is empty: it encodes to no tokens, so there is nothing to generate "
                             "from; give it text")
        if len(tokens) > limit:
            raise ValueError(f"prompt {i} has {len(tokens)} tokens; rollout.max_prompt_tokens={limit} "
                             "(raise it, or shorten the prompt)")
        ids.append(tokens)
    return examples, ids


def make_generator(model, cfg: GRPORecipeConfig, tokenizer=None):
    """The rollout generator; ``tokenizer`` for tool tasks, whose calls end at a stop string."""
    from nopad.inference import Generator

    g = cfg.generator
    return Generator(model, tokenizer, block_size=g.block_size, num_blocks=g.num_blocks,
                     max_num_seqs=g.max_num_seqs, max_num_batched_tokens=g.max_num_batched_tokens)


def streaming_rollouts(cfg: GRPORecipeConfig, generator, prompt_ids: list[list[int]], pick):
    """``rollout.mode=streaming``'s rollouts (None for sync): group ``i`` is ``pick(i)``'s prompt with
    the sampling seed of step ``i // prompts_per_step``, as the synchronous step would sample it."""
    from nopad.training.streaming import StreamingRollouts

    ro = cfg.rollout
    if ro.mode != "streaming":
        return None
    return StreamingRollouts(
        generator, lambda i: (prompt_ids[pick(i)], sampling_params(cfg, i // ro.prompts_per_step)),
        groups_per_step=ro.prompts_per_step, max_staleness=ro.max_staleness, stale_kv=ro.stale_kv,
        total_groups=cfg.train.steps * ro.prompts_per_step)


def environment_tools(cfg: GRPORecipeConfig, tokenizer):
    """The chat template's tool format with ``task.environment``'s tools; None without one."""
    spec = cfg.task.environment
    return None if spec is None else environment_format(tokenizer, load_environment(spec), spec)


def tool_episodes(cfg: GRPORecipeConfig, tokenizer) -> ToolEpisodes | None:
    """The tool task's tools, call format and episode limits, and ``task.environment`` (one per
    episode, rewarded as a whole); None for a single-turn task."""
    from nopad.inference.episodes import EpisodeLimits
    from nopad.training.grpo_step import ToolEpisodes

    task, spec = tool_task(cfg.task.name, cfg.task.prompts), cfg.task.environment
    if task is None and spec is None:
        return None
    ro = cfg.rollout
    limits = EpisodeLimits(max_turns=ro.max_turns, max_tokens=ro.max_tokens, tool_timeout=ro.tool_timeout)
    tool_format = task.tool_format(tokenizer) if task is not None else environment_tools(cfg, tokenizer)
    return ToolEpisodes(task.tools if task is not None else {}, tool_format, limits,
                        environment_factory=load_environment(spec) if spec is not None else None,
                        episode_reward=spec is not None)


def make_accelerator(cfg: GRPORecipeConfig):
    """The run's Accelerator (:func:`nopad.training.accelerator.make_accelerator`)."""
    from nopad.training.accelerator import make_accelerator as build_accelerator

    return build_accelerator(cfg.accelerate.deepspeed_config,
                             max_grad_norm=cfg.train.max_grad_norm, recipe="nopad.recipes.grpo",
                             log_with=cfg.accelerate.log_with, project_dir=cfg.output_dir)


def load_policy(cfg: GRPORecipeConfig, model=None, tokenizer=None):
    """``(model, tokenizer)``: the given ones, or ``model.path`` loaded (then ``output_dir`` is
    required: the trained policy is saved there)."""
    if model is None:
        if not cfg.output_dir:
            raise ConfigError("output_dir", "is required: the trained policy is saved there (and "
                              "metrics.jsonl); set output_dir=runs/grpo")
        return load_model(cfg.model)
    if tokenizer is None:
        raise ValueError("pass the tokenizer together with the model")
    return model, tokenizer


# ----------------------------------------------------------------------------- the run
def run_grpo(cfg: GRPORecipeConfig, model=None, tokenizer=None, progress: bool = True) -> list[dict]:
    """Train for ``train.steps`` GRPO steps; returns (and logs) one metrics dict per step.
    Pass ``model``/``tokenizer`` to train objects you already hold (then ``model.path`` is unused
    and ``output_dir`` optional); else the trained policy is saved to ``output_dir``."""
    import torch
    from tqdm.auto import tqdm

    from nopad.packing.hf import NOPAD_ATTENTION, register_nopad_attention, use_nopad_attention
    from nopad.training import checkpoint
    from nopad.training.accelerator import engine_info
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.curves import finish_trackers, tracker_config, write_curves
    from nopad.training.grpo_step import grpo_step
    from nopad.training.optimizer import make_adamw
    from nopad.training.streaming import streaming_step

    reward_fn = with_timeout(resolve_reward(cfg.reward, cfg.task.environment), cfg.reward_timeout,
                             "reward_timeout", cfg.task.prompt_field)
    examples = task_examples(cfg)  # before the model loads: a prompt set the reward cannot score fails now
    model, tokenizer = load_policy(cfg, model, tokenizer)
    examples, prompt_ids = build_prompts(cfg, tokenizer, examples)
    tr, per_step = cfg.train, cfg.rollout.prompts_per_step
    ref_model = None
    if cfg.loss.beta:  # frozen initial policy for the KL term, also on packed rows
        register_nopad_attention()
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        ref_model.set_attn_implementation(NOPAD_ATTENTION)
    accelerator = make_accelerator(cfg)
    optimizer = make_adamw(model, tr.lr, tr.weight_decay)  # fused where torch can
    model, optimizer = accelerator.prepare(model, optimizer)
    logger.info("training with %s on %d process(es)", engine_info(model, accelerator),
                accelerator.num_processes)
    stepper = OptimizerStepper(model, optimizer, accelerator, max_grad_norm=tr.max_grad_norm,
                               nonfinite=tr.nonfinite)
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
    def pick(group: int) -> int:  # the example of this rank's group-th group: step group // per_step's
        step, j = divmod(group, per_step)
        return order[((step * world + rank) * per_step + j) % len(order)]

    stream = streaming_rollouts(cfg, generator, prompt_ids, pick)
    curves = CURVES + (STREAMING_CURVES if stream is not None else ())
    with use_nopad_attention(policy):  # packed training rows; the generator switches to paged itself
        for step in bar:
            picks = [pick(step * per_step + j) for j in range(per_step)]
            if stream is not None:
                metrics = streaming_step(stepper, stream, lambda g: (examples[pick(g)], prompt_ids[pick(g)]),
                                         reward_fn, tokenizer, loss, step=step, temperature=cfg.rollout.temperature,
                                         ref_model=ref_model)
            else:
                metrics = grpo_step(stepper, generator, [examples[i] for i in picks],
                                    [prompt_ids[i] for i in picks], reward_fn, tokenizer,
                                    sampling_params(cfg, step), loss, step=step,
                                    rollout_mode=cfg.generator.sharded_rollout, ref_model=ref_model,
                                    use_tqdm=progress, episodes=episodes)
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
    if stream is not None:
        stream.close()
    generator.release()
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
