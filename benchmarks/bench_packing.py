"""Packing benchmark: nopad vs TRL on 1M synthetic sequences, measured side by side in one run.

(a) the whole job a user runs on a tokenized ``datasets.Dataset``: nopad ``pack_dataset`` vs TRL
    ``pack_dataset(strategy="bfd")`` made global (one map batch = the whole dataset) and TRL's
    default (1000-row map batches);
(b) nopad's bin assignment alone (``nopad.packing.pack`` on the length array, result arrays included).
Padding-to-longest over random micro-batches of 8 and padding to the capacity are shown for
reference.

    python benchmarks/bench_packing.py           # 1,000,000 rows per workload (TRL takes minutes)
    python benchmarks/bench_packing.py --quick   # 10,000 rows (a smoke run)
"""

from __future__ import annotations

import argparse
import gc
import time

import numpy as np
import pyarrow as pa

WORKLOADS = {
    # name: (length sampler, capacity)
    "lognormal(median 350), cap 4096": (lambda rng, n: rng.lognormal(np.log(350), 0.9, n), 4096),
    "gamma(5, 20), cap 2048": (lambda rng, n: rng.gamma(5.0, 20.0, n), 2048),
}


def make_lengths(sampler, capacity: int, n: int, seed: int = 0) -> np.ndarray:
    raw = sampler(np.random.default_rng(seed), n)
    return np.clip(np.round(raw), 1, capacity).astype(np.int64)


def make_dataset(lengths: np.ndarray):
    """A tokenized Dataset with synthetic token ids of the given lengths (int32, in memory)."""
    import datasets

    offsets = np.zeros(len(lengths) + 1, dtype=np.int32)
    np.cumsum(lengths, out=offsets[1:])
    values = (np.arange(int(offsets[-1]), dtype=np.int64) % 49152).astype(np.int32)
    column = pa.ListArray.from_arrays(pa.array(offsets), pa.array(values))
    return datasets.Dataset(pa.table({"input_ids": column}))


def padded_to_longest(lengths: np.ndarray, micro_batch: int = 8, seed: int = 0) -> float:
    """Efficiency of padding each random micro-batch to its longest sequence."""
    shuffled = np.random.default_rng(seed).permutation(lengths)
    n = len(shuffled) // micro_batch * micro_batch
    groups = shuffled[:n].reshape(-1, micro_batch)
    return groups.sum() / (groups.max(axis=1).sum() * micro_batch)


def packed_efficiency(ds, capacity: int) -> float:
    import pyarrow.compute as pc

    tokens = pc.sum(pc.list_value_length(ds.data.column("input_ids"))).as_py()
    return tokens / (len(ds) * capacity)


def timed(fn):
    """``(result, wall seconds, CPU seconds of this process)``; CPU time stays meaningful when
    other jobs share the machine."""
    gc.collect()
    cpu, start = time.process_time(), time.perf_counter()
    result = fn()
    return result, time.perf_counter() - start, time.process_time() - cpu


def run_workload(name: str, sampler, capacity: int, n: int, repeats: int) -> list[tuple]:
    from trl.data_utils import pack_dataset as trl_pack_dataset

    from nopad.packing import pack, pack_dataset

    lengths = make_lengths(sampler, capacity, n)
    rows = []
    # (b) bin assignment alone, best of `repeats`
    runs = [timed(lambda: pack(lengths, capacity)) for _ in range(repeats)]
    bins, best, cpu = min(runs, key=lambda run: run[1])
    rows.append(("(b) nopad pack() [bfd]", n / best, bins.stats.efficiency, best, cpu))

    # (a) the whole job on a tokenized Dataset; each result is dropped before the next run
    ds = make_dataset(lengths)
    jobs = {
        "(a) nopad pack_dataset": lambda: pack_dataset(ds, capacity, overflow="truncate"),
        "(a) TRL pack_dataset bfd, global": lambda: trl_pack_dataset(
            ds, capacity, "bfd", map_kwargs={"batch_size": len(ds)}
        ),
        "(a) TRL pack_dataset bfd, default": lambda: trl_pack_dataset(ds, capacity, "bfd"),
    }
    seconds = {}
    for label, job in jobs.items():
        packed, seconds[label], cpu = timed(job)
        rows.append((label, n / seconds[label], packed_efficiency(packed, capacity), seconds[label], cpu))
        del packed
    nopad_seconds = seconds["(a) nopad pack_dataset"]
    trl_global_seconds = seconds["(a) TRL pack_dataset bfd, global"]
    del jobs

    rows.append(("padding to longest, micro-batch 8", None, padded_to_longest(lengths), None, None))
    rows.append(("padding to capacity", None, lengths.sum() / (len(lengths) * capacity), None, None))
    print(f"\n== {name}: {n:,} sequences, {int(lengths.sum()):,} tokens ==")
    print(f"{'method':<38} {'seq/s':>12} {'efficiency':>11} {'wall s':>8} {'cpu s':>8}")
    for method, rate, eff, secs, cpu in rows:
        rate_s = f"{rate:,.0f}" if rate else "-"
        secs_s = f"{secs:.2f}" if secs else "-"
        cpu_s = f"{cpu:.3f}" if cpu else "-"
        print(f"{method:<38} {rate_s:>12} {eff:>10.3%} {secs_s:>8} {cpu_s:>8}")
    eff = {row[0]: row[2] for row in rows}
    print(
        f"ratios: pack_dataset nopad/TRL-global speed {trl_global_seconds / nopad_seconds:.1f}x "
        f"(target >= 10x); efficiency nopad - TRL-global "
        f"{(eff['(a) nopad pack_dataset'] - eff['(a) TRL pack_dataset bfd, global']) * 100:+.4f} points; "
        f"pack() {n / best / 1e6:.2f}M seq/s (target >= 5M)"
    )
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="10k rows instead of 1M (a smoke run)")
    parser.add_argument("--rows", type=int, default=None, help="override the number of rows")
    args = parser.parse_args()
    n = args.rows or (10_000 if args.quick else 1_000_000)
    for name, (sampler, capacity) in WORKLOADS.items():
        run_workload(name, sampler, capacity, n, repeats=3)


if __name__ == "__main__":
    main()
