"""Overlap scheduling (``Generator(overlap=True)``, :mod:`nopad.inference.overlap`): step N+1 is
launched on step N's draws before N is read back, so the device never waits for the host's
bookkeeping. On a CPU nothing overlaps, but everything that must hold does: the outputs equal the
serial loop's (tokens, log-probs, stop reasons, order, streamed deltas), a sequence that stopped at
N emits nothing of N+1, and a continued step reads nothing back before its forward is launched.
The whole suite also runs with ``NOPAD_OVERLAP=1`` (``make test-overlap``)."""

from __future__ import annotations

import pytest
import torch
from torch.overrides import TorchFunctionMode

from nopad.inference import Generator, SamplingParams
from nopad.packing import batch_invariant
from tests.inference.test_inference_episodes import STOPS, TOOLS, TokenFormat, prompts_of
from tests.support.models import tiny_model

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest


def completions(outs):
    return [
        (
            o.request_id,
            c.index,
            c.token_ids,
            c.text,
            c.finish_reason,
            c.logprobs,
            c.temperature_logprobs,
            c.sampling_logprobs,
            c.top_logprobs,
            c.policy_versions,
            o.prompt_logprobs,
        )
        for o in outs
        for c in o.outputs
    ]


def both(model, prompts, params, **kwargs):
    """The serial and the overlapped run's completions, and the overlapped generator."""
    runs = {}
    for overlap in (False, True):
        gen = Generator(model, overlap=overlap, **kwargs)
        with batch_invariant():  # bitwise: log-probs independent of which rows share a step
            runs[overlap] = completions(gen.generate(prompts, params, use_tqdm=False))
        gen.allocator.check(owners=[])
    return runs[False], runs[True], gen


MIXED = [
    SamplingParams(max_tokens=9, temperature=0),
    SamplingParams(max_tokens=17, temperature=0.8, seed=1, n=3),
    SamplingParams(max_tokens=6, temperature=1.0, seed=2, top_k=20, logprobs=3),
    SamplingParams(max_tokens=13, temperature=0.7, seed=3, top_p=0.9, min_p=0.05),
    SamplingParams(max_tokens=11, temperature=1.0, seed=4, min_tokens=5, stop_token_ids=STOPS),
    SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=2),
]


def test_overlapped_outputs_equal_serial_for_every_kind_of_request():
    model = tiny_model("llama")
    prompts = prompts_of([5, 9, 3, 14, 7, 4])
    serial, overlapped, gen = both(model, prompts, MIXED, block_size=4, num_blocks=256, max_num_seqs=8)
    assert overlapped == serial
    stats = gen.stats()
    assert stats["overlap_steps"] > stats["steps"] // 2, stats  # most steps did overlap


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "bamba"])
def test_overlapped_outputs_equal_serial_under_preemption_in_a_tiny_cache(family):
    model = tiny_model(family)
    prompts = prompts_of([6, 11, 4, 9, 13, 5, 8])
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=7, n=2, ignore_eos=True)
    serial, overlapped, gen = both(model, prompts, params, block_size=4, num_blocks=24, max_num_seqs=6)
    assert gen.stats()["preemptions"] > 0, "the tiny cache should preempt"
    assert gen.stats()["overlap_steps"] > 0
    assert overlapped == serial


def test_a_sequence_that_stops_at_step_n_emits_nothing_of_step_n_plus_1():
    model = tiny_model("llama")
    prompt = prompts_of([6])[0]
    free = Generator(model, block_size=4, num_blocks=64).generate(
        [prompt], SamplingParams(max_tokens=12, seed=3), use_tqdm=False
    )
    ids = free[0].outputs[0].token_ids
    stop_at = next(i for i in range(3, len(ids)) if ids[i] not in ids[:i])  # its first occurrence
    params = SamplingParams(max_tokens=12, seed=3, stop_token_ids=[ids[stop_at]], logprobs=1)
    deltas = list(Generator(model, block_size=4, num_blocks=64, overlap=True).stream([prompt], params))
    gen = Generator(model, block_size=4, num_blocks=64, overlap=True)
    (out,) = gen.generate([prompt], params, use_tqdm=False)
    completion = out.outputs[0]
    assert completion.token_ids == ids[: stop_at + 1] and completion.finish_reason == "stop"
    assert len(completion.logprobs) == len(completion.top_logprobs) == len(completion.policy_versions) == stop_at + 1
    assert [t for d in deltas for t in d.token_ids] == ids[: stop_at + 1]
    assert deltas[-1].finish_reason == "stop" and all(d.finish_reason is None for d in deltas[:-1])
    # the step after the stop was computed (the sequence was assumed to continue) and dropped
    assert gen.stats()["overlap_wasted_tokens"] == 1 and gen.stats()["decode_tokens"] == stop_at + 1
    gen.allocator.check(owners=[])


