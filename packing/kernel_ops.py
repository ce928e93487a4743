"""The attention kernel as a PyTorch custom op, so ``torch.compile`` sees one opaque call.

Why: a compiled decode step (``Generator(compile_decode=True)``) fuses the model's small ops
(RMSNorm, RoPE, SiLU, residual adds) around attention, but the kernel is called through raw data
pointers and host arrays, which dynamo cannot trace: every layer would break the graph. As a
custom op it takes only tensors with static-shape-friendly arguments (the static decode step's
block table and context lengths) and has a fake implementation, so the whole decode forward
compiles to one graph, with dynamic batch and table width.
"""

from __future__ import annotations

import numpy as np
import torch

from packing import kernel_attention


@torch.compiler.assume_constant_result
def built() -> bool:
    """The kernel was built (decided once: dynamo cannot trace the extension's import)."""
    return kernel_attention.kernel() is not None


def serves(device: torch.device, dtype: torch.dtype) -> bool:
    """:func:`paged_decode` can run attention on ``device`` in ``dtype``."""
    return device.type == "cpu" and dtype in kernel_attention.DTYPE_CODES and built()


@torch.library.custom_op("nopad::paged_decode", mutates_args=())
def paged_decode(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_table: torch.Tensor,
                 context_lens: torch.Tensor, scale: float, window: int, softcap: float) -> torch.Tensor:
    """One query per row ``q (rows, heads, dim)`` over that row's keys in a paged cache
    ``(blocks, block_size, kv_heads, dim)``: ``context_lens[i]`` keys through ``block_table[i]``.
    Same kernel, same per-query order as every other CPU generation step."""
    rows = q.shape[0]
    out = torch.empty_like(q)
    if rows == 0:
        return out
    block_size = k_cache.shape[1]
    lens = np.ascontiguousarray(context_lens.numpy(), dtype=np.int32)
    table = np.ascontiguousarray(block_table.numpy(), dtype=np.int32)
    dtype_code = kernel_attention.DTYPE_CODES[q.dtype]
    kernel_attention.kernel().forward(
        q.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(), out.data_ptr(), dtype_code,
        k_cache.shape[0] * block_size, np.arange(rows + 1, dtype=np.int32), lens, None, table, block_size,
        q.shape[1], k_cache.shape[2], q.shape[2], scale, softcap, window, True, torch.get_num_threads(),
    )
    return out


@paged_decode.register_fake
def _(q, k_cache, v_cache, block_table, context_lens, scale, window, softcap):
    return torch.empty_like(q)
