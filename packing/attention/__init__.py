"""Varlen attention: one entry point (:func:`varlen_attention`) over backends that declare what
they support (:mod:`nopad.packing.attention.registry`), one module per backend:

- ``flash``: flash-attn 2/3 (CUDA, when installed);
- ``torch_varlen``: PyTorch's own FlashAttention varlen (CUDA, nothing to build);
- ``flex``: FlexAttention, for layers with a softcap on CUDA;
- ``triton``: nopad's Triton kernel (CUDA: paged steps, and the batch-invariant mode);
- ``kernel``: nopad's compiled C++ kernel (CPU: paged steps, and the batch-invariant mode);
- ``sdpa_loop`` / ``sdpa_padded`` / ``sdpa_dense`` / ``per_token``: exact PyTorch SDPA paths.

:func:`choose_backend` is the one rule that picks among them; ``NOPAD_ATTN_BACKEND`` or
``backend=`` names one instead. A forward makes the choice once, in its
:class:`~nopad.packing.attention.plan.AttentionPlan`, which every layer reads.
"""

from nopad.packing.attention.dispatch import gather_kv, store_kv, varlen_attention
from nopad.packing.attention.plan import choose_backend, paged_block_size
from nopad.packing.attention.registry import BACKEND_ENV, names

__all__ = ["BACKEND_ENV", "choose_backend", "gather_kv", "names", "paged_block_size", "store_kv", "varlen_attention"]
