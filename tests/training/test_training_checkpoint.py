"""training/checkpoint.py: a checkpoint is complete or absent; SIGKILL inside a write loses only
that step; keep_last prunes; a run directory works as a model path."""

import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest

from nopad.recipes.config import load_config
from nopad.recipes.models import check_model_path
from nopad.recipes.sft import SFTRecipeConfig, train
from nopad.training import checkpoint, run_dir

ROOT = Path(__file__).resolve().parents[2]
SMALL = [
    "model.path=tiny:llama",
    "data.num_rows=24",
    "data.min_len=4",
    "data.max_len=40",
    "data.tokens_per_batch=96",
    "train.lr=1.0e-3",
    "train.progress=false",
    "train.max_steps=3",
    "checkpoint.every=1",
]

# Runs SFT and SIGKILLs itself inside the write of step_2: after the training state is on disk,
# before the model directory is (the moment a kill -9 left a half-written checkpoint before).
DYING_RUN = """
import os, signal, sys
import nopad.recipes.sft as sft
real = sft.save_model_dir
def dying(accelerator, model, tokenizer, path):
    if path.name == ".step_2.incomplete":
        (path / "model.safetensors").write_bytes(b"half a file")
        os.kill(os.getpid(), signal.SIGKILL)
    real(accelerator, model, tokenizer, path)
sft.save_model_dir = dying
sft.main(sys.argv[1:])
"""


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def test_sigkill_inside_a_checkpoint_write_resumes_from_the_previous_complete_one(tmp_path, caplog):
    out = tmp_path / "killed"
    args = [*SMALL, f"checkpoint.output_dir={out}"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [sys.executable, "-c", DYING_RUN, *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == -9, proc.stderr[-3000:]
    assert (out / "step_1").is_dir() and not (out / "step_2").exists()
    assert (out / ".step_2.incomplete").is_dir()  # the torn write, never mistaken for a checkpoint
    assert checkpoint.latest_checkpoint(out) == out / "step_1"

    full = train(load_config(SFTRecipeConfig, None, [*SMALL, f"checkpoint.output_dir={tmp_path / 'full'}"]))
    _reset_accelerate()
    with caplog.at_level(logging.INFO):
        rest = train(load_config(SFTRecipeConfig, None, [*args, "checkpoint.resume_from=latest"]))
    _reset_accelerate()
    assert "resumed from" in caplog.text and "step_1" in caplog.text
    assert rest["losses"] == full["losses"][1:]  # steps 2 and 3, exactly as the uninterrupted run
    assert checkpoint.latest_checkpoint(out) == out / "step_3"
    assert not (out / ".step_2.incomplete").exists()  # cleaned up by the rewrite of step 2


def test_a_directory_without_the_marker_is_skipped_with_a_warning(tmp_path, caplog):
    (tmp_path / "step_1").mkdir()
    (tmp_path / "step_1" / checkpoint.COMPLETE_MARKER).write_text("{}")
    (tmp_path / "step_5").mkdir()  # e.g. written by an older version or a copy cut short
    with caplog.at_level(logging.WARNING):
        assert checkpoint.latest_checkpoint(tmp_path) == tmp_path / "step_1"
    assert "step_5" in caplog.text and "not a complete checkpoint" in caplog.text
    with pytest.raises(FileNotFoundError, match="no complete step_N checkpoint"):
        checkpoint.latest_checkpoint(tmp_path / "nothing")


def test_keep_last_prunes_old_checkpoints_and_a_rewrite_replaces_whole(tmp_path):
    for step in range(1, 5):
        checkpoint.save_checkpoint(
            tmp_path / f"step_{step}", lambda d, s=step: (d / "w").write_text(str(s)), keep_last=2
        )
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_3", "step_4"]
    checkpoint.save_checkpoint(tmp_path / "step_4", lambda d: (d / "v").write_text("again"), keep_last=2)
    assert sorted(p.name for p in (tmp_path / "step_4").iterdir()) == [checkpoint.COMPLETE_MARKER, "v"]
    assert json.loads((tmp_path / "step_4" / checkpoint.COMPLETE_MARKER).read_text())["step"] == 4


def test_sft_keep_last_and_a_run_directory_as_model_path(tmp_path):
    out = tmp_path / "run"
    args = [*SMALL, f"checkpoint.output_dir={out}"]
    train(load_config(SFTRecipeConfig, None, [*args, "checkpoint.keep_last=1"]))
    _reset_accelerate()
    assert sorted(p.name for p in out.glob("step_*")) == ["step_3"]
    assert check_model_path(str(out)) == str(out / "step_3")
    with pytest.raises(ValueError, match="checkpoint.keep_last must be an integer >= 1"):
        train(load_config(SFTRecipeConfig, None, [*args, "checkpoint.keep_last=0"]))


def test_a_run_writes_its_curves_and_a_resumed_run_keeps_every_result(tmp_path):
    out = tmp_path / "run"
    args = [*SMALL, f"checkpoint.output_dir={out}", "train.max_steps=2"]
    train(load_config(SFTRecipeConfig, None, args))
    _reset_accelerate()
    train(
        load_config(
            SFTRecipeConfig,
            None,
            [*SMALL, f"checkpoint.output_dir={out}", "train.max_steps=3", "checkpoint.resume_from=latest"],
        )
    )
    _reset_accelerate()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]  # the resumed run continued the curve
    assert len((out / "results_rank0.jsonl").read_text().splitlines()) == 2  # both runs' results kept
    png = (out / "curves.png").read_bytes()
    assert png[:8] == b"\x89PNG\r\n\x1a\n"


def test_trackers_receive_the_loss(tmp_path):
    pytest.importorskip("tensorboard")
    out = tmp_path / "run"
    train(
        load_config(
            SFTRecipeConfig,
            None,
            [*SMALL, f"checkpoint.output_dir={out}", "train.max_steps=2", "accelerate.log_with=tensorboard"],
        )
    )
    _reset_accelerate()
    assert list(out.rglob("events.out.tfevents*"))


# ----------------------------------------------------------------------- several runs in one directory
def test_a_newer_run_wins_over_an_older_runs_higher_step_and_keeps_its_own_metrics(tmp_path, caplog):
    out = tmp_path / "run"
    train(load_config(SFTRecipeConfig, None, [*SMALL, f"checkpoint.output_dir={out}", "train.max_steps=3"]))
    _reset_accelerate()
    with caplog.at_level(logging.WARNING):
        train(load_config(SFTRecipeConfig, None, [*SMALL, f"checkpoint.output_dir={out}", "train.max_steps=2"]))
    _reset_accelerate()
    assert "already holds checkpoints of an earlier run" in caplog.text
    assert sorted(p.name for p in out.glob("step_*")) == ["step_1", "step_2", "step_3"]
    assert check_model_path(str(out)) == str(out / "step_2")  # the newer run's newest, not the older step_3
    assert checkpoint.latest_checkpoint(out) == out / "step_2"
    runs = {checkpoint.checkpoint_info(out / f"step_{n}")["run"] for n in (2, 3)}
    assert len(runs) == 2 and None not in runs
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2]  # this run's curve alone
    (aside,) = out.glob("metrics.*.jsonl")
    assert [json.loads(line)["step"] for line in aside.read_text().splitlines()] == [1, 2, 3]
    assert (
        not (out / checkpoint.LOCK_FILE).exists()
        or json.loads((out / checkpoint.LOCK_FILE).read_text())["pid"] == os.getpid()
    )


