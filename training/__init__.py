"""What turns packed rows into a training step: the loss normalised across accumulation and ranks
(``loss``), one optimizer step per window (``accumulation``), GRPO rollouts -> packed rows ->
log-probs (``grpo``), checkpoints written whole (``checkpoint``), the Accelerator (``accelerator``),
and the transformers / TRL integrations (``trainer``, ``grpo_trainer``, ``trl_rollout``).

It sits on ``dataloaders`` and ``inference``, which stand side by side on ``packing``. Names are
imported lazily, so ``import training`` does not import TRL.
"""

import importlib

_EXPORTS = {
    "PackedLoss": "training.loss",
    "causal_lm_loss_sum": "training.loss",
    "RowAccumulator": "training.accumulation",
    "Rollout": "training.grpo",
    "pack_rollouts": "training.grpo",
    "packed_logprobs": "training.grpo",
    "NopadTrainer": "training.trainer",
    "NopadTrainerMixin": "training.trainer",
    "NopadSFTTrainer": "training.trainer",
    "NopadGRPOTrainer": "training.grpo_trainer",
    "nopad_rollout_func": "training.trl_rollout",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_EXPORTS)
