"""Token mixers besides attention (recurrent states, convolutions over time, sinks): which ones
nopad computes exactly on packed rows, tree rows and in the generator, and a clear refusal for
every other (:mod:`nopad.packing.mixers.support`). A new mixing kind is one module that registers a
:class:`MixerSupport`, with, for the generator, the state it keeps per sequence
(:mod:`nopad.packing.mixers.state`): :mod:`nopad.packing.mixers.hf_kernels` (Gated DeltaNet, KDA,
short convolutions) and :mod:`nopad.packing.mixers.mamba2` (Mamba2 layers), packed and tree rows and
the generator; :mod:`nopad.packing.mixers.sinks` (attention sinks) everywhere."""

from nopad.packing.mixers import (
    hf_kernels,  # noqa: E402,F401  registers the support of transformers' hybrid kernels
    mamba2,  # noqa: F401  (registers its support on import)
)
from nopad.packing.mixers import sinks as _sinks  # noqa: F401  (registers the attention-sink support)
from nopad.packing.mixers.calling_model import check_calling_model
from nopad.packing.mixers.conv import varlen_causal_conv1d
from nopad.packing.mixers.delta_rule import varlen_delta_rule
from nopad.packing.mixers.recurrence import RecurrencePlan, recurrence_plan
from nopad.packing.mixers.state import LayerState, StateSpec, step_states
from nopad.packing.mixers.support import (
    CONTEXTS,
    GENERATE,
    PACKED,
    TREE,
    Finding,
    MixerSupport,
    UnsupportedMixerError,
    check_model,
    register_mixer_support,
    scan,
    unregister_mixer_support,
    unsupported,
)

__all__ = [
    "CONTEXTS",
    "GENERATE",
    "PACKED",
    "TREE",
    "Finding",
    "MixerSupport",
    "UnsupportedMixerError",
    "check_calling_model",
    "check_model",
    "register_mixer_support",
    "scan",
    "unregister_mixer_support",
    "unsupported",
    "varlen_causal_conv1d",
    "varlen_delta_rule",
    "RecurrencePlan",
    "recurrence_plan",
    "LayerState",
    "StateSpec",
    "step_states",
]
