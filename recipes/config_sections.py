"""The config sections and checks the recipes share: the model, LoRA, the generator, checkpoints,
Accelerate, the learning rate and the sampling settings."""

from __future__ import annotations

import dataclasses
from typing import Literal

from nopad.recipes.config_types import ConfigError, Section

DType = Literal["float32", "bfloat16", "float16"]


@dataclasses.dataclass
class ModelConfig(Section):
    """Which model: ``smollm2`` (the embedded SmolLM2-135M-Instruct), ``tiny:<family>`` (a tiny
    random-weight model, for tests), or a local Hugging Face model directory (a training run's
    output directory means its newest checkpoint)."""

    path: str | None = "smollm2"  # smollm2 (embedded), tiny:llama (tests), a model or run directory
    dtype: DType = "float32"  # float32 | bfloat16 | float16
    tool_template: str | None = None  # a chat template with tool calls: smollm2 (nopad's) or a .jinja file


@dataclasses.dataclass
class LoRAConfig(Section):
    """LoRA through peft: the model is frozen and an adapter of this rank trains on the target
    modules; checkpoints hold the adapter alone (with the base it applies to recorded)."""

    rank: int = 8  # the adapter's rank r
    alpha: float = 16.0  # scaling alpha (the update is scaled by alpha / rank)
    dropout: float = 0.0  # on the adapter's input; > 0: GRPO's rollouts differ from the trainer's
    target_modules: str = "all-linear"  # all-linear, or comma-separated module names: q_proj,v_proj

    def check(self) -> None:
        self.at_least("rank", 1)
        if not self.alpha > 0:
            raise ConfigError("alpha", f"must be a number > 0, got {self.alpha!r}")
        if not 0 <= self.dropout < 1:
            raise ConfigError("dropout", f"must be a number in [0, 1), got {self.dropout!r}")
        if not self.targets:
            raise ConfigError("target_modules", "is empty; use all-linear or module names like q_proj,v_proj")

    @property
    def targets(self) -> str | list[str]:
        """peft's ``target_modules``: ``"all-linear"`` or the list of names."""
        if self.target_modules.strip() == "all-linear":
            return "all-linear"
        return [name.strip() for name in self.target_modules.split(",") if name.strip()]


@dataclasses.dataclass
class ChatModelConfig(ModelConfig):
    """A model that reads prompts: ``chat_template`` true renders them with the tokenizer's chat
    template (an error if it has none), false feeds raw text, ``auto`` uses the template if any."""

    chat_template: bool | Literal["auto"] = "auto"  # true | false (raw text) | auto (if it has one)


@dataclasses.dataclass
class GeneratorConfig(Section):
    """The in-flight generator's KV cache and step budget (:class:`nopad.inference.Generator`)."""

    block_size: int | None = None  # null: the library's rule (nopad.packing.attention.paged_block_size)
    num_blocks: int = 1024  # KV cache blocks
    max_num_seqs: int = 64  # sequences in flight at once
    max_num_batched_tokens: int = 1024  # tokens per generator step (prefill chunks included)

    def check(self) -> None:
        for name in ("block_size", "num_blocks", "max_num_seqs", "max_num_batched_tokens"):
            self.at_least(name, 1)

    @property
    def smallest_block_size(self) -> int:
        """``block_size``, or the smallest the library's rule picks (16; 256 where a backend reads
        only 256-token pages): a KV-capacity check in blocks made with it holds for either."""
        return self.block_size or 16


@dataclasses.dataclass
class StepCheckpointConfig(Section):
    """``step_N`` checkpoints, each written whole (:mod:`nopad.training.checkpoint`), and the resume."""

    every: int = 0  # save a step_N checkpoint every N steps (as train counts them); 0: none before the end
    keep_last: int | None = None  # keep only the newest N complete checkpoints; null: keep all
    resume_from: str | None = None  # a step_N directory, or "latest" in output_dir

    def check(self) -> None:
        self.at_least("every", 0)
        self.at_least("keep_last", 1)


@dataclasses.dataclass
class AccelerateConfig(Section):
    """``deepspeed_config``: a DeepSpeed JSON (or launch with ``accelerate launch``); ``log_with``:
    Accelerate trackers (tensorboard, wandb, all) for the run's curves."""

    deepspeed_config: str | None = None  # a DeepSpeed JSON (recipes/configs/deepspeed_*.json)
    log_with: str | None = None  # trackers for the curves: tensorboard | wandb | all


MAX_LEARNING_RATE = 1.0  # Adam's update is ~lr per step: above this the weights only blow up


def check_learning_rate(lr: float) -> None:
    """``train.lr`` must be in (0, :data:`MAX_LEARNING_RATE`]: ``lr=1e38`` overflowed inside Adam and
    ``lr=0`` trains nothing, both without a word."""
    if not 0 < lr <= MAX_LEARNING_RATE:
        raise ConfigError(
            "lr", f"must be a number in (0, {MAX_LEARNING_RATE:g}], got {lr!r} (fine-tuning uses about 1e-6 to 1e-3)"
        )


def check_optimizer(train: Section) -> None:
    """A train section's ``weight_decay`` (AdamW refuses a negative one, but only after the model
    loaded) and ``max_grad_norm`` (torch "clips" to a negative norm without a word, flipping every
    gradient into ascent; 0 means no clipping, as in transformers), checked before the model loads."""
    train.at_least("weight_decay", 0.0)
    if train.max_grad_norm is not None and train.max_grad_norm < 0:
        raise ConfigError(
            "max_grad_norm",
            f"must be a number > 0, or null or 0 (no clipping), got "
            f"{train.max_grad_norm!r}: a negative norm would flip every gradient",
        )


def check_sampling(**settings) -> None:
    """Sampling settings (``temperature``, ``top_p``, ``max_tokens``...) checked by the rule the
    generator applies (:class:`nopad.inference.SamplingParams`), when the config is built: a
    ``temperature=-1`` is an error naming the key before the model loads, not minutes later."""
    from nopad.inference.sampling_params import SamplingParams

    try:
        SamplingParams(**settings)
    except ValueError as err:  # SamplingParams' messages start with the field's name
        name, _, detail = str(err).partition(" ")
        raise ConfigError(name, detail) from None
