"""Numbers a run must not carry on with when they are NaN or infinite: a reward (or scorer) value,
a step's loss, its gradient norm.

Why: one NaN reward makes every GRPO advantage NaN, the next optimizer step makes every weight
NaN, and the run then saved that as "the policy" and exited 0; SFT kept training and checkpointing
after its loss went NaN. A non-finite number is stopped where it first appears, with the function,
step and sample that produced it, before anything is saved from that step on. The optimizer-step
check itself lives with the step's one owner (:class:`nopad.training.accumulation.OptimizerStepper`).
"""

from __future__ import annotations

import math
import numbers

import torch

NONFINITE_POLICIES = ("stop", "skip")  # what an optimizer step with a non-finite loss or gradient does


class NonFiniteError(RuntimeError):
    """A NaN or infinite number where the run needs a finite one (a reward, a loss, a gradient norm)."""


def function_name(fn) -> str:
    """``module:function`` for a reward or scorer, as a user would write it in the config."""
    name = getattr(fn, "__qualname__", None) or getattr(fn, "__name__", None) or repr(fn)
    module = getattr(fn, "__module__", None)
    return f"{module}:{name}" if module else name


def reward_value(value, fn, where: str, kind: str = "reward") -> float:
    """``value``, what the reward (or scorer) ``fn`` returned for ``where`` (a step and sample), as a
    float: an error naming ``fn``, ``where`` and the value when it is not one finite number."""
    if isinstance(value, torch.Tensor) and value.numel() == 1:
        value = value.item()
    if not isinstance(value, numbers.Real):
        shown = repr(value)
        shown = shown if len(shown) <= 80 else shown[:77] + "..."
        raise TypeError(
            f"{kind} {function_name(fn)} returned {shown} (a {type(value).__name__}) for "
            f"{where}; a {kind} must return one number, e.g. 1.0 for a correct completion and "
            "0.0 otherwise"
        )
    value = float(value)
    if not math.isfinite(value):
        raise NonFiniteError(
            f"{kind} {function_name(fn)} returned {value} for {where}; a {kind} must be "
            f"a finite number (a NaN or infinite {kind} makes the step's loss and then "
            "every weight NaN): fix the function, e.g. return 0.0 where it cannot score"
        )
    return value


def describe_sample(example, prompt_field: str = "prompt") -> str:
    """A short description of a sample for an error message: its prompt, cut to one line."""
    prompt = example.get(prompt_field) if hasattr(example, "get") else None
    if prompt is None:
        return ""
    text = " ".join(str(prompt).split())
    return f" (prompt {text[:60]!r}{'...' if len(text) > 60 else ''})"
