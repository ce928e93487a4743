"""TRL's ``SFTTrainer`` on nopad packed batches: :class:`nopad.training.trainer.NopadTrainerMixin` in front of it.

from nopad.training.trl.sft_trainer import NopadSFTTrainer
trainer = NopadSFTTrainer(model, args=SFTConfig(max_length=1024, packing=False, ...),
                          train_dataset=ds, processing_class=tok)
"""

from __future__ import annotations

from typing import Any

from nopad.training.trainer import NopadTrainerMixin
from nopad.training.trl import lazy_class
from nopad.training.trl.compat import check_sft_trainer


def _sft_trainer_class() -> type:
    from trl import SFTTrainer

    class NopadSFTTrainer(NopadTrainerMixin, SFTTrainer):
        """TRL ``SFTTrainer`` on nopad packed batches: SFTTrainer tokenizes, masks and truncates
        (``packing=False``); nopad packs, balances and attends."""

        def __init__(self, *args: Any, **kwargs: Any):
            sft_args = kwargs.get("args")
            if sft_args is not None and getattr(sft_args, "packing", False):
                raise ValueError(
                    "NopadSFTTrainer packs by itself: set SFTConfig(packing=False) (TRL's packing would pack twice)"
                )
            check_sft_trainer(type(self))
            super().__init__(*args, **kwargs)

        def nopad_columns(self, dataset: Any) -> Any:
            names = getattr(dataset, "column_names", None) or []
            # older TRL leaves completion_mask for its collator, which applies it only when asked
            applies = getattr(self, "completion_only_loss", True)
            if "labels" not in names and "completion_mask" in names and not applies:
                dataset = dataset.remove_columns("completion_mask")
            return super().nopad_columns(dataset)

    return NopadSFTTrainer


__getattr__ = lazy_class(globals(), "NopadSFTTrainer", _sft_trainer_class)
