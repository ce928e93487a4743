"""The SFT recipe's settings (``recipes/sft.py``): a dataclass of sections that checks itself when
built; ``recipes/configs/sft.yaml`` lists the same defaults with comments."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from recipes.config import AccelerateConfig, ConfigError, ModelConfig, Section, check_learning_rate


@dataclass
class SFTModelConfig(ModelConfig):
    # nopad's varlen attention; "sdpa" / "flash_attention_2" also take packed rows
    attn_implementation: str = "nopad"


@dataclass
class SFTDataConfig(Section):
    """Where rows come from (``synthetic``, a ``.jsonl`` file or a saved dataset directory) and how
    they are packed into micro-batches of ``tokens_per_batch`` tokens."""

    source: str = "synthetic"
    split: str = "train"
    prompt_column: str = "prompt"
    completion_column: str = "completion"
    num_rows: int = 256
    min_len: int = 8
    max_len: int = 200
    seed: int = 0
    tokens_per_batch: int | None = None  # null: the longest row of pre-packed data, else 1024
    max_seqs_per_batch: int | None = None
    overflow: Literal["error", "truncate", "split"] = "error"
    max_dropped_fraction: float = 0.05
    num_workers: int = 0
    streaming: bool = False
    buffer_size: int = 1000

    def check(self) -> None:
        for name, low in [("tokens_per_batch", 1), ("max_seqs_per_batch", 1), ("num_workers", 0),
                          ("buffer_size", 1), ("num_rows", 1), ("min_len", 1)]:
            self.at_least(name, low)
        if not 0 <= self.max_dropped_fraction <= 1:
            raise ConfigError("max_dropped_fraction",
                              f"must be a number in [0, 1], got {self.max_dropped_fraction!r}")


@dataclass
class SFTTrainConfig(Section):
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; the epochs repeat if they hold fewer
    grad_accum: int = 2
    lr: float = 1e-5
    weight_decay: float = 0.0
    warmup_steps: int = 0
    max_grad_norm: float | None = None
    weighting: Literal["token", "sequence"] = "token"
    seed: int = 0
    progress: bool = True
    # keep only each layer's input and recompute the layer in backward: a 2048-token fp32 row of
    # SmolLM2-135M holds several GB of activations, far above its weights (benchmarks/bench_memory.py)
    gradient_checkpointing: bool = False

    def check(self) -> None:
        for name, low in [("epochs", 1), ("max_steps", 1), ("grad_accum", 1), ("warmup_steps", 0),
                          ("seed", 0)]:
            self.at_least(name, low)
        check_learning_rate(self.lr)


@dataclass
class CheckpointConfig(Section):
    output_dir: str = "runs/sft"
    every: int = 0  # 0: only at the end
    save_final: bool = True
    keep_last: int | None = None
    resume_from: str | None = None  # a step_N directory, or "latest" in output_dir

    def check(self) -> None:
        self.at_least("every", 0)
        self.at_least("keep_last", 1)


@dataclass
class SFTLogConfig(Section):
    record_indices: bool = False  # keep the dataset indices each rank trained on (tests)


@dataclass
class SFTRecipeConfig(Section):
    """The SFT recipe's settings; ``recipes/configs/sft.yaml`` lists them with comments."""

    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: SFTLogConfig = field(default_factory=SFTLogConfig)
    accelerate: AccelerateConfig = field(default_factory=AccelerateConfig)
