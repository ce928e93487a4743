"""The paged K/V tensors the generator owns: per layer, ``(num_blocks, block_size, kv_heads,
head_dim)`` for keys and values. The block allocator decides which blocks a sequence uses."""

from __future__ import annotations

import torch


def kv_shape(config) -> tuple[int, int, int]:
    """(num_layers, kv_heads, head_dim) of a transformers decoder config."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return config.num_hidden_layers, kv_heads, head_dim


def bytes_per_block(config, block_size: int, dtype: torch.dtype) -> int:
    layers, kv_heads, head_dim = kv_shape(config)
    return 2 * layers * block_size * kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()


class KVCache:
    """``cache[layer] -> (k, v)``, each ``(num_blocks, block_size, kv_heads, head_dim)``."""

    def __init__(self, config, num_blocks: int, block_size: int, dtype: torch.dtype, device):
        layers, kv_heads, head_dim = kv_shape(config)
        self.num_blocks, self.block_size = num_blocks, block_size
        shape = (num_blocks, block_size, kv_heads, head_dim)
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(layers)]

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[layer], self.v[layer]

    def __len__(self) -> int:
        return len(self.k)

    def copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy-on-write: copy block ``src`` into ``dst`` in every layer."""
        if not pairs:
            return
        device = self.k[0].device
        src = torch.tensor([s for s, _ in pairs], device=device)
        dst = torch.tensor([d for _, d in pairs], device=device)
        for k, v in zip(self.k, self.v):
            k[dst] = k[src]
            v[dst] = v[src]

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)