def test_a_second_run_at_once_stops_naming_the_first_runs_pid(tmp_path):
    out = tmp_path / "run"
    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        out.mkdir()
        (out / checkpoint.LOCK_FILE).write_text(
            json.dumps({"pid": other.pid, "host": __import__("socket").gethostname(), "run": "r1", "started": "now"})
        )
        with pytest.raises(RuntimeError, match=f"in use by another run \\(pid {other.pid} "):
            run_dir.claim_run_dir(out)
    finally:
        other.kill()
        other.wait()
    # the same lock once its process is gone: taken over with a warning
    assert run_dir.claim_run_dir(out)
    assert json.loads((out / checkpoint.LOCK_FILE).read_text())["pid"] == os.getpid()
    run_dir.release_run_dir(out)
    assert not (out / checkpoint.LOCK_FILE).exists()


# ------------------------------------------------------------------ wrong or damaged model directories
@pytest.mark.parametrize(
    "kind, expected",
    [
        ("no_config", "holds no config.json, so it is not a Hugging Face model directory"),
        ("training_state", "is a checkpoint's training state .* pass the checkpoint itself, model.path="),
        ("dataset", r"is a saved dataset .* \(data.source= in SFT\)"),
        ("incomplete_run", r"no complete step_N checkpoint \(only .step_2.incomplete"),
        ("empty", "is an empty directory"),
    ],
)
def test_a_directory_that_is_not_a_model_says_what_it_is(tmp_path, kind, expected):
    path = tmp_path / kind
    path.mkdir()
    if kind == "no_config":
        (path / "notes.txt").write_text("x")
    elif kind == "training_state":
        path = tmp_path / "step_1" / "training_state"
        path.mkdir(parents=True)
        (path / "optimizer.bin").write_bytes(b"x")
    elif kind == "dataset":
        import datasets

        datasets.Dataset.from_dict({"input_ids": [[1, 2]]}).save_to_disk(str(path))
    elif kind == "incomplete_run":
        (path / ".step_2.incomplete").mkdir()
    with pytest.raises(FileNotFoundError, match=expected):
        check_model_path(str(path))


