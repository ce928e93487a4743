"""GRPO recipe with ``task.environment=module:Class``: one environment per episode, reset with the
example's fields, its methods the tools, and the reward over the whole episode (``reward=environment``:
its ``get_reward()``; ``reward=module:function``: ``fn(episode, example)``), through ``reward_timeout``."""

from __future__ import annotations

import pytest

from nopad.inference.environments import reset_environments
from nopad.inference.tools import public_methods
from nopad.recipes.config import from_dict, load_config
from nopad.recipes.grpo_config import GRPORecipeConfig

HERE = __name__  # environments and rewards are named to the recipe by import path


class Tally:
    """A calculator that counts its calls. The reward is the number of calls, which the last model
    turn (the answer, after the tool's result) does not show: a last-turn reward scores differently."""

    def reset(self, **example) -> None:
        self.calls, self.example = 0, example

    def calculator(self, expression: str) -> str:
        """Evaluate an expression (always 42 here).

        Args:
            expression: The expression.
        """
        self.calls += 1
        return "42"

    def get_reward(self) -> float:
        return float(self.calls)


def calls_and_turns(episode, example) -> float:
    """An episode reward: the environment's calls plus a tenth of the model's turns."""
    assert example["answer"] == episode.environment.example["answer"]  # its own example
    return episode.environment.calls + 0.1 * episode.num_turns


def text_reward(completion, example) -> float:  # noqa: ARG001 - a completion reward has no episode
    return 0.0


class NoReset:
    def calculator(self, expression: str) -> str:
        return expression


class NoTools:
    def reset(self, **example) -> None:
        pass


def not_a_class() -> Tally:
    return Tally()


def one_argument(episode) -> float:
    return 0.0


def recipe_config(**settings):
    return from_dict(
        GRPORecipeConfig,
        {
            "model": {"path": "tiny:llama"},
            "task": {"name": "calculator", "num_prompts": 4},
            "rollout": {
                "prompts_per_step": 2,
                "num_generations": 4,
                "max_tokens": 48,
                "max_prompt_tokens": 200,
                "max_turns": 4,
            },
            "train": {"steps": 1, "max_tokens_per_batch": 2048, "lr": 1e-3},
            **settings,
        },
    )


@pytest.mark.parametrize("reward", ["environment", f"{HERE}:calls_and_turns"])
def test_the_recipe_trains_on_the_reward_of_the_whole_episode(monkeypatch, reward):
    """The calculator task's text format with the tiny random model: its turns end at frequent stop
    strings and every other turn is read as a call, so episodes call the environment's tool."""
    from nopad.inference.generator import Generator
    from nopad.recipes import tasks, tool_tasks
    from nopad.recipes.grpo import run_grpo
    from nopad.recipes.models import load_model
    from nopad.training import grpo_step as step_module

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
    episodes, seen = [], []
    run = Generator.run_episodes

    def recording_run(self, *args, **kwargs):
        out = run(self, *args, **kwargs)
        episodes.extend(out)
        return out

    inner = step_module.set_advantages

    def recording_advantages(rollouts, rewards, *args, **kwargs):
        seen.extend(rewards.flatten().tolist())
        return inner(rollouts, rewards, *args, **kwargs)

    monkeypatch.setattr(Generator, "run_episodes", recording_run)
    monkeypatch.setattr(step_module, "set_advantages", recording_advantages)
    cfg = recipe_config(task={"name": "calculator", "num_prompts": 4, "environment": f"{HERE}:Tally"}, reward=reward)
    model, tokenizer = load_model(cfg.model)
    (metrics,) = run_grpo(cfg, model=model, tokenizer=tokenizer, progress=False)

    envs = [ep.environment for ep in episodes]
    assert len(episodes) == 8 and all(isinstance(e, Tally) for e in envs) and len(set(map(id, envs))) == 8
    assert all(set(e.example) == {"prompt", "answer"} for e in envs)  # reset(**example), as TRL's
    assert [e.calls for e in envs] == [ep.num_tool_calls for ep in episodes]  # its methods were the tools
    assert metrics["tool_calls_per_episode"] > 0
    expected = [
        calls_and_turns(ep, ep.environment.example) if reward != "environment" else float(ep.environment.calls)
        for ep in episodes
    ]
    assert seen == pytest.approx(expected)
    # the calls are in earlier turns (a call is followed by its result and another turn): a reward
    # of the last turn alone could not see them; the episode reward tells these episodes apart
    assert len(set(seen)) > 1 and metrics["reward_mean"] == pytest.approx(sum(expected) / len(expected))


@pytest.mark.parametrize(
    "settings, message",
    [
        ({"task.environment": "no_such_module:Env"}, r"task.environment='no_such_module:Env': cannot import it"),
        ({"task.environment": "Env"}, r"task.environment='Env' is not an import path; write it as 'module:name'"),
        ({"task.environment": f"{HERE}:not_a_class"}, r"not_a_class' is not a class; give the environment class"),
        ({"task.environment": f"{HERE}:NoReset"}, r"NoReset has no reset method; define reset\(self, \*\*example\)"),
        ({"task.environment": f"{HERE}:NoTools"}, r"NoTools has no public method for the model to call"),
        (
            {"task.environment": f"{HERE}:Tally"},  # the default reward scores text, not an episode
            r"reward='last_number_match': with task.environment the reward scores the whole episode.*"
            r"reward=environment .* or reward=module:function taking \(episode: nopad.inference.Episode, example",
        ),
        (
            {"task.environment": f"{HERE}:Tally", "reward": f"{HERE}:one_argument"},
            r"one_argument' takes \(episode\), but the recipe calls it as fn\(episode: nopad.inference.Episode",
        ),
        ({"task.environment": f"{HERE}:NoTools", "reward": "environment"}, r"NoTools has no public method"),
        ({"reward": "environment"}, r"unknown reward 'environment'"),
    ],
)
def test_a_bad_environment_or_episode_reward_is_one_line_at_config_time(settings, message):
    with pytest.raises(ValueError, match=message):
        load_config(GRPORecipeConfig, overrides=[f"{k}={v}" for k, v in settings.items()])


def test_reward_environment_is_the_environments_own_get_reward():
    class Plain(Tally):
        get_reward = None

    from nopad.recipes.env_tasks import get_episode_reward

    with pytest.raises(
        ValueError,
        match=r"reward=environment reads the environment's get_reward\(\), but "
        r".*Plain has none; define get_reward\(self\) -> float",
    ):
        get_episode_reward("environment", Plain)

    class Awaited(Tally):
        async def get_reward(self) -> float:  # TRL allows an async one (an LLM judge)
            return 2.5

    episode = type("Ep", (), {"environment": Awaited()})()
    score = get_episode_reward("environment", Awaited)
    assert score(episode, {}) == 2.5 and score.__qualname__.endswith("Awaited.get_reward")


def test_get_reward_is_not_a_tool_and_reset_takes_the_examples_fields():
    """TRL's contract: ``get_reward`` is the environment's reward, never a tool the model may call."""
    assert sorted(public_methods(Tally())) == ["calculator"]
    envs, prompts = reset_environments(Tally, [[1, 2], [3]], reset_kwargs=[{"answer": "1"}, {"answer": "2"}])
    assert [g[0].example for g in envs] == [{"answer": "1"}, {"answer": "2"}] and prompts == [[1, 2], [3]]
    with pytest.raises(ValueError, match=r"reset_kwargs must be one mapping of reset\(\) keywords per prompt"):
        reset_environments(Tally, [[1, 2], [3]], reset_kwargs=[{"answer": "1"}])
