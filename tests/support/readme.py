"""The README's code blocks and recipe commands, and one way to run a command as a user would: shared by
tests/test_readme.py (the pipeline) and tests/test_readme_launch.py (its 2-process launch, a file of its
own so that the other xdist worker takes it)."""

from __future__ import annotations

import os
import re
import shlex
import sys
from pathlib import Path

import pytest

from tests.support import launch

ROOT = Path(__file__).resolve().parents[2]
README = (ROOT / "README.md").read_text()


def blocks(language: str) -> list[str]:
    return re.findall(rf"```{language}\n(.*?)```", README, flags=re.S)


def pipeline_commands() -> list[str]:
    """The README's recipe commands, one per line, comments dropped (the setup block is `make`)."""
    commands = []
    for block in blocks("bash"):
        for line in block.splitlines():
            line = line.split("#", 1)[0].strip()
            if line.startswith(("python -m nopad.recipes.", "accelerate launch")):
                commands.append(line)
    return commands


def is_launch(command: str) -> bool:
    return command.startswith("accelerate launch")


def demo_model_installed() -> bool:
    from nopad.assets.smollm2 import smollm2_gguf_path

    try:
        return smollm2_gguf_path().is_file()
    except FileNotFoundError:
        return False


needs_demo_model = pytest.mark.skipif(
    not demo_model_installed(), reason="the README uses the demo model: `make setup-test` installs it"
)


def user_directory(tmp_path: Path) -> Path:
    """A fresh directory that holds only the repository's recipes (paths in the README are relative)."""
    (tmp_path / "recipes").symlink_to(ROOT / "recipes")
    return tmp_path


def run_as_written(command: str, cwd: Path, timeout: float = 600) -> None:
    """Run one README command in ``cwd`` and fail the test with its output's end if it fails. One
    process uses every core, as a user's would (one thread under `make test`'s xdist workers:
    conftest.py), a 2-process launch one thread per rank, on a free port (another test may hold
    accelerate's default). The command runs in its own process group: a timeout kills every rank."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "DS_ACCELERATOR": "cpu", "TOKENIZERS_PARALLELISM": "false"}
    argv = shlex.split(command)
    argv[0] = sys.executable if argv[0] == "python" else argv[0]
    if is_launch(command):
        argv = [
            sys.executable,
            "-m",
            "accelerate.commands.launch",
            "--main_process_port",
            str(launch.free_port()),
            *argv[2:],
        ]
        env["OMP_NUM_THREADS"] = "1"
    returncode, out, err = launch.run_in_group(argv, timeout, cwd=cwd, env=env)
    if returncode is None:
        pytest.fail(f"{command}: no result after {timeout:.0f} s (a hang?)\n{out[-3000:]}\n{err[-3000:]}")
    assert returncode == 0, launch.failure_message(command, f"{out[-3000:]}\n{err}", returncode, tail=8000)
