"""A strict CPU stand-in for PyTorch's ``torch.nn.attention.varlen.varlen_attn``, for tests only
(installed over the real function by the ``torch_varlen_standin`` fixture; the real one raises on
CPU tensors).

Written from torch's own code (``torch/nn/attention/varlen.py``: ``varlen_attn``, the
``_varlen_attn`` custom op and its autograd) and the checks of the FlashAttention-2 kernel it calls
(``aten::_flash_attention_forward`` -> ``mha_varlen_fwd``), with their messages, so a call that would
fail on a GPU fails here:

- q/k/v fp16 or bf16, all one dtype, all on q's device (the tests poison the default device);
- ``cu_seq_q/k`` int32, contiguous, ``(batch + 1,)``; ``max_q/max_k`` Python ints covering every
  sequence; head dim <= 256; a contiguous last dimension;
- query heads equal to KV heads unless ``enable_gqa=True`` (then a multiple) - ``varlen_attn``'s
  own ValueError;
- ``window_size`` a pair, ``(-1, 0)`` meaning causal (torch >= 2.12); torch 2.9's signature has
  ``is_causal`` and no ``scale`` or ``window_size``;
- paged K/V (torch >= 2.12): ``(pages, page_size, kv_heads, dim)`` with an int32 ``block_table``
  ``(batch, max_pages)`` with a contiguous last dimension, ``seqused_k`` required, pages a multiple of
  256 tokens (FlashAttention-2's paged check), and no backward ("block_table is an inference-only
  parameter").

The answer is FlashAttention's maths in fp32 (tests/flash_standin.reference_attention), returned
in q's dtype and differentiable. Every call is recorded in ``calls``.
"""

from __future__ import annotations

import torch

from tests.support.flash_standin import HALF, reference_attention

VERSIONS = ("2.9", "2.10", "2.12")


class TorchVarlenStandIn:
    """``varlen_attn`` as torch ``version`` spells it."""

    def __init__(self, version: str = "2.12"):
        if version not in VERSIONS:
            raise ValueError(f"unknown torch version {version!r}; one of {VERSIONS}")
        self.version = version
        self.calls: list[dict] = []
        self.varlen_attn = self._make()

    def _make(self):
        run = self._run
        if self.version == "2.9":

            def varlen_attn(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, is_causal=False, return_aux=None):
                return run(
                    query,
                    key,
                    value,
                    cu_seq_q,
                    cu_seq_k,
                    max_q,
                    max_k,
                    None,
                    (-1, 0) if is_causal else (-1, -1),
                    False,
                    None,
                    None,
                )
        elif self.version == "2.10":

            def varlen_attn(
                query,
                key,
                value,
                cu_seq_q,
                cu_seq_k,
                max_q,
                max_k,
                *,
                return_aux=None,
                scale=None,
                window_size=(-1, -1),
            ):
                return run(query, key, value, cu_seq_q, cu_seq_k, max_q, max_k, scale, window_size, False, None, None)
        else:

            def varlen_attn(
                query,
                key,
                value,
                cu_seq_q,
                cu_seq_k,
                max_q,
                max_k,
                *,
                return_aux=None,
                scale=None,
                window_size=(-1, -1),
                enable_gqa=False,
                seqused_k=None,
                block_table=None,
                num_splits=None,
            ):
                return run(
                    query,
                    key,
                    value,
                    cu_seq_q,
                    cu_seq_k,
                    max_q,
                    max_k,
                    scale,
                    window_size,
                    enable_gqa,
                    seqused_k,
                    block_table,
                )

        return varlen_attn

    def _check(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window, enable_gqa, seqused_k, table):
        def require(ok, message, error=RuntimeError):
            if not ok:
                raise error(message)

        require(q.dtype in HALF, "FlashAttention only support fp16 and bf16 data type")
        require(k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype")
        require(cu_q.dtype == torch.int32 and cu_k.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
        named = dict(key=k, value=v, cu_seq_q=cu_q, cu_seq_k=cu_k, seqused_k=seqused_k, block_table=table)
        for name, t in named.items():
            if t is not None:
                require(t.device == q.device, f"{name} must be on the device of query ({q.device}), got {t.device}")
        for t in (q, k, v):
            require(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        require(cu_q.is_contiguous() and cu_k.is_contiguous(), "cu_seqlens must be contiguous")
        for name, value in (("max_q", max_q), ("max_k", max_k)):
            require(type(value) is int, f"{name} must be a Python int (the op's schema is int)", TypeError)
        batch = cu_q.numel() - 1
        require(batch > 0 and cu_q.shape == cu_k.shape == (batch + 1,), "cu_seq_q/k must be (batch_size + 1,)")
        require(q.dim() == 3 and q.shape[-1] <= 256, "FlashAttention forward only supports head dimension at most 256")
        paged = table is not None
        heads, kv_heads = q.shape[1], (k.shape[2] if paged else k.shape[1])
        if not enable_gqa:
            require(
                heads == kv_heads,
                f"Expect query and key/value to have the same number of heads but got "
                f"Hq={heads} and Hkv={kv_heads}. Try setting enable_gqa=True for GQA.",
                ValueError,
            )
        require(heads % kv_heads == 0, "Expect number of query heads to be a multiple of kv heads for GQA", ValueError)
        window_ok = isinstance(window, (tuple, list)) and len(window) == 2 and all(type(w) is int for w in window)
        require(window_ok, "window_size must have length 2", ValueError)
        require(scale is None or type(scale) is float, "scale must be a float")
        lens_q = torch.diff(cu_q).tolist()
        if paged:
            require(seqused_k is not None, "block_table requires seqused_k")
            require(seqused_k.dtype == torch.int32 and seqused_k.shape == (batch,), "seqused_k must be int32 (batch,)")
            require(k.dim() == 4 and k.shape == v.shape, "paged key/value must be (pages, page_size, H_kv, D)")
            require(k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
            require(table.dtype == torch.int32, "block_table must have dtype torch.int32")
            require(table.stride(-1) == 1, "block_table must have contiguous last dimension")
            require(table.dim() == 2 and table.shape[0] == batch, "block_table must be (batch_size, max_pages)")
            require(not (q.requires_grad and torch.is_grad_enabled()), "block_table is an inference-only parameter.")
            lens_k = seqused_k.tolist()
        else:
            require(k.dim() == 3 and k.shape[0] >= int(cu_k[-1]), "key has fewer tokens than cu_seq_k describes")
            lens_k = torch.diff(cu_k).tolist()
        require(max(lens_q) <= max_q and max(lens_k) <= max_k, "max_q/max_k smaller than a sequence")
        return lens_q, lens_k

    def _run(self, q, k, v, cu_q, cu_k, max_q, max_k, scale, window, enable_gqa, seqused_k, table):
        lens_q, lens_k = self._check(q, k, v, cu_q, cu_k, max_q, max_k, scale, window, enable_gqa, seqused_k, table)
        window = tuple(window)
        causal = window == (-1, 0)
        self.calls.append(
            dict(
                dtype=q.dtype,
                paged=table is not None,
                window=window,
                gqa=enable_gqa,
                kv_heads=k.shape[-2],
                grad=q.requires_grad,
                num_seqs=len(lens_q),
                block_size=k.shape[1] if table is not None else None,
            )
        )
        return reference_attention(q, k, v, lens_q, lens_k, scale, causal, window, 0.0, table)
