"""Supervised fine-tuning of a Hugging Face causal LM on nopad's packed batches, under Accelerate
(DDP, or DeepSpeed ZeRO-2 with ``accelerate.deepspeed_config``).

Read top to bottom: build the model and the rows, a packed loader that shards itself over the
ranks (it is NOT passed to ``accelerator.prepare``, which would shard it a second time), then one
optimizer step per window of ``grad_accum`` micro-batches with the loss normalised by the window's
global loss-token count. Checkpoints hold model, optimizer, scheduler, RNG and loader position, so
``checkpoint.resume_from`` continues with exactly the batches the uninterrupted run would see.

    python -m recipes.sft recipes/configs/sft.yaml train.epochs=1 model.path=tiny:llama
    accelerate launch --config_file recipes/configs/accelerate_ddp.yaml -m recipes.sft
    accelerate launch --config_file recipes/configs/accelerate_deepspeed.yaml -m recipes.sft

Each checkpoint ``step_N`` is a Hugging Face model directory (``model.path=.../step_N`` in
evaluate, GRPO or ``from_pretrained``) with the resume state in ``step_N/training_state``.

``train(SFTConfig(train={"max_steps": 3}), model=..., tokenizer=..., rows=...)`` runs the same loop
in-process (the demo uses it). DeepSpeed's fixed micro-batch size is one packed row
(``train_micro_batch_size_per_gpu: 1``); the token budget is ``data.tokens_per_batch``.
"""

from __future__ import annotations

import itertools
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from dataloaders import sources
from dataloaders.balance import attention_cost_from_config
from dataloaders.dataset import BOUNDARY_COLUMNS
from dataloaders.loader import move_batch, packed_dataloader
from dataloaders.streaming import StreamingPackedLoader
from recipes.config import (
    AccelerateConfig,
    ConfigError,
    ModelConfig,
    Section,
    check_learning_rate,
    load_model,
    parse_cli,
    save_model_dir,
    setup_logging,
)
from training import checkpoint
from training.accelerator import engine_info
from training.accelerator import make_accelerator as build_accelerator
from training.curves import finish_trackers, tracker_config, write_curves
from training.loss import PackedLoss

logger = logging.getLogger(__name__)
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "sft.yaml"  # these defaults, with comments
DEFAULT_TOKENS_PER_BATCH = 1024  # data.tokens_per_batch=null on data that is not pre-packed


