"""Multi-turn tool episodes in the in-flight generator on tiny random-weight models.

Random weights rarely write a real tool call, so the tests use a token-level tool format: a turn
ends at any token in ``STOPS``; about two turns in three are calls (decided by the stop token and
the context length; name and arguments read from the turn's tokens); results are rendered as one
token per character. The
reference runs each episode alone with HF ``generate`` and the same tool results.
"""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
import torch

from nopad.inference import Generator, SamplingParams
from nopad.inference.environments import reset_environments
from nopad.inference.episodes import EpisodeLimits, EpisodeRunner, _Pending
from nopad.inference.tools import ToolCall
from tests.support.models import tiny_model
from tests.support.step_clock import StepClock

STOPS = [t for t in range(3, 128) if t % 4 == 0]
RESULT_OPEN, RESULT_CLOSE = 5, 6


pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest


def render_text(text: str) -> list[int]:
    return [RESULT_OPEN] + [7 + ord(c) % 120 for c in text] + [RESULT_CLOSE]


class TokenFormat:
    """A stop-ended turn is a call of ``add`` (``echo`` for every third length) unless its stop
    token and the context length say it is a final answer."""

    def parse(self, turn_ids, prefix_ids):
        if (turn_ids[-1] // 4 + len(prefix_ids)) % 3 == 0:
            return []
        name = "echo" if len(turn_ids) % 3 == 0 else "add"
        return [ToolCall(name, {"a": len(turn_ids), "b": turn_ids[0]})]

    def render(self, messages, turn_ids):
        return [t for m in messages for t in render_text(m["content"])]


def add(a: int, b: int) -> str:
    return str(a + b)


def echo(a: int, b: int) -> str:
    return f"e{a}"


TOOLS = {"add": add, "echo": echo}


def prompts_of(lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(9, 128, (n,), generator=g).tolist() for n in lengths]


def reference_episode(model, prompt, turn_tokens, limits, tools=TOOLS):
    """One episode alone: HF generate per turn, the same tools, tokens concatenated."""
    fmt = TokenFormat()
    ids, mask, reason, turns = list(prompt), [], None, 0
    while True:
        budget = limits.max_tokens - (len(ids) - len(prompt))
        x = torch.tensor([ids])
        out = model.generate(
            x,
            attention_mask=torch.ones_like(x),
            max_new_tokens=min(turn_tokens, budget),
            do_sample=False,
            eos_token_id=STOPS,
            pad_token_id=0,
        )[0, len(ids) :].tolist()
        ids += out
        mask += [1] * len(out)
        turns += 1
        if out[-1] not in STOPS:
            reason = "length"
            break
        calls = fmt.parse(out, ids[: len(ids) - len(out)])
        if not calls:
            reason = "stop"
            break
        if turns >= limits.max_turns:
            reason = "max_turns"
            break
        rendered = fmt.render([{"content": tools[c.name](**c.arguments)} for c in calls], out)
        if len(ids) - len(prompt) + len(rendered) >= limits.max_tokens:
            reason = "length"
            break
        ids += rendered
        mask += [0] * len(rendered)
    return ids[len(prompt) :], mask, reason


def forward_logprobs(model, ids):
    with torch.no_grad():
        lp = torch.log_softmax(model(torch.tensor([ids])).logits[0].float(), dim=-1)
    return lp[torch.arange(len(ids) - 1), torch.tensor(ids[1:])]


GREEDY = SamplingParams(temperature=0.0, max_tokens=12, stop_token_ids=STOPS, ignore_eos=True)
LIMITS = EpisodeLimits(max_turns=4, max_tokens=48)
LENGTHS = [4, 9, 2, 15, 6, 11]


@pytest.mark.parametrize("family", ["llama", "qwen2", "mistral", "gemma2"])
def test_greedy_episodes_equal_hf_generate_run_alone(family):
    model = tiny_model(family)
    prompts = prompts_of(LENGTHS)
    gen = Generator(model, block_size=4, num_blocks=256, max_num_batched_tokens=16)
    episodes = gen.run_episodes(prompts, TOOLS, GREEDY, limits=LIMITS, tool_format=TokenFormat())
    assert [e.prompt_index for e in episodes] == list(range(len(prompts)))
    for prompt, ep in zip(prompts, episodes):
        ids, mask, reason = reference_episode(model, prompt, 12, LIMITS)
        assert (ep.completion_ids, ep.model_mask, ep.finish_reason) == (ids, mask, reason)
        assert ep.prompt_token_ids == prompt
        ran = [c for t in ep.turns for c in t.tool_calls if c.result is not None]
        assert len(ran) == ep.num_tool_calls  # a call in the last allowed turn is parsed, not run
    assert sum(e.num_tool_calls for e in episodes) >= 3, "the test should exercise tool calls"
    # KV kept across turns: every token went through the model once (no re-prefill of turns)
    stats = gen.stats()
    assert stats["preemptions"] == 0
    computed = sum(len(e.prompt_token_ids) + len(e.completion_ids) - 1 for e in episodes)
    # (an overlapped step also computes a token for each sequence that stopped at the step before)
    assert stats["prefill_tokens"] + stats["decode_tokens"] - stats["overlap_wasted_tokens"] == computed
    assert gen.allocator.num_free == gen.allocator.num_blocks
    gen.allocator.check(owners=[])


def test_episode_logprobs_are_the_training_forward_at_model_tokens():
    model = tiny_model("llama")
    prompts = prompts_of([5, 8])
    params = SamplingParams(temperature=0.9, seed=3, max_tokens=12, stop_token_ids=STOPS, ignore_eos=True)
    episodes = Generator(model, block_size=4, num_blocks=128).run_episodes(
        prompts, TOOLS, params, limits=LIMITS, tool_format=TokenFormat()
    )
    for ep in episodes:
        ids = ep.prompt_token_ids + ep.completion_ids
        ref = forward_logprobs(model, ids)[len(ep.prompt_token_ids) - 1 :]
        sampled = torch.tensor(ep.model_mask, dtype=torch.bool)
        torch.testing.assert_close(torch.tensor(ep.logprobs)[sampled], ref[sampled], atol=1e-5, rtol=0)
        assert all(lp == 0.0 for lp, m in zip(ep.logprobs, ep.model_mask) if not m)
        assert len(ep.logprobs) == len(ep.completion_ids) == len(ep.model_mask)


def sampled_run(model, **generator_kwargs):
    latency = generator_kwargs.pop("latency", None)
    params = SamplingParams(temperature=1.0, seed=11, n=3, max_tokens=10, stop_token_ids=STOPS, ignore_eos=True)
    gen = Generator(model, block_size=2, **generator_kwargs)
    clock = StepClock(gen)
    tools = TOOLS
    if latency is not None:
        rng = random.Random(latency)

        def add(a: int, b: int) -> str:
            clock.wait(rng.randint(1, 4))  # the tool returns 1 to 4 steps later
            return str(a + b)

        tools = {"add": add, "echo": echo}
    with clock.running():
        episodes = gen.run_episodes(
            prompts_of([3, 7, 12]),
            tools,
            params,
            limits=EpisodeLimits(max_turns=4, max_tokens=40),
            tool_format=TokenFormat(),
        )
    return [(e.branch, e.completion_ids, e.model_mask, e.finish_reason) for e in episodes], episodes, gen


def test_sampled_episodes_invariant_to_batching_latency_and_preemption():
    model = tiny_model("qwen2")
    base, episodes, _ = sampled_run(model, num_blocks=512)
    assert len(base) == 9 and sum(e.num_tool_calls for e in episodes) >= 2
    one_at_a_time, _, _ = sampled_run(model, num_blocks=512, max_num_seqs=3, max_num_batched_tokens=4)
    slow_tools, _, _ = sampled_run(model, num_blocks=512, latency=1)
    tiny, _, gen = sampled_run(model, num_blocks=30, max_num_seqs=6, latency=2)  # tools hold >= 1 step
    assert gen.stats()["paused_preemptions"] > 0, "the tiny cache should preempt paused episodes"
    assert one_at_a_time == base
    assert slow_tools == base
    assert tiny == base
    gen.allocator.check(owners=[])
    assert gen.allocator.num_free == 30


def test_decoding_goes_on_while_a_tool_runs():
    model = tiny_model("llama")
    gen = Generator(model, block_size=4, num_blocks=256)
    clock = StepClock(gen)
    progress = []

    def add(a: int, b: int) -> str:
        progress.append(clock.wait(1))  # returns when another forward ran, or when nothing else can
        return str(a + b)

    with clock.running():
        gen.run_episodes(
            prompts_of(LENGTHS), {"add": add, "echo": echo}, GREEDY, limits=LIMITS, tool_format=TokenFormat()
        )
    assert progress and max(progress) > 0, "other episodes should decode while a tool runs"


def test_fork_shares_blocks_and_equals_unforked_runs():
    model = tiny_model("llama")
    prompts = prompts_of(LENGTHS)
    plain = Generator(model, block_size=4, num_blocks=256).run_episodes(
        prompts, TOOLS, GREEDY, limits=LIMITS, tool_format=TokenFormat()
    )
    asked = []

    def fork(ep):
        asked.append(ep.num_turns)
        return 2 if ep.num_turns == 1 else 1

    gen = Generator(model, block_size=4, num_blocks=256)
    forked = gen.run_episodes(prompts, TOOLS, GREEDY, limits=LIMITS, tool_format=TokenFormat(), fork=fork)
    assert asked and gen.stats()["forked_shared_blocks"] > 0
    by_prompt = {}
    for ep in forked:
        by_prompt.setdefault(ep.prompt_index, []).append(ep)
    for ref in plain:
        branches = by_prompt[ref.prompt_index]
        assert len(branches) == (2 if ref.num_tool_calls else 1)
        for ep in branches:  # greedy: every branch is the unforked episode
            assert (ep.completion_ids, ep.model_mask, ep.finish_reason) == (
                ref.completion_ids,
                ref.model_mask,
                ref.finish_reason,
            )
    # the shared prefix was computed once: fewer tokens through the model than two plain runs
    stats = gen.stats()
    unforked = sum(len(e.prompt_token_ids) + len(e.completion_ids) - 1 for e in forked)
    assert stats["prefill_tokens"] + stats["decode_tokens"] < unforked
    gen.allocator.check(owners=[])


def test_sampled_fork_branch_zero_keeps_the_parents_stream():
    model = tiny_model("mistral")
    params = SamplingParams(temperature=1.0, seed=5, max_tokens=10, stop_token_ids=STOPS, ignore_eos=True)
    prompts = prompts_of([3, 7, 12, 5])
    kwargs = dict(limits=LIMITS, tool_format=TokenFormat())
    plain = Generator(model, block_size=4, num_blocks=256).run_episodes(prompts, TOOLS, params, **kwargs)
    forked = Generator(model, block_size=4, num_blocks=256).run_episodes(
        prompts, TOOLS, params, fork=lambda ep: 3 if ep.num_turns == 1 else 1, **kwargs
    )
    again = Generator(model, block_size=4, num_blocks=256, max_num_seqs=3, max_num_batched_tokens=5)
    again = again.run_episodes(prompts, TOOLS, params, fork=lambda ep: 3 if ep.num_turns == 1 else 1, **kwargs)
    zero = {e.prompt_index: e for e in forked if set(e.branch[1:]) <= {0}}
    for ref in plain:
        assert zero[ref.prompt_index].completion_ids == ref.completion_ids
    assert [e.completion_ids for e in forked] == [e.completion_ids for e in again]
    assert any(len(e.branch) == 2 and e.branch[1] == 2 for e in forked)


# ----------------------------------------------------------------------------- faults
ONE_TOKEN_TURNS = SamplingParams(
    temperature=0.0, max_tokens=4, stop_token_ids=list(range(3, 128)), ignore_eos=True
)  # a turn ends at its first token (unless 0-2)


class EveryTurnCalls:
    """Every one-token turn calls the tool named for its prompt (by the prompt's first token)."""

    def __init__(self, names):
        self.names = names

    def parse(self, turn_ids, prefix_ids):
        name = self.names[prefix_ids[0]]
        if name == "malformed":
            raise ValueError("unbalanced <tool_call>")
        return [ToolCall(name, {})]

    def render(self, messages, turn_ids):
        return [t for m in messages for t in render_text(m["content"][:12])]


def test_faulty_tools_become_error_messages_and_leave_the_batch_alone():
    model = tiny_model("llama")
    released = threading.Event()

    def good() -> str:
        return "fine"

    def raises() -> str:
        raise RuntimeError("boom")

    def hangs() -> str:
        released.wait(60)  # past its timeout: released when the test ends
        return "late"

    def not_a_string():
        return 42

    def huge() -> str:
        return "x" * 5000

    async def good_async() -> str:
        return "async ok"

    def exits() -> str:  # it used to end the whole rollout
        sys.exit(3)

    async def exits_async() -> str:  # on the event-loop thread it would stop every later async call
        sys.exit("bye")

    def surrogate() -> str:  # it used to be accepted, and the tokenizer failed later
        return "ok \ud800"

    tools = {
        f.__name__: f for f in (good, raises, hangs, not_a_string, huge, good_async, exits, exits_async, surrogate)
    }
    names = [
        "good",
        "raises",
        "hangs",
        "not_a_string",
        "huge",
        "nope",
        "malformed",
        "good_async",
        "exits",
        "exits_async",
        "surrogate",
    ]
    prompts = [[10 + i, 40, 41, 42] for i in range(len(names))]
    fmt = EveryTurnCalls({10 + i: n for i, n in enumerate(names)})
    params = ONE_TOKEN_TURNS
    limits = EpisodeLimits(max_turns=2, max_tokens=60, tool_timeout=1.0, max_tool_result_chars=1000)
    gen = Generator(model, block_size=4, num_blocks=256)
    try:
        episodes = gen.run_episodes(prompts, tools, params, limits=limits, tool_format=fmt)
    finally:
        released.set()
    by_name = dict(zip(names, episodes))
    for name in ("good", "good_async"):
        ep = by_name[name]
        assert (ep.finish_reason, ep.num_tool_calls, ep.num_tool_errors) == ("max_turns", 1, 0)
        assert ep.turns[0].tool_calls[0].result in ("fine", "async ok")
    expected = {
        "raises": "raised RuntimeError: boom",
        "hangs": "did not return within 1.0 s",
        "not_a_string": "returned int, not a string",
        "huge": "returned 5000 characters",
        "nope": "unknown tool 'nope'",
        "exits": "tool 'exits' called sys.exit(3); a tool returns",
        "exits_async": "tool 'exits_async' called sys.exit('bye')",
        "surrogate": "not valid Unicode (a lone surrogate, '\\ud800', at character 3)",
    }
    for name, text in expected.items():
        ep = by_name[name]
        call = ep.turns[0].tool_calls[0]
        assert call.error and call.result.startswith("error: ") and text in call.result, (name, call)
        assert (ep.finish_reason, ep.num_tool_calls, ep.num_tool_errors) == ("max_turns", 1, 1)
        first, second = ep.turns
        assert ep.model_mask == (
            [1] * (first.end - first.start) + [0] * (first.tool_end - first.end) + [1] * (second.end - second.start)
        )
        assert ep.completion_ids[first.end : first.tool_end] == render_text(call.result[:12])
    bad = by_name["malformed"]
    assert (bad.finish_reason, bad.num_malformed, bad.num_tool_calls) == ("stop", 1, 0)
    assert "unbalanced" in bad.turns[0].malformed
    # the good episode is what it is alone
    alone = Generator(model, block_size=4, num_blocks=256).run_episodes(
        prompts[:1], tools, params, limits=limits, tool_format=fmt
    )[0]
    assert alone.completion_ids == by_name["good"].completion_ids
    assert gen.allocator.num_free == gen.allocator.num_blocks


def test_an_episode_outgrowing_the_cache_stops_with_an_error_naming_the_limit():
    model = tiny_model("llama")

    def big() -> str:
        return "y" * 40

    def small() -> str:
        return "ok"

    prompts = [[20, 40, 41], [21, 40, 41]]
    fmt = EveryTurnCalls({20: "big", 21: "small"})
    params = ONE_TOKEN_TURNS
    limits = EpisodeLimits(max_turns=3, max_tokens=200)
    gen = Generator(model, block_size=4, num_blocks=8)
    big_ep, small_ep = gen.run_episodes(
        prompts,
        {"big": big, "small": small},
        params,
        limits=limits,
        tool_format=EveryTurnCalls({20: "big", 21: "small"}),
    )
    assert big_ep.finish_reason == "cache_full"
    assert "32" in big_ep.error and "num_blocks" in big_ep.error
    assert small_ep.finish_reason == "max_turns"
    alone = Generator(model, block_size=4, num_blocks=64).run_episodes(
        prompts[1:], {"small": small}, params, limits=limits, tool_format=fmt
    )[0]
    assert alone.completion_ids == small_ep.completion_ids
    # growing by its own tokens past the cache: the same result, from the scheduler
    long = SamplingParams(temperature=0.0, max_tokens=100, ignore_eos=True)
    (ep,) = Generator(model, block_size=4, num_blocks=8).run_episodes(
        [[30, 31]], {}, long, limits=limits, tool_format=fmt
    )
    assert ep.finish_reason == "cache_full" and "whole cache holds 32" in ep.error


def test_an_error_inside_generation_is_not_hidden_by_cleanup():
    model = tiny_model("llama")
    gen = Generator(model, block_size=4, num_blocks=64)
    calls = [0]

    def explode(*_):
        calls[0] += 1
        if calls[0] == 3:
            raise RuntimeError("the real error")

    handle = model.register_forward_pre_hook(explode)
    try:
        with pytest.raises(RuntimeError, match="the real error"):
            try:
                gen.generate(prompts_of([3, 5]), SamplingParams(max_tokens=8), use_tqdm=False)
            finally:
                gen.release()  # the caller's cleanup: must not raise "requests in flight"
        calls[0] = 0
        with pytest.raises(RuntimeError, match="the real error"):
            try:
                gen.run_episodes(prompts_of([3, 5]), TOOLS, GREEDY, limits=LIMITS, tool_format=TokenFormat())
            finally:
                gen.release()
    finally:
        handle.remove()
    assert not gen.has_unfinished() and gen.allocator.num_free == 64
    gen.add_request([5, 6, 7])
    gen.step()
    with pytest.raises(RuntimeError, match="release\\(abort=True\\)"):
        gen.release()
    gen.release(abort=True)
    assert gen.allocator.num_free == 64


def test_bad_episode_arguments_are_named():
    gen = Generator(tiny_model("llama"), block_size=4, num_blocks=64)
    with pytest.raises(ValueError, match="max_turns"):
        EpisodeLimits(max_turns=0)
    with pytest.raises(ValueError, match=r"EpisodeLimits.tool_grace must be a number of seconds >= 0, got -1"):
        EpisodeLimits(tool_grace=-1)
    with pytest.raises(ValueError, match="tokenizer"):
        gen.run_episodes([[3, 4]], TOOLS, GREEDY)
    with pytest.raises(ValueError, match="fork\\(\\) returned 0"):
        gen.run_episodes(
            prompts_of(LENGTHS), TOOLS, GREEDY, limits=LIMITS, tool_format=TokenFormat(), fork=lambda ep: 0
        )
    assert not gen.has_unfinished()


def test_an_open_session_runs_groups_added_while_others_run():
    """``open_episodes``: groups added one at a time, some while others decode or wait on tools, end as
    ``run_episodes`` ends them (greedy: the same tokens), each handed back once, when its last
    episode ends; the session holds the generator until it is closed."""
    model = tiny_model("llama")
    prompts = prompts_of(LENGTHS)
    batch = Generator(model, block_size=4, num_blocks=256).run_episodes(
        prompts, TOOLS, GREEDY, limits=LIMITS, tool_format=TokenFormat()
    )
    gen = Generator(model, block_size=4, num_blocks=256)
    session = gen.open_episodes(TOOLS, limits=LIMITS, tool_format=TokenFormat())
    assert session.add(prompts[0], GREEDY) == 0
    with pytest.raises(RuntimeError, match="open_episodes\\(\\) while requests are in flight"):
        gen.open_episodes(TOOLS, limits=LIMITS, tool_format=TokenFormat())
    finished, step = [], 0
    while session.live or len(finished) < len(prompts):
        if step % 3 == 0 and step // 3 + 1 < len(prompts):
            assert session.add(prompts[step // 3 + 1], GREEDY) == step // 3 + 1
        gen.step()
        finished += [(group, step, episodes) for group, episodes in session.take_finished()]
        step += 1
    assert sorted(group for group, _, _ in finished) == list(range(len(prompts)))
    assert [s for _, s, _ in finished] == sorted(s for _, s, _ in finished)
    for group, _, (episode,) in finished:
        ref = batch[group]
        assert (episode.prompt_index, episode.completion_ids, episode.model_mask) == (
            group,
            ref.completion_ids,
            ref.model_mask,
        )
        assert len(episode.policy_versions) == sum(episode.model_mask) and set(episode.policy_versions) == {0}
    session.close()
    assert not gen.has_unfinished() and gen.allocator.num_free == gen.allocator.num_blocks
    gen.run_episodes(prompts[:1], TOOLS, GREEDY, limits=LIMITS, tool_format=TokenFormat())  # free again


# ----------------------------------------------------------------------------- the chat template's format
CALL_TEXT = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


def char_tokenizer():
    """A one-token-per-character tokenizer (106 tokens, fits the tiny models) with Qwen2.5's
    chat template and TRL's response template for it; ``CALL_TEXT`` is one token, so a scripted
    model can write a whole tool call."""
    from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

    specials = [
        "<pad>",
        "<s>",
        "<|im_end|>",
        "<|im_start|>",
        "<tool_call>",
        "</tool_call>",
        "<tool_response>",
        "</tool_response>",
    ]
    vocab = {t: i for i, t in enumerate(specials + ["\n"] + [chr(c) for c in range(32, 127)] + ["[UNK]"])}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex("[\\s\\S]"), behavior="isolated")
    backend.decoder = decoders.Fuse()
    tok = PreTrainedTokenizerFast(
        tokenizer_object=backend, bos_token="<s>", eos_token="<|im_end|>", pad_token="<pad>", unk_token="[UNK]"
    )
    tok.add_special_tokens({"additional_special_tokens": specials[3:]})
    tok.add_tokens([AddedToken(CALL_TEXT, special=False, normalized=False)])
    tok.chat_template = qwen2_5_chat_template
    return add_response_schema(tok)


def script(model, next_token: dict[int, int]):
    """Make greedy decoding write ``next_token[t]`` after token ``t`` (a large logit bias at the
    rows the forward returns, in HF generate and in the generator alike)."""

    def hook(module, args, kwargs, out):
        ids = kwargs["input_ids"][0]
        keep = kwargs.get("logits_to_keep", 0)
        rows = ids[keep] if isinstance(keep, torch.Tensor) else (ids[-keep:] if keep else ids)
        for r, t in enumerate(rows.tolist()):
            if t in next_token:
                out.logits[0, r, next_token[t]] += 1000.0
        return out

    return model.register_forward_hook(hook, with_kwargs=True)


def add_numbers(a: int, b: int) -> str:
    """Add two numbers.

    Args:
        a: The first number.
        b: The second number.
    """
    return str(a + b)


def test_chat_template_tool_calls_are_parsed_by_transformers_and_results_appended_token_in_token_out():
    from nopad.inference.tools import ChatTemplateTools

    tok = char_tokenizer()
    call, newline = tok.convert_tokens_to_ids(CALL_TEXT), tok.convert_tokens_to_ids("\n")
    eos = tok.eos_token_id
    model = tiny_model("llama", max_position_embeddings=4096)
    handle = script(model, {newline: call, call: eos})  # every assistant turn: the call, then <|im_end|>
    try:

        def add(a: int, b: int) -> str:
            return add_numbers(a, b)

        add.__doc__ = add_numbers.__doc__
        messages = [[{"role": "user", "content": "2+3?"}], [{"role": "user", "content": "again"}]]
        gen = Generator(model, tok, block_size=16, num_blocks=256, max_num_batched_tokens=512)
        params = SamplingParams(temperature=0.0, max_tokens=8)
        limits = EpisodeLimits(max_turns=3, max_tokens=200)
        episodes = gen.run_episodes(messages, [add], params, limits=limits)
    finally:
        handle.remove()
    fmt = ChatTemplateTools(tok, [add])
    for conversation, ep in zip(messages, episodes):
        assert ep.finish_reason == "max_turns" and ep.num_tool_calls == 2 and ep.num_tool_errors == 0
        assert [c.arguments for t in ep.turns for c in t.tool_calls] == [{"a": 2, "b": 3}] * 3
        assert [c.result for t in ep.turns[:2] for c in t.tool_calls] == ["5", "5"]
        # token-in/token-out equals rendering the whole conversation with the template
        function = {"type": "function", "function": {"name": "add", "arguments": {"a": 2, "b": 3}}}
        turn = {"role": "assistant", "content": "", "tool_calls": [function]}
        result = {"role": "tool", "name": "add", "content": "5"}
        whole = fmt._ids(conversation + [turn, result, turn, result, turn], False)
        # (the template writes "\n" after the last <|im_end|>, where the model stopped)
        assert ep.prompt_token_ids + ep.completion_ids == whole[:-1]
        assert ep.prompt_token_ids == fmt.prompt_ids(conversation)
        assert [ep.completion_ids[t.start : t.end] for t in ep.turns] == [[call, eos]] * 3


def test_templates_that_cannot_be_used_token_in_token_out_are_refused():
    from nopad.inference.tools import ChatTemplateTools

    tok = char_tokenizer()
    template = tok.response_template
    tok.response_template = None
    with pytest.raises(ValueError, match="response_template"):
        ChatTemplateTools(tok)
    tok.response_template = template
    tok.chat_template = (
        "{% for m in messages %}{{ m.role }}:{{ m.content }}"
        "{% if loop.last %}<|im_end|>{% endif %}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    with pytest.raises(ValueError, match="prefix"):
        ChatTemplateTools(tok)


class Counter:
    """An environment: its public method ``count`` is a tool; ``reset`` is not (it is called once,
    before the episode, as TRL calls it)."""

    def __init__(self):
        self.n, self.resets = 0, 0

    def reset(self, **example) -> None:
        self.resets += 1

    def count(self) -> str:
        self.n += 1
        return str(self.n)


def test_each_episode_and_fork_has_its_own_environment_and_reward():
    model = tiny_model("llama")
    params = SamplingParams(temperature=0.0, n=2, max_tokens=4, stop_token_ids=list(range(3, 128)), ignore_eos=True)
    episodes = Generator(model, block_size=4, num_blocks=128).run_episodes(
        [[40, 41, 42]],
        {},
        params,
        limits=EpisodeLimits(max_turns=3, max_tokens=60),
        tool_format=EveryTurnCalls({40: "count"}),
        environment_factory=Counter,
        reward_fn=lambda ep: float(ep.environment.n),
        fork=lambda ep: 2 if ep.num_turns == 1 else 1,
    )
    assert [e.branch for e in episodes] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    assert len({id(e.environment) for e in episodes}) == 4
    assert [e.reward for e in episodes] == [2.0] * 4  # two calls each: the forks copied n=1
    assert [c.result for c in episodes[3].turns[1].tool_calls] == ["2"]
    assert [e.environment.resets for e in episodes] == [1] * 4


class CallsCount:
    """Every turn calls ``count``."""

    def parse(self, turn_ids, prefix_ids):
        return [ToolCall("count", {})]

    def render(self, messages, turn_ids):
        return [t for m in messages for t in render_text(m["content"][:12])]


class Puzzle(Counter):
    """reset returns an observation, which TRL appends to the prompt."""

    def reset(self, prompt, **example) -> str:
        self.resets += 1
        return " (puzzle 7)"


def test_environments_are_reset_as_trl_does_and_the_observation_joins_the_prompt():
    """run_episodes used to skip reset(), so a reset that raised went unnoticed."""
    from nopad.recipes.tiny_model import AsciiTokenizer

    gen = Generator(tiny_model("llama"), AsciiTokenizer(), block_size=4, num_blocks=128)
    params = SamplingParams(temperature=0.0, n=2, max_tokens=4, stop_token_ids=list(range(3, 128)), ignore_eos=True)
    limits = EpisodeLimits(max_turns=2, max_tokens=40)
    episodes = gen.run_episodes(
        ["count:"], {}, params, limits=limits, tool_format=CallsCount(), environment_factory=Puzzle
    )
    expected = gen.make_requests(["count: (puzzle 7)"])[0].prompt_token_ids
    assert [e.prompt_token_ids for e in episodes] == [expected, expected]
    assert [(e.environment.resets, e.environment.n) for e in episodes] == [(1, 1), (1, 1)]
    chat = [{"role": "user", "content": "count:"}]
    assert reset_environments(Puzzle, [chat])[1] == [[{"role": "user", "content": "count: (puzzle 7)"}]]
    assert chat == [{"role": "user", "content": "count:"}]  # the caller's messages are left alone


class Broken(Counter):
    def reset(self, **example):
        raise KeyError("no puzzle for this prompt")


class Varies(Counter):
    made = 0

    def reset(self, **example) -> str:
        Varies.made += 1
        return f" seed {Varies.made}"


@pytest.mark.parametrize(
    "factory, tools, prompts, error, message",
    [
        (
            Broken,
            {},
            ["x"],
            RuntimeError,
            r"environment Broken.reset\(prompt=...\) raised KeyError: 'no puzzle "
            r"for this prompt' \(prompt 0, sample 0\)",
        ),
        (lambda: None, {}, ["x"], TypeError, "returned None \\(every tool call would be an unknown tool\\)"),
        (5, {}, ["x"], TypeError, r"environment_factory must be a class or function .*got 5 \(int\)"),
        (
            None,
            "count",
            ["x"],
            TypeError,
            r"tools must be a list of functions or a \{name: function\} mapping, "
            "got 'count'",
        ),
        (Puzzle, {}, [[40, 41]], ValueError, r"reset\(\) returned an observation for prompt 0, which is not "),
        (Varies, {}, ["x"], ValueError, "prompt 0's 2 samples returned different observations"),
    ],
)
def test_bad_environments_and_tools_are_named_before_generating(factory, tools, prompts, error, message):
    from nopad.recipes.tiny_model import AsciiTokenizer

    gen = Generator(tiny_model("llama"), AsciiTokenizer(), block_size=4, num_blocks=64)
    params = SamplingParams(temperature=0.0, n=2, max_tokens=4)
    with pytest.raises(error, match=message):
        gen.run_episodes(prompts, tools, params, tool_format=CallsCount(), environment_factory=factory)
    assert not gen.has_unfinished()


def test_an_episode_reward_that_raises_is_named_with_its_episode():
    from nopad.recipes.tiny_model import AsciiTokenizer

    model = tiny_model("llama")
    params = SamplingParams(temperature=0.0, n=1, max_tokens=4, ignore_eos=True)

    def my_reward(ep):
        return 1 / (ep.prompt_index - 1)

    message = (
        r"episode reward .*\.my_reward raised ZeroDivisionError: division by zero, for the episode of "
        r"prompt 1 \(branch \(0,\), finish_reason '\w+', prompt 'AB'\); fix the reward function"
    )
    gen = Generator(model, AsciiTokenizer(), block_size=4, num_blocks=64)
    with pytest.raises(RuntimeError, match=message) as err:  # the error names the episode's prompt
        gen.run_episodes(
            [[40, 41, 42], [65, 66]],
            {"count": lambda: "1"},
            params,
            limits=EpisodeLimits(max_turns=1, max_tokens=20),
            tool_format=EveryTurnCalls({40: "count", 65: "count"}),
            reward_fn=my_reward,
        )
    assert isinstance(err.value.__cause__, ZeroDivisionError)  # the original, with its traceback
    assert not gen.has_unfinished() and gen.allocator.num_free == gen.allocator.num_blocks


@pytest.mark.parametrize("bad", [float("nan"), float("inf"), "1.0", [1.0], None])
def test_an_episode_reward_that_is_not_one_finite_number_is_named(bad):
    model = tiny_model("llama")
    params = SamplingParams(temperature=0.0, n=1, max_tokens=4, ignore_eos=True)

    def my_reward(ep):
        return bad

    with pytest.raises(ValueError, match=r"episode reward .*my_reward returned .* finite number"):
        Generator(model, block_size=4, num_blocks=64).run_episodes(
            [[40, 41, 42]],
            {"count": lambda: "1"},
            params,
            limits=EpisodeLimits(max_turns=1, max_tokens=20),
            tool_format=EveryTurnCalls({40: "count"}),
            reward_fn=my_reward,
        )


class FinishesOnSecondLook:
    """A tool's future whose ``done()`` turns true on its second call: the tool finished while
    ``poll`` was reading the pending list."""

    def __init__(self):
        self.looks = 0

    def done(self) -> bool:
        self.looks += 1
        return self.looks >= 2

    def result(self) -> str:
        return "late"

    def cancel(self) -> bool:
        return False


class Clock:
    """``time`` for nopad.inference.episodes: ``monotonic()`` jumps past every deadline after its first read."""

    perf_counter = staticmethod(time.perf_counter)

    def __init__(self):
        self.reads = 0

    def monotonic(self) -> float:
        self.reads += 1
        return 0.0 if self.reads == 1 else 100.0


@pytest.mark.parametrize("late", ["tool_finishes", "deadline_passes"])
def test_an_episode_whose_tool_finishes_while_polled_is_resumed_not_lost(monkeypatch, late):
    """poll used to decide each episode twice (ready? then still pending?); one that turned ready
    in between was in neither list, paused for ever while the generator spun."""
    runner = EpisodeRunner(None, TokenFormat(), EpisodeLimits(), vocab_size=128)
    resumed = []
    monkeypatch.setattr(runner, "_resume", lambda p: resumed.append(p.seq))
    if late == "tool_finishes":
        future, deadline = FinishesOnSecondLook(), time.monotonic() + 60
    else:
        future, deadline = FinishesOnSecondLook(), 50.0
        future.looks = -100  # never done: only the deadline ends its wait
        monkeypatch.setattr("nopad.inference.episodes.time", Clock())
    runner.pending = [
        _Pending("ready", [ToolCall("nope")], [None], deadline),
        _Pending("late", [ToolCall("add")], [future], deadline),
    ]
    try:
        runner.poll(block=False)
        assert resumed == ["ready"] and [p.seq for p in runner.pending] == ["late"]
        runner.poll(block=False)
        assert resumed == ["ready", "late"] and runner.pending == []
    finally:
        runner.close()


class BuggyFormat(EveryTurnCalls):
    def __init__(self, bug):
        super().__init__({40: "count"})
        self.bug = bug

    def parse(self, turn_ids, prefix_ids):
        if self.bug == "raises":
            return {}["name"]  # a bug in the format's code, not a malformed call
        return [("count", {})]  # not ToolCalls


@pytest.mark.parametrize(
    "bug, error, message",
    [
        (
            "raises",
            RuntimeError,
            r"the tool format BuggyFormat's parse\(\) raised KeyError: 'name' \(prompt 0, "
            r"turn 1\); only a ValueError means a malformed call .* or raise ValueError",
        ),
        (
            "returns",
            TypeError,
            r"the tool format BuggyFormat's parse\(\) returned \[\('count', \{\}\)\]; it must "
            r"return a list of nopad.inference.tools.ToolCall",
        ),
    ],
)
def test_a_bug_in_the_tool_format_is_an_error_not_the_models_malformed_call(bug, error, message):
    """Any exception from parse() used to be recorded as the model's malformed call (and trained on)."""
    gen = Generator(tiny_model("llama"), block_size=4, num_blocks=64)
    with pytest.raises(error, match=message):
        gen.run_episodes(
            [[40, 41, 42]],
            {"count": lambda: "1"},
            ONE_TOKEN_TURNS,
            limits=EpisodeLimits(max_turns=2, max_tokens=20),
            tool_format=BuggyFormat(bug),
        )
    assert not gen.has_unfinished() and gen.allocator.num_free == gen.allocator.num_blocks
