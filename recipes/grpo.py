"""GRPO on the live policy: generate with the in-flight generator on the very parameters the
optimizer updates (no copy, no weight sync), score, pack prompt+completion sequences into varlen
rows, recompute the log-probs with the training forward and take one optimizer step: each step is
:func:`training.grpo_step.grpo_step`, the code the tests and the sharded runs call too.

    python -m recipes.grpo [recipes/configs/grpo.yaml] output_dir=runs/grpo [key=value ...]
    accelerate launch --config_file recipes/configs/accelerate_zero3.yaml -m recipes.grpo [...]

Under ZeRO-3 / FSDP2 the rollout gathers the full weights once or keeps the ranks in lockstep
(``generator.sharded_rollout``, :mod:`inference.sharded`), and every rank trains on the same number
of packed rows with exactly one optimizer step per GRPO step (:mod:`training.accumulation`).

Generator and trainer run the same attention core, so in the batch-invariant mode the generator's
sampled-token log-probs equal the training forward's bitwise (the gap is reported every step), and
several optimizer steps per rollout batch (``train.num_iterations``, ``train.steps_per_generation``)
take the rollout's log-probs as the old policy's with no extra forward. When they are not equal
(the mode off), ``train.old_logprobs=recompute`` scores the batch once with the trainer, and
``loss.is_correction`` re-weights each token or sequence (TRL's four modes). The loss is
``loss.loss_type`` (TRL's names: :mod:`training.policy_loss`).

With ``model.lora`` set only a LoRA adapter trains (peft), the generator runs the adapted model as
it is, and ``output_dir`` receives the adapter alone; ``model.path`` may itself be an adapter.

``checkpoint.every=N`` writes ``output_dir/step_N`` atomically every N GRPO steps (through SFT's
:func:`training.checkpoint.save_training_checkpoint`: policy or adapter, optimizer, RNG and
:class:`GRPOProgress`), and ``checkpoint.resume_from=latest`` continues exactly (docs/rl.md).
"""

from __future__ import annotations

import copy
import hashlib
import json
import logging
import os
import signal
from pathlib import Path
from typing import TYPE_CHECKING

from recipes.cli import run_recipe
from recipes.config import ConfigError, parse_cli, setup_logging
from recipes.grpo_config import GRPORecipeConfig
from recipes.models import load_model, save_model_dir
from recipes.tasks import TASKS, check_prompts_per_step, encode_prompt, get_reward, load_examples
from recipes.tool_tasks import TOOL_TASKS, chat_tool_prompt

if TYPE_CHECKING:  # torch and training/ are imported where they run, so --help answers without them
    from training.grpo_step import GRPOLoss, ToolEpisodes

logger = logging.getLogger(__name__)

DEFAULT_CONFIG = Path(__file__).parent / "configs" / "grpo.yaml"  # these defaults, with comments
CURVES = ("reward_mean", "loss", "logprob_gap_max")  # plotted to curves.png and sent to the trackers


# ----------------------------------------------------------------------------- config -> objects
def grpo_loss(cfg: GRPORecipeConfig, device) -> GRPOLoss:
    """The step's loss settings from ``loss`` and ``train``, with ``batch_invariant`` resolved for
    ``device``."""
    from training.grpo import resolve_batch_invariant
    from training.grpo_step import GRPOLoss

    tr, lc = cfg.train, cfg.loss
    invariant = resolve_batch_invariant(tr.batch_invariant, device, "train.batch_invariant")
    return GRPOLoss(max_tokens_per_batch=tr.max_tokens_per_batch, shared_prefix=tr.shared_prefix,
                    policy=lc.policy(cfg.rollout.max_tokens), scale_rewards=lc.scale_rewards,
                    mask_truncated_completions=lc.mask_truncated_completions,
                    num_iterations=tr.num_iterations, steps_per_generation=tr.steps_per_generation,
                    old_logprobs=tr.old_logprobs, batch_invariant=invariant)


def sampling_params(cfg: GRPORecipeConfig, step: int):
    from inference import SamplingParams

    ro = cfg.rollout
    task = TOOL_TASKS.get(cfg.task.name) if cfg.task.prompts is None else None
    return SamplingParams(n=ro.num_generations, max_tokens=ro.max_tokens, temperature=ro.temperature,
                          top_p=ro.top_p, seed=ro.seed * 1_000_003 + step, stop=task.stop if task else None)


