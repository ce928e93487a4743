"""What turns packed rows into a training step: one globally normalised optimizer step per window
of rows, under any engine (``accumulation``), the SFT step and its data (``sft``, ``sft_data``),
the GRPO step (``grpo_step``) over rollouts -> packed rows -> log-probs (``grpo``), the losses
(``loss``; the GRPO family behind one seam: ``policy_loss``), checkpoints written whole
(``checkpoint``), the Accelerator (``accelerator``), the checks that stop a run on a NaN or
infinite reward, loss or gradient (``nonfinite``), packed batches in transformers' ``Trainer``
(``trainer``), and the TRL integration, all of it in one package (``trl``: ``grpo_trainer``,
``sft_trainer``, ``rollout``).

It sits on ``dataloaders`` and ``inference``, which stand side by side on ``packing``. Names are
imported lazily, so ``from nopad import training`` does not import TRL.
"""

import importlib

_EXPORTS = {
    "causal_lm_loss_sum": "nopad.training.loss",
    "row_loss_sum": "nopad.training.loss",
    "row_nll_sum": "nopad.training.loss",
    "OptimizerStepper": "nopad.training.accumulation",
    "NonFiniteError": "nopad.training.nonfinite",
    "Rollout": "nopad.training.grpo",
    "pack_rollouts": "nopad.training.grpo",
    "packed_logprobs": "nopad.training.grpo",
    "grpo_step": "nopad.training.grpo_step",
    "train_on_rollouts": "nopad.training.grpo_step",
    "sft_step": "nopad.training.sft",
    "NopadTrainer": "nopad.training.trainer",
    "NopadTrainerMixin": "nopad.training.trainer",
    "NopadSFTTrainer": "nopad.training.trl.sft_trainer",
    "NopadGRPOTrainer": "nopad.training.trl.grpo_trainer",
    "nopad_rollout_func": "nopad.training.trl.rollout",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nopad.training' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_EXPORTS)
