"""Exact pure-PyTorch varlen attention (CPU, or any device without flash-attn).

Four backends that run the same maths (declared in :data:`BACKENDS` at the end):

- ``sdpa_loop``: one SDPA call per sequence on slices of the flat row (:func:`per_sequence`). No
  padding and no mask for training rows (``is_causal``), so it does the least arithmetic; costs
  one call per sequence. The exact fallback of every device.
- ``sdpa_padded``: all sequences in one padded ``(B, heads, max_q, max_k)`` SDPA call with a
  key-padding mask (:func:`padded`). It moves and masks the padding; by name only
  (``benchmarks/bench_attention.py`` compares it with ``sdpa_loop``).
- ``sdpa_dense``: one SDPA over the whole row with a block-diagonal mask (:func:`dense`). Quadratic
  in the row length; a baseline for the benchmark.
- ``per_token``: one SDPA call per query token (:func:`per_token`): the pure-PyTorch
  batch-invariant path.

All four take attention sinks (``Opts.sinks``, gpt-oss): such a layer runs the explicit softmax
with the sink as one more logit per row, as transformers' eager attention does (differentiable in
q, k, v and the sinks).

All read K/V from a :class:`KeySource`: flat ``(total_k, kv_heads, dim)`` tensors cut by the
meta's key lengths (the dispatcher gathers a paged cache's keys first).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from nopad.packing.attention.registry import Backend
from nopad.packing.varlen import VarlenMeta


@dataclass
class KeySource:
    """Where sequence ``i``'s keys live: rows ``cu_seqlens_k[i]:cu_seqlens_k[i+1]`` of the flat
    ``k``/``v``."""

    k: torch.Tensor  # (total_k, kv_heads, dim)
    v: torch.Tensor
    meta: VarlenMeta

    def splitter(self):
        """``keys(i) -> (k_i, v_i)``, each ``(lk_i, kv_heads, dim)``, cut with one ``split`` (its
        backward is a single concatenation, not one full-size gradient per sequence)."""
        lens = list(self.meta.seqlens_k)
        ks, vs = self.k.split(lens), self.v.split(lens)
        return lambda i: (ks[i], vs[i])


def _mask(lq: int, lk: int, causal: bool, window: int | None, device) -> torch.Tensor | None:
    """Boolean (lq, lk) mask, causal aligned to the end of the keys; None when all-visible."""
    if not causal and window is None:
        return None
    q_pos = torch.arange(lk - lq, lk, device=device)[:, None]
    k_pos = torch.arange(lk, device=device)[None, :]
    keep = torch.ones(lq, lk, dtype=torch.bool, device=device)
    if causal:
        keep = keep & (k_pos <= q_pos)
    if window is not None:
        keep = keep & (k_pos > q_pos - window)
    return keep


_ROW_MASKS: list = [None, {}]  # [the meta whose masks are kept, (lq, lk, causal, window, device) -> mask]


def _row_mask(meta: VarlenMeta, lq: int, lk: int, causal: bool, window: int | None, device):
    """:func:`_mask`, kept for the row being computed: every layer of a forward reads the same meta,
    and a tree row's segments (queries after their context) each need a mask, so a forward built
    segments x layers of them (a ~20M Llama's tree step: 480). One row's masks are held at a time."""
    if _ROW_MASKS[0] is not meta:
        _ROW_MASKS[:] = [meta, {}]
    masks = _ROW_MASKS[1]
    key = (lq, lk, causal, window, device)
    if key not in masks:
        masks[key] = _mask(lq, lk, causal, window, device)
    return masks[key]


def _sdpa(q, k, v, mask, *, scale, softcap, is_causal=False, sinks=None):
    """SDPA on (..., Hkv*G, Lq, D) vs (..., Hkv, Lk, D), or explicit maths when soft-capping or
    with attention sinks: ``sinks`` broadcasts to (..., Hkv*G, Lq, 1), one logit per query row
    that joins the softmax and is dropped after it, as transformers' eager gpt-oss attention does."""
    groups = q.shape[-3] // k.shape[-3]
    if softcap is None and sinks is None:
        # CPU SDPA uses its flash kernel (also with enable_gqa) only for 4-D inputs; 3-D inputs
        # silently take the slow math path, so add a batch dimension.
        squeeze = q.dim() == 3
        if squeeze:
            q, k, v = q[None], k[None], v[None]
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale, enable_gqa=groups > 1
        )
        return out[0] if squeeze else out
    if groups > 1:
        k = k.repeat_interleave(groups, dim=-3)
        v = v.repeat_interleave(groups, dim=-3)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        lq, lk = scores.shape[-2:]
        mask = _mask(lq, lk, True, None, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)
    sink = sinks.to(torch.float32).expand(*scores.shape[:-1], 1)
    probs = torch.softmax(torch.cat([scores.float(), sink], dim=-1), dim=-1)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def _head_sinks(sinks, heads_axis_rank: int):
    """``sinks (heads,)`` shaped to broadcast over a (heads, ..., 1) score tensor whose heads axis
    has ``heads_axis_rank`` axes after it (None stays None)."""
    return None if sinks is None else sinks.view(-1, *([1] * heads_axis_rank))