def build_prompts(cfg: GRPORecipeConfig, tokenizer) -> tuple[list[dict], list[list[int]]]:
    """The task's examples and their prompt token ids (chat template when configured)."""
    task = cfg.task
    if task.prompts is not None:
        examples = load_examples(task.prompts, task.prompt_field, key="task.prompts")
    else:
        examples = TASKS[task.name](num_prompts=task.num_prompts, seed=task.seed)
    limit = cfg.rollout.max_prompt_tokens
    system = TOOL_TASKS[task.name].system if task.prompts is None and task.name in TOOL_TASKS else None
    ids = []
    for i, ex in enumerate(examples):
        if system is not None:  # a chat-format tool task: its system turn, then the question
            tokens = chat_tool_prompt(tokenizer, system, str(ex[task.prompt_field]), task.name)
        else:
            tokens = encode_prompt(tokenizer, str(ex[task.prompt_field]), chat=cfg.model.chat_template)
        if not tokens or len(tokens) > limit:
            raise ValueError(f"prompt {i} has {len(tokens)} tokens; rollout.max_prompt_tokens={limit} "
                             "(raise it, or shorten the prompt)")
        ids.append(tokens)
    return examples, ids


def make_generator(model, cfg: GRPORecipeConfig, tokenizer=None):
    """The rollout generator; ``tokenizer`` for tool tasks, whose calls end at a stop string."""
    from inference import Generator

    g = cfg.generator
    return Generator(model, tokenizer, block_size=g.block_size, num_blocks=g.num_blocks,
                     max_num_seqs=g.max_num_seqs, max_num_batched_tokens=g.max_num_batched_tokens)


def tool_episodes(cfg: GRPORecipeConfig, tokenizer) -> ToolEpisodes | None:
    """The tool task's tools, call format and episode limits; None for a single-turn task."""
    from inference.episodes import EpisodeLimits
    from training.grpo_step import ToolEpisodes

    task = TOOL_TASKS.get(cfg.task.name) if cfg.task.prompts is None else None
    if task is None:
        return None
    ro = cfg.rollout
    limits = EpisodeLimits(max_turns=ro.max_turns, max_tokens=ro.max_tokens, tool_timeout=ro.tool_timeout)
    return ToolEpisodes(task.tools, task.tool_format(tokenizer), limits)


def make_accelerator(cfg: GRPORecipeConfig):
    """The run's Accelerator (:func:`training.accelerator.make_accelerator`)."""
    from training.accelerator import make_accelerator as build_accelerator

    return build_accelerator(cfg.accelerate.deepspeed_config,
                             max_grad_norm=cfg.train.max_grad_norm, recipe="recipes.grpo",
                             log_with=cfg.accelerate.log_with, project_dir=cfg.output_dir)


