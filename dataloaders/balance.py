"""Spread packed bins over data-parallel ranks so every step costs about the same on every rank.

Synchronous data parallelism waits for the slowest rank at every step, so what matters is the
cost of each *step* on each rank, not only the per-rank total over an epoch. A bin's cost is
``token_cost * tokens + attention_cost * sum(l**2)``: the linear layers scale with tokens, the
attention with the square of each sequence's length; :func:`attention_cost_from_config` derives
the ratio from the model's width, depth, heads and vocabulary.

The plan: sort bins by cost, cut the sorted list into steps of ``num_ranks`` consecutive bins
(neighbours in the sorted order cost nearly the same, so each step is balanced), hand the bins of
each step to ranks longest-processing-time first against the running per-rank totals (so the
epoch totals are balanced too), then shuffle the order of the steps. Every rank gets the same
number of steps by construction: before cutting, bins with two or more sequences are split in
two until the bin count is a multiple of ``num_ranks * steps_multiple_of``. Only when there are
too few sequences to split does a bin get duplicated; duplicates are flagged (the collator masks
their loss) and counted.
"""

from __future__ import annotations

import heapq
from dataclasses import dataclass

import numpy as np

# attention_cost / token_cost for a dense decoder: per token and layer the linear layers do about
# 24*d^2 FLOPs, causal attention over a sequence of length l about 2*d*l^2, so b/a = 1/(12*d).
DEFAULT_HIDDEN_SIZE = 2048


def default_attention_cost(hidden_size: int = DEFAULT_HIDDEN_SIZE) -> float:
    """Weight of ``sum(l**2)`` relative to tokens for a model of width ``hidden_size``."""
    if hidden_size < 1:
        raise ValueError(f"hidden_size must be >= 1, got {hidden_size}")
    return 1.0 / (12.0 * hidden_size)


