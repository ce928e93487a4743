"""The generator on hybrid models: Gated DeltaNet, short-convolution and Mamba2 layers
keep a per-sequence conv and recurrent state in slots beside the KV blocks. Greedy output equals HF
``generate`` (which keeps the same state in its own cache) through chunked prefill, n > 1 samples,
forks, tool episodes that pause and resume, and preemption; sampled log-probs equal a training
forward of the whole sequence, whatever else shares the batch."""

from __future__ import annotations

import pytest
import torch

from nopad.inference import Generator, SamplingParams
from nopad.packing.mixers import mamba2
from tests.inference.test_inference_episodes import GREEDY as EPISODE
from tests.inference.test_inference_episodes import LIMITS, TOOLS, TokenFormat, echo, reference_episode
from tests.inference.test_inference_generator import forward_logprobs, hf_greedy, prompts_of
from tests.packing.test_packing_mamba2 import mamba_model
from tests.support.models import MAMBA2_FAMILIES, tiny_model
from tests.support.step_clock import StepClock

FAMILIES = ("qwen3_5", "lfm2", "qwen3_next", "olmo_hybrid", "kimi_linear", *MAMBA2_FAMILIES)
GREEDY = SamplingParams(temperature=0.0, max_tokens=8)
LENGTHS = [1, 5, 17, 3, 12]


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest


def hybrid_model(family):
    """A tiny model of ``family``; a Mamba2 family's with a slowly decaying SSM state, a short scan
    chunk, projections 10x their random init and no skip term (``D = 0``): at random init the SSM
    state's part of the logits is ~1e-5, so a state lost or leaked between steps, chunks or forks
    would pass unseen; here losing it moves log-probs by ~0.4 and changes the tokens."""
    if family not in MAMBA2_FAMILIES:
        return tiny_model(family)
    model = mamba_model(family)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, mamba2.mixers()):
                module.D.zero_()
                module.in_proj.weight.mul_(10)
                module.out_proj.weight.mul_(10)
    return model


def assert_all_freed(gen: Generator) -> None:
    slots = gen.scheduler.state_slots
    assert slots.num_free == slots.num_slots
    # what may wait for the next step is a snapshot of a finished sequence's last state (harmless)
    assert all(dst >= slots.num_slots for _, dst in slots.pending_copies)
    assert gen.allocator.num_free == gen.allocator.num_blocks
    gen.allocator.check(owners=[])


@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_equals_hf_generate_with_chunked_prefill(family):
    model = hybrid_model(family)
    prompts = prompts_of(LENGTHS)
    # three slots for five prompts: slots are reused, so a new sequence must start from zero
    gen = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=6, max_num_seqs=3)
    outs = gen.generate(prompts, GREEDY, use_tqdm=False)
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0].token_ids
        assert completion == hf_greedy(model, prompt, 8)
        ref = forward_logprobs(model, prompt, completion)
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), ref, atol=1e-4, rtol=0)
    stats = gen.stats()
    assert max(stats["tokens_per_step"]) <= 6  # the 17- and 12-token prompts ran in chunks
    assert stats["preemptions"] == 0
    assert gen.layer_states and gen._kv_cache.states.nbytes > 0
    assert_all_freed(gen)


@pytest.mark.parametrize("family", ["qwen3_5", "nemotron_h"])
def test_samples_of_a_prompt_copy_its_state_and_ignore_the_batch(family):
    model = hybrid_model(family)
    prompt = prompts_of([9], seed=3)[0]
    params = SamplingParams(temperature=1.0, seed=5, n=4, max_tokens=8, ignore_eos=True)
    gen = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=5)
    alone = gen.generate([prompt], params, use_tqdm=False)[0]
    assert gen.stats()["forked_shared_blocks"] > 0
    samples = [o.token_ids for o in alone.outputs]
    assert len(set(map(tuple, samples))) > 1, "the samples should differ"
    for o in alone.outputs:  # each sample continued the prompt's final state, then its own
        ref = forward_logprobs(model, prompt, o.token_ids)
        torch.testing.assert_close(torch.tensor(o.logprobs), ref, atol=1e-4, rtol=0)
    others = prompts_of([6, 14, 2], seed=4)
    crowd = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=16)
    mixed = crowd.generate(
        [others[0], prompt, others[1], others[2]],
        [
            SamplingParams(temperature=1.0, seed=9, max_tokens=6),
            params,
            SamplingParams(temperature=0.7, seed=1, n=2, max_tokens=5),
            GREEDY,
        ],
        use_tqdm=False,
    )
    assert [o.token_ids for o in mixed[1].outputs] == samples
    assert_all_freed(crowd)


@pytest.mark.parametrize("family", ["qwen3_5", "granitemoehybrid"])
def test_preemption_recomputes_the_state(family):
    model = hybrid_model(family)
    prompts = prompts_of([7, 11, 5, 9], seed=6)
    gen = Generator(model, block_size=2, num_blocks=24, max_num_batched_tokens=16, max_num_seqs=4)
    outs = gen.generate(prompts, SamplingParams(temperature=0.0, max_tokens=10), use_tqdm=False)
    assert gen.stats()["preemptions"] > 0, "the small cache should preempt"
    for prompt, out in zip(prompts, outs):
        completion = out.outputs[0].token_ids
        assert completion == hf_greedy(model, prompt, 10)
        ref = forward_logprobs(model, prompt, completion)
        torch.testing.assert_close(torch.tensor(out.outputs[0].logprobs), ref, atol=1e-4, rtol=0)
    assert_all_freed(gen)


