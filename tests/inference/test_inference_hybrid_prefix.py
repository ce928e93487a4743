"""The prefix cache on hybrid models: a later request reuses cached K/V blocks only
up to the last block boundary with a state snapshot, starts its conv and recurrent state from a copy
of that snapshot, and prefills the rest; without a snapshot it recomputes from its first token.
Greedy output with the cache equals HF ``generate`` and the generator without it, on a delta-rule
model (Qwen3.5), short convolutions (LFM2) and Mamba2 (Bamba), and the hit skips prefill work."""

from __future__ import annotations

import pytest
import torch

from nopad.inference import Generator, SamplingParams
from nopad.inference.state_cache import copy_waves
from tests.inference.test_inference_generator import forward_logprobs, hf_greedy, prompts_of
from tests.inference.test_inference_hybrid import FAMILIES as ALL_FAMILIES
from tests.inference.test_inference_hybrid import assert_all_freed, hybrid_model

GREEDY = SamplingParams(temperature=0.0, max_tokens=6)
FAMILIES = ("qwen3_5", "lfm2", "bamba")

pytestmark = pytest.mark.usefixtures("one_thread_module")


def run_staggered(gen: Generator, prompts, params=GREEDY, groups: list[int] | None = None) -> list:
    """Queue the prompts in groups (default: one by one), each when the earlier ones finished their
    prefill (a later request finds their cache; the generator drops it only when idle). Returns
    each request's samples."""
    ids, outs, start = [], {}, 0

    def step():
        outs.update((o.request_id, [c.token_ids for c in o.outputs]) for o in gen.step())

    for size in groups or [1] * len(prompts):
        ids += [gen.add_request(p, params) for p in prompts[start : start + size]]
        start += size
        while gen.scheduler.waiting or any(s.num_pending > 1 for s in gen.scheduler.running):
            step()
    while gen.has_unfinished():
        step()
    return [outs[i] for i in ids]


def run_one_by_one(gen: Generator, prompts) -> list[list[int]]:
    return [samples[0] for samples in run_staggered(gen, prompts)]


def shared(system: list[int], *tails: list[int]) -> list[list[int]]:
    return [system + tail for tail in tails]


def check_greedy(model, prompts, completions, n=6):
    for prompt, completion in zip(prompts, completions):
        assert completion == hf_greedy(model, prompt, n)
        ref = forward_logprobs(model, prompt, completion)
        assert torch.isfinite(ref).all()


@pytest.fixture(scope="module", params=FAMILIES)
def model(request):
    return hybrid_model(request.param)


def test_a_long_shared_prefix_is_reused_and_equals_hf_and_the_cache_off(model):
    """The first request's prefill stops at 20 (its last block boundary) and leaves a snapshot
    there; the second shares the 19-token system prompt, so its cached blocks end at 16 where no
    state is known: it recomputes, stopping at 16 to leave one; the third and fourth start there."""
    check_shared_prefix(model)


@pytest.mark.parametrize("family", [f for f in ALL_FAMILIES if f not in FAMILIES])
def test_every_served_hybrid_family_reuses_a_shared_prefix(family):
    check_shared_prefix(hybrid_model(family))


def check_shared_prefix(model):
    system, tails = prompts_of([19], seed=1)[0], prompts_of([3, 6, 1, 4], seed=2)
    prompts = shared(system, *tails)
    on = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=64)
    off = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=64, enable_prefix_caching=False)
    got = run_one_by_one(on, prompts)
    assert got == run_one_by_one(off, prompts)
    check_greedy(model, prompts, got)
    stats, plain = on.stats(), off.stats()
    assert stats["state_snapshot_hits"] == 2
    assert stats["prefix_cache_hit_tokens"] == 2 * 16
    assert sum(stats["tokens_per_step"]) == sum(plain["tokens_per_step"]) - 2 * 16  # the hits skipped them
    assert "state_snapshots" not in plain
    assert_all_freed(on)


