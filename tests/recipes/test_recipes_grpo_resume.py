"""GRPO checkpoints and exact resume: a run killed with SIGKILL (after a rollout, after an optimizer
step, inside a checkpoint write) and resumed from its newest complete checkpoint ends with the same
metrics and, in the batch-invariant mode (fp32), bitwise the same parameters as a run never killed;
on one process and on two (torchrun, gloo, CPU). The kills come from outside the recipe
(:mod:`tests.support.grpo_kills`)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from nopad.recipes.config import load_config
from nopad.recipes.grpo import GRPORecipeConfig, run_grpo
from nopad.recipes.tiny_model import AsciiTokenizer
from tests.support.launch import free_port, run_in_group, signal_deaths

RUN = [
    "model.path=tiny:llama",
    "model.chat_template=false",
    "reward=tests.recipes.test_recipes_grpo:ids_checksum_reward",
    "task.num_prompts=8",
    "rollout.prompts_per_step=2",
    "rollout.num_generations=4",
    "rollout.max_tokens=8",
    "generator.num_blocks=64",
    "generator.max_num_batched_tokens=256",
    "train.steps=4",
    "train.lr=1e-3",
    "train.batch_invariant=true",
    "train.num_iterations=2",
    "loss.beta=0.05",
    "checkpoint.every=1",
]
TIMING = ("rollout_s", "train_s", "rollout_tokens_per_s", "train_tokens_per_s")


def recipe(kill_at: str | None) -> list[str]:
    """``-m nopad.recipes.grpo``, or the recipe killed at ``kill_at`` (:mod:`tests.support.grpo_kills`)."""
    return ["-m", "tests.support.grpo_kills", kill_at] if kill_at else ["-m", "nopad.recipes.grpo"]


def grpo(out: Path, *extra: str, kill_at: str | None = None) -> int:
    """The recipe in a subprocess of its own (its own process group and timeout); its exit code."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "ACCELERATE_USE_CPU": "1"}
    cmd = [sys.executable, *recipe(kill_at), *RUN, f"output_dir={out}", *extra]
    code, output, _ = run_in_group(cmd, 300, env=env, stderr=subprocess.STDOUT)
    assert code is not None, f"the GRPO run did not finish in 300 s:\n{output[-3000:]}"
    if code not in (0, -signal.SIGKILL):
        pytest.fail(f"the GRPO run failed ({code}):\n{output[-3000:]}")
    return code


