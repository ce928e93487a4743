"""Which exact CPU varlen attention is fastest? The measurement behind ``backend="auto"``.

Training row: 8,192 packed tokens, 8 heads (2 KV heads), dim 64, documents of 64-1,024 tokens;
forward and forward+backward for per-sequence SDPA (``sdpa_loop``), one padded SDPA
(``sdpa_padded``), the compiled batch-invariant kernel (``kernel``: its forward; its backward is
per-sequence SDPA's), SDPA with a dense block-diagonal mask (``sdpa_dense``), and FlexAttention with
a document mask, eager and compiled (forward only: FlexAttention has no CPU backward; ``--quick``
leaves out the compiled one).

Decode step: 64 sequences x ~300 cached tokens (SmolLM2 shape: 9 heads, 3 KV heads, dim 64),
paged with 16-token blocks; per-sequence SDPA vs one padded SDPA vs ``auto`` (the paged kernel).
The kernel's decode in GB/s against measured memory bandwidth: benchmarks/bench_kernel_bandwidth.py.

    python benchmarks/bench_attention.py [--quick]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from nopad.packing.attention import store_kv, varlen_attention
from nopad.packing.varlen import VarlenMeta


def best_of(fn, repeats: int) -> float:
    fn()  # warm-up (and compile)
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times) * 1e3


def training_row(total: int, lo: int, hi: int, repeats: int, dense: bool, flex_compiled: bool = True) -> list:
    rng = np.random.default_rng(0)
    lengths = []
    while sum(lengths) < total:
        lengths.append(int(rng.integers(lo, hi + 1)))
    lengths[-1] -= sum(lengths) - total
    meta = VarlenMeta.from_lengths([n for n in lengths if n > 0])
    q = torch.randn(total, 8, 64, requires_grad=True)
    k = torch.randn(total, 2, 64, requires_grad=True)
    v = torch.randn(total, 2, 64, requires_grad=True)

    def fwd(backend):
        def run():
            with torch.no_grad():
                varlen_attention(q, k, v, meta, backend=backend)

        return run

    def fwd_bwd(backend):
        def run():
            varlen_attention(q, k, v, meta, backend=backend).sum().backward()

        return run

    rows = []
    backends = ["sdpa_loop", "sdpa_padded", "kernel"] + (["sdpa_dense"] if dense else [])
    for backend in backends:
        rows.append((backend, best_of(fwd(backend), repeats), best_of(fwd_bwd(backend), repeats)))
    rows.append(("flex (eager)", best_of(fwd("flex"), 1), None))
    if flex_compiled:
        rows.append(("flex (compiled)", _flex_compiled(q, k, v, meta, repeats), None))
    label = f"training row: {total} tokens, {meta.num_seqs} documents of {lo}-{hi}, 8/2 heads, dim 64"
    return label, rows


def _flex_compiled(q, k, v, meta: VarlenMeta, repeats: int) -> float | None:
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    doc = meta.seq_idx.long()

    def causal_doc(b, h, qi, ki):
        return (doc[qi] == doc[ki]) & (ki <= qi)

    try:
        block_mask = create_block_mask(causal_doc, None, None, q.shape[0], k.shape[0], device="cpu")
        compiled = torch.compile(flex_attention)
        args = [t.detach().transpose(0, 1)[None] for t in (q, k, v)]

        def run():
            with torch.no_grad():
                compiled(*args, block_mask=block_mask, enable_gqa=True)

        return best_of(run, repeats)
    except Exception as err:  # torch.compile needs a C++ toolchain; report instead of failing
        print(f"  (compiled flex unavailable: {type(err).__name__}: {str(err)[:100]})")
        return None


def decode_step(num_seqs: int, context: int, repeats: int) -> list:
    rng = np.random.default_rng(0)
    ctx = rng.integers(context // 2, context * 3 // 2, num_seqs)
    block = 16
    blocks_per_seq = -(-(ctx + 1) // block)
    num_blocks = int(blocks_per_seq.sum())
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0))
    table = torch.zeros(num_seqs, int(blocks_per_seq.max()), dtype=torch.int32)
    start = 0
    for i, nb in enumerate(blocks_per_seq):
        table[i, :nb] = perm[start : start + nb]
        start += nb
    cache = (torch.randn(num_blocks, block, 3, 64), torch.randn(num_blocks, block, 3, 64))
    slots = table[torch.arange(num_seqs), torch.from_numpy(ctx // block)].long() * block + torch.from_numpy(ctx % block)
    meta = VarlenMeta.for_step([1] * num_seqs, ctx, block_table=table, slot_mapping=slots)
    q, k, v = torch.randn(num_seqs, 9, 64), torch.randn(num_seqs, 3, 64), torch.randn(num_seqs, 3, 64)
    store_kv(cache, k, v, slots)

    def run(backend):
        def go():
            with torch.no_grad():
                varlen_attention(q, None, None, meta, kv_cache=cache, backend=backend)

        return go

    rows = [(b, best_of(run(b), repeats), None) for b in ("sdpa_loop", "sdpa_padded", "auto")]
    label = f"decode step: {num_seqs} sequences x ~{context} cached tokens, 9/3 heads, dim 64, block 16"
    return label, rows


def print_table(label: str, rows: list) -> None:
    print(f"\n{label}")
    base_f, base_b = rows[0][1], rows[0][2]
    print(f"  {'backend':18s} {'fwd ms':>9s} {'vs loop':>8s} {'fwd+bwd ms':>11s} {'vs loop':>8s}")
    for name, f, b in rows:
        fs = f"{f:9.1f} {base_f / f:7.2f}x" if f is not None else f"{'n/a':>9s} {'':>8s}"
        bs = f"{b:11.1f} {base_b / b:7.2f}x" if b is not None and base_b else f"{'no bwd':>11s} {'':>8s}"
        print(f"  {name:18s} {fs} {bs}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    repeats = 1 if args.quick else 3
    total = 2048 if args.quick else 8192
    print(f"torch {torch.__version__}, {args.threads} threads")
    # --quick leaves out compiled flex: its torch.compile is most of a quick run's time, and a failed
    # compile is reported, not raised, so a smoke run of it would check nothing
    print_table(*training_row(total, 64, 1024, repeats, dense=True, flex_compiled=not args.quick))
    print_table(*decode_step(16 if args.quick else 64, 300, repeats * 5))


if __name__ == "__main__":
    main()
