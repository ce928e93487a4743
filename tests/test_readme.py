"""The README works as written: every Python block runs, and every shell command of the recipes
pipeline runs in order (slow: it trains the real demo model for a few steps). Its 2-process launch
runs in tests/test_readme_launch.py, a file of its own, so that the other xdist worker takes it.

Why: a user's first hour is the README. Its pipeline once failed at its second command while every
unit test passed; these tests make such a break impossible to land.
"""

from __future__ import annotations

import pytest

from tests.support import readme


def test_the_readme_has_what_these_tests_run():
    assert len(readme.blocks("python")) >= 2
    commands = readme.pipeline_commands()
    for recipe in ("preprocess", "sft", "evaluate", "grpo"):
        assert any(f"nopad.recipes.{recipe}" in c for c in commands), recipe
    assert any(readme.is_launch(c) for c in commands)


@readme.needs_demo_model
def test_every_python_block_runs_in_order():
    namespace: dict = {"__name__": "readme"}
    for code in readme.blocks("python"):
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README is ours


@pytest.mark.slow
@pytest.mark.timeout(1500)  # six commands of up to 600 s each: one hung is a failure, not a stuck suite
@readme.needs_demo_model
def test_every_pipeline_command_runs_as_written(tmp_path):
    """preprocess -> SFT -> evaluate -> GRPO -> evaluate -> calculator GRPO, in order, from a fresh
    directory (the launch line: tests/test_readme_launch.py)."""
    cwd = readme.user_directory(tmp_path)
    for command in readme.pipeline_commands():
        if not readme.is_launch(command):
            readme.run_as_written(command, cwd)
    assert (tmp_path / "runs" / "grpo").is_dir()