def metrics(out: Path) -> list[dict]:
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def parameters(path: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted")
    assert grpo(out) == 0
    return out


def assert_same_run(out: Path, uninterrupted: Path) -> None:
    """Each step once, with the same metrics, and bitwise the same final parameters."""
    assert metrics(out) == metrics(uninterrupted)
    assert [m["step"] for m in metrics(out)] == [0, 1, 2, 3]
    want, got = parameters(uninterrupted / "step_4"), parameters(out / "step_4")
    assert want.keys() == got.keys()
    for name in want:
        assert torch.equal(want[name], got[name]), name


# after step 2's optimizer steps, before its metrics and checkpoint
@pytest.mark.parametrize("kill_at", ["step:2"])
def test_kill_and_resume_equals_the_uninterrupted_run_bitwise(kill_at, uninterrupted, tmp_path):
    assert grpo(tmp_path, kill_at=kill_at) == -signal.SIGKILL
    assert not (tmp_path / "step_4").exists()
    assert grpo(tmp_path, "checkpoint.resume_from=latest") == 0
    assert_same_run(tmp_path, uninterrupted)


# The other kill points, chained in one run (each resume is killed again): the final run still equals
# the uninterrupted one bitwise only if every resume was exact, with one launch and ~4 steps fewer
# than a kill-and-resume pair per point.
ONE_PROCESS_KILLS = (
    "rollout:2",  # after step 2's rollout, before its training (resumes from step_2)
    "checkpoint:3",  # inside the write of step_3 (step_3 is incomplete: resumes from step_2)
)


@pytest.mark.slow
def test_kills_at_each_point_then_resume_equal_the_uninterrupted_run_bitwise(uninterrupted, tmp_path):
    for i, kill_at in enumerate(ONE_PROCESS_KILLS):
        resume = ["checkpoint.resume_from=latest"] if i else []
        assert grpo(tmp_path, *resume, kill_at=kill_at) == -signal.SIGKILL, f"not killed at {kill_at}"
        assert not (tmp_path / "step_4").exists()
    assert grpo(tmp_path, "checkpoint.resume_from=latest") == 0
    assert_same_run(tmp_path, uninterrupted)


TWO_RANK_TIMEOUT_S = 420  # one 2-process GRPO run of 4 steps on 2 shared cores; a hang fails here


def grpo_two_ranks(out: Path, *extra: str, kill_at: str | None = None) -> tuple[int | None, str]:
    """The recipe on two ranks (torchrun, gloo on the CPU), killed at ``kill_at`` on both ranks."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": os.getcwd(), "ACCELERATE_USE_CPU": "1"}
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        *recipe(kill_at),
        *RUN,
        f"output_dir={out}",
        *extra,
    ]
    code, output, _ = run_in_group(cmd, TWO_RANK_TIMEOUT_S, env=env, stderr=subprocess.STDOUT)
    assert code is not None, f"the 2-rank GRPO run did not end in {TWO_RANK_TIMEOUT_S} s:\n{output[-3000:]}"
    return code, output


@pytest.fixture(scope="module")
def uninterrupted_two_ranks(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("uninterrupted_two_ranks")
    code, output = grpo_two_ranks(out)
    assert code == 0, f"the 2-rank GRPO run failed ({code}):\n{output[-3000:]}"
    return out


TWO_RANK_KILLS = (
    "checkpoint:2",  # inside the write of step_2 (resumes from step_1)
    "step:2",  # after step 2's optimizer steps, before its metrics and checkpoint (resumes from step_2)
)


@pytest.mark.slow
@pytest.mark.timeout(1800)  # the fixture's run and three more, 420 s each
def test_two_ranks_killed_and_resumed_equal_the_uninterrupted_run_bitwise(uninterrupted_two_ranks, tmp_path):
    """Both ranks killed at each point in turn (chained as above), then resumed to the end."""
    for i, kill_at in enumerate(TWO_RANK_KILLS):
        resume = ["checkpoint.resume_from=latest"] if i else []
        code, output = grpo_two_ranks(tmp_path, *resume, kill_at=kill_at)
        killed = code != 0 and any("SIGKILL" in d for d in signal_deaths(output))
        assert killed, f"not killed at {kill_at}:\n{output[-3000:]}"
        assert not (tmp_path / "step_4").exists()
    code, output = grpo_two_ranks(tmp_path, "checkpoint.resume_from=latest")
    assert code == 0, f"the resumed 2-rank run failed ({code}):\n{output[-3000:]}"
    assert_same_run(tmp_path, uninterrupted_two_ranks)


def tiny_run(tmp_path, **overrides):
    from tests.recipes.test_recipes_grpo import tiny_config
    from tests.support.models import tiny_model

    torch.manual_seed(0)
    overrides.setdefault("checkpoint", {"every": 1})
    cfg = tiny_config(output_dir=str(tmp_path), **overrides)
    return run_grpo(cfg, model=tiny_model("llama"), tokenizer=AsciiTokenizer(), progress=False)


def test_a_resume_with_another_learning_rate_is_refused(tmp_path, one_thread):
    """The checkpoint's AdamW state used to restore its own lr over the changed train.lr, silently."""
    tiny_run(tmp_path)
    with pytest.raises(
        ValueError,
        match=r"^cannot resume: the checkpoint was made with train.lr=0.001 "
        r"but this run has train.lr=0.0001",
    ):
        tiny_run(tmp_path, train={"steps": 2, "lr": 1e-4}, checkpoint={"every": 1, "resume_from": "latest"})


def test_a_resume_with_another_loss_is_one_clear_line(tmp_path, one_thread):
    tiny_run(tmp_path)
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1"]
    with pytest.raises(
        ValueError,
        match=r"^cannot resume: the checkpoint was made with loss.loss_type='dapo' "
        r"but this run has loss.loss_type='grpo'; resume with the same",
    ):
        tiny_run(
            tmp_path,
            train={"steps": 2},
            loss={"loss_type": "grpo"},
            checkpoint={"every": 1, "resume_from": "latest"},
        )


def test_model_path_of_a_grpo_run_is_its_newest_checkpoint(tmp_path, one_thread):
    from nopad.recipes.config import ChatModelConfig
    from nopad.recipes.models import load_model

    tiny_run(tmp_path, train={"steps": 2})
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1", "step_2"]
    assert not (tmp_path / "config.json").exists()  # the policy is the newest checkpoint
    model, _ = load_model(ChatModelConfig(path=str(tmp_path), chat_template=False))
    newest = parameters(tmp_path / "step_2")
    assert all(torch.equal(p, newest[n]) for n, p in model.state_dict().items() if n in newest)


def test_checkpoints_need_an_output_dir():
    with pytest.raises(ValueError, match=r"checkpoint.every needs output_dir"):
        load_config(GRPORecipeConfig, overrides=["checkpoint.every=2"])


def test_resuming_from_the_other_recipes_checkpoint_says_which_recipe_wrote_it(tmp_path, one_thread):
    """GRPO resumed from an SFT step (or the reverse) used to print Accelerate's words and "the file
    may be damaged"; the checkpoint records its recipe, and one from before that is told by its state."""
    from nopad.recipes.sft import train
    from nopad.recipes.sft_config import SFTRecipeConfig
    from tests.recipes.test_recipes_sft import _reset_accelerate

    sft = [
        "model.path=tiny:llama",
        "data.num_rows=8",
        "data.max_len=20",
        "data.tokens_per_batch=64",
        "train.progress=false",
        "train.max_steps=1",
        "train.grad_accum=1",
    ]
    train(load_config(SFTRecipeConfig, None, [*sft, f"checkpoint.output_dir={tmp_path / 'sft'}"]))
    _reset_accelerate()
    step = tmp_path / "sft" / "step_1"
    refused = (
        f"checkpoint.resume_from={step} is a checkpoint of nopad.recipes.sft, not of nopad.recipes.grpo: a "
        "resume continues the run that wrote it. To start nopad.recipes.grpo from that model, set "
        f"model.path={step} and leave checkpoint.resume_from unset"
    )
    with pytest.raises(ValueError) as err:
        tiny_run(tmp_path / "grpo", checkpoint={"every": 1, "resume_from": str(step)})
    assert str(err.value) == refused
    _reset_accelerate()
    marker = step / "nopad_checkpoint.json"  # a checkpoint written before the marker named its recipe
    marker.write_text(json.dumps({k: v for k, v in json.loads(marker.read_text()).items() if k != "recipe"}))
    with pytest.raises(ValueError) as err:
        tiny_run(tmp_path / "grpo", checkpoint={"every": 1, "resume_from": str(step)})
    assert str(err.value) == refused
    _reset_accelerate()
    tiny_run(tmp_path / "grpo2")
    _reset_accelerate()
    with pytest.raises(ValueError, match=r"is a checkpoint of nopad.recipes.grpo, not of nopad.recipes.sft: "):
        train(
            load_config(
                SFTRecipeConfig,
                None,
                [
                    *sft,
                    f"checkpoint.output_dir={tmp_path / 'sft2'}",
                    f"checkpoint.resume_from={tmp_path / 'grpo2' / 'step_1'}",
                ],
            )
        )
    _reset_accelerate()


STREAMING = ["rollout.mode=streaming", "rollout.max_staleness=4", "rollout.stale_kv=recompute"]


def test_streaming_killed_and_resumed_equals_the_uninterrupted_run_bitwise(tmp_path):
    """Streaming rollouts (``stale_kv=recompute``): the checkpoint keeps the groups in flight (their
    tokens, log-probs and policy versions) and the finished ones not yet trained; killed after step 2's
    optimizer steps and resumed, the run re-prefills them with the resumed weights and ends with the
    same metrics and bitwise the same parameters as a run never killed."""
    uninterrupted = tmp_path / "uninterrupted"
    assert grpo(uninterrupted, *STREAMING) == 0
    state = torch.load(uninterrupted / "step_2" / "streaming_rank0.pt", weights_only=False)
    assert state["in_flight"], "no group was in flight at the checkpoint: the test would prove nothing"
    assert state["policy_version"] == 4  # two GRPO steps of two optimizer steps each
    killed = tmp_path / "killed"
    assert grpo(killed, *STREAMING, kill_at="step:2") == -signal.SIGKILL
    assert grpo(killed, *STREAMING, "checkpoint.resume_from=latest") == 0
    assert_same_run(killed, uninterrupted)
    assert any(m["staleness_max"] > 0 for m in metrics(uninterrupted))  # it really streamed