def per_sequence(q, src: KeySource, *, causal, scale, window, softcap, seqs=None, sinks=None) -> list:
    """Per-sequence SDPA; returns a list of ``(lq, heads, dim)`` outputs for ``seqs``
    (default: all)."""
    meta = src.meta
    q_parts = q.split(list(meta.seqlens_q))
    keys = src.splitter()
    outs = []
    for i in range(meta.num_seqs) if seqs is None else seqs:
        lq, lk = meta.seqlens_q[i], meta.seqlens_k[i]
        if lq == 0:
            outs.append(q_parts[i])
            continue
        k_i, v_i = keys(i)
        window_i = window if window is not None and window < lk else None
        plain_causal = causal and window_i is None and lq == lk and lq > 1
        sees_all = (not causal or lq == 1) and window_i is None
        mask = None if plain_causal or sees_all else _row_mask(meta, lq, lk, causal, window_i, q.device)
        q_i = q_parts[i].transpose(0, 1)  # (heads, lq, dim)
        kv_heads = k_i.shape[1]
        if lq == 1 and kv_heads < q_i.shape[0] and sinks is None:
            # a decode token: fold the GQA groups into the query axis, (kv_heads, groups, dim);
            # faster than enable_gqa for one query (all groups share the one mask row;
            # benchmarks/bench_attention.py)
            q_i = q_i.reshape(kv_heads, -1, q_i.shape[-1])
        out = _sdpa(
            q_i,
            k_i.transpose(0, 1),
            v_i.transpose(0, 1),
            mask,
            scale=scale,
            softcap=softcap,
            is_causal=plain_causal,
            sinks=_head_sinks(sinks, 2),
        )
        outs.append(out.reshape(-1, lq, out.shape[-1]).transpose(0, 1))
    return outs


def per_token(q, src: KeySource, *, causal, scale, window, softcap, sinks=None) -> list:
    """One SDPA call per query token over exactly the keys it sees: slow, but each token's result
    depends on nothing else in the call, so it is the pure-PyTorch batch-invariant path (used by
    :func:`nopad.packing.batch_invariant` when the compiled kernel is not built)."""
    meta = src.meta
    keys = src.splitter()
    outs = []
    for i, q_i in enumerate(q.split(list(meta.seqlens_q))):
        lq, lk = meta.seqlens_q[i], meta.seqlens_k[i]
        if lq == 0:
            outs.append(q_i)
            continue
        k_i, v_i = (t.transpose(0, 1) for t in keys(i))  # (kv_heads, lk, dim)
        rows = []
        for t in range(lq):
            pos = lk - lq + t
            top = pos + 1 if causal else lk
            bottom = max(0, pos - window + 1) if window is not None else 0
            out = _sdpa(
                q_i[t][:, None],
                k_i[:, bottom:top],
                v_i[:, bottom:top],
                None,
                scale=scale,
                softcap=softcap,
                sinks=_head_sinks(sinks, 2),
            )
            rows.append(out[:, 0])
        outs.append(torch.stack(rows))
    return outs


def _padded_mask(meta: VarlenMeta, causal: bool, window: int | None) -> torch.Tensor:
    """The ``(B, max_q, max_k)`` mask of one padded call over every sequence, from the meta's
    :attr:`~nopad.packing.varlen.VarlenMeta.padded_layout` (device ops only: no sync per layer)."""
    lay = meta.padded_layout
    k_pos = torch.arange(meta.max_seqlen_k, device=lay.key_lens.device)
    keep = (k_pos[None, :] < lay.key_lens[:, None])[:, None, :].expand(-1, meta.max_seqlen_q, -1)
    if causal:
        keep = keep & (k_pos[None, None, :] <= lay.query_pos[:, :, None])
    if window is not None:
        keep = keep & (k_pos[None, None, :] > lay.query_pos[:, :, None] - window)
    return keep | (~lay.query_valid[:, :, None] & (k_pos == 0))  # padded queries see key 0: no NaN rows


