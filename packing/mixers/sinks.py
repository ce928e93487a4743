"""Attention sinks (gpt-oss): one learned logit per head that joins every softmax denominator and
adds no value. nopad computes them exactly on every path - packed rows, prefix-tree rows and the
generator's paged steps - when the layer hands them to the attention interface as ``s_aux`` (what
transformers' gpt-oss attention does): :func:`nopad.packing.hf.attention.nopad_attention` passes them on
as ``sinks`` and only backends declared to take them run the layer (:mod:`nopad.packing.attention`).

A sink parameter used any other way is not claimed here, so :mod:`nopad.packing.mixers.support` still
refuses it.
"""

from __future__ import annotations

import inspect

from torch import nn

from nopad.packing.mixers.support import ALL_CONTEXTS, MixerSupport, calls_attention, register_mixer_support

_PASSES_SINKS: dict[type, bool] = {}
SINKS_ARGUMENT = "s_aux="  # how transformers' gpt-oss attention hands its sinks on (read in its source)


def _passes_sinks(cls: type) -> bool:
    """Whether ``cls.forward`` hands its sinks to the attention interface as ``s_aux``."""
    if cls not in _PASSES_SINKS:
        try:
            source = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            source = ""
        _PASSES_SINKS[cls] = SINKS_ARGUMENT in source
    return _PASSES_SINKS[cls]


def handles_sinks(module: nn.Module) -> bool:
    """An attention module with a ``sinks`` parameter that it passes to nopad's attention."""
    own = {name for name, _ in module.named_parameters(recurse=False)}
    return "sinks" in own and calls_attention(module) and _passes_sinks(type(module))


# computed inside the attention call, so exact wherever the attention has the row's boundaries,
# including those it derives from position_ids alone
# (and they stand for no layer kind: a layer declared as another kind of attention is not theirs)
SINKS = MixerSupport("attention sinks (s_aux)", handles_sinks, frozenset(ALL_CONTEXTS), layer_kinds=frozenset())
register_mixer_support(SINKS)
