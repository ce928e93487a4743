"""Streaming GRPO with tool episodes (:mod:`nopad.training.streaming`, ``episodes=``): an episode paused on
its tools keeps its KV blocks across an optimizer step and resumes under the new weights, on its old
KV (``stale_kv=keep``) or re-prefilled (``recompute``); every model token carries the version that drew
it, the tools' tokens are context, not trained on; ``max_staleness=0`` is the synchronous episode step,
bitwise; and the recipe streams its tool task.

The tiny random models rarely write a real call, so the tool formats here decide from the token
positions which turns call (as in tests/inference/test_inference_episodes.py)."""

from __future__ import annotations

import copy
import threading

import pytest
import torch

from nopad.inference import Generator, SamplingParams
from nopad.inference.episodes import EpisodeLimits
from nopad.inference.tools import ToolCall
from nopad.packing.invariance import batch_invariant
from nopad.training.grpo import Rollout
from nopad.training.streaming import StreamingRollouts
from tests.inference.test_inference_episodes import STOPS, TOOLS, TokenFormat, prompts_of, render_text
from tests.support.models import tiny_model
from tests.training.test_training_streaming import T, trainer_logprobs

pytestmark = pytest.mark.usefixtures("one_thread_module")  # tiny models: one thread is fastest

RARE_STOPS = [t for t in range(3, 128) if t % 8 == 0]  # turns of several tokens
SEEDS = {"llama": 1, "qwen3_5": 3}  # a first turn that ends at a stop (a call), with turns after it


class FirstTurnCalls:
    """An episode's first turn (the one right after a prompt of ``prompt_len`` tokens) calls ``lookup``;
    every later turn is a final answer."""

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len

    def parse(self, turn_ids, prefix_ids):
        return [ToolCall("lookup", {"a": len(turn_ids)})] if len(prefix_ids) == self.prompt_len else []

    def render(self, messages, turn_ids):
        return [t for m in messages for t in render_text(m["content"])]


def perturb(model, seed: int) -> None:
    """An optimizer step's stand-in: the weights change in place."""
    noise = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn(p.shape, generator=noise) * 0.05)


def tool_spans(episode) -> list[tuple[int, int]]:
    """The completion ranges of the tools' tokens (model_mask 0)."""
    spans, mask = [], episode.model_mask
    for i, m in enumerate(mask):
        if not m and (i == 0 or mask[i - 1]):
            spans.append([i, i + 1])
        elif not m:
            spans[-1][1] = i + 1
    return [tuple(s) for s in spans]


def versions_by_token(episode) -> list[int | None]:
    """The policy version of each completion token (None at the tools' tokens)."""
    it = iter(episode.policy_versions)
    return [next(it) if m else None for m in episode.model_mask]


def paused_across_an_update(stale_kv: str, family: str):
    """One episode on a tiny ``family`` model: its first turn calls a tool that returns only once the weights
    changed (``update_weights`` while the episode is paused, its blocks pinned). Returns the episode,
    the weights by version, the model, the prompt, the pinned blocks before and after the update, and
    the generator."""
    model = tiny_model(family)
    gen = Generator(model, block_size=4, num_blocks=64, max_num_batched_tokens=64)
    prompt = prompts_of([6])[0]
    released = threading.Event()

    def lookup(a: int) -> str:
        released.wait(30)
        return f"r{a}"

    params = SamplingParams(
        temperature=T, seed=SEEDS[family], max_tokens=12, stop_token_ids=RARE_STOPS, ignore_eos=True
    )
    limits = EpisodeLimits(max_turns=3, max_tokens=40)
    session = gen.open_episodes({"lookup": lookup}, limits=limits, tool_format=FirstTurnCalls(len(prompt)))
    session.add(prompt, params)
    weights = {0: copy.deepcopy(model.state_dict())}
    with batch_invariant(True):
        while session.live and not gen.scheduler.paused:
            gen.step()
        assert gen.scheduler.paused, "the episode ended before its tool call: the test would prove nothing"
        (seq,) = gen.scheduler.paused
        assert not gen.scheduler.running and not gen.scheduler.waiting
        # overlapped (NOPAD_OVERLAP=1), the step after the turn's last token ran before the pause was
        # seen: that token's K/V was written by the weights that sampled it, not at the resume
        gen.early_kv = seq.num_computed == len(seq.token_ids)
        before = list(seq.block_table)
        perturb(model, 0)
        gen.update_weights(stale_kv)
        weights[1] = copy.deepcopy(model.state_dict())
        after = list(seq.block_table)
        released.set()
        while session.live:
            gen.step()
    ((group, (episode,)),) = session.take_finished()
    session.close()
    assert group == 0 and episode.finish_reason == "stop"
    assert gen.allocator.num_free == gen.allocator.num_blocks
    gen.allocator.check(owners=[])
    return episode, weights, model, prompt, (before, after), gen


