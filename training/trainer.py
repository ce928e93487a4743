"""nopad packing inside transformers' ``Trainer`` (TRL's ``SFTTrainer`` is one: see nopad.training.trl.sft_trainer).

    from nopad.training.trainer import NopadTrainer
    from nopad.training.trl.sft_trainer import NopadSFTTrainer
    trainer = NopadSFTTrainer(model, args=SFTConfig(max_length=1024, ...), train_dataset=ds,
                              processing_class=tok)         # tokens_per_batch defaults to
    trainer.train()                                          # per_device_train_batch_size * max_length

What changes against the stock trainer, and nothing else:

- **Batches**: the packed loader (one global best-fit-decreasing plan per epoch, bins balanced over
  the ranks by attention cost, every rank the same number of steps) replaces Trainer's padded
  loader. Each micro-batch is one flat row of whole sequences (a :class:`~nopad.packing.row.PackedRow`:
  ``input_ids``, ``labels``, ``position_ids``, ``nopad_meta``) with ``labels = IGNORE_INDEX`` at
  every sequence's first token.
- **Attention**: the model is switched to nopad's varlen attention (``attention="nopad"``), so no
  sequence attends to its neighbour whatever the hardware (TRL #2834 / #3910).
- **Loss**: ``NopadTrainer`` computes it through nopad's chunked LM head (no ``T x V`` logits);
  ``NopadSFTTrainer`` keeps TRL's own (``loss_type="nll"`` / ``"chunked_nll"``, TRL's fused head
  on the loss positions). Either way Trainer divides the summed token loss of each micro-batch by
  ``num_items_in_batch`` (the loss tokens of the whole accumulation window, over all ranks) and
  counts it from ``labels[..., 1:]``; our labels make that count exactly the tokens the unpacked
  data trains on, so loss and gradients equal the unpacked run's.
- **Resume**: a Trainer "epoch" is ``len(loader)`` batches of the endless stream of packed epochs
  0, 1, 2... (packed epochs may differ by a bin or two in length), so the batches at any
  ``global_step`` are a pure function of (data, budget, seed, world size). Trainer's own
  ``resume_from_checkpoint`` skip therefore lands on exactly the batch an uninterrupted run would
  take next - it skips index lists, not data. The loader's state is saved in every checkpoint
  (``nopad_loader.json``) and checked on resume (``PackedBatchSampler.load_state_dict``: budget, seed,
  world size, dataset size), so such a change is an error instead of silently different batches.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, Sampler
from transformers import Trainer, TrainerCallback
from transformers.trainer_utils import PREFIX_CHECKPOINT_DIR, get_last_checkpoint

from nopad.dataloaders.collator import PackedCollator
from nopad.dataloaders.dataset import MASK_COLUMNS, PackedDataset, PackedItem
from nopad.dataloaders.loader import packed_dataloader
from nopad.dataloaders.sampler import PackedBatchSampler
from nopad.packing.hf import compat
from nopad.packing.row import PackedRow, as_row

logger = logging.getLogger(__name__)

STATE_FILE = "nopad_loader.json"


class TrainerEpochSampler(Sampler[list[PackedItem]]):
    """Trainer epoch ``e`` = batches ``[e * L, (e + 1) * L)`` of the stream packed-epoch 0, 1, ...,
    where ``L`` is the length of packed epoch 0: a fixed epoch length, as Trainer's step arithmetic
    needs, without dropping or repeating a batch when packed epochs differ in length."""

    def __init__(self, packed: PackedBatchSampler):
        self.packed = packed
        self._lengths: list[int] = []  # batches in packed epoch 0, 1, ... (planned on demand)
        self.steps_per_epoch = self._length(0)
        self.epoch = 0

    def _length(self, packed_epoch: int) -> int:
        while len(self._lengths) <= packed_epoch:
            self.packed.set_epoch(len(self._lengths))
            self._lengths.append(len(self.packed))
        return self._lengths[packed_epoch]

    def set_epoch(self, epoch: int) -> None:
        self.epoch = int(epoch)

    def __len__(self) -> int:
        return self.steps_per_epoch

    def __iter__(self) -> Iterator[list[PackedItem]]:
        start, packed_epoch = self.epoch * self.steps_per_epoch, 0
        while start >= self._length(packed_epoch):
            start -= self._length(packed_epoch)
            packed_epoch += 1
        remaining = self.steps_per_epoch
        while remaining:
            self.packed.set_epoch(packed_epoch)
            self.packed.start_step = start
            for batch in self.packed:
                yield batch
                remaining -= 1
                if not remaining:
                    break
            packed_epoch, start = packed_epoch + 1, 0

    def state_dict(self) -> dict:
        return {"packed": self.packed.state_dict(), "steps_per_epoch": self.steps_per_epoch, "epoch": self.epoch}

    def load_state_dict(self, state: dict) -> None:
        """Check the checkpoint was made with the same data, budget, seed and world size (the
        position itself comes from Trainer's step count)."""
        epoch = self.packed.epoch
        self.packed.load_state_dict(state["packed"])  # raises on a different fingerprint
        self.packed.set_epoch(epoch)
        if int(state["steps_per_epoch"]) != self.steps_per_epoch:
            raise ValueError(
                f"cannot resume: the checkpoint's loader had {state['steps_per_epoch']} batches "
                f"per epoch, this one {self.steps_per_epoch}; resume with the same data and "
                "settings"
            )
        self.epoch = int(state["epoch"])


class PackedTrainerLoader(DataLoader):
    """A plain ``DataLoader`` over :class:`TrainerEpochSampler` (so Accelerate's
    ``skip_first_batches`` can wrap it on resume); ``set_epoch`` reaches the sampler."""

    def set_epoch(self, epoch: int) -> None:
        self.batch_sampler.set_epoch(epoch)


class _SaveLoaderState(TrainerCallback):
    """Write the loader's state into every checkpoint directory Trainer saves."""

    def __init__(self, trainer: NopadTrainerMixin):
        self.trainer = trainer

    def on_save(self, args, state, control, **kwargs):
        sampler = getattr(self.trainer.nopad_loader, "batch_sampler", None)
        if sampler is None or not state.is_world_process_zero:
            return control
        folder = os.path.join(args.output_dir, f"{PREFIX_CHECKPOINT_DIR}-{state.global_step}")
        if os.path.isdir(folder):
            with open(os.path.join(folder, STATE_FILE), "w") as f:
                json.dump(sampler.state_dict(), f)
        return control


class NopadTrainerMixin:
    """Put in front of ``Trainer`` or any subclass: ``class T(NopadTrainerMixin, SomeTrainer)``.

    ``tokens_per_batch``: tokens in one packed micro-batch per device (default: ``args.max_length``
    x ``per_device_train_batch_size`` when the args have a ``max_length``, as ``SFTConfig`` does).
    ``attention``: the attention implementation to switch the model to (``None`` keeps the
    model's; transformers' sdpa/flash paths also honour packed ``position_ids``).
    """

    def __init__(self, *args: Any, tokens_per_batch: int | None = None, attention: str | None = "nopad", **kwargs: Any):
        compat.check()  # the Trainer's private names nopad overrides, before any other work
        if tokens_per_batch is not None and tokens_per_batch < 1:
            raise ValueError(f"tokens_per_batch must be >= 1, got {tokens_per_batch}")
        dataset = kwargs.get("train_dataset")
        if dataset is not None and hasattr(dataset, "__len__") and len(dataset) == 0:
            raise ValueError(
                "train_dataset is empty: there is nothing to pack or train on; check the "
                "dataset's filtering and split before building the trainer"
            )
        self.nopad_tokens_per_batch = tokens_per_batch
        self.nopad_loader: PackedTrainerLoader | None = None
        self._nopad_resume_state: dict | None = None
        super().__init__(*args, **kwargs)
        if attention is not None:
            from nopad.training.sft import use_attention

            use_attention(self.accelerator.unwrap_model(self.model), attention)
        self.add_callback(_SaveLoaderState(self))

    # ----------------------------------------------------------------- loaders
    def nopad_tokens(self) -> int:
        if self.nopad_tokens_per_batch is not None:
            return self.nopad_tokens_per_batch
        max_length = getattr(self.args, "max_length", None)
        if max_length:
            return int(max_length) * int(self.args.per_device_train_batch_size)
        raise ValueError(
            "pass tokens_per_batch=... (tokens in one packed micro-batch per device); these "
            "training arguments have no max_length to derive it from"
        )

    def nopad_columns(self, dataset: Any) -> Any:
        """The columns the packed loader reads (ids, labels, loss masks): rows are fetched whole."""
        names = getattr(dataset, "column_names", None)
        if names is None or not hasattr(dataset, "select_columns"):
            return dataset
        return dataset.select_columns([c for c in ("input_ids", "labels", *MASK_COLUMNS) if c in names])

    def _nopad_dataset(self, dataset: Any, what: str) -> PackedDataset:
        if dataset is None:
            raise ValueError(f"Trainer: {what} requires a dataset")
        if isinstance(dataset, IterableDataset) or type(dataset).__name__ == "IterableDataset":
            raise ValueError(
                f"the {what} dataset is a stream; the packed Trainer loader plans whole epochs. "
                "Use a map-style dataset, or nopad.dataloaders.StreamingPackedLoader in your own loop"
            )
        return PackedDataset(self.nopad_columns(dataset))

    def get_train_dataloader(self) -> PackedTrainerLoader:
        dataset = self._nopad_dataset(self.train_dataset, "training")
        args = self.args
        packed = PackedBatchSampler(
            dataset.lengths,
            self.nopad_tokens(),
            num_replicas=args.world_size,
            rank=args.process_index,
            seed=args.data_seed if args.data_seed is not None else args.seed,
        )
        sampler = TrainerEpochSampler(packed)
        if self._nopad_resume_state is not None:
            sampler.load_state_dict(self._nopad_resume_state)
        self.nopad_loader = PackedTrainerLoader(
            dataset,
            batch_sampler=sampler,
            collate_fn=PackedCollator(),
            num_workers=args.dataloader_num_workers,
            pin_memory=args.dataloader_pin_memory,
            persistent_workers=args.dataloader_persistent_workers and args.dataloader_num_workers > 0,
        )
        return self.nopad_loader

    def get_eval_dataloader(self, eval_dataset: Any = None) -> DataLoader:
        """Packed too (nopad attention refuses padded batches), in a fixed order."""
        if isinstance(eval_dataset, str):
            eval_dataset = self.eval_dataset[eval_dataset]
        if eval_dataset is None:
            eval_dataset = self.eval_dataset
        dataset = self._nopad_dataset(eval_dataset, "evaluation")
        return packed_dataloader(
            dataset, self.nopad_tokens(), num_replicas=self.args.world_size, rank=self.args.process_index, shuffle=False
        )

    # ----------------------------------------------------------------- steps
    def _prepare_inputs(self, inputs: PackedRow | dict) -> dict:
        """The model's arguments of a packed row on the training device: not its bookkeeping
        (``seq_lens``, ``indices``, counts), and its ``VarlenMeta``, which Trainer's tensor mover
        does not know, moved with it."""
        if not isinstance(inputs, PackedRow) and "nopad_meta" not in inputs:
            return super()._prepare_inputs(inputs)
        return as_row(inputs).to(self.args.device, non_blocking=True).model_kwargs(labels=True)

    def train(self, resume_from_checkpoint: str | bool | None = None, *args: Any, **kwargs: Any):
        self._nopad_resume_state = None
        checkpoint = resume_from_checkpoint
        if checkpoint is True:
            checkpoint = get_last_checkpoint(self.args.output_dir)
        if isinstance(checkpoint, str):
            path = os.path.join(checkpoint, STATE_FILE)
            if os.path.isfile(path):
                with open(path) as f:
                    self._nopad_resume_state = json.load(f)
            else:
                logger.warning(
                    "%s has no %s (saved without the nopad loader?): resuming by Trainer's step "
                    "count without checking that data, budget, seed and world size are unchanged",
                    checkpoint,
                    STATE_FILE,
                )
        return super().train(resume_from_checkpoint, *args, **kwargs)


class NopadTrainer(NopadTrainerMixin, Trainer):
    """transformers ``Trainer`` on nopad packed batches; give ``tokens_per_batch``. Its loss runs
    the chunked LM head (:func:`nopad.training.loss.row_nll_sum`) instead of the model's own, which would
    build the row's ``T x V`` logits: the same value, normalised as Trainer normalises the model's."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        custom = self.label_smoother is not None or self.compute_loss_func is not None
        if return_outputs or custom or "nopad_meta" not in inputs or "labels" not in inputs:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        from nopad.training.loss import row_nll_sum

        total = row_nll_sum(model, as_row(inputs))
        if self.model_accepts_loss_kwargs and num_items_in_batch is not None:
            loss = total / num_items_in_batch  # the window's loss tokens on every rank, as the model's loss
            if self.args.average_tokens_across_devices:
                loss = loss * (self.accelerator.num_processes // self.get_tp_size())
            return loss
        return total / max(as_row(inputs).num_loss_tokens, 1)  # the model's own mean over this batch
