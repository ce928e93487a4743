"""The GRPO recipe's settings (``recipes/grpo.py``): a dataclass of sections that checks itself
when built. Each default and its comment are written once: here, or where a section comes from
(the loss's knobs: :mod:`nopad.training.policy_loss.settings`; shared sections: :mod:`nopad.recipes.config_sections`);
``recipes/configs/grpo.yaml`` is generated from them (``python -m nopad.recipes.config``) and a test keeps it so."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING, Any, Literal

from nopad.recipes.config import (
    AccelerateConfig,
    ChatModelConfig,
    ConfigError,
    GeneratorConfig,
    LoRAConfig,
    Section,
    StepCheckpointConfig,
    check_learning_rate,
    check_optimizer,
    check_sampling,
)
from nopad.recipes.env_tasks import resolve_reward
from nopad.recipes.tasks import TASKS, tool_task
from nopad.training.policy_loss.settings import PolicyLossSettings

if TYPE_CHECKING:  # (nopad.training.policy_loss imports torch: a config, and --help, load without it)
    from nopad.training.policy_loss import PolicyLossConfig


@dataclass
class GRPOModelConfig(ChatModelConfig):
    lora: LoRAConfig | None = None  # null: full fine-tune; model.lora.rank=8 (any key): a LoRA adapter


@dataclass
class TaskConfig(Section):
    """The prompts: a built-in task (``nopad.recipes.tasks.TASKS``) or a JSONL file / saved dataset with
    ``prompt`` (and ``answer``) fields."""

    name: str = "arithmetic"  # nopad.recipes.tasks.TASKS (calculator: a tool task); ignored when prompts is set
    prompts: str | None = None  # a data file or saved dataset with prompt (and answer) fields
    prompt_field: str = "prompt"  # the field of each record that holds the prompt
    num_prompts: int = 64  # the size of the built-in task
    seed: int = 0  # the built-in task's sampling of prompts
    environment: str | None = None  # "module:Class" (TRL's protocol): tools, and a reward over the episode

    def check(self) -> None:
        self.at_least("num_prompts", 1)
        if self.prompts is None and self.name not in TASKS:
            raise ConfigError(
                "name",
                f"{self.name!r} is not a built-in task; use one of {sorted(TASKS)} or set task.prompts to a JSONL file",
            )


@dataclass
class RolloutConfig(Section):
    prompts_per_step: int = 8  # prompts per step on each rank
    num_generations: int = 8  # completions per prompt (the GRPO group), at least 2
    max_prompt_tokens: int = 64  # longer prompts are an error; bounds the KV cache check
    max_tokens: int = 48  # new tokens per completion (a tool task's episode: the model's and the tools')
    temperature: float = 1.0  # sampling temperature; with logprobs=tempered also the trained policy's
    logprobs: Literal["tempered", "raw"] = "tempered"  # trained: softmax(logits/temperature) as TRL | raw
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 0  # sampling seed (a different one each step)
    max_turns: int = 4  # tool tasks (nopad.recipes.tool_tasks): model turns per episode
    tool_timeout: float = 10.0  # tool tasks: seconds a round of tool calls may take
    tool_grace: float = 0.1  # streaming tool tasks: seconds a step waits for tools (faster ones: repeatable runs)
    mode: Literal["sync", "streaming"] = "sync"  # streaming: generation runs on across optimizer steps
    max_staleness: int = 1  # streaming: groups whose oldest token is more optimizer steps old are dropped
    stale_kv: Literal["keep", "recompute"] = "keep"  # streaming: after an update, keep the KV | recompute it

    def check(self) -> None:
        for name, low in [
            ("prompts_per_step", 1),
            ("num_generations", 2),
            ("max_prompt_tokens", 1),
            ("max_tokens", 1),
            ("max_turns", 1),
            ("max_staleness", 0),
        ]:
            self.at_least(name, low)
        if not self.tool_timeout > 0:
            raise ConfigError("tool_timeout", f"must be > 0 seconds, got {self.tool_timeout}")
        if not self.tool_grace >= 0:
            raise ConfigError("tool_grace", f"must be >= 0 seconds, got {self.tool_grace}")
        check_sampling(temperature=self.temperature, top_p=self.top_p, seed=self.seed)
        if self.temperature == 0:
            raise ConfigError(
                "temperature",
                "is 0 (greedy): every completion of a group would be the same, "
                "so every advantage is 0 and nothing is learned; sample with temperature > 0 "
                "(1.0: the model's own distribution)",
            )


@dataclass
class GRPOGeneratorConfig(GeneratorConfig):
    num_blocks: int = 512  # KV cache blocks: the whole rollout batch must fit
    max_num_batched_tokens: int = 512  # tokens per generator step (prefill chunks included)
    sharded_rollout: Literal["gather", "lockstep"] = "gather"  # ZeRO-3/FSDP2: gather | lockstep (memory-lean)


@dataclass
class GRPOLossConfig(Section, PolicyLossSettings):
    """The policy loss (:mod:`nopad.training.policy_loss`): TRL 1.16 ``GRPOConfig``'s names and defaults
    (``is_*`` are TRL's ``vllm_importance_sampling_*``). A knob the chosen loss ignores is an error."""

    # the loss's knobs are PolicyLossSettings' (declared there once); these two the step reads
    scale_rewards: Literal["group", "batch", "none"] = "group"  # advantage / std of: group | batch | none
    mask_truncated_completions: bool = False  # completions cut by rollout.max_tokens carry no loss

    def check(self) -> None:
        try:  # PolicyLossConfig's checks (nopad.training.policy_loss imports torch: only when a config is built)
            self.policy(max_completion_length=1)
        except ValueError as err:
            raise knob_error(err) from None

    def policy(self, max_completion_length: int) -> PolicyLossConfig:
        """The loss's settings (``max_completion_length``: dr_grpo's normaliser, rollout.max_tokens)."""
        from nopad.training.policy_loss import PolicyLossConfig

        knobs = {f.name: getattr(self, f.name) for f in fields(PolicyLossSettings)}
        if self.loss_type == "dr_grpo":
            knobs["max_completion_length"] = max_completion_length
        return PolicyLossConfig(**knobs)


def knob_error(err: ValueError) -> ConfigError:
    """The library's ``"<knob> <what is wrong>"`` as the error naming the config key."""
    knob, _, detail = str(err).partition(" ")
    return ConfigError(knob, detail)


@dataclass
class GRPOTrainConfig(Section):
    steps: int = 2  # GRPO steps (rollout batches), num_iterations x steps_per_generation optimizer steps each
    lr: float = 1e-6  # AdamW's learning rate, in (0, 1]
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # clip the gradient norm; null: no clipping
    max_tokens_per_batch: int = 1024  # packing capacity of one training forward
    shared_prefix: bool = True  # each prompt once per row, its completions attending to it
    num_iterations: int = 1  # passes over each rollout batch (TRL's num_iterations)
    steps_per_generation: int = 1  # mini-batches per pass, one optimizer step each
    old_logprobs: Literal["rollout", "recompute"] = "rollout"  # rollout: exact in batch_invariant, no forward
    batch_invariant: bool | Literal["auto"] = "auto"  # rollout log-probs = trainer's (auto: on CPU)
    nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss or gradient: stop the run | skip the step
    seed: int = 0

    def check(self) -> None:
        self.at_least("steps", 1)  # 0 would save an untrained copy as "the policy"
        check_learning_rate(self.lr)
        check_optimizer(self)
        self.at_least("max_tokens_per_batch", 2)
        self.at_least("num_iterations", 1)
        self.at_least("steps_per_generation", 1)


GRPOCheckpointConfig = StepCheckpointConfig  # SFT's adds its output_dir; GRPO's is top-level


@dataclass
class GRPORecipeConfig(Section):
    """The GRPO recipe's settings; ``recipes/configs/grpo.yaml`` is generated from them.
    ``output_dir`` is required unless :func:`nopad.recipes.grpo.run_grpo` is given the model object
    (then the caller holds the trained policy)."""

    model: GRPOModelConfig = field(default_factory=GRPOModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: str | Callable[..., Any] = "last_number_match"  # REWARDS name or "module:function"; see task.environment
    reward_timeout: float | None = 60.0  # seconds a reward call may take, else the run stops; null: no limit
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generator: GRPOGeneratorConfig = field(default_factory=GRPOGeneratorConfig)
    loss: GRPOLossConfig = field(default_factory=GRPOLossConfig)
    train: GRPOTrainConfig = field(default_factory=GRPOTrainConfig)
    checkpoint: GRPOCheckpointConfig = field(default_factory=GRPOCheckpointConfig)
    accelerate: AccelerateConfig = field(default_factory=AccelerateConfig)
    output_dir: str | None = None  # metrics.jsonl, curves.png, step_N checkpoints and the trained model

    def check(self) -> None:
        resolve_reward(self.reward, self.task.environment)
        if self.reward_timeout is not None and not self.reward_timeout > 0:
            raise ConfigError("reward_timeout", f"must be > 0 seconds or null (no limit), got {self.reward_timeout}")
        ro, gen, tr = self.rollout, self.generator, self.train
        seq_tokens = ro.max_prompt_tokens + ro.max_tokens
        num_seqs = ro.prompts_per_step * ro.num_generations
        blocks_needed = num_seqs * math.ceil(seq_tokens / gen.smallest_block_size)
        if blocks_needed > gen.num_blocks:
            raise ValueError(
                f"the rollout batch is larger than the KV cache: rollout.prompts_per_step="
                f"{ro.prompts_per_step} x rollout.num_generations={ro.num_generations} sequences of up to "
                f"{seq_tokens} tokens need {blocks_needed} blocks of {gen.smallest_block_size}, but "
                f"generator.num_blocks={gen.num_blocks}; raise generator.num_blocks or lower "
                "rollout.prompts_per_step / rollout.num_generations / rollout.max_tokens"
            )
        try:
            self.loss.check_old_logprobs(tr.old_logprobs, key="train.old_logprobs")
        except ValueError as err:
            raise knob_error(err).under("loss") from None
        if ro.mode == "streaming":
            self._check_streaming()
        if self.checkpoint.every and not self.output_dir:
            raise ConfigError("checkpoint.every", "needs output_dir: the checkpoints are written there")
        if seq_tokens > tr.max_tokens_per_batch:
            raise ValueError(
                f"train.max_tokens_per_batch={tr.max_tokens_per_batch} is smaller than one "
                f"rollout sequence ({seq_tokens} tokens = rollout.max_prompt_tokens + "
                "rollout.max_tokens); raise it"
            )

    def _check_streaming(self) -> None:
        """What ``rollout.mode=streaming`` cannot serve yet, refused before the model loads."""
        episodes = self.task.environment is not None or tool_task(self.task.name, self.task.prompts) is not None
        ck = self.checkpoint
        if episodes and (ck.every or ck.resume_from):
            raise ConfigError(
                "checkpoint.every" if ck.every else "checkpoint.resume_from",
                "cannot checkpoint streaming tool episodes yet (an episode in flight holds running "
                "tools and environments); set checkpoint.every=0 and no resume_from, or use rollout.mode=sync",
            )
        if self.generator.sharded_rollout == "lockstep":
            raise ConfigError(
                "rollout.mode",
                "streaming gathers sharded weights once per step for its rollouts "
                "(generator.sharded_rollout=gather); lockstep rollouts would make each rank's "
                "decode steps wait for the others'. Use generator.sharded_rollout=gather, or "
                "rollout.mode=sync",
            )