def check_versions_and_mask(episode) -> int:
    """Version 0 up to the tool call, 1 after it; the tool's tokens are its result and carry no loss.
    Returns where the tool's tokens end."""
    ((start, end),) = tool_spans(episode)
    assert episode.completion_ids[start:end] == render_text(f"r{start}")
    versions = versions_by_token(episode)
    assert set(versions[:start]) == {0} and set(versions[end:]) == {1} and len(versions) - end >= 4
    rollout = Rollout.from_episode(episode)
    assert rollout.num_loss_tokens == len(rollout.gen_logprobs) == len(episode.completion_ids) - (end - start)
    assert list(rollout.policy_versions) == episode.policy_versions
    return end


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_recompute_a_paused_episode_resumes_as_if_the_new_weights_had_computed_everything(family, one_thread):
    """``stale_kv=recompute``: the paused episode's pinned blocks are freed at the update and its whole
    context (the tool's result included) is re-prefilled by the new weights when it resumes. Every
    recorded log-prob is the trainer's under the version stamped on its token, bitwise, and the
    tokens after the tool are those a fresh episode on the new weights, given the same context and
    seed, samples; on an attention model and a Gated DeltaNet hybrid (its state slot recomputed too)."""
    episode, weights, model, prompt, (before, after), gen = paused_across_an_update("recompute", family)
    assert before and not after and gen.stats()["stale_recomputes"] == 1
    end = check_versions_and_mask(episode)
    recorded, versions = torch.tensor(episode.temperature_logprobs), versions_by_token(episode)
    for version in (0, 1):
        at = torch.tensor([v == version for v in versions])
        want = trainer_logprobs(model, weights[version], prompt, episode.completion_ids).to(recorded.dtype)
        assert torch.equal(recorded[at], want[at]), version

    fresh = tiny_model(family)
    fresh.load_state_dict(weights[1])
    context = prompt + episode.completion_ids[:end]
    params = SamplingParams(
        temperature=T, seed=SEEDS[family], max_tokens=12, stop_token_ids=RARE_STOPS, ignore_eos=True
    )
    with batch_invariant(True):
        (reference,) = Generator(fresh, block_size=4, num_blocks=64, max_num_batched_tokens=64).run_episodes(
            [context],
            {},
            params,
            limits=EpisodeLimits(max_turns=2, max_tokens=40 - end),
            tool_format=FirstTurnCalls(len(prompt)),
        )
    assert reference.completion_ids == episode.completion_ids[end:]
    assert reference.temperature_logprobs == episode.temperature_logprobs[end:]