def test_stop_strings_and_streamed_deltas_equal_serial():
    model = tiny_model("llama")
    prompts = prompts_of([4, 8, 5])

    class Chars:  # a tokenizer whose text is one letter per token id
        eos_token_id = None

        def decode(self, ids, skip_special_tokens=True):
            return "".join(chr(97 + t % 26) for t in ids)

    params = SamplingParams(max_tokens=30, temperature=1.0, seed=3, stop=["e", "xy"], n=2)
    runs = {}
    for overlap in (False, True):
        gen = Generator(model, Chars(), block_size=4, num_blocks=128, overlap=overlap)
        deltas = [(d.request_id, d.index, d.token_ids, d.finish_reason) for d in gen.stream(prompts, params)]
        runs[overlap] = (deltas, completions(gen.generate(prompts, params, use_tqdm=False)))
    assert any(c[4] == "stop" for c in runs[False][1])
    assert runs[True] == runs[False]


def forked_tool_episodes(gen: Generator, **extra) -> tuple[list[tuple], int]:
    """Sampled tool episodes of three prompts, n = 2, each forked in two after its first tool call, in
    ``batch_invariant()``: each episode's branch, tokens, mask, log-probs and finish reason, and the
    tool calls made; the generator's blocks are all back after. ``extra``: more sampling parameters."""
    params = SamplingParams(
        temperature=1.0, seed=11, n=2, max_tokens=10, stop_token_ids=STOPS, ignore_eos=True, **extra
    )
    with batch_invariant():
        episodes = gen.run_episodes(
            prompts_of([3, 7, 12]),
            TOOLS,
            params,
            tool_format=TokenFormat(),
            fork=lambda ep: 2 if ep.num_turns == 1 else 1,
        )
    gen.allocator.check(owners=[])
    records = [(e.branch, e.completion_ids, e.model_mask, e.logprobs, e.finish_reason) for e in episodes]
    return records, sum(e.num_tool_calls for e in episodes)


def test_tool_episodes_with_forks_and_pauses_equal_serial():
    model = tiny_model("qwen2")
    runs = {}
    for overlap in (False, True):
        gen = Generator(model, block_size=2, num_blocks=512, overlap=overlap)
        runs[overlap], calls = forked_tool_episodes(gen)
    assert calls >= 2 and len(runs[True]) > 6  # tools ran, forks forked
    assert runs[True] == runs[False]
    assert gen.stats()["overlap_steps"] > 0


def test_a_weight_update_completes_the_step_in_flight_and_stamps_its_old_version():
    model = tiny_model("llama")
    gen = Generator(model, block_size=4, num_blocks=64, overlap=True)
    gen.add_request(prompts_of([5])[0], SamplingParams(max_tokens=12, ignore_eos=True), request_id="r")
    for _ in range(4):
        gen.step()
    assert gen.pipeline.busy
    drawn = len(gen.request("r").samples[0].policy_versions)
    gen.update_weights("keep")
    assert not gen.pipeline.busy
    versions = gen.request("r").samples[0].policy_versions
    assert len(versions) == drawn + 1 and set(versions) == {0}  # the in-flight draw ran on version 0
    while gen.has_unfinished():
        outs = gen.step()
    assert outs[0].outputs[0].policy_versions == [0] * (drawn + 1) + [1] * (12 - drawn - 1)


class ForwardsAndReadBacks(TorchFunctionMode):
    """The order of model forwards and device->host read-backs within a step."""

    def __init__(self, events: list[str]):
        super().__init__()
        self.events = events

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__name__", "") in ("tolist", "item", "cpu"):  # (numpy() of a device tensor raises)
            self.events.append("read")
        return func(*args, **(kwargs or {}))


