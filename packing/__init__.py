"""nopad's core: packing algorithms, the varlen metadata record, varlen attention, the block
allocator and the transformers integration. Both the training side (``dataloaders``) and the
generation side (``inference``) import from here; nothing here imports them.

Names are loaded lazily so ``from nopad import packing`` stays cheap.
"""

from __future__ import annotations

import importlib
import logging

logging.getLogger(__name__).addHandler(logging.NullHandler())

_EXPORTS = {
    "VarlenMeta": "nopad.packing.varlen",
    "varlen_attention": "nopad.packing.attention",
    "store_kv": "nopad.packing.attention",
}


def _export(module: str, *names: str) -> None:
    """Let a core module add its public names (used by the modules listed in __all__)."""
    for name in names:
        _EXPORTS[name] = module


# Public names by module. Each entry: module -> names it provides.
_export("nopad.packing.bins.stats", "Bins", "PackStats")
_export("nopad.packing.bins.binpack", "pack")
_export("nopad.packing.bins.streaming", "StreamingPacker")
_export("nopad.packing.bins.hf_datasets", "pack_dataset")
_export("nopad.packing.blocks", "BlockAllocator", "OutOfBlocksError")
_export("nopad.packing.row", "PackedRow", "IGNORE_INDEX")
_export("nopad.packing.hf.attention", "register_nopad_attention", "NOPAD_ATTENTION", "use_nopad_attention")
_export("nopad.packing.hf.packed_call", "packed_forward_guard")
_export("nopad.packing.hf.verification", "verify", "VerifyReport")
_export("nopad.packing.invariance", "batch_invariant")
_export("nopad.packing.head.chunked", "token_logprobs", "nll_sum")
_export("nopad.packing.head.model_head", "LMHead")

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'nopad.packing' has no attribute {name!r}")
    return getattr(importlib.import_module(module), name)


def __dir__() -> list[str]:
    return __all__
