"""training/progress.py: the one run-progress record SFT and GRPO checkpoint, and its settings diff."""

import pytest

from nopad.training.progress import Progress


def test_a_resume_with_another_setting_names_it_and_an_unrecorded_one_is_not_compared():
    saved = Progress({"train.lr": 1e-3, "train.grad_accum": 2})
    saved.step = 3
    state = saved.state_dict()
    with pytest.raises(
        ValueError,
        match=r"^cannot resume: the checkpoint was made with train.lr=0.001 but "
        r"this run has train.lr=0.0001; resume with the same value",
    ):
        Progress({"train.lr": 1e-4, "train.grad_accum": 2}).load_state_dict(state)
    resumed = Progress({"train.lr": 1e-3, "train.grad_accum": 2, "train.warmup_steps": 5})
    resumed.load_state_dict(state)  # warmup_steps: not recorded by this checkpoint
    assert resumed.step == 3


def test_an_sft_checkpoint_from_before_grad_accum_was_a_setting_is_still_compared():
    old_state = {"step": 2, "grad_accum": 2, "settings": {"train.lr": 1e-3}}
    with pytest.raises(ValueError, match=r"train.grad_accum=2 but this run has train.grad_accum=4"):
        Progress({"train.lr": 1e-3, "train.grad_accum": 4}).load_state_dict(old_state)
    with pytest.raises(ValueError, match=r"^not a training progress state"):
        Progress().load_state_dict({"order": [0]})
