"""GRPO-family policy losses behind one seam (:mod:`.base`): ``loss_type`` names and knobs as TRL
1.16's ``GRPOConfig`` (declared once, without torch, in :mod:`.settings`); each loss a class in
:mod:`.losses`; IS correction modes in :mod:`.importance`.

Names are imported lazily, so a recipe's config reads :mod:`.settings` without importing torch;
taking any name from this package registers the losses first.
"""

import importlib

_EXPORTS = {
    "IS_MODES": "nopad.training.policy_loss.importance",
    "importance_weights": "nopad.training.policy_loss.importance",
    "LOSSES": "nopad.training.policy_loss.base",
    "PolicyBatch": "nopad.training.policy_loss.base",
    "PolicyLoss": "nopad.training.policy_loss.base",
    "PolicyLossConfig": "nopad.training.policy_loss.base",
    "PolicyLossOutput": "nopad.training.policy_loss.base",
    "make_policy_loss": "nopad.training.policy_loss.base",
    "objective": "nopad.training.policy_loss.base",
    "register": "nopad.training.policy_loss.base",
    "PolicyLossSettings": "nopad.training.policy_loss.settings",
}


def __getattr__(name: str):
    if name in _EXPORTS:
        importlib.import_module("nopad.training.policy_loss.losses")  # registers the losses
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'nopad.training.policy_loss' has no attribute {name!r}")


def __dir__() -> list[str]:
    return sorted(_EXPORTS)