@pytest.mark.parametrize("family", ["llama", "qwen3_5"])
def test_keep_a_paused_episode_resumes_on_the_kv_its_older_weights_wrote(family, one_thread):
    """``stale_kv=keep``: the paused episode keeps its blocks across the update; its tool's tokens and
    later tokens are computed by the new weights over the K/V the old weights wrote. Its recorded
    log-probs are that mixed computation's (HF's forward, the cache filled token by token by the
    weights of each step) and not the new weights' alone; a hybrid keeps its recurrent state too."""
    episode, weights, model, prompt, (before, after), gen = paused_across_an_update("keep", family)
    assert before and after == before and gen.stats()["stale_recomputes"] == 0
    end = check_versions_and_mask(episode)
    reference = copy.deepcopy(model).eval()
    mixed, cache, inputs = [], None, list(prompt)
    for token, version in zip(episode.completion_ids, versions_by_token(episode), strict=True):
        if version is None:  # a tool's token: prefilled with the next model token's forward
            inputs.append(token)
            continue
        if gen.early_kv and version == 1:  # the turn's last token went through the old weights first
            reference.load_state_dict(weights[0])
            with torch.no_grad():
                cache = reference(torch.tensor([inputs[:1]]), past_key_values=cache, use_cache=True).past_key_values
            inputs, gen.early_kv = inputs[1:], False
        reference.load_state_dict(weights[version])
        with torch.no_grad():
            out = reference(torch.tensor([inputs]), past_key_values=cache, use_cache=True)
        cache, inputs = out.past_key_values, [token]
        mixed.append(torch.log_softmax(out.logits[0, -1].float() / T, -1)[token])
    sampled = [lp for lp, m in zip(episode.temperature_logprobs, episode.model_mask) if m]
    torch.testing.assert_close(torch.tensor(sampled), torch.stack(mixed), rtol=0, atol=2e-5)
    pure = trainer_logprobs(model, weights[1], prompt, episode.completion_ids)
    assert (pure[end] - episode.temperature_logprobs[end]).abs() > 1e-4, "keep recomputed the old KV"


