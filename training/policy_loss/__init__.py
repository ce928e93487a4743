"""GRPO-family policy losses behind one seam (:mod:`.base`): ``loss_type`` names and knobs as TRL
1.16's ``GRPOConfig``; each loss a class in :mod:`.losses`; IS correction modes in :mod:`.importance`.
"""

from training.policy_loss import losses as _losses  # noqa: F401  (registers the losses)
from training.policy_loss.base import (
    LOSSES,
    PolicyBatch,
    PolicyLoss,
    PolicyLossConfig,
    PolicyLossOutput,
    make_policy_loss,
    objective,
    register,
)
from training.policy_loss.importance import IS_MODES, importance_weights

__all__ = [
    "IS_MODES",
    "LOSSES",
    "PolicyBatch",
    "PolicyLoss",
    "PolicyLossConfig",
    "PolicyLossOutput",
    "importance_weights",
    "make_policy_loss",
    "objective",
    "register",
]
