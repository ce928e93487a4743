"""Token mixers besides attention (recurrent states, convolutions over time, sinks): which ones
nopad computes exactly on packed rows, tree rows and in the generator, and a clear refusal for
every other (:mod:`packing.mixers.support`). A new mixing kind is one module that registers a
:class:`MixerSupport`."""

from packing.mixers import sinks as _sinks  # noqa: F401  (registers the attention-sink support)
from packing.mixers.support import (
    CONTEXTS,
    GENERATE,
    PACKED,
    TREE,
    Finding,
    MixerSupport,
    UnsupportedMixerError,
    check_calling_model,
    check_model,
    register_mixer_support,
    scan,
    unregister_mixer_support,
    unsupported,
)

__all__ = ["CONTEXTS", "GENERATE", "PACKED", "TREE", "Finding", "MixerSupport", "UnsupportedMixerError",
           "check_calling_model", "check_model", "register_mixer_support", "scan", "unregister_mixer_support",
           "unsupported"]
