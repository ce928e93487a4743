"""Prompt sets and reward functions for the GRPO and evaluation recipes.

A task is a list of examples, each a dict with at least ``"prompt"`` (text) and usually
``"answer"``. A reward (or scorer) is ``fn(completion: str, example: dict) -> float``. Both are
chosen by name from the registries below or by import path (``"my_module:my_fn"``), so a user
swaps in their own data and reward without editing the recipes.
"""

from __future__ import annotations

import importlib
import random
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from nopad.inference.tools import ChatTemplateTools
from nopad.recipes.prompt_sets import load_examples as load_examples  # where it was
from nopad.recipes.reward_calls import check_reward_signature
from nopad.recipes.tool_tasks import (
    CALCULATOR_SYSTEM,
    CALL_CLOSE,
    TextToolFormat,
    calculator,
    calculator_chat_task,
    calculator_task,
)

if TYPE_CHECKING:  # the one reward type; training (torch) is not imported to read configs
    from nopad.training.grpo_step import RewardFn

ARITHMETIC_TEMPLATE = "What is {a} {op} {b}? Answer with the number only."


def arithmetic_task(num_prompts: int = 64, seed: int = 0, max_operand: int = 12) -> list[dict]:
    """Offline arithmetic questions made by code: ``"What is 7 + 12? ..."`` with answer ``"19"``.

    Small operands keep the answers within reach of a 135M model, so rewards are not all zero.
    """
    if num_prompts < 1:
        raise ValueError(f"num_prompts must be >= 1, got {num_prompts}")
    if max_operand < 1:
        raise ValueError(f"max_operand must be >= 1, got {max_operand}")
    rng = random.Random(seed)
    ops = {"+": lambda a, b: a + b, "-": lambda a, b: a - b, "*": lambda a, b: a * b}
    examples = []
    for _ in range(num_prompts):
        op = rng.choice(sorted(ops))
        a, b = rng.randint(0, max_operand), rng.randint(0, max_operand)
        if op == "-" and b > a:
            a, b = b, a  # keep answers non-negative
        examples.append({"prompt": ARITHMETIC_TEMPLATE.format(a=a, op=op, b=b), "answer": str(ops[op](a, b))})
    return examples


# ----------------------------------------------------------------------------- rewards
def reads(*fields: str) -> Callable[[RewardFn], RewardFn]:
    """Declare the example fields a reward compares against (``@reads("answer")``): a prompt set
    lacking one is refused at start, naming the field, instead of training on all-zero rewards."""

    def mark(fn: RewardFn) -> RewardFn:
        fn.example_fields = fields
        return fn

    return mark


def example_fields(fn: RewardFn) -> tuple[str, ...]:
    """The example fields ``fn`` declared with :func:`reads` (none for an undeclared reward)."""
    return tuple(getattr(fn, "example_fields", ()))


def _answer(example: Mapping) -> str:
    if "answer" not in example:
        raise KeyError(f"this reward needs an 'answer' field in each example; got keys {sorted(example)}")
    return str(example["answer"]).strip()


@reads("answer")
def exact_match(completion: str, example: Mapping) -> float:
    """1.0 when the completion, stripped of surrounding whitespace, equals the answer."""
    return float(completion.strip() == _answer(example))


_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@reads("answer")
def last_number_match(completion: str, example: Mapping) -> float:
    """1.0 when the last number in the completion equals the answer: "7 + 12 = 19" and
    "The answer is 19." both score 1 (small chat models like to restate the question)."""
    found = _NUMBER.findall(completion)
    return float(bool(found) and found[-1] == _answer(example))


# a word: letters/digits, joined by inner punctuation ("3.14", "it's", "well-known"); an outer
# sign kept (-5), the rest of the punctuation dropped ("Fe." is "fe")
_WORD = re.compile(r"-?\w+(?:[.,'’/:-]\w+)*")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