# ----------------------------------------------------------------------------- the run
def run_grpo(cfg: GRPORecipeConfig, model=None, tokenizer=None, progress: bool = True) -> list[dict]:
    """Train for ``train.steps`` GRPO steps; returns (and logs) one metrics dict per step.
    Pass ``model``/``tokenizer`` to train objects you already hold (then ``model.path`` is unused
    and ``output_dir`` optional); else the trained policy is saved to ``output_dir``."""
    import torch
    from tqdm.auto import tqdm

    from packing.hf import NOPAD_ATTENTION, register_nopad_attention, use_nopad_attention
    from training import checkpoint
    from training.accelerator import engine_info
    from training.accumulation import OptimizerStepper
    from training.curves import finish_trackers, tracker_config, write_curves
    from training.grpo_step import grpo_step
    from training.lora import trainable_parameters

    if model is None:
        if not cfg.output_dir:
            raise ConfigError("output_dir", "is required: the trained policy is saved there (and "
                              "metrics.jsonl); set output_dir=runs/grpo")
        model, tokenizer = load_model(cfg.model)
    elif tokenizer is None:
        raise ValueError("pass the tokenizer together with the model")
    reward_fn = get_reward(cfg.reward)
    examples, prompt_ids = build_prompts(cfg, tokenizer)
    tr, per_step = cfg.train, cfg.rollout.prompts_per_step
    ref_model = None
    if cfg.loss.beta:  # frozen initial policy for the KL term, also on packed rows
        register_nopad_attention()
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        ref_model.set_attn_implementation(NOPAD_ATTENTION)
    accelerator = make_accelerator(cfg)
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=tr.lr, weight_decay=tr.weight_decay)
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
    out = Path(cfg.output_dir) if cfg.output_dir else None
    if out is not None:  # lock: two runs at once into one directory stop with the other's pid
        _refuse_stale_policy(cfg)
        checkpoint.claim_run_dir(out, accelerator, resuming=bool(cfg.checkpoint.resume_from))
    if cfg.checkpoint.resume_from:
        path = checkpoint.resume_training(accelerator, cfg.checkpoint.resume_from, out, save.load_kwargs)
        if accelerator.is_main_process:
            checkpoint.trim_metrics(out, run.step)  # GRPO logs steps 0, 1, ...
        logger.info("resumed from %s at grpo step %d", path, run.step)
    history, saved_at = [], None
    show = progress and accelerator.is_main_process
    bar = tqdm(range(run.step, tr.steps), desc="grpo", disable=not show)
    with use_nopad_attention(policy):  # packed training rows; the generator switches to paged itself
        for step in bar:
            start = (step * world + rank) * per_step
            picks = [order[(start + j) % len(order)] for j in range(per_step)]
            metrics = grpo_step(stepper, generator, [examples[i] for i in picks],
                                [prompt_ids[i] for i in picks], _killable(reward_fn, step), tokenizer,
                                sampling_params(cfg, step), loss, step=step,
                                rollout_mode=cfg.generator.sharded_rollout, ref_model=ref_model,
                                use_tqdm=progress, episodes=episodes)
            _kill_point("step", step)
            history.append(metrics)
            logger.info("grpo step %d: %s", step, json.dumps({k: round(v, 6) for k, v in metrics.items()}))
            bar.set_postfix(reward=f"{metrics['reward_mean']:.2f}", gap=f"{metrics['logprob_gap_max']:.1e}")
            accelerator.log({k: metrics[k] for k in CURVES}, step=step)  # to the log_with trackers
            if out is not None and accelerator.is_main_process:
                checkpoint.append_metrics(out, metrics)
            run.step = step + 1
            if cfg.checkpoint.every and run.step % cfg.checkpoint.every == 0:
                save(run.step)
                saved_at = run.step
    if out is not None and accelerator.is_main_process:
        write_curves(out / checkpoint.METRICS_FILE, CURVES, "nopad GRPO")
    finish_trackers(accelerator)
    generator.release()
    if out is not None and cfg.checkpoint.every:  # the last checkpoint is the policy (model.path=output_dir)
        if saved_at != run.step:
            save(run.step)
        logger.info("the policy is %s/step_%d (load it with model.path=%s)", out, run.step, out)
    elif out is not None:  # a model (or LoRA adapter) dir: model.path=<output_dir> in evaluate/grpo/SFT
        save_model_dir(accelerator, model, tokenizer, out)
        logger.info("saved the policy to %s (load it with model.path=%s)", out, out)
    return history


# ----------------------------------------------------------------------------- checkpoints
class GRPOProgress:
    """What a GRPO checkpoint keeps beside the policy, optimizer and RNG (Accelerate's state): the
    GRPO steps done, the prompt order, and what must not change across a resume (the loss settings
    and the reference model's identity); a resume that changed them stops with one line."""

    def __init__(self, order: list[int], settings: dict, reference: dict | None):
        self.step, self.order, self.settings, self.reference = 0, order, settings, reference

    def state_dict(self) -> dict:
        return {"step": self.step, "order": self.order, "settings": self.settings,
                "reference": self.reference}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "order" not in state:
            raise ValueError(f"not a GRPO checkpoint's progress state: {state!r}")
        changed = sorted(k for k in {**state["settings"], **self.settings}
                         if state["settings"].get(k) != self.settings.get(k))
        if changed:
            k = changed[0]
            raise ValueError(f"cannot resume: the checkpoint was made with {k}={state['settings'].get(k)!r} "
                             f"but this run has {k}={self.settings.get(k)!r}; resume with the same settings, "
                             "or start a new run in another output_dir")
        if state["order"] != self.order:
            raise ValueError("cannot resume: this run's prompts differ from the checkpoint's (task, "
                             "task.seed or train.seed changed); resume with the same ones")
        if state["reference"] != self.reference:
            raise ValueError(f"cannot resume: the KL reference model differs from the checkpoint's "
                             f"({state['reference']} vs {self.reference}); resume with the model.path of the "
                             "run that wrote it (the initial policy, not a checkpoint)")
        self.step = int(state["step"])


