"""FlexAttention (``torch.nn.attention.flex_attention``) with a document mask: on CUDA it compiles
the mask and a softcap score mod into one Triton kernel, so it serves the layers that need a score
mod when flash-attn is absent. CPU FlexAttention has no backward (torch 2.13)."""

from __future__ import annotations

import torch

from nopad.packing.attention.registry import Backend
from nopad.packing.varlen import VarlenMeta


def flex(q, k, v, meta: VarlenMeta, *, causal, scale, window, softcap) -> torch.Tensor:
    """Attention of a flat varlen row ``(total, heads, dim)`` through one FlexAttention call."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if q.device.type == "cpu" and torch.is_grad_enabled() and (q.requires_grad or k.requires_grad):
        raise ValueError("FlexAttention has no backward on CPU; use backend='auto' or 'sdpa_loop' to train")
    if not torch.is_grad_enabled():  # CPU flex refuses inputs that require grad even under no_grad
        q, k, v = q.detach(), k.detach(), v.detach()
    device = q.device
    seq_k, k_pos = (t.to(device) for t in meta.key_positions)
    seq_q = meta.seq_idx_long.to(device)
    q_pos = meta.position_ids.to(device)  # the query's position among its sequence's keys

    def mask_mod(b, h, qi, ki):
        keep = seq_q[qi] == seq_k[ki]
        if causal:
            keep = keep & (k_pos[ki] <= q_pos[qi])
        if window is not None:
            keep = keep & (k_pos[ki] > q_pos[qi] - window)
        return keep

    score_mod = None
    if softcap is not None:

        def score_mod(score, b, h, qi, ki):
            return softcap * torch.tanh(score / softcap)

    block_mask = create_block_mask(mask_mod, None, None, q.shape[0], k.shape[0], device=device)
    out = flex_attention(
        q.transpose(0, 1)[None],
        k.transpose(0, 1)[None],
        v.transpose(0, 1)[None],
        score_mod=score_mod,
        block_mask=block_mask,
        scale=scale,
        enable_gqa=q.shape[1] != k.shape[1],
    )
    return out[0].transpose(0, 1)


def _forward(q, k, v, meta, opts, table=None, block_size=1):
    return flex(q, k, v, meta, causal=opts.causal, scale=opts.scale, window=opts.window, softcap=opts.softcap)


def _missing(call) -> str | None:
    if call.device.type == "cpu" and call.grad:
        return "has no backward on CPU"
    return None


BACKENDS = (
    Backend(
        "flex", _forward, devices=("cuda",), dtypes=(torch.float32, torch.bfloat16, torch.float16), missing=_missing
    ),
)
