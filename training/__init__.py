"""What turns packed rows into a training step: one globally normalised optimizer step per window
of rows, under any engine (``accumulation``), the SFT step and its data (``sft``, ``sft_data``),
the GRPO step (``grpo_step``) over rollouts -> packed rows -> log-probs (``grpo``), the losses
(``loss``; the GRPO family behind one seam: ``policy_loss``), checkpoints written whole
(``checkpoint``), the Accelerator (``accelerator``), the checks that stop a run on a NaN or
infinite reward, loss or gradient (``nonfinite``), packed batches in transformers' ``Trainer``
(``trainer``), and the TRL integration, all of it in one package (``trl``: ``grpo_trainer``,
``sft_trainer``, ``rollout``).

It sits on ``dataloaders`` and ``inference``, which stand side by side on ``packing``. Names are
imported lazily, so ``import training`` does not import TRL.
"""

import importlib

_EXPORTS = {
    "causal_lm_loss_sum": "training.loss",
    "row_loss_sum": "training.loss",
    "row_nll_sum": "training.loss",
    "OptimizerStepper": "training.accumulation",
    "NonFiniteError": "training.nonfinite",
    "Rollout": "training.grpo",
    "pack_rollouts": "training.grpo",
    "packed_logprobs": "training.grpo",
    "grpo_step": "training.grpo_step",
    "train_on_rollouts": "training.grpo_step",
    "sft_step": "training.sft",
    "NopadTrainer": "training.trainer",
    "NopadTrainerMixin": "training.trainer",
    "NopadSFTTrainer": "training.trl.sft_trainer",
    "NopadGRPOTrainer": "training.trl.grpo_trainer",
    "nopad_rollout_func": "training.trl.rollout",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'training' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_EXPORTS)