def padded(q, src: KeySource, *, causal, scale, window, softcap, sinks=None) -> torch.Tensor:
    """Every sequence in one padded SDPA call; returns the outputs ``(total_q, heads, dim)`` in
    sequence order. GQA groups are folded into the query axis so K/V are gathered once per KV
    head, not repeated per query head. Padded key slots read the sequence's first key: finite
    values, masked out."""
    meta = src.meta
    lay = meta.padded_layout
    k_index, q_rows, q_valid = lay.key_rows, lay.query_rows, lay.query_valid
    keep = _padded_mask(meta, causal, window)
    keys_len, max_q = meta.max_seqlen_k, meta.max_seqlen_q
    b, heads, dim = meta.num_seqs, q.shape[1], q.shape[2]
    kv_heads = src.k.shape[1]
    groups = heads // kv_heads
    # index_select on 2-D rows is faster than on (rows, kv_heads, dim) (benchmarks/bench_attention.py)
    k = src.k.reshape(-1, kv_heads * dim).index_select(0, k_index.reshape(-1))
    v = src.v.reshape(-1, kv_heads * dim).index_select(0, k_index.reshape(-1))
    k = k.view(b, keys_len, kv_heads, dim).transpose(1, 2)
    v = v.view(b, keys_len, kv_heads, dim).transpose(1, 2)
    qp = q if q_rows is None else q.index_select(0, q_rows.reshape(-1))
    qp = qp.reshape(b, max_q, kv_heads, groups, dim).permute(0, 2, 3, 1, 4)
    qp = qp.reshape(b, kv_heads, groups * max_q, dim)
    mask = keep[:, None, None].expand(-1, 1, groups, -1, -1).reshape(b, 1, groups * max_q, keys_len)
    if sinks is not None:  # one per query head: (kv_heads, groups) rows, each repeated over max_q
        sinks = sinks.view(kv_heads, groups, 1).expand(-1, -1, max_q).reshape(kv_heads, groups * max_q, 1)
    out = _sdpa(qp, k, v, mask, scale=scale, softcap=softcap, sinks=sinks)  # (b, kv_heads, groups*max_q, dim)
    out = out.view(b, kv_heads, groups, max_q, dim).permute(0, 3, 1, 2, 4).reshape(b * max_q, heads, dim)
    if max_q == 1:
        return out
    return out[q_valid.reshape(-1)]


def dense(q, k, v, meta: VarlenMeta, *, causal, scale, window, softcap, sinks=None) -> torch.Tensor:
    """One SDPA over the whole flat row with a block-diagonal mask (baseline; O(T^2) memory)."""
    seq_q = meta.seq_idx_long.to(q.device)
    seq_k, k_pos = (t.to(q.device) for t in meta.key_positions)  # built once per meta, not per layer
    q_pos = meta.position_ids.to(q.device)  # the query's position among its sequence's keys
    keep = seq_q[:, None] == seq_k[None, :]
    if causal:
        keep = keep & (k_pos[None, :] <= q_pos[:, None])
    if window is not None:
        keep = keep & (k_pos[None, :] > q_pos[:, None] - window)
    out = _sdpa(
        q.transpose(0, 1),
        k.transpose(0, 1),
        v.transpose(0, 1),
        keep,
        scale=scale,
        softcap=softcap,
        sinks=_head_sinks(sinks, 2),
    )
    return out.transpose(0, 1)


def _cat(pieces: list, q: torch.Tensor) -> torch.Tensor:
    if not pieces:
        return q.new_zeros(q.shape)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def _options(opts) -> dict:
    return dict(causal=opts.causal, scale=opts.scale, window=opts.window, softcap=opts.softcap, sinks=opts.sinks)


def _loop(q, k, v, meta, opts, table=None, block_size=1):
    return _cat(per_sequence(q, KeySource(k, v, meta), **_options(opts)), q)


def _padded(q, k, v, meta, opts, table=None, block_size=1):
    return padded(q, KeySource(k, v, meta), **_options(opts))


def _per_token(q, k, v, meta, opts, table=None, block_size=1):
    return _cat(per_token(q, KeySource(k, v, meta), **_options(opts)), q)


def _dense(q, k, v, meta, opts, table=None, block_size=1):
    return dense(q, k, v, meta, **_options(opts))


def _backend(name, forward, **kwargs):
    return Backend(
        name,
        forward,
        devices=("cpu", "cuda"),
        dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64),
        sinks=True,
        **kwargs,
    )


BACKENDS = (
    _backend("sdpa_loop", _loop),  # the exact fallback everywhere
    _backend("sdpa_padded", _padded),
    _backend("sdpa_dense", _dense),
    _backend("per_token", _per_token, invariant=True),  # the batch-invariant twin of the CPU kernel
)
