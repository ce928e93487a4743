"""The TRL fence (nopad.training.trl.compat, nopad.training.trl.vllm_state): the installed TRL passes, an
untested version or a TRL whose private names, signatures or tuples changed is refused at
construction with what differs, and every TRL path the fake vLLM flags open is listed."""

import logging
import re
from pathlib import Path

import pytest

trl = pytest.importorskip("trl")

from trl import GRPOTrainer, SFTTrainer  # noqa: E402

from nopad.training.trl import compat, vllm_state  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]


# ----------------------------------------------------------------------------- the installed TRL
def test_the_installed_trl_passes_every_check():
    assert compat.grpo_problems(GRPOTrainer) == []
    assert compat.sft_problems(SFTTrainer) == []
    compat.check_grpo_trainer(GRPOTrainer)
    compat.check_sft_trainer(SFTTrainer)


def test_the_loss_types_nopad_accepts_are_the_installed_trls():
    """The construction check lists TRL's loss types; its GRPOConfig says which it has."""
    from trl import GRPOConfig

    text = GRPOConfig.__dataclass_fields__["loss_type"].metadata["help"]
    said = re.search(r"Supported values are (.*?)\. ", text).group(1)
    assert re.findall(r"'(\w+)'", said) == sorted(compat.GRPO_LOSS_TYPES, key=said.index)


def test_the_pin_in_pyproject_is_the_tested_range():
    pins = re.findall(r'"(trl[^"]*)"', (ROOT / "pyproject.toml").read_text())  # every extra naming trl
    assert pins and all(r == f"trl{compat.TESTED_TRL}" for r in pins), pins


# ----------------------------------------------------------------------------- versions
@pytest.mark.parametrize("version", ["1.17.0", "1.15.2", "2.0.0"])
def test_a_version_outside_the_tested_range_is_refused(monkeypatch, version):
    monkeypatch.setattr(trl, "__version__", version)
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(compat.UntestedTRLError, match=rf"trl>=1\.16,<1\.17.*this is trl {version}"):
        compat.check_grpo_trainer(GRPOTrainer)
    with pytest.raises(compat.UntestedTRLError, match=compat.ALLOW_UNTESTED_ENV):
        compat.check_sft_trainer(SFTTrainer)


def test_an_untested_version_runs_when_allowed_if_its_names_match(monkeypatch, caplog):
    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.setenv(compat.ALLOW_UNTESTED_ENV, "1")
    with caplog.at_level(logging.WARNING, logger="nopad.training.trl.compat"):
        compat.check_grpo_trainer(GRPOTrainer)
    assert "untested trl 1.17.0" in caplog.text


def test_nopad_trainers_refuse_an_untested_trl_at_construction(monkeypatch):
    """Before any model, data or Accelerator work: the first thing the constructors do."""
    from nopad.training import NopadGRPOTrainer, NopadSFTTrainer

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    monkeypatch.delenv(compat.ALLOW_UNTESTED_ENV, raising=False)
    with pytest.raises(compat.UntestedTRLError, match="NopadSFTTrainer was written for trl>=1.16,<1.17"):
        NopadSFTTrainer(None)
    with pytest.raises(compat.UntestedTRLError, match="GRPOTrainer integration was written for"):
        NopadGRPOTrainer(None, [])


def test_the_rollout_checks_a_plain_trl_trainer_once(monkeypatch):
    from nopad.training import nopad_rollout_func

    class Trainer(GRPOTrainer):  # TRL's own trainer given rollout_func=nopad_rollout_func()
        pass

    monkeypatch.setattr(trl, "__version__", "1.17.0")
    rollout = nopad_rollout_func()
    with pytest.raises(compat.UntestedTRLError):
        rollout(["a prompt"], object.__new__(Trainer))
    assert rollout.checked_trainers == set()


# ----------------------------------------------------------------------------- private names
def _reordered_tool_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
    tool_mask = tool_images = []
    tool_call_count = tool_failure_count = 0
    return completions, tool_mask, completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images