@reads("answer")
def contains_answer(completion: str, example: Mapping) -> float:
    """1.0 when the answer's words appear, in order and as whole words, in the completion, ignoring
    case, spacing and surrounding punctuation: "The chemical symbol of Iron is Fe." contains "Fe",
    "Feet" does not (a chat model answers in sentences, which exact_match scores 0)."""
    want, have = _words(_answer(example)), _words(completion)
    n = len(want)
    return float(n > 0 and any(have[i : i + n] == want for i in range(len(have) - n + 1)))


REWARDS: dict[str, RewardFn] = {
    "exact_match": exact_match,
    "last_number_match": last_number_match,
    "contains_answer": contains_answer,
}


def get_reward(spec: str | RewardFn, key: str = "reward") -> RewardFn:
    """Resolve a reward by registry name or ``"module:function"`` / ``"module.function"`` path.

    ``key`` names the config entry in the error message, so a user knows what to fix.
    """
    if callable(spec):
        return check_reward_signature(spec, f"{key} {getattr(spec, '__qualname__', spec)!r}")
    if not isinstance(spec, str) or not spec:
        raise ValueError(f"{key} must be a reward name or an import path, got {spec!r}")
    if spec in REWARDS:
        return REWARDS[spec]
    if ":" in spec or "." in spec:
        fn = import_path(spec, key)
        if not callable(fn):
            raise ValueError(f"{key}={spec!r} is not callable")
        return check_reward_signature(fn, f"{key}={spec!r}")
    raise ValueError(
        f"unknown {key} {spec!r}; use one of {sorted(REWARDS)} or an import path 'module:function' "
        "taking (completion: str, example: dict) -> float"
    )


def import_path(spec: str, key: str) -> object:
    """The object ``"module:name"`` (or ``"module.name"``) names; an error naming ``key`` otherwise."""
    module_name, _, attr = spec.replace(":", ".").rpartition(".")
    if not module_name:
        raise ValueError(f"{key}={spec!r} is not an import path; write it as 'module:name'")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as err:
        raise ValueError(f"{key}={spec!r}: cannot import it ({err})") from err


# ----------------------------------------------------------------------------- prompt sets
def check_prompts_per_step(num_prompts: int, prompts_per_step: int, world_size: int = 1) -> None:
    """One GRPO step takes ``prompts_per_step`` distinct prompts on each of ``world_size`` ranks;
    with fewer prompts it used to repeat them inside the step, silently."""
    if prompts_per_step * world_size > num_prompts:
        raise ValueError(
            f"rollout.prompts_per_step={prompts_per_step} x {world_size} process(es) needs "
            f"{prompts_per_step * world_size} distinct prompts per step, but the prompt set has "
            f"{num_prompts}; lower rollout.prompts_per_step or give more prompts "
            "(task.num_prompts / task.prompts)"
        )


@dataclass(frozen=True)
class Task:
    """A built-in task: its examples and, for a tool task, its tools, the stop strings that end a
    model turn at a call, and the call format (``tokenizer -> nopad.inference.tools.ToolFormat``)."""

    examples: Callable[..., list[dict]]
    tools: Mapping[str, Callable] = field(default_factory=dict)
    stop: tuple[str, ...] = ()
    tool_format: Callable | None = None
    system: str | None = None  # chat-format tool tasks: the system turn before each prompt

    @property
    def uses_tools(self) -> bool:
        return bool(self.tools)


# the one registry of task.name (GRPO) and data.task (evaluate)
TASKS: dict[str, Task] = {
    "arithmetic": Task(arithmetic_task),
    "calculator": Task(calculator_task, {"calculator": calculator}, (CALL_CLOSE,), TextToolFormat),
    "calculator_chat": Task(
        calculator_chat_task, {"calculator": calculator}, tool_format=ChatTemplateTools, system=CALCULATOR_SYSTEM
    ),
}


def tool_task(name: str, prompts: str | None = None) -> Task | None:
    """The built-in task ``name`` when it is a tool task and no prompt file (``prompts``) replaces it."""
    task = TASKS[name] if prompts is None else None
    return task if task is not None and task.uses_tools else None


# ----------------------------------------------------------------------------- tokenizing
