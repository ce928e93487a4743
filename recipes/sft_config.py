"""The SFT recipe's settings (``recipes/sft.py``): a dataclass of sections that checks itself when
built. Each default and its comment are written here once; ``recipes/configs/sft.yaml`` is generated
from them (``python -m nopad.recipes.config``) and a test keeps it so."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from nopad.recipes.config import (
    AccelerateConfig,
    ConfigError,
    LoRAConfig,
    ModelConfig,
    Section,
    StepCheckpointConfig,
    check_learning_rate,
    check_optimizer,
)


@dataclass
class SFTModelConfig(ModelConfig):
    attn_implementation: str = "nopad"  # nopad | sdpa | flash_attention_2 (all take packed rows)
    lora: LoRAConfig | None = None  # null: full fine-tune; model.lora.rank=8 (any key): a LoRA adapter


@dataclass
class SFTDataConfig(Section):
    """Where rows come from (``synthetic``, a data file or a saved dataset directory) and how they
    are packed into micro-batches of ``tokens_per_batch`` tokens. Pre-packed rows (``nopad.recipes.preprocess``,
    TRL's ``pack_dataset``) keep their documents apart."""

    source: str = "synthetic"  # synthetic | a data file (JSONL, parquet, CSV, ...) | a saved dataset dir
    split: str = "train"  # the split of a DatasetDict
    prompt_column: str = "prompt"  # text rows: the prompt's tokens are masked out of the loss
    completion_column: str = "completion"  # text rows: the tokens trained on
    per_turn_samples: bool = False  # chat rows: each assistant turn a sample, packed as prefix trees
    messages_column: str = "messages"  # per_turn_samples: the rows' conversations [{role, content}, ...]
    num_rows: int = 256  # synthetic only: random token rows with a masked prompt
    min_len: int = 8  # synthetic only: the shortest row
    max_len: int = 200  # synthetic only: the longest row
    seed: int = 0  # synthetic rows and the packing order
    tokens_per_batch: int | None = None  # a micro-batch per rank; null: longest pre-packed row, else 1024
    max_seqs_per_batch: int | None = None  # null: no limit
    overflow: Literal["error", "truncate", "split"] = "error"  # what a row longer than tokens_per_batch does
    max_dropped_fraction: float = 0.05  # overflow=truncate may drop at most this share of the tokens
    num_workers: int = 0  # DataLoader worker processes (they only fetch; packing is in the sampler)
    streaming: bool = False  # pack with the bounded-buffer streaming packer (needs train.max_steps)
    buffer_size: int = 1000  # streaming look-ahead buffer (sequences)

    def check(self) -> None:
        for name, low in [
            ("tokens_per_batch", 1),
            ("max_seqs_per_batch", 1),
            ("num_workers", 0),
            ("buffer_size", 1),
            ("num_rows", 1),
            ("min_len", 1),
        ]:
            self.at_least(name, low)
        if self.min_len > self.max_len:
            raise ConfigError(
                "min_len",
                f"({self.min_len}) is above data.max_len ({self.max_len}): "
                "the synthetic rows' lengths are drawn between them; change one",
            )
        if not 0 <= self.max_dropped_fraction <= 1:
            raise ConfigError("max_dropped_fraction", f"must be a number in [0, 1], got {self.max_dropped_fraction!r}")
        if self.per_turn_samples and self.streaming:
            raise ConfigError(
                "per_turn_samples", "packs whole prefix trees, which a stream cannot; set data.streaming=false"
            )


@dataclass
class SFTTrainConfig(Section):
    epochs: int = 1
    max_steps: int | None = None  # optimizer steps; the epochs repeat if they hold fewer
    grad_accum: int = 2  # micro-batches per optimizer step (an epoch's last step: what is left)
    lr: float = 1e-5  # AdamW's peak learning rate, in (0, 1]
    weight_decay: float = 0.0
    warmup_steps: int = 0  # linear warm-up, then a linear decay to 0
    max_grad_norm: float | None = None  # clip the gradient norm; null: no clipping
    weighting: Literal["token", "sequence"] = "token"  # loss: mean over tokens | of per-sequence means
    seed: int = 0
    progress: bool = True  # a progress bar
    nonfinite: Literal["stop", "skip"] = "stop"  # a NaN/inf loss or gradient: stop the run | skip the step
    gradient_checkpointing: bool = False  # recompute layers in backward: less memory (bench_memory.py)

    def check(self) -> None:
        for name, low in [("epochs", 1), ("max_steps", 1), ("grad_accum", 1), ("warmup_steps", 0), ("seed", 0)]:
            self.at_least(name, low)
        check_learning_rate(self.lr)
        check_optimizer(self)


@dataclass
class CheckpointConfig(StepCheckpointConfig):
    output_dir: str = "runs/sft"  # step_N/ model directories (resume state in step_N/training_state)
    save_final: bool = True  # save model, optimizer and loader state at the end


@dataclass
class SFTLogConfig(Section):
    record_indices: bool = False  # keep the dataset indices each rank trained on (tests)


@dataclass
class SFTRecipeConfig(Section):
    """The SFT recipe's settings; ``recipes/configs/sft.yaml`` is generated from them."""

    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: SFTLogConfig = field(default_factory=SFTLogConfig)
    accelerate: AccelerateConfig = field(default_factory=AccelerateConfig)
