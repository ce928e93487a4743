"""nopad inside TRL: the one place in the library that imports ``trl``.

``grpo_trainer``: ``NopadGRPOTrainer`` (packed training forwards), ``rollout``: ``nopad_rollout_func``
(nopad's generator as TRL's ``rollout_func``), ``sft_trainer``: ``NopadSFTTrainer``. Every module
imports ``trl`` lazily, so importing this package does not import TRL.
"""
