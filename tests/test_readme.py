"""The README works as written: every Python block runs, and every shell command of the recipes
pipeline runs in order (slow: it trains the real demo model for a few steps).

Why: a user's first hour is the README. Its pipeline once failed at its second command while every
unit test passed; these tests make such a break impossible to land.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support import launch

ROOT = Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def pipeline_commands() -> list[str]:
    """The README's recipe commands, one per line, comments dropped (the setup block is `make`)."""
    commands = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith(("python -m recipes.", "accelerate launch")):
                commands.append(line)
    return commands


def test_the_readme_has_what_these_tests_run():
    assert len(blocks("python")) >= 2
    commands = pipeline_commands()
    for recipe in ("preprocess", "sft", "evaluate", "grpo"):
        assert any(f"recipes.{recipe}" in c for c in commands), recipe
    assert any(c.startswith("accelerate launch") for c in commands)


def demo_model_installed() -> bool:
    from assets.smollm2 import smollm2_gguf_path

    try:
        return smollm2_gguf_path().is_file()
    except FileNotFoundError:
        return False


needs_demo_model = pytest.mark.skipif(not demo_model_installed(),
                                      reason="the README uses the demo model: `make setup-test` installs it")


@needs_demo_model
def test_every_python_block_runs_in_order():
    namespace: dict = {"__name__": "readme"}
    for code in blocks("python"):
        exec(compile(code, "README.md", "exec"), namespace)  # noqa: S102 - the README is ours


@pytest.mark.slow
@needs_demo_model
def test_every_pipeline_command_runs_as_written(tmp_path):
    """preprocess -> SFT -> evaluate -> GRPO -> evaluate, then the 2-process launch, from a fresh
    directory that holds only the repository's recipes (paths in the README are relative)."""
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    for command in pipeline_commands():
        argv = shlex.split(command)
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        # one process uses every core, as a user's would (one thread under `make test`'s xdist workers:
        # conftest.py), a 2-process launch one thread per rank
        threads = {}
        if argv[0] == "accelerate":  # plus a free port: another test may hold accelerate's default
            argv = [sys.executable, "-m", "accelerate.commands.launch", "--main_process_port",
                    str(launch.free_port()), *argv[2:]]
            threads = {"OMP_NUM_THREADS": "1"}
        proc = subprocess.run(argv, cwd=tmp_path, env={**env, **threads}, capture_output=True, text=True,
                              timeout=600)
        assert proc.returncode == 0, launch.failure_message(command, f"{proc.stdout[-3000:]}\n{proc.stderr}",
                                                            proc.returncode, tail=8000)
    assert (tmp_path / "runs" / "grpo").is_dir()
