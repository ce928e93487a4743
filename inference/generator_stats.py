"""What a generator reports: :meth:`nopad.inference.Generator.stats`, the scheduler's counters (steps,
tokens, preemptions, overlap), the block allocator's (prefix-cache hits, evictions), the policy
version and the hybrid state snapshots', in one flat dict."""

from __future__ import annotations

import dataclasses

from nopad.inference.state_prefix import reset_snapshot_stats, snapshot_stats


def generator_stats(generator) -> dict:
    """Counters since construction or :func:`reset_generator_stats`."""
    scheduler, allocator = generator.scheduler, generator.allocator
    return {
        **dataclasses.asdict(scheduler.stats),
        "prefix_cache_hit_blocks": allocator.hits,
        "max_num_seqs": scheduler.max_num_seqs,
        "num_blocks": allocator.num_blocks,
        "block_size": generator.block_size,
        "evictions": allocator.evictions,
        "policy_version": generator.versions.version,
        "stale_recomputes": generator.versions.recomputed,
        "decode_batch_steps": generator.decode_batch.steps,  # steps served from the kept arrays
        "graph_draw_steps": generator.decode_batch.graph_steps,  # of which the compiled graph drew the rows
        **snapshot_stats(scheduler.state_slots),
    }


def reset_generator_stats(generator) -> None:
    generator.scheduler.stats = type(generator.scheduler.stats)()
    generator.allocator.hits = generator.allocator.evictions = 0
    generator.decode_batch.steps = generator.decode_batch.graph_steps = 0
    reset_snapshot_stats(generator.scheduler.state_slots)
