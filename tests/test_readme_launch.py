"""The README's 2-process launch line (DeepSpeed ZeRO-3 SFT of the demo model) runs as written, on
the packed data of the README's own preprocess line. A file of its own: under `make test`'s
`--dist loadfile` a file is one worker's, and this launch beside the rest of the README pipeline
(tests/test_readme.py) made one file of ~6 minutes."""

from __future__ import annotations

import json

import pytest

from tests.support import readme


@pytest.mark.slow
@pytest.mark.timeout(1200)  # the preprocess line and the launch, each killed after 600 s
@readme.needs_demo_model
def test_the_launch_line_runs_as_written(tmp_path):
    """The launch reads what the README's preprocess line writes (runs/packed_chat), so that line runs
    first; the SFT and GRPO lines between them do not feed it."""
    commands = readme.pipeline_commands()
    launches = [c for c in commands if readme.is_launch(c)]
    preprocess = [c for c in commands if c.startswith("python -m nopad.recipes.preprocess")]
    assert launches and preprocess
    cwd = readme.user_directory(tmp_path)
    for command in preprocess + launches:
        readme.run_as_written(command, cwd)
    # both ranks trained under DeepSpeed and the run saved its model (the recipe's default output_dir)
    for rank in (0, 1):
        result = json.loads((tmp_path / "runs" / "sft" / f"result_rank{rank}.json").read_text())
        assert result["world_size"] == 2 and result["deepspeed_engine"] and result["steps"] >= 1
        assert (tmp_path / result["checkpoint"] / "model.safetensors").is_file()