def test_a_continued_step_reads_nothing_back_before_its_forward_is_launched():
    """The critical path from one launch to the next holds no host-device sync: everything read back
    is the step before's, after the next forward is launched (on a GPU, while it runs)."""
    model = tiny_model("llama", num_hidden_layers=2)
    gen = Generator(model, block_size=4, num_blocks=64, overlap=True)
    for i in range(4):
        gen.add_request(prompts_of([5], seed=i)[0], SamplingParams(max_tokens=10, temperature=0.9, seed=i))
    events: list[str] = []
    model.register_forward_pre_hook(lambda *_: events.append("forward"))
    gen.step()  # the prefill, completed at once
    gen.step()  # the first decode, left in flight
    for _ in range(3):
        events.clear()
        steps = gen.stats()["overlap_steps"]
        with ForwardsAndReadBacks(events):
            gen.step()
        assert gen.stats()["overlap_steps"] == steps + 1, "the step did not continue the pipeline"
        assert events[0] == "forward" and "read" in events, events


def test_overlap_breaks_are_counted_and_a_bad_env_value_is_refused(monkeypatch):
    model = tiny_model("llama")
    gen = Generator(model, block_size=4, num_blocks=128, max_num_seqs=2, overlap=True)
    gen.generate(prompts_of([4, 6, 5, 7]), SamplingParams(max_tokens=8, ignore_eos=True), use_tqdm=False)
    stats = gen.stats()
    assert 0 < stats["overlap_breaks"] < stats["steps"] and stats["overlap_steps"] > 0
    monkeypatch.setenv("NOPAD_OVERLAP", "yes")
    with pytest.raises(ValueError, match="NOPAD_OVERLAP must be 0 or 1"):
        Generator(model, block_size=4, num_blocks=16)
    monkeypatch.setenv("NOPAD_OVERLAP", "1")
    assert Generator(model, block_size=4, num_blocks=16).overlap
    with pytest.raises(TypeError, match="overlap must be True, False or None"):
        Generator(model, block_size=4, num_blocks=16, overlap="yes")


def test_static_and_compiled_decode_overlapped_equal_serial():
    model = tiny_model("llama")
    prompts = prompts_of([5, 9, 3])
    params = SamplingParams(max_tokens=10, temperature=0.8, seed=5, n=2)
    ref = completions(Generator(model, block_size=4, num_blocks=64).generate(prompts, params, use_tqdm=False))
    gen = Generator(model, block_size=4, num_blocks=64, static_decode=True, overlap=True)
    got = completions(gen.generate(prompts, params, use_tqdm=False))
    assert gen._runner.static_steps > 0 and gen.stats()["overlap_steps"] > 0
    assert [c[2] for c in got] == [c[2] for c in ref]
    torch.testing.assert_close([c[5] for c in got], [c[5] for c in ref])


def test_on_cuda_the_draws_are_read_back_from_pinned_copies_and_stay_on_the_device(monkeypatch):
    """The CUDA read-back path, run on CPU with its copies and event stood in for: the result comes
    from the host copies made behind the event, and the device tokens stay where the next step's
    input ids are gathered from (a host copy there would be a cross-device index on a GPU)."""
    from nopad.inference import sampler

    copies, events = [], []

    class Event:
        def record(self):
            events.append("record")

        def synchronize(self):
            events.append("sync")

    def pinned(t):
        copies.append(t)
        return t.clone()

    monkeypatch.setattr(sampler, "_reads_back_async", lambda device: True)
    monkeypatch.setattr(sampler, "_to_pinned_host", pinned)
    monkeypatch.setattr(torch.cuda, "Event", Event)
    model = tiny_model("llama")
    prompts = prompts_of([5, 7, 4])
    params = SamplingParams(max_tokens=8, temperature=0.9, seed=2, logprobs=2, n=2)
    monkeypatch.setenv("NOPAD_OVERLAP", "0")
    serial = completions(Generator(model, block_size=4, num_blocks=64).generate(prompts, params, use_tqdm=False))
    gen = Generator(model, block_size=4, num_blocks=64, overlap=True)
    launched = []  # every draw, the overlapped steps' (the pipeline's and the decode batch's) among them
    draw = gen.sampler.draw
    gen.sampler.draw = lambda *args, **kwargs: launched.append(draw(*args, **kwargs)) or launched[-1]
    assert completions(gen.generate(prompts, params, use_tqdm=False)) == serial
    assert launched and all(sample.tokens is not sample._host[0] for sample in launched)
    assert copies and events.count("record") >= len(launched) and "sync" in events
