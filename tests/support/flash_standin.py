"""A strict CPU stand-in for flash-attn, for tests only (installed into ``sys.modules`` by the
``flash_standin`` fixture of tests/packing/test_packing_precision.py, never on the library's import path).

Written from flash-attn's own checks (``csrc/flash_attn/flash_api.cpp::mha_varlen_fwd`` and
``flash_attn/flash_attn_interface.py``; flash-attn 3: ``hopper/flash_attn_interface.py``), with
flash-attn's error messages, so a call that would fail on a GPU fails here:

- q/k/v fp16 or bf16 (flash-attn 3: also fp8), and all one dtype;
- ``cu_seqlens_q/k`` int32, contiguous, shaped ``(batch + 1,)``, batch > 0;
- every tensor on q's device (``CHECK_DEVICE``: on a GPU "must be on CUDA"; here "the device" is
  q's, and the tests poison the default device so a tensor built without naming it is caught);
- q/k/v with a contiguous last dimension;
- ``max_seqlen_q/k`` Python ints (the custom op's schema is ``int``) covering every sequence;
- head dim <= 256 (flash-attn 3: also a multiple of 8), query heads a multiple of KV heads;
- paged K/V: ``(num_blocks, page_block_size, kv_heads, dim)`` with page size % 256 == 0 and an
  int32 ``block_table`` with a contiguous last dimension, shaped ``(batch, max_blocks)``;
- the signatures of 2.5 (no ``softcap``: passing it is a TypeError), 2.6+ (``softcap``) and 3
  (no ``dropout_p``, no ``block_table``; returns ``(out, softmax_lse)``).

The answer is computed per sequence in fp32 maths (bottom-right causal mask, ``window_size``
inclusive bounds, soft-capping, GQA) and returned in q's dtype, differentiable through autograd.
Every call is recorded in ``calls`` so tests can check what reached the kernel.
"""

from __future__ import annotations

import importlib.machinery
import math
import types

import torch

HALF = (torch.float16, torch.bfloat16)