def _extended_tool_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
    tool_mask = tool_images = tool_rewards = []
    tool_call_count = tool_failure_count = 0
    return (
        tool_mask,
        completions,
        completion_ids,
        logprobs,
        tool_call_count,
        tool_failure_count,
        tool_images,
        tool_rewards,
    )


def _record_tool_loop(self, prompts, prompt_ids, completion_ids, completions, logprobs, images, multimodal_fields):
    return {"tool_mask": []}


@pytest.mark.parametrize(
    "fake, said",
    [
        (_reordered_tool_loop, "('completions', 'tool_mask',"),
        (_extended_tool_loop, "'tool_images', 'tool_rewards')"),
        (_record_tool_loop, "something other than a tuple of names"),
    ],
)
def test_a_trl_whose_tool_loop_tuple_changed_is_refused(monkeypatch, fake, said):
    """The tuple's positions are what the masks train on: a change must never pass silently."""
    monkeypatch.setattr(GRPOTrainer, "_tool_call_loop", fake)
    with pytest.raises(compat.UntestedTRLError, match="differs where nopad reaches into it") as error:
        compat.check_grpo_trainer(GRPOTrainer)
    message = str(error.value)
    assert "GRPOTrainer._tool_call_loop returns" in message and said in message


def test_a_trl_whose_caller_unpacks_the_tool_loop_differently_is_refused(monkeypatch):
    def _generate(self, prompts):
        (completions, tool_mask, completion_ids, logprobs, tool_call_count, tool_failure_count, tool_images) = (
            self._tool_call_loop(prompts)
        )
        return completions

    monkeypatch.setattr(GRPOTrainer, "_generate", _generate)
    with pytest.raises(
        compat.UntestedTRLError,
        match=r"_generate unpacks _tool_call_loop's result into "
        r"\('completions', 'tool_mask'",
    ):
        compat.check_grpo_trainer(GRPOTrainer)


def test_a_trl_whose_overridden_signature_or_attributes_changed_is_refused(monkeypatch):
    def logps(self, model, input_ids, attention_mask, logits_to_keep, compute_entropy=False):
        return None

    monkeypatch.setattr(GRPOTrainer, "_get_per_token_logps_and_entropies", logps)
    expected = compat.GRPO_METHODS["_get_per_token_logps_and_entropies"]
    assert compat.grpo_problems(GRPOTrainer) == [
        "GRPOTrainer._get_per_token_logps_and_entropies takes ('model', 'input_ids', 'attention_mask', "
        f"'logits_to_keep', 'compute_entropy'), not {expected}"
    ]
    monkeypatch.undo()
    monkeypatch.setattr(compat, "GRPO_ATTRIBUTES", (*compat.GRPO_ATTRIBUTES, "_tool_dicts"))
    assert compat.grpo_problems(GRPOTrainer) == ["GRPOTrainer no longer sets self._tool_dicts"]


# ----------------------------------------------------------------------------- the record
def test_the_tool_loop_record_lands_on_trls_positions():
    """Read back by the names TRL's own _generate unpacks into, each value is the right field."""
    record = compat.ToolLoopResult(
        model_mask=[[1, 0]],
        messages=[[{"role": "assistant"}]],
        completion_ids=[[5, 6]],
        logprobs=[[-0.5, 0.0]],
        tool_calls=3,
        tool_failures=1,
        tool_images=[[]],
    )
    names = compat._unpacked_names(GRPOTrainer._generate, "_tool_call_loop")
    got = dict(zip(names, compat.as_tool_loop_return(record), strict=True))
    assert got == {
        "tool_mask": [[1, 0]],
        "completions": [[{"role": "assistant"}]],
        "completion_ids": [[5, 6]],
        "logprobs": [[-0.5, 0.0]],
        "tool_call_count": 3,
        "tool_failure_count": 1,
        "tool_images": [[]],
    }


