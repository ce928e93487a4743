"""The GRPO recipe's settings (``recipes/grpo.py``): a dataclass of sections that checks itself
when built. Each default and its comment are written here once; ``recipes/configs/grpo.yaml`` is
generated from them (``python -m recipes.config``) and a test keeps it so."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from recipes.config import (
    AccelerateConfig,
    ChatModelConfig,
    ConfigError,
    GeneratorConfig,
    LoRAConfig,
    Section,
    check_learning_rate,
    check_sampling,
)
from recipes.tasks import TASKS, get_reward

if TYPE_CHECKING:  # (training.grpo imports torch: a config, and --help, load without it)
    from training.grpo import ISWeightFn


@dataclass
class GRPOModelConfig(ChatModelConfig):
    lora: LoRAConfig | None = None  # null: full fine-tune; model.lora.rank=8 (any key): a LoRA adapter


@dataclass
class TaskConfig(Section):
    """The prompts: a built-in task (``recipes.tasks.TASKS``) or a JSONL file / saved dataset with
    ``prompt`` (and ``answer``) fields."""

    name: str = "arithmetic"  # recipes.tasks.TASKS (calculator: a tool task); ignored when prompts is set
    prompts: str | None = None  # a data file or saved dataset with prompt (and answer) fields
    prompt_field: str = "prompt"  # the field of each record that holds the prompt
    num_prompts: int = 64  # the size of the built-in task
    seed: int = 0  # the built-in task's sampling of prompts

    def check(self) -> None:
        self.at_least("num_prompts", 1)
        if self.prompts is None and self.name not in TASKS:
            raise ConfigError("name", f"{self.name!r} is not a built-in task; use one of {sorted(TASKS)} "
                              "or set task.prompts to a JSONL file")


@dataclass
class RolloutConfig(Section):
    prompts_per_step: int = 8  # prompts per step on each rank
    num_generations: int = 8  # completions per prompt (the GRPO group), at least 2
    max_prompt_tokens: int = 64  # longer prompts are an error; bounds the KV cache check
    max_tokens: int = 48  # new tokens per completion (a tool task's episode: the model's and the tools')
    temperature: float = 1.0  # the trained policy is the raw model: keep 1.0 for on-policy
    top_p: float = 1.0  # 1: no nucleus filter
    seed: int = 0  # sampling seed (a different one each step)
    max_turns: int = 4  # tool tasks (recipes.tool_tasks): model turns per episode
    tool_timeout: float = 10.0  # tool tasks: seconds a round of tool calls may take

    def check(self) -> None:
        for name, low in [("prompts_per_step", 1), ("num_generations", 2), ("max_prompt_tokens", 1),
                          ("max_tokens", 1), ("max_turns", 1)]:
            self.at_least(name, low)
        if not self.tool_timeout > 0:
            raise ConfigError("tool_timeout", f"must be > 0 seconds, got {self.tool_timeout}")
        check_sampling(temperature=self.temperature, top_p=self.top_p, seed=self.seed)


@dataclass
class GRPOGeneratorConfig(GeneratorConfig):
    num_blocks: int = 512  # KV cache blocks: the whole rollout batch must fit
    max_num_batched_tokens: int = 512  # tokens per generator step (prefill chunks included)
    sharded_rollout: Literal["gather", "lockstep"] = "gather"  # ZeRO-3/FSDP2: gather | lockstep (memory-lean)


@dataclass
class GRPOTrainConfig(Section):
    steps: int = 2  # GRPO steps, one optimizer step each
    lr: float = 1e-6  # AdamW's learning rate, in (0, 1]
    weight_decay: float = 0.0
    max_grad_norm: float | None = 1.0  # clip the gradient norm; null: no clipping
    max_tokens_per_batch: int = 1024  # packing capacity of one training forward
    shared_prefix: bool = True  # each prompt once per row, its completions attending to it
    clip_eps: float = 0.2  # PPO clip range of the ratio: [1 - clip_eps, 1 + clip_eps]
    beta: float = 0.0  # KL penalty against a frozen copy of the initial policy; 0: none
    batch_invariant: bool | Literal["auto"] = "auto"  # rollout log-probs = trainer's (auto: on CPU)
    is_correction: str | Callable[..., Any] = "none"  # none | tis | "module:function"
    tis_cap: float = 2.0  # is_correction=tis: min(pi_train / pi_gen, tis_cap)
    nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss or gradient: stop the run | skip the step
    seed: int = 0

    def check(self) -> None:
        self.at_least("steps", 1)  # 0 would save an untrained copy as "the policy"
        self.at_least("beta", 0.0)
        check_learning_rate(self.lr)
        self.at_least("max_tokens_per_batch", 2)
        if not 0 < self.clip_eps < 1:
            raise ConfigError("clip_eps", f"must be in (0, 1), got {self.clip_eps}")
        resolve_is_correction(self)


@dataclass
class GRPORecipeConfig(Section):
    """The GRPO recipe's settings; ``recipes/configs/grpo.yaml`` is generated from them.
    ``output_dir`` is required unless :func:`recipes.grpo.run_grpo` is given the model object
    (then the caller holds the trained policy)."""

    model: GRPOModelConfig = field(default_factory=GRPOModelConfig)
    task: TaskConfig = field(default_factory=TaskConfig)
    reward: str | Callable[..., Any] = "last_number_match"  # recipes.tasks.REWARDS name or "module:function"
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    generator: GRPOGeneratorConfig = field(default_factory=GRPOGeneratorConfig)
    train: GRPOTrainConfig = field(default_factory=GRPOTrainConfig)
    accelerate: AccelerateConfig = field(default_factory=AccelerateConfig)
    output_dir: str | None = None  # metrics.jsonl, curves.png and the trained model (an HF model directory)

    def check(self) -> None:
        get_reward(self.reward, key="reward")
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
        if seq_tokens > tr.max_tokens_per_batch:
            raise ValueError(f"train.max_tokens_per_batch={tr.max_tokens_per_batch} is smaller than one "
                             f"rollout sequence ({seq_tokens} tokens = rollout.max_prompt_tokens + "
                             "rollout.max_tokens); raise it")


def resolve_is_correction(train_cfg: GRPOTrainConfig) -> ISWeightFn | None:
    spec = train_cfg.is_correction
    if spec in (None, "none"):
        return None
    if spec == "tis":
        from training.grpo import truncated_is

        if train_cfg.tis_cap <= 0:
            raise ConfigError("tis_cap", f"must be > 0, got {train_cfg.tis_cap}")
        return truncated_is(float(train_cfg.tis_cap))
    if callable(spec):
        return spec
    if ":" not in spec and "." not in spec:
        raise ConfigError("is_correction", f"{spec!r} is unknown; use none, tis, or an import path "
                          "'module:function' taking (train_logprobs, gen_logprobs) -> per-token weights")
    return get_reward(spec, key="train.is_correction")  # same import-path resolution
