"""The attention function's own check of the model calling it: a forward no nopad entry point
prepared (a bare ``model.set_attn_implementation("nopad")``, compiled or not) reaches nopad's attention
with the attention module only, so the model :func:`~nopad.packing.mixers.support.check_model` checks is
the outermost ``PreTrainedModel`` holding that module, found once among the live objects."""

from __future__ import annotations

import gc
import weakref

import torch
from torch import nn

from nopad.packing.mixers.support import MODULE_CHECKED, PROBING, UnsupportedMixerError, check_model

_OWNERS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # module -> weakref of its model


def _owning_model(module: nn.Module) -> nn.Module | None:
    """The outermost ``PreTrainedModel`` holding ``module``, found among the live objects (one scan
    per model, then a look-up). Not the call stack: a traced forward has none to walk."""
    owner = _OWNERS.get(module)
    if owner is not None and owner() is not None:
        return owner()
    from transformers import PreTrainedModel

    holders = [
        o
        for o in gc.get_objects()  # type(), not isinstance(): a dead weakref.proxy raises
        if issubclass(type(o), PreTrainedModel) and any(m is module for m in o.modules())
    ]
    if not holders:
        return None
    model = max(holders, key=lambda o: sum(1 for _ in o.modules()))
    ref = weakref.ref(model)
    for m in model.modules():
        _OWNERS[m] = ref
    return model


@torch._dynamo.assume_constant_result
def _refusal_while_tracing(module: nn.Module, context: str) -> str:
    """check_model's refusal of the model holding ``module`` ("" if it passes or nothing holds it).
    Run by dynamo once, as it traces, and kept in the graph as a constant: no graph break and no
    work per step. Without it a bare ``torch.compile(model)`` on nopad attention skipped the check
    and ran an unknown recurrent layer across a packed row's boundaries with no error."""
    model = _owning_model(module)
    if model is None:
        return ""
    try:
        check_model(model, context, inside_forward=True)
    except UnsupportedMixerError as error:
        return str(error)
    return ""


def check_calling_model(module: nn.Module, context: str) -> None:
    """The attention function's check, for a forward that no nopad entry point prepared (a bare
    ``model.set_attn_implementation("nopad")``, compiled or not): it is called with its attention
    module only, so the model checked is the outermost ``PreTrainedModel`` holding ``module``
    (:func:`_owning_model`). Runs once per attention module and context (once per trace when
    compiled); a dictionary look-up after that."""
    if PROBING:
        return  # the boundary probe's own forward: its verdict is being decided
    if torch.compiler.is_compiling():
        refusal = _refusal_while_tracing(module, context)
        if refusal:
            raise UnsupportedMixerError(refusal)
        return
    done = MODULE_CHECKED.get(module)
    if done is not None and context in done:
        return
    model = _owning_model(module)
    if model is not None:
        check_model(model, context, inside_forward=True)
    MODULE_CHECKED.setdefault(module, set()).add(context)
