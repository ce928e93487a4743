"""Does the paged attention kernel decode at memory speed? Kernel vs per-sequence SDPA, in GB/s.

A decode step reads every sequence's cached K/V once per layer; at batch >= 32 that read is the
floor of attention's time. This script measures, in one run:

1. the machine's memory read bandwidth: ``torch.sum`` over a 1 GiB fp32 buffer (far larger than
   the last-level cache), best of several, with the same thread count as the kernel;
2. one paged decode step (48 sequences of 150-450 cached tokens, one new token each) for two
   shapes, SmolLM2-135M (9 heads, 3 KV heads, dim 64) and a G=8 shape (16 heads, 2 KV heads,
   dim 128), in fp32, bf16 and fp16, with KV blocks of 16 and 256 tokens, for the compiled kernel
   (``nopad.packing.attention.cpu_kernel.forward``, keys read in place) and for the per-sequence SDPA path
   (``varlen_attention(backend="sdpa_loop")``, the peer).

Each layer has its own cache and the timed call runs over enough layers (>= 256 MB of K/V, 8x
the L3 here) that every layer's K/V come from memory, as in a real step. It prints the K/V bytes
read per layer, ms per layer, GB/s and the percentage of the measured bandwidth, and the kernel's
GB/s with one layer's K/V already in cache ("in cache"): its arithmetic alone, so a kernel whose
in-cache figure is near its from-memory one is compute-bound, not waiting on memory.

3. one chunked-prefill step (5 sequences, 128-512 new tokens over 0-900 cached ones, paged): the
   kernel, reading the blocks in place, against per-sequence SDPA on gathered keys, in GFLOP/s.

    python benchmarks/bench_kernel_bandwidth.py [--threads N]
    python benchmarks/bench_kernel_bandwidth.py --quick   # smoke run: one shape, fp32/bf16, 8 sequences,
                                                          # small buffers (the figures are not the claim)
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from nopad.packing.attention import (
    cpu_kernel,  # noqa: E402
    varlen_attention,  # noqa: E402
)
from nopad.packing.varlen import VarlenMeta  # noqa: E402

SHAPES = [("SmolLM2 9/3 heads, dim 64", 9, 3, 64), ("G=8 16/2 heads, dim 128", 16, 2, 128)]
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
BLOCK_SIZES = [16, 256]
KV_BYTES_PER_CALL = 256 << 20
BANDWIDTH_BYTES = 1 << 30


def best_of(fn, repeats: int) -> float:
    """Best wall time of ``fn`` in seconds, after one warm-up call."""
    fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def read_bandwidth(repeats: int, nbytes: int = BANDWIDTH_BYTES) -> float:
    """Memory read bandwidth in GB/s: a sum over 1 GiB of fp32 (torch's vectorised reduction uses
    the threads set by torch.set_num_threads)."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    seconds = best_of(lambda: buf.sum(), repeats)
    return buf.numel() * buf.element_size() / seconds / 1e9


