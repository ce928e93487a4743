"""Exact pure-PyTorch varlen attention kernels (CPU, or any device without flash-attn).

Four backends that run the same maths (declared in :data:`BACKENDS` at the end):

- ``per_sequence``: one SDPA call per sequence on slices of the flat row. No padding and no mask
  for training rows (``is_causal``), so it does the least arithmetic; costs one call per sequence.
- ``padded``: gather all sequences into one padded ``(B, heads, max_q, max_k)`` SDPA call with a
  key-padding mask. One call for the whole step, but it moves and masks the padding: slower than
  ``per_sequence`` on CPU even for decode steps and for 100+ short documents
  (``benchmarks/bench_attention.py``), so it is available by name only.
- ``dense``: one SDPA over the whole row with a block-diagonal mask. Quadratic in the row
  length; kept as a baseline for the benchmark.

All take K/V from a ``KeySource``: either flat ``(total_k, kv_heads, dim)`` tensors indexed by
``cu_seqlens_k``, or a paged cache read through a block table (see ``key_rows``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from packing.attention.registry import Backend
from packing.varlen import VarlenMeta


@dataclass
class KeySource:
    """Where sequence ``i``'s keys live: rows of ``k``/``v`` (flat, or the flattened paged cache)
    given by ``key_rows(i)``. ``new_k``/``new_v`` are this step's own keys (one per query), used
    instead of a gather when a sequence has no cached context."""

    k: torch.Tensor  # (rows, kv_heads, dim)
    v: torch.Tensor
    meta: VarlenMeta
    block_table: torch.Tensor | None = None  # int32 [num_seqs, max_blocks] when paged
    block_size: int = 1
    new_k: torch.Tensor | None = None
    new_v: torch.Tensor | None = None

    def rows(self, positions: torch.Tensor, seq: torch.Tensor) -> torch.Tensor:
        """Row index (into ``k``/``v``) of key ``positions`` of sequences ``seq``."""
        if self.block_table is None:
            return self.meta.cu_seqlens_k.to(torch.long)[seq] + positions
        blocks = self.long_table()[seq, torch.div(positions, self.block_size, rounding_mode="floor")]
        return blocks.to(torch.long) * self.block_size + positions % self.block_size

    def long_table(self) -> torch.Tensor:
        """The block table as int64 for indexing; the meta's own table is converted once per step."""
        if self.block_table is self.meta.block_table or self.block_table is self.meta._derived.get(
                "block_table_long"):
            return self.meta.block_table_long()
        return self.block_table.to(torch.long)

    def splitter(self):
        """``keys(i) -> (k_i, v_i)``, each ``(lk_i, kv_heads, dim)``. Flat K/V are cut with one
        ``split`` (its backward is a single concatenation, not one full-size gradient per
        sequence); paged K/V are gathered per sequence unless the sequence is a fresh prefill
        whose keys are this step's own tokens."""
        meta = self.meta
        if self.block_table is None:
            ks, vs = self.k.split(list(meta.seqlens_k)), self.v.split(list(meta.seqlens_k))
            return lambda i: (ks[i], vs[i])
        new = None
        if self.new_k is not None:
            new = (self.new_k.split(list(meta.seqlens_q)), self.new_v.split(list(meta.seqlens_q)))

        bs = self.block_size
        table = self.long_table()
        k_blocks, v_blocks = self.k.view(-1, bs * self.k[0].numel()), self.v.view(-1, bs * self.v[0].numel())

        def keys(i):
            lq, lk = meta.seqlens_q[i], meta.seqlens_k[i]
            if new is not None and lq == lk:
                return new[0][i], new[1][i]
            # whole blocks (one contiguous copy each), then cut to the sequence's length
            blocks = table[i, : -(-lk // bs)]
            k = k_blocks.index_select(0, blocks).view(-1, *self.k.shape[1:])[:lk]
            v = v_blocks.index_select(0, blocks).view(-1, *self.v.shape[1:])[:lk]
            return k, v

        return keys


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


def _sdpa(q, k, v, mask, *, scale, softcap, is_causal=False):
    """SDPA on (..., Hkv*G, Lq, D) vs (..., Hkv, Lk, D), or explicit maths when soft-capping."""
    groups = q.shape[-3] // k.shape[-3]
    if softcap is None:
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
    scores = softcap * torch.tanh(scores / softcap)
    if is_causal:
        lq, lk = scores.shape[-2:]
        mask = _mask(lq, lk, True, None, q.device)
    if mask is not None:
        scores = scores.masked_fill(~mask, float("-inf"))
    return torch.matmul(torch.softmax(scores.float(), dim=-1).to(q.dtype), v)


def per_sequence(q, src: KeySource, *, causal, scale, window, softcap, seqs=None) -> list:
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
        mask = None if plain_causal or sees_all else _mask(lq, lk, causal, window_i, q.device)
        q_i = q_parts[i].transpose(0, 1)  # (heads, lq, dim)
        kv_heads = k_i.shape[1]
        if lq == 1 and kv_heads < q_i.shape[0]:
            # a decode token: fold the GQA groups into the query axis, (kv_heads, groups, dim);
            # 1.5x faster than enable_gqa for one query (all groups share the one mask row)
            q_i = q_i.reshape(kv_heads, -1, q_i.shape[-1])
        out = _sdpa(
            q_i, k_i.transpose(0, 1), v_i.transpose(0, 1), mask,
            scale=scale, softcap=softcap, is_causal=plain_causal,
        )
        outs.append(out.reshape(-1, lq, out.shape[-1]).transpose(0, 1))
    return outs


def per_token(q, src: KeySource, *, causal, scale, window, softcap) -> list:
    """One SDPA call per query token over exactly the keys it sees: slow, but each token's result
    depends on nothing else in the call, so it is the pure-PyTorch batch-invariant path (used by
    :func:`packing.batch_invariant` when the compiled kernel is not built)."""
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
            out = _sdpa(q_i[t][:, None], k_i[:, bottom:top], v_i[:, bottom:top], None, scale=scale,
                        softcap=softcap)
            rows.append(out[:, 0])
        outs.append(torch.stack(rows))
    return outs


def _padded_index(src: KeySource, seqs: tuple[int, ...], causal: bool, window: int | None):
    """What one padded call over ``seqs`` gathers, memoised on the meta (every layer of a forward
    shares it): key rows ``(B, max_k)`` (of the flat K/V or the flattened cache), query
    rows (None when the queries are already in order, one per sequence) and the
    ``(B, max_q, max_k)`` mask."""
    table = src.block_table
    version = None if table is None else table._version  # an in-place edit invalidates the memo
    key = ("padded_index", id(table), src.block_size, seqs, causal, window, version)
    if key in src.meta._derived:
        return src.meta._derived[key]
    meta, device = src.meta, src.k.device
    sel = torch.tensor(seqs, dtype=torch.long, device=device)
    lq = torch.tensor([meta.seqlens_q[i] for i in seqs], device=device)
    lk = torch.tensor([meta.seqlens_k[i] for i in seqs], device=device)
    max_q, max_k = int(lq.max()), int(lk.max())
    # padded key slots point at the sequence's first key: finite values (masked out below),
    # whereas unused cache slots may hold anything, NaN included
    k_pos = torch.arange(max_k, device=device)
    k_pos_clamped = torch.where(k_pos[None, :] < lk[:, None], k_pos[None, :], 0)
    k_index = src.rows(k_pos_clamped, sel[:, None].expand(-1, max_k))
    keys_len = max_k
    k_pos = torch.arange(keys_len, device=device)
    q_off = torch.arange(max_q, device=device)
    q_valid = q_off[None, :] < lq[:, None]
    q_rows = meta.cu_seqlens_q.to(torch.long)[sel][:, None] + torch.where(q_valid, q_off[None, :], 0)
    if max_q == 1 and len(seqs) == meta.num_seqs and seqs == tuple(range(meta.num_seqs)):
        q_rows = None  # a pure decode step: q is already (B, heads, dim) in order
    q_pos = (lk - lq)[:, None] + q_off[None, :]  # position of each query among its keys
    keep = (k_pos[None, :] < lk[:, None])[:, None, :].expand(-1, max_q, -1)
    if causal:
        keep = keep & (k_pos[None, None, :] <= q_pos[:, :, None])
    if window is not None:
        keep = keep & (k_pos[None, None, :] > q_pos[:, :, None] - window)
    keep = keep | (~q_valid[:, :, None] & (k_pos == 0))  # padded queries see key 0: no NaN rows
    result = (k_index, keys_len, q_rows, q_valid, keep, max_q)
    src.meta._derived[key] = result
    return result


def padded(q, src: KeySource, *, causal, scale, window, softcap, seqs=None) -> torch.Tensor:
    """All ``seqs`` in one padded SDPA call; returns their outputs ``(sum lq, heads, dim)`` in
    sequence order. GQA groups are folded into the query axis so K/V are gathered once per KV
    head, not repeated per query head."""
    meta = src.meta
    seqs = tuple(range(meta.num_seqs)) if seqs is None else tuple(seqs)
    k_index, keys_len, q_rows, q_valid, keep, max_q = _padded_index(src, seqs, causal, window)
    b, heads, dim = len(seqs), q.shape[1], q.shape[2]
    kv_heads = src.k.shape[1]
    groups = heads // kv_heads
    # index_select on 2-D rows is ~2x faster than on (rows, kv_heads, dim)
    k = src.k.reshape(-1, kv_heads * dim).index_select(0, k_index.reshape(-1))
    v = src.v.reshape(-1, kv_heads * dim).index_select(0, k_index.reshape(-1))
    k = k.view(b, keys_len, kv_heads, dim).transpose(1, 2)
    v = v.view(b, keys_len, kv_heads, dim).transpose(1, 2)
    qp = q if q_rows is None else q.index_select(0, q_rows.reshape(-1))
    qp = qp.reshape(b, max_q, kv_heads, groups, dim).permute(0, 2, 3, 1, 4)
    qp = qp.reshape(b, kv_heads, groups * max_q, dim)
    mask = keep[:, None, None].expand(-1, 1, groups, -1, -1).reshape(b, 1, groups * max_q, keys_len)
    out = _sdpa(qp, k, v, mask, scale=scale, softcap=softcap)  # (b, kv_heads, groups*max_q, dim)
    out = out.view(b, kv_heads, groups, max_q, dim).permute(0, 3, 1, 2, 4).reshape(b * max_q, heads, dim)
    if max_q == 1:
        return out
    return out[q_valid.reshape(-1)]


def dense(q, k, v, meta: VarlenMeta, *, causal, scale, window, softcap) -> torch.Tensor:
    """One SDPA over the whole flat row with a block-diagonal mask (baseline; O(T^2) memory)."""
    seq_q = meta.seq_idx_long().to(q.device)
    seq_k, k_pos = (t.to(q.device) for t in meta.key_positions())  # built once per meta, not per layer
    q_pos = meta.position_ids.to(q.device)  # the query's position among its sequence's keys
    keep = seq_q[:, None] == seq_k[None, :]
    if causal:
        keep = keep & (k_pos[None, :] <= q_pos[:, None])
    if window is not None:
        keep = keep & (k_pos[None, :] > q_pos[:, None] - window)
    out = _sdpa(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), keep, scale=scale, softcap=softcap)
    return out.transpose(0, 1)


def _cat(pieces: list, q: torch.Tensor) -> torch.Tensor:
    if not pieces:
        return q.new_zeros(q.shape)
    return pieces[0] if len(pieces) == 1 else torch.cat(pieces, dim=0)


def _options(opts) -> dict:
    return dict(causal=opts.causal, scale=opts.scale, window=opts.window, softcap=opts.softcap)


def _loop(q, k, v, meta, opts, table=None, block_size=1):
    return _cat(per_sequence(q, KeySource(k, v, meta), **_options(opts)), q)


def _padded(q, k, v, meta, opts, table=None, block_size=1):
    return padded(q, KeySource(k, v, meta), **_options(opts))


def _per_token(q, k, v, meta, opts, table=None, block_size=1):
    return _cat(per_token(q, KeySource(k, v, meta), **_options(opts)), q)


def _dense(q, k, v, meta, opts, table=None, block_size=1):
    return dense(q, k, v, meta, **_options(opts))


def _backend(name, forward, **kwargs):
    return Backend(name, forward, devices=("cpu", "cuda"),
                   dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.float64), **kwargs)


BACKENDS = (
    _backend("sdpa_loop", _loop),  # the exact fallback everywhere
    _backend("sdpa_padded", _padded),
    _backend("sdpa_dense", _dense),
    _backend("per_token", _per_token, invariant=True),  # the batch-invariant twin of the CPU kernel
)
