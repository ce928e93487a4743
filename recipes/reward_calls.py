"""How the recipes call a user's reward (or scorer): its signature checked when the config is read,
each call under a deadline.

Why: a reward with the wrong parameters used to fail mid-run with a TypeError traceback, after the
model had loaded and the first rollout had run; and a reward that never returned hung the run
without a word (tool calls had a timeout, rewards had none).
"""

from __future__ import annotations

import functools
import inspect
import threading
from collections.abc import Callable, Mapping

SIGNATURE = "(completion: str, example: dict) -> float"  # how GRPO and evaluate call a reward
# how GRPO calls the reward of a task.environment: the whole episode, its environment included
EPISODE_SIGNATURE = "(episode: nopad.inference.Episode, example: dict) -> float"


def check_reward_signature(fn: Callable, label: str, expected: str = SIGNATURE) -> Callable:
    """``fn`` when it can be called with two arguments (``expected``: which); otherwise an error
    naming ``label`` (``reward='my_module:score'``), the signature it has and the one expected."""
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without a readable signature: the first call will tell
        return fn
    try:
        signature.bind("completion", {})
    except TypeError:
        plain = [p.replace(annotation=p.empty) for p in signature.parameters.values()]
        has = signature.replace(parameters=plain, return_annotation=signature.empty)
        raise ValueError(
            f"{label} takes {has}, but the recipe calls it as fn{expected}: give it those two "
            "parameters (any others need defaults)"
        ) from None
    return fn


def with_timeout(
    fn: Callable, seconds: float | None, setting: str, prompt_field: str = "prompt", kind: str = "reward"
) -> Callable:
    """``fn`` run in a worker thread that gets ``seconds`` per call; past that, a ``TimeoutError``
    naming the prompt and ``setting`` (the config key that raises the limit). ``None`` calls ``fn``
    directly, in this thread (a reward that uses ``signal.alarm`` needs the main thread).

    A Python thread cannot be killed: a reward that never returns keeps its worker, a daemon thread,
    which ends with the process, while the run stops with the error instead of hanging."""
    if seconds is None:
        return fn

    @functools.wraps(fn)  # its name, module and declared example fields stay the user's
    def timed(completion, example: Mapping) -> float:  # completion: the text, or an episode reward's Episode
        done: dict = {}

        def call() -> None:
            try:
                done["value"] = fn(completion, example)
            except BaseException as err:  # handed to the caller below, with its traceback
                done["error"] = err

        worker = threading.Thread(target=call, name=f"nopad-{kind}", daemon=True)
        worker.start()
        worker.join(seconds)
        if worker.is_alive():
            prompt = " ".join(str(example.get(prompt_field, "")).split()) if hasattr(example, "get") else ""
            raise TimeoutError(
                f"the {kind} {_name(fn)} did not return within {seconds:g} s for the prompt "
                f"{prompt[:80]!r}; make it faster or set {setting} higher (seconds; null: no "
                "limit)"
            )
        if "error" in done:
            raise done["error"]
        return done["value"]

    return timed


def _name(fn: Callable) -> str:
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}:{name}" if module else name
