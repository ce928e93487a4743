"""Several recipe runs in one multi-process launch, in turn, for the slow tests:

    torchrun --nproc_per_node 2 -m tests.support.recipe_runs sft ARGS... -- sft ARGS... -- grpo ARGS...

Each run is what ``python -m recipes.<name> ARGS`` does (the same config parsing and entry point), on
a fresh model and a fresh Accelerate state; only the launch's start-up (torchrun, the imports,
DeepSpeed's set-up of the process group) is paid once instead of once per run, and that start-up
is most of a tiny run's time on two shared cores.
"""

from __future__ import annotations

import sys

from accelerate.state import AcceleratorState, GradientState

from nopad.recipes import grpo, sft

RECIPES = {"sft": sft.main, "grpo": grpo.main}


def split_runs(argv: list[str]) -> list[tuple[str, list[str]]]:
    """``["sft", "a", "--", "grpo", "b"]`` -> ``[("sft", ["a"]), ("grpo", ["b"])]``."""
    runs, current = [], []
    for word in [*argv, "--"]:
        if word != "--":
            current.append(word)
            continue
        if not current or current[0] not in RECIPES:
            raise SystemExit(f"each run starts with a recipe name ({', '.join(RECIPES)}), got {current[:1]}")
        runs.append((current[0], current[1:]))
        current = []
    return runs


def main(argv: list[str]) -> None:
    for name, args in split_runs(argv):
        AcceleratorState._reset_state(True)
        GradientState._reset_state()
        RECIPES[name](args)


if __name__ == "__main__":
    main(sys.argv[1:])
