"""The paged K/V tensors the generator owns: per layer that computes K/V, ``(num_blocks,
block_size, kv_heads, head_dim)`` for keys and values. The block allocator decides which blocks a
sequence uses.

Layers are not all alike (:func:`kv_layout` reads each one's from its attention module where the
module says, else from the config):

- a layer's own head count and size (Gemma4: a larger head on its full-attention layers;
  MiMo-V2-Flash: twice the K/V heads on its sliding layers, which its config does not give);
- keys and values of different sizes (MLA: DeepSeek-V3, Kimi): both are held at the larger size,
  the smaller zero-padded, as the attention computes them
  (:func:`nopad.packing.attention.dispatch.one_head_dim`), so every backend reads the blocks in place;
- a layer that reuses an earlier layer's K/V (Gemma4's K/V-shared layers) holds no blocks of its
  own: it reads the blocks of the layer it shares with. transformers hands it that layer's new
  keys too, and writing them again at the same slots changes nothing.

An attention call whose K/V do not fit its layer's blocks is refused by name
(:func:`nopad.packing.attention.dispatch.varlen_attention`), never written across a wrong shape.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from nopad.packing.mixers.support import calls_attention
from nopad.packing.model_config import text_config

if TYPE_CHECKING:
    from nopad.inference.state_cache import StateCache

DEFAULT_KV_MEMORY_BYTES = 1 << 30


@dataclass(frozen=True)
class LayerKV:
    """One layer's paged K/V: ``source`` is the layer whose blocks it reads (itself unless it
    reuses an earlier layer's K/V); each token holds ``kv_heads x head_dim`` keys and values."""

    source: int
    kv_heads: int
    head_dim: int


def _layer_heads(config, layer: int) -> tuple[int, int]:
    """(kv_heads, head_dim) of a layer: MLA expands its latent to one K/V head per query head,
    keys of ``qk_nope + qk_rope`` and values of ``v_head_dim`` (held at the larger); a per-layer
    config (Gemma4) overrides the model's head count and size."""
    heads = config.num_attention_heads
    if getattr(config, "qk_nope_head_dim", None) is not None and getattr(config, "v_head_dim", None):
        key_dim = config.qk_nope_head_dim + config.qk_rope_head_dim
        return heads, max(key_dim, config.v_head_dim)
    per_layer = getattr(config, "per_layer_config", None)
    own = per_layer[layer] if per_layer is not None else config
    kv_heads = getattr(own, "num_key_value_heads", None) or getattr(config, "num_key_value_heads", None) or heads
    head_dim = getattr(own, "head_dim", None) or config.hidden_size // heads
    return kv_heads, head_dim