def test_a_truncated_weights_file_is_named(tmp_path):
    from nopad.recipes.config import ModelConfig
    from nopad.recipes.models import load_model
    from nopad.recipes.tiny_model import tiny_causal_lm

    model, _ = tiny_causal_lm("llama")
    model.save_pretrained(tmp_path)
    weights = tmp_path / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    with pytest.raises(RuntimeError, match="could not load the model from model.safetensors .* truncated"):
        load_model(ModelConfig(path=str(tmp_path)))


def test_a_failing_write_is_a_clear_error_and_leaves_no_partial_checkpoint(tmp_path):
    def full_disk(tmp):
        (tmp / "part").write_text("x")
        raise OSError(28, "No space left on device")

    checkpoint.save_checkpoint(tmp_path / "step_1", lambda d: (d / "w").write_text("1"))
    with pytest.raises(OSError, match="could not write checkpoint .*step_2 .*full disk.*resume_from=latest"):
        checkpoint.save_checkpoint(tmp_path / "step_2", full_disk)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["step_1"]
    with pytest.raises(OSError, match="unexpected pos"):  # torch's zip writer on a full disk
        checkpoint.save_checkpoint(
            tmp_path / "step_2",
            lambda d: (_ for _ in ()).throw(
                RuntimeError(
                    "[enforce fail at inline_container.cc:778] . PytorchStreamWriter failed writing "
                    "file data/3: unexpected pos 335680 vs 335568"
                )
            ),
        )


def test_only_a_file_readers_own_words_suggest_a_damaged_checkpoint():
    """Every load failure used to end in "the file may be damaged", Accelerate's "registered
    objects" mismatch (another recipe's checkpoint) included."""
    from nopad.training.checkpoint import resume_failure

    other = resume_failure(
        "runs/x/step_1",
        RuntimeError("Number of custom checkpoints in folder x does not match the number of registered objects"),
    )
    assert "damaged" not in other and "resume with the recipe, model and settings of the run" in other
    torn = resume_failure(
        "runs/x/step_1",
        RuntimeError("PytorchStreamReader failed reading zip archive: failed finding central directory"),
    )
    assert "the file may be damaged: resume from an earlier step_N directory" in torn