class FlashStandIn:
    """One installed flash-attn version; ``module`` is what ``import flash_attn`` returns."""

    def __init__(self, version: str = "2.6"):
        if version not in ("2.5", "2.6", "3"):
            raise ValueError(f"unknown flash-attn version {version!r}")
        self.version = version
        self.calls: list[dict] = []
        name = "flash_attn_interface" if version == "3" else "flash_attn"
        self.module = types.ModuleType(name)
        self.module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
        self.module.__version__ = {"2.5": "2.5.9", "2.6": "2.6.3", "3": "3.0.0"}[version]
        self.module.flash_attn_varlen_func = self._make_varlen_func()

    def _make_varlen_func(self):
        run = self._run
        if self.version == "2.5":

            def flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                dropout_p=0.0,
                softmax_scale=None,
                causal=False,
                window_size=(-1, -1),
                alibi_slopes=None,
                deterministic=False,
                return_attn_probs=False,
                block_table=None,
            ):
                return run(
                    q,
                    k,
                    v,
                    cu_seqlens_q,
                    cu_seqlens_k,
                    max_seqlen_q,
                    max_seqlen_k,
                    dropout_p,
                    softmax_scale,
                    causal,
                    window_size,
                    0.0,
                    block_table,
                )
        elif self.version == "2.6":

            def flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                dropout_p=0.0,
                softmax_scale=None,
                causal=False,
                window_size=(-1, -1),
                softcap=0.0,
                alibi_slopes=None,
                deterministic=False,
                return_attn_probs=False,
                block_table=None,
            ):
                return run(
                    q,
                    k,
                    v,
                    cu_seqlens_q,
                    cu_seqlens_k,
                    max_seqlen_q,
                    max_seqlen_k,
                    dropout_p,
                    softmax_scale,
                    causal,
                    window_size,
                    softcap,
                    block_table,
                )
        else:

            def flash_attn_varlen_func(
                q,
                k,
                v,
                cu_seqlens_q,
                cu_seqlens_k,
                max_seqlen_q,
                max_seqlen_k,
                seqused_q=None,
                seqused_k=None,
                softmax_scale=None,
                causal=False,
                qv=None,
                q_descale=None,
                k_descale=None,
                v_descale=None,
                window_size=(-1, -1),
                attention_chunk=0,
                softcap=0.0,
                num_splits=1,
                pack_gqa=None,
                deterministic=False,
                sm_margin=0,
                return_attn_probs=False,
            ):
                out = run(
                    q,
                    k,
                    v,
                    cu_seqlens_q,
                    cu_seqlens_k,
                    max_seqlen_q,
                    max_seqlen_k,
                    0.0,
                    softmax_scale,
                    causal,
                    window_size,
                    softcap,
                    None,
                )
                lse = torch.zeros(q.shape[1], q.shape[0], dtype=torch.float32, device=q.device)
                return out, lse

        return flash_attn_varlen_func

    # ------------------------------------------------------------------ checks (flash_api.cpp)
    def _check(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window, softcap, table):
        def require(ok, message):
            if not ok:
                raise RuntimeError(message)

        allowed = HALF + ((torch.float8_e4m3fn,) if self.version == "3" else ())
        require(q.dtype in allowed, "FlashAttention only support fp16 and bf16 data type")
        require(k.dtype == q.dtype, "query and key must have the same dtype")
        require(v.dtype == q.dtype, "query and value must have the same dtype")
        require(cu_q.dtype == torch.int32, "cu_seqlens_q must have dtype int32")
        require(cu_k.dtype == torch.int32, "cu_seqlens_k must have dtype int32")
        device = q.device
        named = dict(k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k, block_table=table)
        for name, t in named.items():
            if t is not None:
                require(t.device == device, f"{name} must be on the device of q ({device}), got {t.device}")
        if table is not None:
            require(table.dtype == torch.int32, "block_table must have dtype torch.int32")
            require(table.stride(-1) == 1, "block_table must have contiguous last dimension")
        for t in (q, k, v):
            require(t.stride(-1) == 1, "Input tensor must have contiguous last dimension")
        require(cu_q.is_contiguous(), "cu_seqlens_q must be contiguous")
        require(cu_k.is_contiguous(), "cu_seqlens_k must be contiguous")
        for name, value in (("max_seqlen_q", max_q), ("max_seqlen_k", max_k)):
            if type(value) is not int:
                raise TypeError(f"{name} must be a Python int (the op's schema is int), got {type(value).__name__}")
        batch = cu_q.numel() - 1
        require(batch > 0, "batch size must be positive")
        require(q.dim() == 3, "q must be (total_q, num_heads, head_size)")
        heads, head_dim = q.shape[1], q.shape[2]
        paged = table is not None
        kv_heads = k.shape[2] if paged else k.shape[1]
        require(head_dim <= 256, "FlashAttention forward only supports head dimension at most 256")
        if self.version == "3":
            require(head_dim % 8 == 0, "head_size should be a multiple of 8")
        require(heads % kv_heads == 0, "Number of heads in key/value must divide number of heads in query")
        require(cu_q.shape == (batch + 1,), "cu_seqlens_q must have shape (batch_size + 1)")
        require(cu_k.shape == (batch + 1,), "cu_seqlens_k must have shape (batch_size + 1)")
        if paged:
            require(k.dim() == 4 and k.shape == v.shape, "k/v must be (num_blocks, page_block_size, heads_k, d)")
            require(k.shape[1] % 256 == 0, "Paged KV cache block size must be divisible by 256")
            require(
                table.dim() == 2 and table.shape[0] == batch, "block_table must have shape (batch_size, max_blocks)"
            )
        else:
            require(k.dim() == 3 and k.shape == v.shape[:2] + k.shape[2:], "k must be (total_k, heads_k, d)")
            require(k.shape[0] >= int(cu_k[-1]), "k has fewer tokens than cu_seqlens_k describes")
        lens_q, lens_k = torch.diff(cu_q).tolist(), torch.diff(cu_k).tolist()
        require(max(lens_q) <= max_q and max(lens_k) <= max_k, "max_seqlen_q/k smaller than a sequence")
        require(dropout_p == 0.0, "the tests never train with attention dropout")
        require(type(scale) is float and type(causal) is bool, "softmax_scale float, causal bool")
        require(
            isinstance(window, tuple) and len(window) == 2 and all(type(w) is int for w in window),
            "window_size must be a (left, right) tuple of ints",
        )
        require(type(softcap) is float, "softcap must be a float")
        return lens_q, lens_k

    # ------------------------------------------------------------------ the maths (fp32)
    def _run(self, q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window, softcap, table):
        lens_q, lens_k = self._check(
            q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, scale, causal, window, softcap, table
        )
        self.calls.append(
            dict(
                dtype=q.dtype,
                paged=table is not None,
                k_dim=k.dim(),
                window=window,
                softcap=softcap,
                causal=causal,
                num_seqs=len(lens_q),
                total_q=q.shape[0],
                block_size=k.shape[1] if table is not None else None,
                grad=q.requires_grad,
            )
        )
        return reference_attention(q, k, v, lens_q, lens_k, scale, causal, window, softcap, table)