# ---------------------------------------------------------------------------------- config
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
class SFTConfig(Section):
    """The SFT recipe's settings; ``recipes/configs/sft.yaml`` lists them with comments."""

    model: SFTModelConfig = field(default_factory=SFTModelConfig)
    data: SFTDataConfig = field(default_factory=SFTDataConfig)
    train: SFTTrainConfig = field(default_factory=SFTTrainConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    log: SFTLogConfig = field(default_factory=SFTLogConfig)
    accelerate: AccelerateConfig = field(default_factory=AccelerateConfig)


# ---------------------------------------------------------------------------------- model and data
def synthetic_rows(num_rows: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[dict]:
    """Random token rows whose first quarter is a prompt (masked out of the loss)."""
    rng = np.random.default_rng(seed)
    rows = []
    for length in rng.integers(min_len, max_len + 1, size=num_rows):
        ids = rng.integers(3, vocab_size, size=length)
        labels = ids.copy()
        labels[: length // 4] = -100
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def tokenize_rows(rows, tokenizer, prompt_column: str, completion_column: str) -> list[dict]:
    """Text rows (prompt, completion) -> token rows with the prompt masked; token rows pass through."""
    out = []
    for row in rows:
        if "input_ids" in row:
            out.append(row)
            continue
        if prompt_column not in row or completion_column not in row:
            raise KeyError(f"rows need 'input_ids' or text columns {prompt_column!r} and "
                           f"{completion_column!r}; got {sorted(row)}")
        if tokenizer is None:
            raise ValueError("text rows need a tokenizer; this model has none")
        prompt = tokenizer(row[prompt_column], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row[completion_column], add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            completion = completion + [tokenizer.eos_token_id]
        out.append({"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion})
    return out


def load_rows(data: SFTDataConfig, tokenizer, vocab_size: int) -> list[dict]:
    source = data.source
    if source == "synthetic":
        return synthetic_rows(data.num_rows, data.min_len, data.max_len, vocab_size, data.seed)
    rows = sources.load_sft_rows(source, data.prompt_column, data.completion_column, data.split, tokenizer)
    if "input_ids" in rows.column_names:  # tokenized or pre-packed (seq_lengths): read in place
        return rows
    return tokenize_rows(rows, tokenizer, data.prompt_column, data.completion_column)


def set_attention(model, name: str) -> None:
    if name == "nopad":
        from packing.hf import register_nopad_attention

        register_nopad_attention()
    model.set_attn_implementation(name)


# ---------------------------------------------------------------------------------- training
class Progress:
    """Optimizer steps done, checkpointed with the rest so a resumed run knows where it is, and the
    accumulation that groups micro-batches into those steps (a different one would regroup them)."""

    def __init__(self, grad_accum: int = 1):
        self.step = 0
        self.grad_accum = grad_accum

    def state_dict(self) -> dict:
        return {"step": self.step, "grad_accum": self.grad_accum}

    def load_state_dict(self, state: dict) -> None:
        if not isinstance(state, dict) or "step" not in state or "grad_accum" not in state:
            raise ValueError(f"not an SFT progress state: {state!r}")
        if state["grad_accum"] != self.grad_accum:
            raise ValueError(f"cannot resume: the checkpoint was made with train.grad_accum="
                             f"{state['grad_accum']} but this run has train.grad_accum={self.grad_accum}; "
                             "resume with the same value")
        self.step = int(state["step"])


def make_accelerator(cfg: SFTConfig):
    """The run's Accelerator (:func:`training.accelerator.make_accelerator`) from the config."""
    return build_accelerator(cfg.accelerate.deepspeed_config, grad_accum=cfg.train.grad_accum,
                             max_grad_norm=cfg.train.max_grad_norm, recipe="recipes.sft",
                             log_with=cfg.accelerate.log_with, project_dir=cfg.checkpoint.output_dir)


STATE_DIR = "training_state"  # inside step_N/: what resuming needs beyond the model directory


def save_checkpoint(accelerator, model, tokenizer, path: Path, keep_last: int | None = None) -> None:
    """``path`` becomes an HF model directory (load it with ``model.path=path``) holding, in
    ``training_state/``, the optimizer, scheduler, RNG and loader state to resume from. Written
    whole or not at all (:mod:`training.checkpoint`)."""

    def write(tmp: Path) -> None:
        accelerator.save_state(str(tmp / STATE_DIR))
        save_model_dir(accelerator, model, tokenizer, tmp)

    checkpoint.save_checkpoint(path, write, accelerator, keep_last=keep_last)


def is_prepacked(rows) -> bool:
    """True for rows that each hold several documents (``seq_lengths`` / ``position_ids``)."""
    columns = getattr(rows, "column_names", None)
    if columns is None:
        columns = rows[0].keys() if len(rows) else ()
    return any(c in columns for c in BOUNDARY_COLUMNS)


def plan_budget(dcfg: SFTDataConfig, rows) -> int:
    """``data.tokens_per_batch`` for these rows, checked against the rows before anything trains.

    Why: a pre-packed row is already a bin, so by default the budget is the longest row; and
    ``data.overflow=truncate`` must not drop a large share of the data quietly (it once dropped
    45% of a pre-packed dataset, visible only in a stats line)."""
    prepacked = is_prepacked(rows)
    lengths = np.fromiter((len(ids) for ids in _input_ids(rows)), dtype=np.int64)
    longest = int(lengths.max()) if lengths.size else 0
    budget = dcfg.tokens_per_batch or (longest if prepacked else DEFAULT_TOKENS_PER_BATCH)
    what = "pre-packed rows" if prepacked else "sequences"
    too_long = lengths > budget
    if not too_long.any() or dcfg.overflow == "split":
        return budget
    if dcfg.overflow == "error":
        raise ValueError(
            f"data.tokens_per_batch={budget} is smaller than {int(too_long.sum())} of the {what} of "
            f"data.source={dcfg.source!r} (the longest has {longest} tokens); "
            + ("leave data.tokens_per_batch unset (it then takes the longest pre-packed row) or set it "
               f">= {longest}" if prepacked else f"set data.tokens_per_batch >= {longest}, or "
               "data.overflow=split (pieces train as separate sequences) or data.overflow=truncate"))
    sources.check_dropped_tokens(lengths, budget, dcfg.max_dropped_fraction, key="data.max_dropped_fraction",
                                 capacity_key="data.tokens_per_batch", what=what)
    return budget


def _input_ids(rows):
    if hasattr(rows, "column_names"):
        return rows["input_ids"]
    return (row["input_ids"] for row in rows)


def build_loader(dcfg: SFTDataConfig, rows, accelerator, gas: int, model_config):
    """Map-style (global BFD per epoch) or streaming (bounded buffer) packed loader for this rank;
    each epoch is a whole number of ``gas``-micro-batch optimizer steps on every rank."""
    common = dict(num_replicas=accelerator.num_processes, rank=accelerator.process_index,
                  seed=dcfg.seed, max_seqs_per_batch=dcfg.max_seqs_per_batch, overflow=dcfg.overflow,
                  steps_multiple_of=gas, attention_cost=attention_cost_from_config(model_config))
    if dcfg.streaming:
        return StreamingPackedLoader(rows, dcfg.tokens_per_batch or DEFAULT_TOKENS_PER_BATCH,
                                     buffer_size=dcfg.buffer_size, **common)
    budget = plan_budget(dcfg, rows)
    return packed_dataloader(rows, budget, num_workers=dcfg.num_workers, **common)


def _epoch_stats(loader) -> dict | None:
    sampler = getattr(loader, "packed_sampler", None)
    return sampler.last_stats if sampler is not None else loader.last_stats


def _windows(loader, size: int):
    """The loader's batches of one epoch in lists of ``size`` (one optimizer step each)."""
    batches = iter(loader)
    while window := list(itertools.islice(batches, size)):
        yield window


def train(cfg: SFTConfig, *, model=None, tokenizer=None, rows=None, accelerator=None) -> dict:
    """Run SFT as configured; returns ``{"losses": [...], "steps": n, "stats": [...], ...}``.

    ``model``/``tokenizer``/``rows`` override ``model.path``/``data.source`` (rows: token dicts
    with ``input_ids`` and optional ``labels``, or text rows with the prompt/completion columns).
    """
    tcfg, dcfg, ccfg = cfg.train, cfg.data, cfg.checkpoint
    accelerator = accelerator or make_accelerator(cfg)
    torch.manual_seed(tcfg.seed)
    model, tokenizer, rows = _model_and_rows(cfg, model, tokenizer, rows)
    gas = tcfg.grad_accum
    loader = build_loader(dcfg, rows, accelerator, gas, model.config)
    total_steps = _total_steps(tcfg, dcfg, loader, gas)
    optimizer, scheduler = _optimizer(model, tcfg, total_steps)
    # the loader is not prepared (it shards itself); neither is the scheduler, which Accelerate
    # would step once per process for every optimizer step
    logger.info("setting up %s on %d process(es) (a DeepSpeed ZeRO-3 start partitions the weights here)",
                accelerator.distributed_type, accelerator.num_processes)
    model, optimizer = accelerator.prepare(model, optimizer)
    progress = Progress(gas)
    info = engine_info(model, accelerator)
    logger.info("training with %s on %d process(es)", info, accelerator.num_processes)
    accelerator.init_trackers("nopad-sft", config=tracker_config(cfg.to_dict()))
    for obj in (progress, loader, scheduler):  # progress first: it names train.grad_accum on a mismatch
        accelerator.register_for_checkpointing(obj)
    output_dir = Path(ccfg.output_dir)
    checkpoint.claim_run_dir(output_dir, accelerator, resuming=bool(ccfg.resume_from))  # lock, own metrics
    if ccfg.resume_from:
        _resume(accelerator, ccfg.resume_from, output_dir, progress, loader)

    # Accelerate (and DeepSpeed inside it) divides the loss by grad_accum; PackedLoss undoes that
    # and the rank averaging, and divides by the step's global loss-token count instead.
    loss_fn = PackedLoss(tcfg.weighting, world_size=accelerator.num_processes, backward_divisor=gas)
    max_steps = tcfg.max_steps or total_steps
    if progress.step >= max_steps:
        logger.warning("nothing to train: the run is already at optimizer step %d of %d (train.max_steps / "
                       "train.epochs); raise them to train further", progress.step, max_steps)
    losses, stats, seen = [], [], [] if cfg.log.record_indices else None
    saved_at = None
    bar = _progress_bar(tcfg.progress and accelerator.is_local_main_process, max_steps, progress.step)
    logger.info("training %d optimizer step(s) of %d micro-batch(es) each; the progress bar moves when a "
                "step ends (the first one, a forward and backward of every micro-batch, is the slowest)",
                max(max_steps - progress.step, 0), gas)
    while progress.step < max_steps:
        for window in _windows(loader, gas):
            step_loss = _optimizer_step(window, model, optimizer, loss_fn, accelerator, tcfg.max_grad_norm,
                                        seen)
            scheduler.step()
            progress.step += 1
            losses.append(_record_step(accelerator, output_dir, progress.step, step_loss, bar))
            if ccfg.every and progress.step % ccfg.every == 0:
                save_checkpoint(accelerator, model, tokenizer, output_dir / f"step_{progress.step}",
                                ccfg.keep_last)
                saved_at = progress.step
            if progress.step >= max_steps:
                break
        epoch_stats = _epoch_stats(loader)
        if epoch_stats is not None and epoch_stats not in stats:
            stats.append(epoch_stats)
    if bar is not None:
        bar.close()
    final = output_dir / f"step_{progress.step}"
    if ccfg.save_final and saved_at != progress.step:  # (decided the same way on every rank)
        save_checkpoint(accelerator, model, tokenizer, final, ccfg.keep_last)
    accelerator.wait_for_everyone()
    result = {"losses": losses, "steps": progress.step, "stats": stats, "rank": accelerator.process_index,
              "world_size": accelerator.num_processes, **info,
              "checkpoint": str(final) if ccfg.save_final else None,
              "micro_batches_per_epoch": None if dcfg.streaming else len(loader)}
    if seen is not None:
        result["indices_per_step"] = seen  # dataset rows of each micro-batch, in order
    _write_result(accelerator, output_dir, result)
    return result


def _model_and_rows(cfg: SFTConfig, model, tokenizer, rows):
    """The model in training mode with its attention set, and the tokenized rows."""
    dcfg = cfg.data
    if model is None:  # tiny:llama comes with the ASCII tokenizer, so its checkpoints reload too
        model, tokenizer = load_model(cfg.model)
    set_attention(model, cfg.model.attn_implementation)
    model.config.use_cache = False
    model.train()
    if rows is None:
        rows = load_rows(dcfg, tokenizer, model.config.vocab_size)
    else:
        rows = tokenize_rows(rows, tokenizer, dcfg.prompt_column, dcfg.completion_column)
    return model, tokenizer, rows


def _total_steps(tcfg: SFTTrainConfig, dcfg: SFTDataConfig, loader, gas: int) -> int:
    """Optimizer steps of the whole run: ``train.max_steps`` counts them, and the epochs repeat as
    needed to reach it; a stream has no length, so there it must be given."""
    if dcfg.streaming:
        if not tcfg.max_steps:
            raise ValueError("data.streaming=true needs train.max_steps (a stream's length is unknown)")
        return tcfg.max_steps
    steps_per_epoch = len(loader) // gas
    if tcfg.max_steps and tcfg.max_steps > steps_per_epoch * tcfg.epochs:
        logger.warning("train.max_steps=%d is more than train.epochs=%d x %d steps per epoch: the data "
                       "repeats for %d epochs", tcfg.max_steps, tcfg.epochs, steps_per_epoch,
                       -(-tcfg.max_steps // steps_per_epoch))
    return max(steps_per_epoch * tcfg.epochs, tcfg.max_steps or 0)


def _optimizer(model, tcfg: SFTTrainConfig, total_steps: int):
    """AdamW with a linear warm-up, then a linear decay to 0 at ``total_steps``."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=tcfg.lr, weight_decay=tcfg.weight_decay)
    warmup = tcfg.warmup_steps
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda s: min(1.0, (s + 1) / (warmup + 1)) * max(0.0, 1 - s / max(total_steps, 1))
    )
    return optimizer, scheduler


def _resume(accelerator, resume_from: str, output_dir: Path, progress: Progress, loader) -> None:
    """Load ``checkpoint.resume_from`` (a step_N directory, or ``latest`` complete one)."""
    resume = checkpoint.latest_checkpoint(output_dir) if resume_from == "latest" else Path(resume_from)
    if not (resume / STATE_DIR).is_dir():
        raise FileNotFoundError(f"checkpoint.resume_from={str(resume)!r} holds no {STATE_DIR}/ "
                                "written by this recipe; give a step_N directory of an earlier run")
    try:
        accelerator.load_state(str(resume / STATE_DIR))
    except ValueError:  # our own: a resume under another plan, naming the setting
        raise
    except Exception as err:  # a damaged file: say which checkpoint, not only the zip reader's words
        raise RuntimeError(checkpoint.resume_failure(resume, err)) from err
    logger.info("resumed from %s at step %d (epoch %d)", resume, progress.step, loader.epoch)


def _optimizer_step(window, model, optimizer, loss_fn, accelerator, max_grad_norm, seen) -> float:
    """Forward and backward every micro-batch of one accumulation window; the optimizer steps once,
    at the window's last micro-batch. Returns this rank's share of the step's loss."""
    loss_fn.start_step(window)
    step_loss = 0.0
    for batch in window:
        batch = move_batch(batch, accelerator.device)
        if seen is not None:
            seen.append(batch["indices"].tolist())
        with accelerator.accumulate(model):
            logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"],
                           nopad_meta=batch["nopad_meta"], use_cache=False).logits
            loss = loss_fn(logits, batch)
            accelerator.backward(loss)
            step_loss += loss_fn.unscaled(loss)
            if accelerator.sync_gradients and max_grad_norm:
                accelerator.clip_grad_norm_(model.parameters(), max_grad_norm)
            optimizer.step()
            optimizer.zero_grad()
    if not accelerator.sync_gradients:
        raise RuntimeError("internal: an optimizer-step window ended without a gradient sync")
    return step_loss


def _record_step(accelerator, output_dir: Path, step: int, step_loss: float, bar) -> float:
    """The step's loss over all ranks, to the trackers, ``metrics.jsonl`` and the progress bar."""
    loss = accelerator.reduce(torch.tensor([step_loss], device=accelerator.device), "sum").item()
    accelerator.log({"loss": loss}, step=step)  # to the log_with trackers
    if accelerator.is_main_process:
        output_dir.mkdir(parents=True, exist_ok=True)
        with open(output_dir / "metrics.jsonl", "a") as f:  # appended: a resumed run continues it
            f.write(json.dumps({"step": step, "loss": loss}) + "\n")
    if bar is not None:
        bar.update(1)
        bar.set_postfix(loss=f"{loss:.4f}")
    return loss


def _progress_bar(show: bool, total: int, initial: int):
    if not show:
        return None
    from tqdm.auto import tqdm

    return tqdm(total=total, initial=initial, desc="sft", unit="step")


def _write_result(accelerator, output_dir: Path, result: dict) -> None:
    """``result_rank*.json`` (this run), ``results_rank*.jsonl`` (every run) and the curves."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"result_rank{accelerator.process_index}.json").write_text(json.dumps(result))
    with open(output_dir / f"results_rank{accelerator.process_index}.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")  # every run's result, so a resumed run loses none
    if accelerator.is_main_process:
        write_curves(output_dir / "metrics.jsonl", ["loss"], "nopad SFT")
    finish_trackers(accelerator)


def main(argv: list[str] | None = None) -> dict:
    setup_logging()
    return train(parse_cli(SFTConfig, argv, "recipes.sft", __doc__))


def cli() -> None:
    """The ``nopad-sft`` console script: the recipe from any directory once nopad is installed."""
    main()


if __name__ == "__main__":
    main()