def _module_heads(module: nn.Module | None) -> tuple[int, int] | None:
    """(kv_heads, head_dim) of an attention module with separate ``k_proj`` / ``v_proj`` linear
    layers and a ``head_dim``: what it computes, whatever its config says (None: it does not say)."""
    k, v, head_dim = (getattr(module, name, None) for name in ("k_proj", "v_proj", "head_dim"))
    linear = isinstance(k, nn.Linear) and isinstance(v, nn.Linear)
    if not (linear and isinstance(head_dim, int) and head_dim > 0):
        return None
    kv_heads, rest = divmod(k.out_features, head_dim)
    if rest or not kv_heads or v.out_features % kv_heads:
        return None
    return kv_heads, max(head_dim, v.out_features // kv_heads)


def attention_modules(model: nn.Module) -> dict[int, nn.Module]:
    """Each decoder layer's attention module (one that calls transformers' attention interface), by
    its ``layer_idx``."""
    found = {}
    for module in model.modules():
        idx = getattr(module, "layer_idx", None)
        if isinstance(idx, int) and idx not in found and calls_attention(module):
            found[idx] = module
    return found


def _sources(config) -> list[int]:
    """Which layer's K/V each layer reads: its own, or, for a layer transformers marks as reusing
    K/V (``kv_sharing_modes``: Gemma4), the layer of the same kind that stores them."""
    layers = config.num_hidden_layers
    modes = getattr(config, "kv_sharing_modes", None)
    if not isinstance(modes, (list, tuple)) or len(modes) != layers or "reuse" not in modes:
        return list(range(layers))
    kinds = getattr(config, "layer_types", None) or [None] * layers
    store = {kinds[i]: i for i in range(layers) if modes[i] == "store"}
    sources = []
    for i in range(layers):
        if modes[i] != "reuse":
            sources.append(i)
        elif kinds[i] in store and store[kinds[i]] < i:
            sources.append(store[kinds[i]])
        else:
            raise ValueError(
                f"layer {i} reuses K/V of a {kinds[i]!r} layer but no earlier layer stores them "
                f"(kv_sharing_modes {list(modes)}); the generator cannot lay out its cache"
            )
    return sources


def kv_layout(config, model: nn.Module | None = None) -> list[LayerKV]:
    """Every decoder layer's paged K/V (see the module docstring); with ``model``, a layer whose
    attention module says its heads (:func:`_module_heads`) is laid out as the module computes."""
    config = text_config(config)
    if not isinstance(getattr(config, "num_hidden_layers", None), int):
        raise ValueError(
            f"{type(config).__name__} gives no num_hidden_layers (nor a text config that does): "
            "the generator cannot lay out a paged K/V cache for a model of this shape "
            "(docs/models.md)"
        )
    modules = attention_modules(model) if model is not None else {}
    return [
        LayerKV(source, *(_module_heads(modules.get(source)) or _layer_heads(config, source)))
        for source in _sources(config)
    ]


def bytes_per_block(layout: list[LayerKV], block_size: int, dtype: torch.dtype) -> int:
    """Bytes of one block across every layer that holds K/V (shared layers hold none)."""
    size = torch.empty((), dtype=dtype).element_size()
    return sum(
        2 * block_size * layer.kv_heads * layer.head_dim * size for i, layer in enumerate(layout) if layer.source == i
    )


def num_kv_blocks(
    layout: list[LayerKV],
    block_size: int,
    dtype: torch.dtype,
    num_blocks: int | None,
    kv_memory_bytes: int | None,
    max_num_seqs: int,
    state_bytes: int,
    max_model_len: int,
) -> int:
    """``num_blocks`` if given, else how many fit in ``kv_memory_bytes`` (default 1 GiB, then
    capped at what ``max_num_seqs`` sequences of the model's full length need) after
    ``state_bytes`` of per-sequence state (hybrid models)."""
    if num_blocks is not None and kv_memory_bytes is not None:
        raise ValueError("give num_blocks or kv_memory_bytes, not both")
    if block_size < 1:
        raise ValueError(f"block_size must be >= 1, got {block_size}")
    if num_blocks is not None:
        return num_blocks
    per_block = bytes_per_block(layout, block_size, dtype)
    num_blocks = max(0, (kv_memory_bytes or DEFAULT_KV_MEMORY_BYTES) - state_bytes) // per_block
    if kv_memory_bytes is None:
        full_length = math.ceil(min(max_model_len, 1 << 20) / block_size)
        num_blocks = min(num_blocks, max_num_seqs * full_length)
    if num_blocks < 1:
        raise ValueError(
            f"kv_memory_bytes={kv_memory_bytes} is less than one KV block ({per_block} bytes) after "
            f"the per-sequence state of max_num_seqs={max_num_seqs} sequences ({state_bytes} bytes)"
        )
    return num_blocks


class KVCache:
    """``cache[layer] -> (k, v)``, each ``(num_blocks, block_size, kv_heads, head_dim)`` of that
    layer's :class:`LayerKV` (a K/V-shared layer gets its source layer's tensors). ``states``: a
    hybrid model's per-sequence state slots (:mod:`nopad.inference.state_cache`; None: attention
    only), carried here because the step's kernel calls get this cache as ``nopad_kv_cache``."""

    def __init__(
        self,
        layout: list[LayerKV],
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device,
        states: StateCache | None = None,
    ):
        self.layout = layout
        self.states = states
        self.num_blocks, self.block_size = num_blocks, block_size
        self.k: list[torch.Tensor] = []  # one per layer that holds K/V
        self.v: list[torch.Tensor] = []
        self._slot: list[int] = []  # layer -> index into self.k / self.v
        for i, layer in enumerate(self.layout):
            if layer.source != i:
                self._slot.append(self._slot[layer.source])
                continue
            shape = (num_blocks, block_size, layer.kv_heads, layer.head_dim)
            self._slot.append(len(self.k))
            self.k.append(torch.zeros(shape, dtype=dtype, device=device))
            self.v.append(torch.zeros(shape, dtype=dtype, device=device))

    def __getitem__(self, layer: int) -> tuple[torch.Tensor, torch.Tensor]:
        slot = self._slot[layer]
        return self.k[slot], self.v[slot]

    def __len__(self) -> int:
        return len(self.layout)

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