def reference_attention(q, k, v, lens_q, lens_k, scale, causal, window, softcap, table=None):
    """What a FlashAttention varlen kernel computes, in fp32 maths per sequence (bottom-right
    causal mask, ``window=(left, right)`` inclusive bounds with -1 unlimited, soft-capping, GQA),
    returned in q's dtype and differentiable. ``table``: paged K/V ``(blocks, page, kv_heads, d)``."""
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    groups = q.shape[1] // (k.shape[-2])
    outs, start_q, start_k = [], 0, 0
    for i, (lq, lk) in enumerate(zip(lens_q, lens_k)):
        if table is not None:
            bs = k.shape[1]
            blocks = table[i, : -(-lk // bs)].long()
            ki = k[blocks].reshape(-1, *k.shape[2:])[:lk]
            vi = v[blocks].reshape(-1, *v.shape[2:])[:lk]
        else:
            ki, vi = k[start_k : start_k + lk], v[start_k : start_k + lk]
        qi = q[start_q : start_q + lq].float().transpose(0, 1)  # (heads, lq, d)
        ki = ki.float().transpose(0, 1).repeat_interleave(groups, 0)
        vi = vi.float().transpose(0, 1).repeat_interleave(groups, 0)
        scores = qi @ ki.transpose(-1, -2) * scale
        if softcap > 0:
            scores = softcap * torch.tanh(scores / softcap)
        row = torch.arange(lq, device=q.device)[:, None] + (lk - lq)  # bottom-right aligned
        col = torch.arange(lk, device=q.device)[None, :]
        left, right = window
        if causal:
            right = 0
        keep = torch.ones(lq, lk, dtype=torch.bool, device=q.device)
        if right >= 0:
            keep &= col <= row + right
        if left >= 0:
            keep &= col >= row - left
        scores = scores.masked_fill(~keep, -math.inf)
        probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)  # an empty row gives zeros
        outs.append((probs @ vi).transpose(0, 1))
        start_q, start_k = start_q + lq, start_k + lk
    return torch.cat(outs).to(q.dtype)


def broken_package(tmp_path, name: str = "flash_attn"):
    """A flash-attn whose CUDA extension fails to load: ``find_spec`` finds it, import raises."""
    package = tmp_path / name
    package.mkdir()
    (package / "__init__.py").write_text(
        "raise ImportError('libcudart.so.12: cannot open shared object file: No such file or directory')\n"
    )
    return tmp_path
