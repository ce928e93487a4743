"""Rank balance benchmark: how much the busiest of 8 data-parallel ranks works compared with the
mean, for nopad's balancing vs the usual ways of sharding packed bins, measured in the same run.

Lengths: lognormal (median 350), clipped to [1, 4096]; bins: the core's BFD at capacity 4096.
Cost of a bin = tokens + sum(l^2) / (12 * hidden) (linear layers + causal attention of a model of
width ``hidden``); "attention only" is sum(l^2). Two skews, lower is better, 1.0 is perfect:

- rank total: max over ranks of the epoch's total cost / mean (who finishes the epoch last);
- per step: sum over steps of the busiest rank's cost / sum of the mean - the synchronous-step
  slowdown, since every step waits for the slowest rank.

Peers: contiguous sharding of the BFD bin list (rank r takes the r-th slice), and shuffled bins
dealt round-robin (what a DistributedSampler over TRL-style packed rows does).

    python benchmarks/bench_balance.py           # 200,000 lengths
    python benchmarks/bench_balance.py --quick   # 20,000 lengths
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from nopad.dataloaders.balance import balance_bins, default_attention_cost, skew
from nopad.packing import pack

RANKS = 8
CAPACITY = 4096


def bin_arrays(lengths: np.ndarray, seed: int):
    packed = pack(lengths, CAPACITY, strategy="bfd", seed=seed)
    items = np.split(np.arange(len(packed.lengths), dtype=np.int64), packed.offsets[1:-1])
    tokens = np.add.reduceat(packed.lengths, packed.offsets[:-1])
    squares = np.add.reduceat(packed.lengths**2, packed.offsets[:-1]).astype(np.float64)
    return packed, items, tokens.astype(np.float64), squares


def contiguous(num_bins: int) -> np.ndarray:
    """(steps, ranks) bin ids: rank r gets bins [r*S, (r+1)*S); the remainder is dropped."""
    steps = num_bins // RANKS
    return np.arange(steps * RANKS).reshape(RANKS, steps).T


def round_robin(num_bins: int, seed: int) -> np.ndarray:
    """(steps, ranks) bin ids: bins shuffled, then dealt i % ranks; the remainder is dropped."""
    perm = np.random.default_rng(seed).permutation(num_bins)
    steps = num_bins // RANKS
    return perm[: steps * RANKS].reshape(steps, RANKS)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="20k lengths instead of 200k")
    parser.add_argument("--n", type=int, default=None)
    parser.add_argument("--hidden", type=int, default=2048, help="model width for the cost model")
    args = parser.parse_args()
    n = args.n or (20_000 if args.quick else 200_000)
    rng = np.random.default_rng(0)
    lengths = np.clip(np.round(rng.lognormal(np.log(350), 0.9, n)), 1, CAPACITY).astype(np.int64)
    b = default_attention_cost(args.hidden)

    packed, items, tokens, squares = bin_arrays(lengths, seed=0)
    t0 = time.perf_counter()
    plan = balance_bins(items, packed.lengths, RANKS, attention_cost=b, seed=0)
    balance_s = time.perf_counter() - t0
    nopad_ids = np.array(plan.steps)
    plan_bins = plan.bins
    plan_tokens = np.array([packed.lengths[x].sum() for x in plan_bins], dtype=np.float64)
    plan_squares = np.array([(packed.lengths[x] ** 2).sum() for x in plan_bins], dtype=np.float64)

    rows = []
    for name, ids, tok, sq, dropped in (
        ("nopad balance", nopad_ids, plan_tokens, plan_squares, 0),
        ("contiguous shards", contiguous(len(items)), tokens, squares, len(items) % RANKS),
        ("shuffled round-robin", round_robin(len(items), 0), tokens, squares, len(items) % RANKS),
    ):
        combined = skew((tok + b * sq)[ids])
        attention = skew(sq[ids])
        rows.append((name, ids.shape[0], dropped, *combined, *attention))

    print(
        f"{n:,} lognormal lengths (median 350, clip [1, {CAPACITY}]) -> {len(items):,} BFD bins "
        f"({packed.stats.efficiency:.2%} full), {RANKS} ranks, cost = tokens + sum(l^2)/(12*{args.hidden})"
    )
    print(
        f"nopad: {plan.bins_split} bins split, {len(plan.duplicated)} duplicated to equalise steps; "
        f"balancing took {balance_s:.2f} s"
    )
    header = (
        f"{'method':<22}{'steps':>7}{'dropped':>9}{'rank total':>12}{'per step':>10}"
        f"{'attn total':>12}{'attn step':>11}{'step vs nopad':>15}"
    )
    print(header)
    print("-" * len(header))
    base = rows[0][4]
    for name, steps, dropped, total, step, attn_total, attn_step in rows:
        print(
            f"{name:<22}{steps:>7}{dropped:>9}{total:>12.4f}{step:>10.4f}{attn_total:>12.4f}"
            f"{attn_step:>11.4f}{step / base:>14.3f}x"
        )
    print("(max/mean; 'step vs nopad' = per-step skew of the method / nopad's: >1 means slower steps)")


if __name__ == "__main__":
    main()
