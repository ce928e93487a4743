"""The guard on a packed forward under another attention implementation: transformers' own packed path
(``sdpa``/``eager``/``flash_attention_2`` with packed ``position_ids``) is exact only with
``attention_mask=None`` and no cache, and a shared-prefix row's labels would be shifted wrongly;
:func:`check_packed_call` raises in those cases instead of returning wrong logits, and
:func:`packed_forward_guard` runs it before every forward of a model."""

from __future__ import annotations

import torch
import transformers

from nopad.packing.mixers import PACKED, check_model
from nopad.packing.mixers.support import NOPAD_ATTENTION


def _is_packed(position_ids: torch.Tensor | None) -> bool:
    """True when a row of ``position_ids`` restarts (several sequences in one row)."""
    if position_ids is None or position_ids.shape[-1] < 2:
        return False
    return bool((position_ids[..., 1:] != position_ids[..., :-1] + 1).any())


def check_packed_call(model: transformers.PreTrainedModel, kwargs: dict) -> None:
    """Raise instead of letting a packed forward return wrong logits (see the module docstring)."""
    position_ids = kwargs.get("position_ids")
    meta = kwargs.get("nopad_meta")
    impl = model.config._attn_implementation
    if meta is not None and position_ids is None:
        raise ValueError("nopad_meta given without position_ids; pass position_ids=meta.position_ids[None]")
    if meta is not None and meta.key_index is not None and kwargs.get("labels") is not None:
        raise ValueError(
            "labels= with a shared-prefix row: the model's loss predicts token t from t - 1, but a "
            "completion's first token is predicted by its prompt's last token. Compute the loss from the "
            "logits at nopad_meta.previous_rows() (see nopad.training.grpo.packed_logprobs)."
        )
    if meta is None and not _is_packed(position_ids):
        return
    if impl == NOPAD_ATTENTION:
        return  # the nopad path reads the boundaries itself; padding masks are refused there
    mask = kwargs.get("attention_mask")
    if mask is not None:
        raise ValueError(
            f"packed row with attention_mask under attn_implementation={impl!r}: transformers then "
            "ignores the packing and attends across sequences. Pass attention_mask=None (or use 'nopad')."
        )
    use_cache = kwargs.get("use_cache")
    if use_cache is None:
        use_cache = getattr(model.config, "use_cache", False)
    if use_cache and kwargs.get("cache", kwargs.get("past_key_values")) is None:  # the old name until 5.40
        raise ValueError(
            f"packed row with use_cache=True under attn_implementation={impl!r}: transformers 5 only "
            "honours packed position_ids without a cache. Pass use_cache=False (or use 'nopad')."
        )


def packed_forward_guard(model: transformers.PreTrainedModel, context: str = PACKED):
    """Install a forward pre-hook that runs :func:`check_packed_call`; returns the hook handle.
    A model with a layer nopad does not compute exactly for ``context`` (``nopad.packing.mixers``) is
    refused here first, naming the layer."""
    check_model(model, context)

    def hook(module, args, kwargs):
        check_packed_call(module, kwargs)

    return model.register_forward_pre_hook(hook, with_kwargs=True)
