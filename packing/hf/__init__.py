"""nopad inside Hugging Face transformers: the ``"nopad"`` attention implementation
(``AttentionInterface``), the packed-forward guard and ``verify`` (packed == unpacked on a model)."""

from nopad.packing.hf import boundary_probe as _boundary_probe  # noqa: F401  (registers the boundary probe)
from nopad.packing.hf.attention import (
    NOPAD_ATTENTION,
    compute_dtype,
    nopad_attention,
    register_nopad_attention,
    use_nopad_attention,
)
from nopad.packing.hf.packed_call import check_packed_call, packed_forward_guard

__all__ = [
    "NOPAD_ATTENTION",
    "check_packed_call",
    "compute_dtype",
    "nopad_attention",
    "packed_forward_guard",
    "register_nopad_attention",
    "use_nopad_attention",
]