def test_a_prefix_ending_inside_a_block_reuses_up_to_the_last_snapshot(model):
    """The second prompt shares 10 tokens: blocks 0 and 1 are cached, but the first request's only
    snapshot is at 16, so nothing is reused (it leaves a snapshot at 8); a third one sharing 17
    tokens reuses 16, a fourth sharing 10 reuses 8."""
    first = prompts_of([18], seed=3)[0]
    second = first[:10] + prompts_of([5], seed=4)[0]
    third = first[:17] + prompts_of([2], seed=5)[0]
    fourth = first[:10] + prompts_of([3], seed=6)[0]
    gen = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=64)
    got = run_one_by_one(gen, [first, second, third, fourth])
    assert gen.stats()["prefix_cache_hit_tokens"] == 16 + 8 and gen.stats()["state_snapshot_hits"] == 2
    check_greedy(model, [first, second, third, fourth], got)
    assert_all_freed(gen)


def test_an_evicted_snapshot_forces_a_recompute(model):
    """One snapshot slot: the second prompt's snapshot evicts the first's, so the first prompt's
    blocks are still cached but its state is not known: the third request recomputes it all."""
    a, b = prompts_of([13, 9], seed=6)
    prompts = [a + [5], b + [7], a + [9, 4]]
    gen = Generator(model, block_size=4, num_blocks=64, num_state_snapshots=1)
    got = run_one_by_one(gen, prompts)
    stats = gen.stats()
    assert stats["state_snapshot_evictions"] >= 1 and stats["state_snapshot_hits"] == 0
    assert stats["prefix_cache_hit_tokens"] == 0
    check_greedy(model, prompts, got)
    # a block evicted from the KV cache takes its snapshot with it
    tight = Generator(model, block_size=4, num_blocks=8)
    run_one_by_one(tight, prompts[:2])
    assert tight.stats()["evictions"] > 0
    snapshots = tight.scheduler.state_slots.snapshots
    assert all(tight.allocator._hash_to_block.get(h) is not None for h in snapshots._by_hash)
    assert run_one_by_one(tight, prompts[2:]) == got[2:]


def test_chunked_prefill_snapshots_at_block_aligned_chunk_ends(model):
    """Chunks of at most 6 tokens are cut back to blocks of 4: snapshots at 4, 8, ..., 24. The
    second prompt shares 23 tokens (reuses 20), the third 9 (reuses 8)."""
    system, tails = prompts_of([23], seed=7)[0], prompts_of([4, 2], seed=8)
    prompts = shared(system, *tails) + [system[:9] + tails[1]]
    on = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=6)
    got = run_one_by_one(on, prompts)
    assert max(on.stats()["tokens_per_step"]) <= 6
    assert on.stats()["state_snapshots_taken"] >= 6
    assert on.stats()["prefix_cache_hit_tokens"] == 20 + 8
    off = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=6, enable_prefix_caching=False)
    assert got == run_one_by_one(off, prompts)
    check_greedy(model, prompts, got)
    assert_all_freed(on)


def test_concurrent_requests_and_seeded_samples_are_unchanged_by_the_cache(model):
    system = prompts_of([17], seed=9)[0]
    prompts = shared(system, *prompts_of([2, 5, 3, 1], seed=10))
    params = SamplingParams(temperature=1.0, seed=3, n=2, max_tokens=6, ignore_eos=True)
    outs = {}
    for caching in (True, False):
        gen = Generator(model, block_size=4, num_blocks=128, max_num_batched_tokens=32, enable_prefix_caching=caching)
        # the first leaves the system prompt's snapshot; the other three come at once, all hitting it
        outs[caching] = run_staggered(gen, prompts, params, groups=[1, 3])
        if caching:
            assert gen.stats()["state_snapshot_hits"] == 3
        assert_all_freed(gen)
    assert outs[True] == outs[False]


def test_state_copies_apply_in_order():
    """A restore queued before its snapshot slot is retaken reads the old snapshot: a batch of
    copies reads every source before it writes, so a copy that reads a row the batch writes, or
    writes it again, starts the next batch."""
    assert copy_waves([(0, 5), (1, 6), (5, 2), (3, 5), (4, 7), (2, 1)]) == [
        ([0, 1], [5, 6]),
        ([5, 3, 4], [2, 5, 7]),
        ([2], [1]),
    ]


@pytest.mark.parametrize("bad", [-1, "4", 2.5, True])
def test_a_bad_snapshot_count_is_one_clear_line(bad):
    from nopad.inference.state_prefix import state_snapshots

    with pytest.raises(ValueError, match="num_state_snapshots must be an int >= 0"):
        state_snapshots([object()], True, bad, 4)
