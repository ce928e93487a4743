"""The GRPO recipe, killed with SIGKILL at a chosen point, for the crash-resume tests:

    python -m tests.support.grpo_kills rollout:N|step:N|checkpoint:N ARGS...
    torchrun --nproc_per_node 2 -m tests.support.grpo_kills step:N ARGS...

It is ``python -m nopad.recipes.grpo ARGS`` with one of the recipe's functions wrapped from outside, as
SFT's crash test wraps ``save_model_dir``, so the shipped recipe carries no kill switch:

- ``rollout:N``: after step N's rollout (and rewards), before its training;
- ``step:N``: after step N's optimizer steps, before its metrics and checkpoint;
- ``checkpoint:N``: inside the write of ``step_N``, after the training state, before the model files.

Every rank that reaches the point kills itself.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import nopad.recipes.grpo_checkpoint
import nopad.training.grpo_step
import nopad.training.streaming
from nopad.recipes import grpo

POINTS = ("rollout", "step", "checkpoint")


def die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


def kill_at(where: str, step: int) -> None:
    """Wrap the function the point sits in (the recipe looks each one up when it calls it)."""
    if where == "rollout":  # grpo_step calls train_on_rollouts once the step's rollouts are scored
        train_on_rollouts = nopad.training.grpo_step.train_on_rollouts

        def rollout_then_die(*args, **kwargs):
            if kwargs.get("step") == step:
                die()
            return train_on_rollouts(*args, **kwargs)

        nopad.training.grpo_step.train_on_rollouts = rollout_then_die
    elif where == "step":  # the recipe imports its step function when a step runs, so it gets these
        for module, name in ((nopad.training.grpo_step, "grpo_step"), (nopad.training.streaming, "streaming_step")):
            run_step = getattr(module, name)

            def step_then_die(*args, _run_step=run_step, **kwargs):
                metrics = _run_step(*args, **kwargs)
                if kwargs.get("step") == step:
                    die()
                return metrics

            setattr(module, name, step_then_die)
    else:  # the Checkpointer writes the model files after Accelerate's training state
        save_model_dir = nopad.recipes.grpo_checkpoint.save_model_dir

        def save_then_die(accelerator, model, tokenizer, path):
            if Path(path).name == f".step_{step}.incomplete":
                die()
            save_model_dir(accelerator, model, tokenizer, path)

        nopad.recipes.grpo_checkpoint.save_model_dir = save_then_die


def main(argv: list[str]) -> None:
    where, _, step = (argv[0] if argv else "").partition(":")
    if where not in POINTS or not step.isdigit():
        raise SystemExit(f"usage: python -m tests.support.grpo_kills {{{'|'.join(POINTS)}}}:N ARGS...")
    kill_at(where, int(step))
    grpo.main(argv[1:])


if __name__ == "__main__":
    main(sys.argv[1:])