def attention_cost_from_config(config) -> float:
    """Weight of ``sum(l**2)`` relative to tokens, from a transformers model config (what slime's
    ``--balance-by-flops`` does). Forward FLOPs per token: each layer's q/k/v/o projections
    (``2*d*(heads + 2*kv_heads)*head_dim + 2*heads*head_dim*d``) and gated MLP (``6*d*ffn``), plus
    the LM head (``2*d*vocab``); causal attention over a sequence of length ``l`` adds
    ``2*heads*head_dim*l**2`` per layer (QK^T and AV, half the square). Sliding windows are
    ignored (an upper bound on the attention term)."""
    d = int(config.hidden_size)
    layers = int(config.num_hidden_layers)
    heads = int(config.num_attention_heads)
    kv_heads = int(getattr(config, "num_key_value_heads", None) or heads)
    head_dim = int(getattr(config, "head_dim", None) or d // heads)
    ffn = int(getattr(config, "intermediate_size", None) or 4 * d)
    vocab = int(getattr(config, "vocab_size", 0) or 0)
    if min(d, layers, heads, head_dim) < 1:
        raise ValueError(
            f"config has hidden_size={d}, num_hidden_layers={layers}, "
            f"num_attention_heads={heads}: cannot derive the attention cost; "
            "pass attention_cost= explicitly"
        )
    linear = 2 * d * (heads + 2 * kv_heads) * head_dim + 2 * heads * head_dim * d + 6 * d * ffn
    per_token = layers * linear + 2 * d * vocab
    return 2.0 * heads * head_dim * layers / per_token


def bin_cost(lengths: np.ndarray, token_cost: float, attention_cost: float) -> float:
    lengths = np.asarray(lengths, dtype=np.float64)
    return float(token_cost * lengths.sum() + attention_cost * np.square(lengths).sum())


@dataclass
class RankPlan:
    """Which bins each rank runs at each step: ``steps[s][r]`` is a bin id (into the bins list
    returned alongside), identical on every rank."""

    steps: list[list[int]]
    bins: list[np.ndarray]  # item ids (positions in the packer's flat item arrays) per bin
    duplicated: set[int]  # bin ids that repeat another bin's items (loss masked)
    bins_split: int  # bins split in two to equalise step counts
    rank_cost_skew: float  # max / mean of the per-rank epoch totals
    step_cost_skew: float  # sum over steps of max rank cost / sum over steps of mean rank cost
    step_costs: np.ndarray | None = None  # (num_steps, num_ranks) cost of each rank's bin
    step_tokens: np.ndarray | None = None  # (num_steps, num_ranks) real tokens of each rank's bin

    @property
    def num_steps(self) -> int:
        return len(self.steps)

    def rank_bins(self, rank: int) -> list[int]:
        return [step[rank] for step in self.steps]

    def step_report(self, capacity: int) -> dict:
        """Per step: max/mean rank cost (1.0 = no rank waits) and pad fraction (empty token slots
        of the step's ``num_ranks`` rows of ``capacity``); plus the epoch's worst/mean of each and
        the idle fraction (rank time spent waiting for the step's busiest rank)."""
        costs, tokens = self.step_costs, self.step_tokens
        max_over_mean = costs.max(axis=1) / np.maximum(costs.mean(axis=1), 1e-30)
        pad = 1.0 - tokens.sum(axis=1) / (tokens.shape[1] * capacity)
        return {
            "step_max_over_mean": max_over_mean.tolist(),
            "step_pad_fraction": pad.tolist(),
            "worst_step_max_over_mean": float(max_over_mean.max()),
            "mean_step_max_over_mean": float(max_over_mean.mean()),
            "pad_fraction": float(1.0 - tokens.sum() / tokens.size / capacity),
            "idle_fraction": float(1.0 - costs.mean(axis=1).sum() / costs.max(axis=1).sum()),
        }


def _split_in_two(items: np.ndarray, item_lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Split one bin's items into two non-empty halves of about equal tokens (greedy LPT)."""
    order = items[np.argsort(-item_lengths[items], kind="stable")]
    halves: list[list[int]] = [[], []]
    loads = [0, 0]
    for item in order:
        side = 0 if loads[0] <= loads[1] else 1
        halves[side].append(int(item))
        loads[side] += int(item_lengths[item])
    return np.array(halves[0], dtype=np.int64), np.array(halves[1], dtype=np.int64)


def equalize_bin_count(
    bins: list[np.ndarray], item_lengths: np.ndarray, multiple: int, cost
) -> tuple[list[np.ndarray], set[int], int]:
    """Make ``len(bins)`` a multiple of ``multiple``: split the costliest multi-item bins, and
    duplicate bins only when nothing is left to split. Returns (bins, duplicated ids, splits)."""
    bins = list(bins)
    need = -len(bins) % multiple
    heap = [(-cost(item_lengths[b]), i) for i, b in enumerate(bins) if len(b) >= 2]
    heapq.heapify(heap)
    splits = 0
    while need and heap:
        _, i = heapq.heappop(heap)
        first, second = _split_in_two(bins[i], item_lengths)
        bins[i] = first
        bins.append(second)
        splits += 1
        need -= 1
        for j in (i, len(bins) - 1):
            if len(bins[j]) >= 2:
                heapq.heappush(heap, (-cost(item_lengths[bins[j]]), j))
    duplicated: set[int] = set()
    source = 0
    while need:  # fewer sequences than steps * ranks: repeat bins, loss-masked
        if not bins:
            raise ValueError("cannot balance an empty set of bins over ranks")
        duplicated.add(len(bins))
        bins.append(bins[source % len(bins)].copy())
        source += 1
        need -= 1
    return bins, duplicated, splits


def balance_bins(
    bins: list[np.ndarray],
    item_lengths: np.ndarray,
    num_ranks: int,
    *,
    steps_multiple_of: int = 1,
    token_cost: float = 1.0,
    attention_cost: float | None = None,
    seed: int | None = 0,
) -> RankPlan:
    """Plan an epoch: equal step counts on every rank, each step's bins of similar cost.

    ``bins`` holds item ids per bin, ``item_lengths[item]`` the tokens of an item. ``seed`` shuffles
    the order of steps (``None`` keeps them sorted, costliest first).
    """
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if steps_multiple_of < 1:
        raise ValueError(f"steps_multiple_of must be >= 1, got {steps_multiple_of}")
    if not bins:
        raise ValueError("no bins to balance: the dataset is empty (or every sequence was skipped)")
    item_lengths = np.asarray(item_lengths, dtype=np.int64)
    a = float(token_cost)
    b = default_attention_cost() if attention_cost is None else float(attention_cost)

    def cost(lengths: np.ndarray) -> float:
        return bin_cost(lengths, a, b)

    bins, duplicated, splits = equalize_bin_count(bins, item_lengths, num_ranks * steps_multiple_of, cost)
    costs = np.array([cost(item_lengths[x]) for x in bins])
    order = np.argsort(-costs, kind="stable")
    totals = np.zeros(num_ranks)
    steps: list[list[int]] = []
    for s in range(len(bins) // num_ranks):
        group = order[s * num_ranks : (s + 1) * num_ranks]  # costliest first
        step = [0] * num_ranks
        for rank, bin_id in zip(np.argsort(totals, kind="stable"), group):
            step[int(rank)] = int(bin_id)
            totals[rank] += costs[bin_id]
        steps.append(step)
    if seed is not None:
        perm = np.random.default_rng(seed).permutation(len(steps))
        steps = [steps[i] for i in perm]
    step_costs = costs[np.array(steps, dtype=np.int64)]  # (num_steps, num_ranks)
    tokens = np.array([int(item_lengths[x].sum()) for x in bins], dtype=np.int64)
    step_tokens = tokens[np.array(steps, dtype=np.int64)]
    step_tokens[np.isin(np.array(steps), list(duplicated))] = 0  # duplicates are loss-masked padding
    return RankPlan(
        steps=steps,
        bins=bins,
        duplicated=duplicated,
        bins_split=splits,
        rank_cost_skew=float(totals.max() / totals.mean()),
        step_cost_skew=float(step_costs.max(axis=1).sum() / step_costs.mean(axis=1).sum()),
        step_costs=step_costs,
        step_tokens=step_tokens,
    )


def skew(rank_step_costs: np.ndarray) -> tuple[float, float]:
    """(rank total max/mean, per-step max/mean) of a ``(num_steps, num_ranks)`` cost table, for
    comparing other ways of sharding against :func:`balance_bins`."""
    totals = rank_step_costs.sum(axis=0)
    per_step = rank_step_costs.max(axis=1).sum() / rank_step_costs.mean(axis=1).sum()
    return float(totals.max() / totals.mean()), float(per_step)