def stream_episodes(stale_kv: str, steps: int = 4):
    """Tool-episode groups (two samples each) streamed two per step, the weights perturbed after each
    step; the tools return at once. Returns the groups taken, the weights by version and the model."""
    model = tiny_model("llama")
    gen = Generator(model, block_size=4, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    prompts = prompts_of([5, 9, 7, 4, 6, 8, 5, 7], seed=1)
    limits = EpisodeLimits(max_turns=4, max_tokens=40, tool_grace=5.0)
    session = gen.open_episodes(TOOLS, limits=limits, tool_format=TokenFormat())

    def source(i):
        return prompts[i % 8], SamplingParams(
            n=2, temperature=T, seed=i, max_tokens=10, stop_token_ids=STOPS, ignore_eos=True
        )

    stream = StreamingRollouts(
        gen, source, groups_per_step=2, max_staleness=3, stale_kv=stale_kv, total_groups=2 * steps, episodes=session
    )
    weights, taken = {0: copy.deepcopy(model.state_dict())}, []
    for step in range(steps):
        with batch_invariant(True):
            taken += stream.next_groups()
        perturb(model, step)
        stream.weights_updated(1)
        weights[gen.policy_version] = copy.deepcopy(model.state_dict())
    stream.close()
    assert not gen.has_unfinished() and gen.allocator.num_free == gen.allocator.num_blocks
    return taken, weights, model


def test_streamed_tool_episodes_every_token_is_the_trainers_under_its_version(one_thread):
    """Streamed tool episodes with ``stale_kv=recompute``: some episode's tool call spans an optimizer
    step (its result collected under newer weights than its call), and every recorded log-prob equals,
    bitwise, the trainer's under the weights of its token's version. Tools that return at once give
    the same groups, in the same order, on every run."""
    taken, weights, model = stream_episodes("recompute")
    assert all(g.episodes is not None and len(g.episodes) == 2 for g in taken)
    spanning = checked = 0
    for group in taken:
        for ep in group.episodes:
            versions = versions_by_token(ep)
            spanning += sum(versions[s - 1] < versions[e] for s, e in tool_spans(ep) if e < len(versions))
            recorded = torch.tensor(ep.temperature_logprobs)
            for version in sorted(set(ep.policy_versions)):
                at = torch.tensor([v == version for v in versions])
                want = trainer_logprobs(model, weights[version], ep.prompt_token_ids, ep.completion_ids)
                assert torch.equal(recorded[at], want.to(recorded.dtype)[at]), (group.index, ep.branch, version)
                checked += int(at.sum())
    assert spanning, "no tool call spans an optimizer step: the test would prove nothing"
    assert checked == sum(len(ep.policy_versions) for g in taken for ep in g.episodes)
    again, _, _ = stream_episodes("recompute")
    assert [(g.index, g.finished_at, [e.completion_ids for e in g.episodes]) for g in again] == [
        (g.index, g.finished_at, [e.completion_ids for e in g.episodes]) for g in taken
    ]


def test_a_group_too_old_to_train_is_aborted_with_its_paused_episodes(one_thread):
    """Group 0's episodes wait on a tool that does not return while later groups finish and train: once
    its oldest token is older than ``max_staleness`` it is aborted at the update (its paused episodes,
    their blocks and their tools), counted as dropped, and never handed to the trainer."""
    model = tiny_model("llama")
    gen = Generator(model, block_size=4, num_blocks=256, max_num_seqs=8, max_num_batched_tokens=64)
    prompts = prompts_of([6, 9, 7, 4, 8], seed=2)
    released = threading.Event()

    def lookup(a: int) -> str:
        released.wait(60)
        return "late"

    limits = EpisodeLimits(max_turns=3, max_tokens=40, tool_timeout=60.0, tool_grace=0.01)
    session = gen.open_episodes({"lookup": lookup}, limits=limits, tool_format=FirstTurnCalls(len(prompts[0])))

    def source(i):
        stops = RARE_STOPS if i == 0 else []  # group 0 calls the tool at its first stop; the rest answer
        return prompts[i], SamplingParams(
            n=2, temperature=T, seed=i, max_tokens=12, stop_token_ids=stops, ignore_eos=True
        )

    stream = StreamingRollouts(
        gen, source, groups_per_step=1, max_staleness=1, stale_kv="keep", total_groups=3, episodes=session
    )
    try:
        for _ in range(3):
            with batch_invariant(True):  # draws independent of which rows share a step (overlap on or off)
                groups = stream.next_groups()
            now = gen.policy_version
            assert all(now - v <= 1 for g in groups for ep in g.episodes for v in ep.policy_versions)
            assert 0 not in [g.index for g in groups]
            if now == 0:
                gen.pipeline.drain()  # (overlapped: the step that paused them may still be in flight)
                assert len(gen.scheduler.paused) == 2  # group 0's samples, waiting on their tools
            stream.weights_updated(1)
    finally:
        released.set()
        stream.close()
    assert stream.stats.dropped_groups == 1 and stream.stats.dropped_tokens > 0
    assert stream.stats.trained_groups == 3 and not gen.scheduler.paused
    assert not gen.has_unfinished() and gen.allocator.num_free == gen.allocator.num_blocks


# ----------------------------------------------------------------------------- the recipe
def tool_task_recipe(
    monkeypatch, task_settings=None, reward="tests.recipes.test_recipes_grpo:ids_checksum_reward", **rollout
):
    """The recipe's calculator task on the tiny llama, every other turn read as a call (as in
    tests/training/test_training_episodes.py), with a reward that tells random completions apart."""
    from nopad.recipes import tasks, tool_tasks
    from nopad.recipes.config import from_dict
    from nopad.recipes.grpo_config import GRPORecipeConfig

    class EveryOtherTurnCalls(tool_tasks.TextToolFormat):
        def parse(self, turn_ids, prefix_ids):
            return [] if len(turn_ids) % 2 else [tool_tasks.ToolCall("calculator", {"expression": "6 * 7"})]

    task = tasks.Task(
        tool_tasks.calculator_task,
        {"calculator": tool_tasks.calculator},
        stop=tuple(chr(c) for c in range(48, 80)),
        tool_format=EveryOtherTurnCalls,
    )
    monkeypatch.setitem(tasks.TASKS, "calculator", task)
    return from_dict(
        GRPORecipeConfig,
        {
            "model": {"path": "tiny:llama"},
            "task": {"name": "calculator", "num_prompts": 8, **(task_settings or {})},
            "reward": reward,
            "rollout": {
                "prompts_per_step": 2,
                "num_generations": 4,
                "max_tokens": 48,
                "max_prompt_tokens": 200,
                "max_turns": 4,
                **rollout,
            },
            "train": {"steps": 2, "max_tokens_per_batch": 2048, "lr": 1e-3, "batch_invariant": True},
        },
    )


def run_tool_recipe(cfg, monkeypatch):
    """The run's metrics, final parameters and every rollout it trained on."""
    from nopad.recipes.grpo import run_grpo
    from nopad.recipes.models import load_model
    from nopad.training import grpo_step as step_module

    trained, inner = [], step_module.train_on_rollouts

    def recording(stepper, rollouts, *args, **kwargs):
        trained.extend(rollouts)
        return inner(stepper, rollouts, *args, **kwargs)

    monkeypatch.setattr(step_module, "train_on_rollouts", recording)
    model, tokenizer = load_model(cfg.model)
    history = run_grpo(cfg, model=model, tokenizer=tokenizer, progress=False)
    monkeypatch.setattr(step_module, "train_on_rollouts", inner)
    return history, [p.detach().clone() for p in model.parameters()], trained


KEYS = ("loss", "grad_norm", "reward_mean", "completion_tokens", "logprob_gap_max", "tool_calls_per_episode")


ENVIRONMENT = {
    "task_settings": {"environment": "tests.recipes.test_recipes_grpo_environment:Tally"},
    "reward": "tests.recipes.test_recipes_grpo_environment:calls_and_turns",
}


@pytest.mark.parametrize("setting", [{}, ENVIRONMENT], ids=["tools", "environment"])
def test_max_staleness_0_is_the_synchronous_episode_step_bitwise(monkeypatch, setting, one_thread):
    """The tool task (and an environment task, each group's environments reset with its example and
    rewarded whole), same seeds, exact mode: streaming at ``max_staleness=0`` trains exactly what the
    synchronous recipe's episode step trains, to the last bit of every parameter and metric."""
    h_sync, p_sync, r_sync = run_tool_recipe(tool_task_recipe(monkeypatch, **setting), monkeypatch)
    h_stream, p_stream, r_stream = run_tool_recipe(
        tool_task_recipe(monkeypatch, mode="streaming", max_staleness=0, **setting), monkeypatch
    )
    assert any(h["loss"] != 0.0 for h in h_sync) and all(h["tool_calls_per_episode"] > 0 for h in h_sync)
    for a, b in zip(h_sync, h_stream, strict=True):
        for key in KEYS:
            assert a[key] == b[key], key
        assert b["staleness_max"] == 0 and b["dropped_groups"] == 0
    assert [(r.completion_ids, list(r.loss_mask)) for r in r_sync] == [
        (r.completion_ids, list(r.loss_mask)) for r in r_stream
    ]
    assert all(torch.equal(p, q) for p, q in zip(p_sync, p_stream, strict=True))


@pytest.mark.parametrize("stale_kv", ["keep", "recompute"])
def test_the_recipe_streams_its_tool_task(monkeypatch, stale_kv, one_thread):
    """``rollout.mode=streaming`` on the tool task runs steps with episodes in flight across them;
    the tools' tokens are context: the step trains on the model's tokens only."""
    cfg = tool_task_recipe(monkeypatch, mode="streaming", max_staleness=1, stale_kv=stale_kv)
    history, _, trained = run_tool_recipe(cfg, monkeypatch)
    assert len(history) == 2 and all(h["tool_calls_per_episode"] > 0 for h in history)
    assert history[-1]["staleness_max"] <= 1 and history[-1]["policy_version"] == 2
    assert any(0 in r.loss_mask for r in trained)
    assert sum(h["completion_tokens"] for h in history) == sum(sum(r.loss_mask) for r in trained)
    assert all(len(r.policy_versions) == sum(r.loss_mask) for r in trained)