def test_no_cross_request_prefix_reuse_without_state_snapshots():
    """A cached block says nothing about the state after it: with no snapshot slots the blocks are
    cached but never reused, and the same prompt twice computes the same output (reuse with
    snapshots: test_inference_hybrid_prefix)."""
    qwen = tiny_model("qwen3_5")
    prompt = prompts_of([13], seed=8)[0]
    gen = Generator(qwen, block_size=4, num_blocks=64, num_state_snapshots=0)
    assert gen.scheduler.enable_prefix_caching and gen.scheduler.state_slots.snapshots is None
    first = gen.generate([prompt], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert first == hf_greedy(qwen, prompt, 8)
    longer = prompt + first[:3]
    ids = [gen.add_request(prompt, GREEDY), gen.add_request(longer, GREEDY)]
    outs = {}
    while gen.has_unfinished():
        outs.update((o.request_id, o.outputs[0].token_ids) for o in gen.step())
    assert gen.stats()["prefix_cache_hit_tokens"] == 0 and gen.allocator.num_cached > 0
    assert [outs[i] for i in ids] == [first, hf_greedy(qwen, longer, 8)]


def assert_equals_reference(model, episodes, refs):
    """Tokens, mask and reason as HF generate turn by turn, and every model token's log-prob as a
    training forward of the whole episode (within 1e-4: a wrong state moves it)."""
    for ep in episodes:
        assert (ep.completion_ids, ep.model_mask, ep.finish_reason) == refs[ep.prompt_index]
        ref = forward_logprobs(model, ep.prompt_token_ids, ep.completion_ids)
        sampled = torch.tensor(ep.model_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(ep.logprobs)[sampled], ref[sampled], atol=1e-4, rtol=0)


def slow_tools(clock: StepClock, steps: int):
    """The tools, returning ``steps`` generator steps after they are called (not after a sleep:
    on a loaded machine fewer steps would pass, and nothing would be preempted)."""
    return {"add": clock.slow(TOOLS["add"], steps), "echo": echo}


@pytest.mark.parametrize("family", ["qwen3_5", "lfm2", "bamba", "falcon_h1"])
def test_tool_episodes_pause_resume_fork_and_preempt_equal_hf(family):
    model = hybrid_model(family)
    prompts = prompts_of([4, 9, 2, 15, 6], seed=0) + prompts_of([4, 9, 2], seed=2)  # >= 2 tool calls on both
    refs = [reference_episode(model, p, 12, LIMITS) for p in prompts]
    gen = Generator(model, block_size=4, num_blocks=256, max_num_batched_tokens=16)
    episodes = gen.run_episodes(prompts, TOOLS, EPISODE, limits=LIMITS, tool_format=TokenFormat())
    assert sum(e.num_tool_calls for e in episodes) >= 2, "the test should pause episodes on tools"
    assert_equals_reference(model, episodes, refs)
    assert_all_freed(gen)
    # fork at the first tool result: each branch copies the state and equals the unforked run
    forked = Generator(model, block_size=4, num_blocks=256).run_episodes(
        prompts, TOOLS, EPISODE, limits=LIMITS, tool_format=TokenFormat(), fork=lambda ep: 2 if ep.num_turns == 1 else 1
    )
    assert len(forked) > len(prompts)
    assert_equals_reference(model, forked, refs)
    # more branches than state slots: a member with no slot is preempted and recomputes its state
    few = Generator(model, block_size=4, num_blocks=256, max_num_seqs=2)
    with StepClock(few).running() as clock:  # tools return 2 steps later
        crowded = few.run_episodes(
            prompts,
            slow_tools(clock, 2),
            EPISODE,
            limits=LIMITS,
            tool_format=TokenFormat(),
            fork=lambda ep: 2 if ep.num_turns == 1 else 1,
        )
    assert sorted((e.prompt_index, e.branch) for e in crowded) == sorted((e.prompt_index, e.branch) for e in forked)
    assert few.stats()["preemptions"] > 0, "two slots should not hold every branch"
    assert_equals_reference(model, crowded, refs)
    assert_all_freed(few)
    # a cache too small for all: paused episodes lose their blocks and state, and recompute them
    tight = Generator(model, block_size=2, num_blocks=30, max_num_seqs=8)
    with StepClock(tight).running() as clock:  # tools return 10 steps later: paused, others decode
        squeezed = tight.run_episodes(prompts, slow_tools(clock, 10), EPISODE, limits=LIMITS, tool_format=TokenFormat())
    assert tight.stats()["paused_preemptions"] > 0, "the small cache should preempt paused episodes"
    assert_equals_reference(model, squeezed, refs)
    assert_all_freed(tight)


@pytest.mark.parametrize("family", ["qwen3_5", "bamba"])
def test_state_slots_come_out_of_the_memory_budget(family):
    from nopad.inference.kv_cache import bytes_per_block, kv_layout
    from nopad.inference.state_cache import bytes_per_slot

    model = tiny_model(family)

    budget = 1 << 20
    for snapshots, rows in ((None, 8 + 8), (3, 8 + 3), (0, 8)):  # a slot per sequence, then the snapshots'
        gen = Generator(model, block_size=4, kv_memory_bytes=budget, max_num_seqs=8, num_state_snapshots=snapshots)
        state = rows * bytes_per_slot(gen.layer_states, torch.float32)
        assert state > 0
        per_block = bytes_per_block(kv_layout(model.config), 4, torch.float32)
        assert gen.allocator.num_blocks == (budget - state) // per_block
