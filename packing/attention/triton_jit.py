"""The jitted body of nopad's Triton varlen attention (:mod:`nopad.packing.attention.triton_kernel`
launches it and says why it is written this way); defined only where triton is installed."""

from __future__ import annotations

try:
    import triton
    import triton.language as tl
except ImportError:  # optional: the backend then says what to install
    triton = None


# fmt: off
# (the Triton kernels: each load's and store's pointer arithmetic stays on one line; spread out by the
# formatter, the kernel body grew from 97 lines to 127)
if triton is not None:

    @triton.jit
    def _dot(a, b, INTERPRETED: tl.constexpr, FP32: tl.constexpr):
        """``a @ b`` with fp32 results: tl.dot on a GPU (IEEE for fp32 operands, not TF32), a
        row-invariant fp32 sum interpreted."""
        if INTERPRETED:
            return tl.sum(a.to(tl.float32)[:, :, None] * b.to(tl.float32)[None, :, :], 1)
        elif FP32:
            return tl.dot(a, b, input_precision="ieee")
        else:
            return tl.dot(a, b)

    # Triton compiles a kernel per integer argument equal to 1 or divisible by 16: window=1 must not
    # compile one of its own, nor the block table's width (stride_table) each time a growing table
    # crosses a multiple of 16 mid-generation (~1 s on the H100, inside a decode step)
    @triton.jit(do_not_specialize=["window", "stride_table"])
    def _attention_kernel(
        Q, K, V, OUT, CU_Q, KEYS, TABLE, SINK,
        stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_ot, stride_oh, stride_table,
        scale, softcap, window,
        G: tl.constexpr, HEAD_DIM: tl.constexpr, D_PAD: tl.constexpr,
        BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, PAGE: tl.constexpr,
        PAGED: tl.constexpr, DECODE: tl.constexpr, CAUSAL: tl.constexpr, SOFTCAP: tl.constexpr,
        INTERPRETED: tl.constexpr, FP32: tl.constexpr, SINKS: tl.constexpr,
    ):
        """Program (sequence, row tile, KV head). Rows r of a tile are (query token r // G, query
        head kv_head * G + r % G). ``KEYS`` is ``cu_seqlens_k`` (flat or paged keys, lengths from
        its differences), or with DECODE the per-row key counts (one query per row, no CU_Q)."""
        seq = tl.program_id(0)
        tile = tl.program_id(1)
        kv_head = tl.program_id(2)
        if DECODE:
            q_start = seq
            q_len = 1
            k_len = tl.load(KEYS + seq).to(tl.int32)
            k_start = 0
        else:
            q_start = tl.load(CU_Q + seq)
            q_len = tl.load(CU_Q + seq + 1) - q_start
            k_start = tl.load(KEYS + seq)
            k_len = tl.load(KEYS + seq + 1) - k_start
        row0 = tile * BLOCK_M
        n_rows = q_len * G  # tiles past a sequence's rows store nothing and visit no key block
        rows = row0 + tl.arange(0, BLOCK_M)
        row_ok = rows < n_rows
        token = rows // G
        head = kv_head * G + rows % G
        pos = k_len - q_len + token  # each query's position among its keys (bottom-right aligned)
        if CAUSAL:
            hi = pos
        else:
            hi = tl.zeros_like(pos) + (k_len - 1)
        lo = tl.where(window > 0, tl.maximum(pos - window + 1, 0), 0)
        # the tile's key blocks: from the first row's lowest key to the last row's highest (all
        # operands of // kept >= 0: Triton's integer division truncates, the interpreter's floors)
        last = tl.maximum(tl.minimum(row0 + BLOCK_M, n_rows) - 1, row0)
        pos_first = k_len - q_len + row0 // G
        pos_last = k_len - q_len + last // G
        key_lo = tl.where(window > 0, tl.maximum(pos_first - window + 1, 0), 0)
        if CAUSAL:
            key_hi = pos_last
        else:
            key_hi = k_len - 1
        first_block = key_lo // BLOCK_N
        any_rows = (row0 < n_rows) & (key_hi >= 0)
        end_block = tl.where(any_rows, tl.maximum(key_hi, 0) // BLOCK_N + 1, first_block)

        d = tl.arange(0, D_PAD)
        d_ok = d < HEAD_DIM
        q_rows = (q_start + token).to(tl.int64)
        q = tl.load(Q + q_rows[:, None] * stride_qt + head[:, None] * stride_qh + d[None, :],
                    mask=row_ok[:, None] & d_ok[None, :], other=0.0)

        m = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_sum = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
        for block in range(first_block, end_block):
            keys = block * BLOCK_N + tl.arange(0, BLOCK_N)
            key_ok = keys < k_len
            if PAGED:
                page = tl.load(TABLE + seq.to(tl.int64) * stride_table + keys // PAGE, mask=key_ok, other=0)
                k_rows = page.to(tl.int64) * PAGE + keys % PAGE
            else:
                k_rows = (k_start + keys).to(tl.int64)
            kv_mask = key_ok[:, None] & d_ok[None, :]
            k = tl.load(K + k_rows[:, None] * stride_kt + kv_head * stride_kh + d[None, :], mask=kv_mask,
                        other=0.0)
            v = tl.load(V + k_rows[:, None] * stride_vt + kv_head * stride_vh + d[None, :], mask=kv_mask,
                        other=0.0)
            s = _dot(q, tl.trans(k), INTERPRETED, FP32) * scale
            if SOFTCAP:  # softcap * tanh(s / softcap), tanh from exp (odd, exact at 0)
                a = s / softcap
                e = tl.exp(-2.0 * tl.abs(a))
                t = (1.0 - e) / (1.0 + e)
                s = softcap * tl.where(a < 0, -t, t)
            visible = (keys[None, :] >= lo[:, None]) & (keys[None, :] <= hi[:, None]) & row_ok[:, None]
            s = tl.where(visible, s, float("-inf"))
            active = tl.max(visible.to(tl.int32), 1) > 0  # rows that see a key of this block
            m_new = tl.maximum(m, tl.max(s, 1))
            m_use = tl.where(m_new == float("-inf"), 0.0, m_new)  # no (-inf) - (-inf)
            alpha = tl.exp(m - m_use)
            p = tl.exp(s - m_use[:, None])
            pv = _dot(p.to(V.dtype.element_ty), v, INTERPRETED, FP32)  # p rounded to the dtype, as flash does
            # a block that shows a row nothing leaves the row's bits untouched
            acc = tl.where(active[:, None], acc * alpha[:, None] + pv, acc)
            l_sum = tl.where(active, l_sum * alpha + tl.sum(p, 1), l_sum)
            m = tl.where(active, m_new, m)
        if SINKS:  # the head's sink logit joins the denominator and adds no value (gpt-oss)
            sink = tl.load(SINK + head, mask=row_ok, other=0.0).to(tl.float32)
            l_sum = l_sum + tl.exp(sink - tl.where(m == float("-inf"), sink, m))
        out = acc / tl.where(l_sum > 0, l_sum, 1.0)[:, None]  # a query with no keys gives zeros
        tl.store(OUT + q_rows[:, None] * stride_ot + head[:, None] * stride_oh + d[None, :],
                 out.to(OUT.dtype.element_ty), mask=row_ok[:, None] & d_ok[None, :])
# fmt: on