def test_the_tool_loop_record_refuses_ragged_entries():
    with pytest.raises(ValueError, match="completion 0: 2 tokens but 1 mask entries"):
        compat.ToolLoopResult([[1]], [[]], [[5, 6]], [[0.0, 0.0]], 0, 0, [[]])
    with pytest.raises(ValueError, match="lists differ in length"):
        compat.ToolLoopResult([[1]], [[], []], [[5]], [[0.0]], 0, 0, [[]])


def test_the_handed_back_tool_loop_answers_once():
    class Trainer:
        def _tool_call_loop(self, *args):
            return "TRL's own loop"

    trainer = Trainer()
    record = compat.ToolLoopResult([[1]], [[]], [[5]], [[0.0]], 0, 0, [[]])
    compat.hand_back_tool_loop(trainer, record)
    assert trainer._tool_call_loop(["prompt"]) == compat.as_tool_loop_return(record)
    assert trainer._tool_call_loop() == "TRL's own loop"  # not a stale batch's episodes


# ----------------------------------------------------------------------------- the vLLM flags
def test_every_trl_path_the_vllm_flags_open_is_listed():
    new, gone = vllm_state.unlisted_vllm_paths(GRPOTrainer)
    assert not new, (
        f"this TRL branches on {vllm_state.VLLM_FLAGS} where VLLM_PATHS does not say what "
        f"happens with nopad's fake vLLM state; read each and list it: {new}"
    )
    assert not gone, f"VLLM_PATHS lists paths this TRL no longer has: {gone}"


def test_a_new_vllm_branch_is_named_and_refused(monkeypatch):
    def _sync_lora(self):
        if self.use_vllm and self.vllm_mode == "colocate":
            self.vllm_generation.load_lora()

    monkeypatch.setattr(GRPOTrainer, "_sync_lora", _sync_lora, raising=False)
    new, _ = vllm_state.unlisted_vllm_paths(GRPOTrainer)
    assert new == [
        ("GRPOTrainer._sync_lora", "self.use_vllm and self.vllm_mode == 'colocate'"),
        ("GRPOTrainer._sync_lora", "self.vllm_generation.load_lora"),
    ]
    trainer = object.__new__(GRPOTrainer)
    with pytest.raises(compat.UntestedTRLError, match="GRPOTrainer._sync_lora"):
        vllm_state.enable_importance_sampling(trainer)
    assert not hasattr(trainer, "vllm_generation")  # nothing was set


def _unflagged_trainer(**settings):
    from types import SimpleNamespace

    trainer = object.__new__(GRPOTrainer)
    values = {
        "use_vllm": False,
        "vllm_importance_sampling_correction": True,
        "loss_type": "grpo",
        "vllm_importance_sampling_mode": "sequence_mask",
        "state": SimpleNamespace(global_step=3),
    }
    for name, value in {**values, **settings}.items():
        setattr(trainer, name, value)
    return trainer


def test_importance_sampling_sets_the_flags_once_and_keeps_trls_vespo_check():
    trainer = _unflagged_trainer()
    vllm_state.enable_importance_sampling(trainer)
    assert (trainer.use_vllm, trainer.vllm_mode, trainer._last_loaded_step) == (True, "server", 3)
    assert trainer.vllm_generation.sync_weights() is None
    with pytest.raises(RuntimeError, match="vLLM generation path is not available"):
        trainer.vllm_generation.generate(prompts=[[1]])
    vllm_state.enable_importance_sampling(trainer)  # idempotent: a second call is not "use_vllm=True"
    # TRL refuses this at construction only when use_vllm is already on; nopad flips it later
    with pytest.raises(ValueError, match="VESPO loss with importance_sampling=True needs"):
        vllm_state.enable_importance_sampling(_unflagged_trainer(loss_type="vespo"))
    with pytest.raises(ValueError, match="for rollouts without vLLM"):
        vllm_state.enable_importance_sampling(_unflagged_trainer(use_vllm=True))
