"""Environment tasks of the GRPO recipe: ``task.environment=module:Class`` and the reward over the
whole episode, as :meth:`nopad.inference.Generator.run_episodes` and TRL's ``environment_factory``
take them.

Why: the recipe's reward read the last model turn's text only, so a task whose score lies in what
the episode did (the tools called, the state they left in the environment) could not be trained.

The environment is TRL's: a class whose public methods are the model's tools, ``reset(**example)``
called before each episode with the example's fields, and optionally ``get_reward()``, its own
reward (never a tool). With an environment, ``reward`` scores the episode: ``reward=environment``
(its ``get_reward()``) or ``reward=module:function`` called as
``fn(episode: nopad.inference.Episode, example: dict) -> float`` (``episode.environment`` is that
episode's environment). Either goes through ``reward_timeout`` like any reward.
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Callable

from nopad.inference.tools import ChatTemplateTools
from nopad.recipes.config import ConfigError
from nopad.recipes.reward_calls import EPISODE_SIGNATURE, check_reward_signature
from nopad.recipes.tasks import REWARDS, get_reward, import_path

ENVIRONMENT_REWARD = "environment"  # reward=environment: the environment's own get_reward() (TRL's)
_NOT_TOOLS = ("reset", "get_reward")  # TRL's contract: the other public methods are tools


def tool_names(environment: type) -> list[str]:
    """The tools of an environment class: its public functions other than ``reset`` and
    ``get_reward`` (read on the class, as TRL reads them, so properties are not evaluated)."""
    return [
        name
        for name, _ in inspect.getmembers(environment, predicate=inspect.isfunction)
        if not name.startswith("_") and name not in _NOT_TOOLS
    ]


def load_environment(spec: str, key: str = "task.environment") -> type:
    """The environment class ``spec`` (``"module:Class"``) names, checked against the protocol."""
    cls = import_path(spec, key) if isinstance(spec, str) and spec else None
    if not inspect.isclass(cls):
        raise ValueError(
            f"{key}={spec!r} is not a class; give the environment class as 'module:Class' (its "
            "public methods are the tools, reset(**example) starts each episode)"
        )
    if not callable(getattr(cls, "reset", None)):
        raise ValueError(
            f"{key}={spec!r}: {cls.__qualname__} has no reset method; define reset(self, **example) "
            "(called before each episode with the example's fields, as TRL calls it; it may "
            "return None)"
        )
    if not tool_names(cls):
        raise ValueError(
            f"{key}={spec!r}: {cls.__qualname__} has no public method for the model to call; "
            "its tools are its public methods other than reset and get_reward: define one"
        )
    return cls


def get_episode_reward(spec: str | Callable, environment: type, key: str = "reward") -> Callable:
    """The reward of an environment task, called as ``fn(episode, example)``: the environment's own
    ``get_reward()`` (``reward=environment``) or a function over the whole episode."""
    if spec == ENVIRONMENT_REWARD:
        if not callable(getattr(environment, "get_reward", None)):
            raise ValueError(
                f"{key}=environment reads the environment's get_reward(), but "
                f"{environment.__qualname__} has none; define get_reward(self) -> float or set "
                f"{key}=module:function taking {EPISODE_SIGNATURE}"
            )
        return environment_reward(environment)
    if callable(spec):
        return check_reward_signature(spec, f"{key} {getattr(spec, '__qualname__', spec)!r}", EPISODE_SIGNATURE)
    if not isinstance(spec, str) or spec in REWARDS or not (":" in spec or "." in spec):
        raise ValueError(
            f"{key}={spec!r}: with task.environment the reward scores the whole episode, not a "
            f"completion's text; set {key}=environment (the environment's get_reward()) or "
            f"{key}=module:function taking {EPISODE_SIGNATURE}"
        )
    fn = import_path(spec, key)
    if not callable(fn):
        raise ValueError(f"{key}={spec!r} is not callable")
    return check_reward_signature(fn, f"{key}={spec!r}", EPISODE_SIGNATURE)


def environment_reward(environment: type) -> Callable:
    """``reward=environment``: each episode scored by its own environment's ``get_reward()``
    (awaited when it is ``async``, as TRL allows), named after it in errors."""

    def score(episode, example) -> float:
        value = episode.environment.get_reward()
        return asyncio.run(value) if inspect.iscoroutine(value) else value

    score.__module__, score.__qualname__ = environment.__module__, f"{environment.__qualname__}.get_reward"
    return score


def resolve_reward(spec: str | Callable, environment: str | None) -> Callable:
    """The recipe's reward: a completion reward (``fn(completion, example)``) for a plain or tool task,
    an episode reward (``fn(episode, example)``) with ``task.environment``."""
    if environment is None:
        return get_reward(spec, key="reward")
    return get_episode_reward(spec, load_environment(environment))


def environment_format(tokenizer, environment: type, task: str) -> ChatTemplateTools:
    """The tool format of an environment task without a built-in tool format: the chat template's
    (``model.tool_template``), rendering the tools of an instance (TRL builds one to read them too)."""
    if getattr(tokenizer, "response_template", None) is None or not getattr(tokenizer, "chat_template", None):
        raise ConfigError(
            "model.tool_template",
            f"task.environment={task} calls its tools in the chat template's "
            "format, and this tokenizer's template has none; set model.tool_template=smollm2 "
            "(SmolLM2 and other ChatML models) or use a built-in tool task's format "
            "(task.name=calculator: calls as plain text)",
        )
    probe = environment()
    return ChatTemplateTools(tokenizer, [getattr(probe, name) for name in tool_names(environment)])