def resume_settings(cfg: GRPORecipeConfig) -> dict:
    """The settings a resume must keep: the loss, the mini-batching and the rollout's shape."""
    keys = {f"loss.{k}": v for k, v in cfg.loss.to_dict().items()}
    for k in ("num_iterations", "steps_per_generation", "old_logprobs", "seed"):
        keys[f"train.{k}"] = getattr(cfg.train, k)
    for k in ("prompts_per_step", "num_generations", "seed"):
        keys[f"rollout.{k}"] = getattr(cfg.rollout, k)
    return keys


def reference_identity(cfg: GRPORecipeConfig, ref_model) -> dict | None:
    """The KL reference model: where it came from and a digest of its weights (None without KL)."""
    import torch

    if ref_model is None:
        return None
    digest = hashlib.sha256()
    for name, tensor in sorted(ref_model.state_dict().items()):
        digest.update(name.encode())
        digest.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return {"model.path": str(cfg.model.path), "sha256": digest.hexdigest()[:16]}


class Checkpointer:
    """``save(step)``: ``output_dir/step_N`` atomically, a model (or LoRA adapter) directory with the
    resume state in ``training_state/`` (:func:`training.checkpoint.save_training_checkpoint`)."""

    def __init__(self, cfg: GRPORecipeConfig, accelerator, model, tokenizer, run: GRPOProgress):
        from training.lora import is_peft_model, keep_resume_state_to_adapter

        self.cfg, self.accelerator, self.model, self.tokenizer = cfg, accelerator, model, tokenizer
        self.save_kwargs, self.load_kwargs = {}, {}
        if is_peft_model(accelerator.unwrap_model(model)):  # resume state: the adapter, not a base copy
            self.save_kwargs, self.load_kwargs = keep_resume_state_to_adapter(accelerator)

    def __call__(self, step: int) -> None:
        from training import checkpoint

        def save_model(d: Path) -> None:
            _kill_point("checkpoint", step)  # tests: a kill between the training state and the model files
            save_model_dir(self.accelerator, self.model, self.tokenizer, d)

        checkpoint.save_training_checkpoint(self.accelerator, Path(self.cfg.output_dir) / f"step_{step}",
                                            save_model, self.cfg.checkpoint.keep_last, self.save_kwargs)


def _refuse_stale_policy(cfg: GRPORecipeConfig) -> None:
    """With checkpoints, model.path=<output_dir> means its newest checkpoint; a policy an earlier run
    saved at the top of the directory would be picked instead."""
    top = {p.name for p in Path(cfg.output_dir).iterdir()} if Path(cfg.output_dir).is_dir() else set()
    if cfg.checkpoint.every and top & {"config.json", "adapter_config.json"}:
        raise ConfigError("checkpoint.every", f"> 0 makes {cfg.output_dir}/step_N the policy, but "
                          f"{cfg.output_dir} already holds a policy saved by an earlier run without "
                          "checkpoints; use another output_dir")


KILL_ENV = "NOPAD_GRPO_KILL_AT"  # tests: "rollout:N", "step:N" or "checkpoint:N" kills the run there


def _kill_point(where: str, step: int) -> None:
    """The crash-resume tests' hook: SIGKILL this process at a chosen point of a chosen step."""
    if os.environ.get(KILL_ENV) == f"{where}:{step}":
        os.kill(os.getpid(), signal.SIGKILL)


def _killable(reward_fn, step: int):
    """The reward, with the ``rollout:N`` kill point at its first call: after step N's rollout."""
    if not os.environ.get(KILL_ENV, "").startswith("rollout:"):
        return reward_fn

    def reward(text, example):
        _kill_point("rollout", step)
        return reward_fn(text, example)

    return reward


def main(argv: list[str] | None = None) -> list[dict]:
    cfg = parse_cli(GRPORecipeConfig, argv, "recipes.grpo", __doc__)  # --help: before torch loads
    setup_logging("%(message)s")
    return run_grpo(cfg)


def cli() -> None:
    """The ``nopad-grpo`` console script: the recipe from any directory once nopad is installed."""
    run_recipe(main, "recipes.grpo")


if __name__ == "__main__":
    cli()