def paged_step(
    num_seqs: int,
    heads: int,
    kv_heads: int,
    dim: int,
    block: int,
    dtype: torch.dtype,
    kv_bytes_per_call: int = KV_BYTES_PER_CALL,
):
    """A decode step's meta and queries plus enough per-layer paged caches to exceed the LLC."""
    rng = np.random.default_rng(0)
    ctx = rng.integers(150, 451, num_seqs)
    key_lens = ctx + 1
    need = -(-key_lens // block)
    num_blocks = int(need.sum())
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(0)).to(torch.int32)
    table = torch.zeros(num_seqs, int(need.max()), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start : start + n]
        start += n
    meta = VarlenMeta.for_step([1] * num_seqs, ctx, block_table=table)
    itemsize = torch.empty((), dtype=dtype).element_size()
    kv_bytes = int(key_lens.sum()) * kv_heads * dim * 2 * itemsize  # K and V, the keys actually read
    layers = max(1, -(-kv_bytes_per_call // kv_bytes))
    gen = torch.Generator().manual_seed(1)
    caches = [
        tuple(torch.randn(num_blocks, block, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
        for _ in range(layers)
    ]
    q = torch.randn(num_seqs, heads, dim, generator=gen).to(dtype)
    return meta, q, caches, kv_bytes


def decode_case(num_seqs, heads, kv_heads, dim, block, dtype, repeats, kv_bytes_per_call=KV_BYTES_PER_CALL):
    meta, q, caches, kv_bytes = paged_step(num_seqs, heads, kv_heads, dim, block, dtype, kv_bytes_per_call)
    scale = dim**-0.5

    def kernel_layer(cache):
        flat = [c.view(-1, kv_heads, dim) for c in cache]
        return cpu_kernel.forward(q, *flat, meta, table=meta.block_table, block_size=block, scale=scale)

    def kernel():
        for cache in caches:
            kernel_layer(cache)

    def sdpa():
        with torch.no_grad():
            for cache in caches:
                varlen_attention(q, None, None, meta, kv_cache=cache, backend="sdpa_loop")

    # same answer first: a fast wrong kernel is no result
    got = kernel_layer(caches[0])
    with torch.no_grad():
        ref = varlen_attention(
            q.float(), None, None, meta, kv_cache=tuple(c.float() for c in caches[0]), backend="sdpa_loop"
        )
    err = (got.float() - ref).abs().max().item()
    layers = len(caches)
    # the same call with one layer's K/V already in cache: the kernel's arithmetic alone, the most
    # a perfect overlap of memory and compute could give
    in_cache = best_of(lambda: [kernel_layer(caches[0]) for _ in range(8)], repeats) / 8
    from_memory = best_of(kernel, repeats) / layers
    return kv_bytes, from_memory, in_cache, best_of(sdpa, max(1, repeats // 2)) / layers, err


def print_head(head: str) -> None:
    print(head)
    print("-" * len(head))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--threads", type=int, default=os.cpu_count())
    parser.add_argument("--seqs", type=int, default=48)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: one shape, fp32/bf16, 8 sequences, small buffers, fewer repeats",
    )
    args = parser.parse_args()
    shapes, dtypes, chunks = SHAPES, DTYPES, PREFILL_CHUNKS
    kv_per_call, bandwidth_bytes = KV_BYTES_PER_CALL, BANDWIDTH_BYTES
    if args.quick:
        shapes, dtypes, kv_per_call, bandwidth_bytes = SHAPES[:1], DTYPES[:2], 4 << 20, 64 << 20
        args.seqs, chunks = min(args.seqs, 8), [(q // 8, c // 8) for q, c in PREFILL_CHUNKS]
    if args.seqs < 1 or args.threads < 1:
        parser.error(f"--seqs and --threads must be >= 1, got {args.seqs} and {args.threads}")
    if cpu_kernel.kernel() is None:
        raise SystemExit("the attention kernel is not built: python setup.py build_ext --inplace")
    torch.set_num_threads(args.threads)
    repeats = 1 if args.quick else 5
    bandwidth = read_bandwidth(repeats, bandwidth_bytes)
    print(f"torch {torch.__version__}, {args.threads} threads, load average {os.getloadavg()[0]:.2f}")
    print(
        f"memory read bandwidth (torch.sum over {bandwidth_bytes >> 20} MiB fp32, best of {repeats}): "
        f"{bandwidth:.1f} GB/s"
    )
    print(f"decode step: {args.seqs} sequences x 150-450 cached tokens + 1 new; per layer, K/V from memory\n")
    print_head(
        f"{'shape':27s} {'dtype':9s} {'block':>5s} {'KV MB':>7s} | {'kernel ms':>9s} {'GB/s':>6s}"
        f" {'% bw':>5s} | {'in cache':>8s} {'% bw':>5s} | {'sdpa ms':>8s} {'GB/s':>6s} {'% bw':>5s} | "
        f"{'speedup':>7s} {'max err':>8s}"
    )
    for name, heads, kv_heads, dim in shapes:
        for dtype in dtypes:
            for block in BLOCK_SIZES:
                kv_bytes, t_kernel, t_hot, t_sdpa, err = decode_case(
                    args.seqs, heads, kv_heads, dim, block, dtype, repeats, kv_per_call
                )
                gk, gh, gs = (kv_bytes / t / 1e9 for t in (t_kernel, t_hot, t_sdpa))
                print(
                    f"{name:27s} {str(dtype)[6:]:9s} {block:5d} {kv_bytes / 1e6:7.2f} | "
                    f"{t_kernel * 1e3:9.3f} {gk:6.1f} {100 * gk / bandwidth:4.0f}% | "
                    f"{gh:8.1f} {100 * gh / bandwidth:4.0f}% | "
                    f"{t_sdpa * 1e3:8.3f} {gs:6.1f} {100 * gs / bandwidth:4.0f}% | "
                    f"{t_sdpa / t_kernel:6.2f}x {err:8.1e}",
                    flush=True,
                )
    prefill_section(repeats, shapes, dtypes, chunks)


# (new tokens, cached tokens) of each sequence of the prefill step
PREFILL_CHUNKS = [(512, 0), (512, 512), (256, 700), (256, 200), (128, 900)]


def prefill_case(
    heads: int,
    kv_heads: int,
    dim: int,
    dtype: torch.dtype,
    repeats: int,
    chunks: list[tuple[int, int]] = PREFILL_CHUNKS,
):
    """One chunked-prefill step: each sequence's new tokens attend causally to its cached keys
    (paged, blocks of 16) and to each other; the kernel reads the blocks in place, per-sequence
    SDPA gathers them first."""
    block = 16
    query_lens = [q for q, _ in chunks]
    cached = [c for _, c in chunks]
    need = [-(-(q + c) // block) for q, c in chunks]
    perm = torch.randperm(sum(need), generator=torch.Generator().manual_seed(0)).to(torch.int32)
    table = torch.zeros(len(need), max(need), dtype=torch.int32)
    start = 0
    for i, n in enumerate(need):
        table[i, :n] = perm[start : start + n]
        start += n
    meta = VarlenMeta.for_step(query_lens, cached, block_table=table)
    gen = torch.Generator().manual_seed(2)
    cache = tuple(torch.randn(sum(need), block, kv_heads, dim, generator=gen).to(dtype) for _ in range(2))
    q = torch.randn(sum(query_lens), heads, dim, generator=gen).to(dtype)
    flat = [c.view(-1, kv_heads, dim) for c in cache]
    scale = dim**-0.5

    def kernel():
        return cpu_kernel.forward(q, *flat, meta, table=meta.block_table, block_size=block, scale=scale)

    def sdpa():
        with torch.no_grad():
            return varlen_attention(q, None, None, meta, kv_cache=cache, backend="sdpa_loop")

    err = (kernel().float() - sdpa().float()).abs().max().item()
    # causal pairs (query, visible key) x heads x 2 matmuls x 2 flops x dim
    pairs = sum(qn * c + qn * (qn + 1) // 2 for qn, c in chunks)
    flops = pairs * heads * 4 * dim
    return flops, best_of(kernel, repeats), best_of(sdpa, repeats), err


def prefill_section(repeats: int, shapes, dtypes, chunks) -> None:
    described = ", ".join(f"{qn} new over {c} cached" for qn, c in chunks)
    print(
        f"\nprefill chunks (one step: {described}; paged, blocks of 16): kernel reads the cache in place, "
        "per-sequence SDPA gathers it"
    )
    print_head(
        f"{'shape':27s} {'dtype':9s} | {'kernel ms':>9s} {'GFLOP/s':>8s} | {'sdpa ms':>8s} "
        f"{'GFLOP/s':>8s} | {'speedup':>7s} {'max err':>8s}"
    )
    for name, heads, kv_heads, dim in shapes:
        for dtype in dtypes:
            flops, t_kernel, t_sdpa, err = prefill_case(heads, kv_heads, dim, dtype, repeats, chunks)
            print(
                f"{name:27s} {str(dtype)[6:]:9s} | {t_kernel * 1e3:9.2f} {flops / t_kernel / 1e9:8.1f} | "
                f"{t_sdpa * 1e3:8.2f} {flops / t_sdpa / 1e9:8.1f} | {t_sdpa / t_kernel:6.2f}x {err:8.1e}",
                flush=True,
            )


if __name__ == "__main__":
    main()
