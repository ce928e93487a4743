"""The one owner of the training step (nopad.training.accumulation.OptimizerStepper): SFT's and GRPO's
steps give the parameters TRL's trainers give after one step on the same data, and a window that
fails leaves the Accelerator as it found it."""

from __future__ import annotations

import copy
import os

import datasets
import pytest
import torch

from tests.recipes.test_recipes_sft import _reset_accelerate
from tests.support.models import tiny_model
from tests.training.test_training_trl import _texts, make_tokenizer

trl = pytest.importorskip("trl")
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")
LR = 0.5  # SGD, no clipping, constant schedule: one step is lr * the gradient


@pytest.fixture()
def accelerator():
    from accelerate import Accelerator

    _reset_accelerate()
    yield Accelerator(cpu=True)
    _reset_accelerate()


def _assert_same_parameters(a: torch.nn.Module, b: torch.nn.Module, initial: dict) -> None:
    moved = max(float((p.detach() - initial[n]).abs().max()) for n, p in a.named_parameters())
    assert moved > 1e-3  # the step really changed the model
    other = dict(b.named_parameters())
    for name, p in a.named_parameters():
        torch.testing.assert_close(p, other[name], atol=1e-6, rtol=1e-5)


# ----------------------------------------------------------------------------- GRPO
PROMPTS = ["w10 w11 w12", "w20 w21"]
GENERATIONS = 4


def _completion(prompt_ids: list[int], j: int) -> list[int]:
    """The j-th completion of a prompt: varied lengths, no EOS (TRL would cut the mask there)."""
    length = 1 + (sum(prompt_ids) + 3 * j) % 6
    return [6 + (7 * sum(prompt_ids) + 11 * j + 5 * k) % 100 for k in range(length)]


def _reward(completion_ids) -> float:
    return float(sum(completion_ids) % 7)


def _fixed_rollout(prompts, trainer):
    """TRL's rollout_func: each prompt repeated GENERATIONS times in a row -> the fixed completions."""
    from nopad.training.trl.rollout import tokenize_prompts

    prompt_ids = tokenize_prompts(prompts, trainer)
    completions = [_completion(ids, i % GENERATIONS) for i, ids in enumerate(prompt_ids)]
    return {
        "prompt_ids": prompt_ids,
        "completion_ids": completions,
        "logprobs": [[0.0] * len(c) for c in completions],
    }  # unused: no IS correction, one iteration


def test_grpo_step_equals_nopad_grpo_trainers_step(one_thread, tmp_path, accelerator):
    from trl import GRPOConfig

    from nopad.packing.hf import use_nopad_attention
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.grpo import Rollout, pack_rollouts, packed_logprobs
    from nopad.training.grpo_step import GRPOStepConfig, set_advantages, train_on_rollouts
    from nopad.training.trl.grpo_trainer import NopadGRPOTrainer

    tok = make_tokenizer()
    model = tiny_model("llama")
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    trl_model = copy.deepcopy(model)

    # the step's owner: the rollouts' log-probs from the same packed forward (ratio exactly 1, as TRL's
    # first iteration has), group advantages, one window
    rollouts = []
    for prompt in PROMPTS:
        ids = tok(prompt)["input_ids"]
        rollouts += [Rollout(ids, _completion(ids, j)) for j in range(GENERATIONS)]
    loss = GRPOStepConfig(max_tokens_per_batch=1024, shared_prefix=True)
    model.train()
    with use_nopad_attention(model):
        with torch.no_grad():
            for row in pack_rollouts(rollouts, loss.max_tokens_per_batch):
                scored = packed_logprobs(model, row).split(
                    [len(rollouts[i].completion_ids) for i in row["indices"].tolist()]
                )
                for i, lp in zip(row["indices"].tolist(), scored):
                    rollouts[i].gen_logprobs = lp.tolist()
        rewards = torch.tensor([_reward(r.completion_ids) for r in rollouts]).view(len(PROMPTS), GENERATIONS)
        set_advantages(rollouts, rewards)
        optimizer = torch.optim.SGD(model.parameters(), lr=LR)
        prepared, optimizer = accelerator.prepare(model, optimizer)
        metrics = train_on_rollouts(OptimizerStepper(prepared, optimizer, accelerator), rollouts, loss)
    assert metrics["logprob_gap_max"] == 0.0 and metrics["clip_fraction"] == 0.0
    flat = sum(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    assert metrics["flat_train_tokens"] == flat and metrics["train_tokens"] < flat  # each prompt once
    assert metrics["tree_token_saving"] == 1 - metrics["train_tokens"] / flat
    _reset_accelerate()

    # TRL's GRPOTrainer with nopad's packed forward, the same rollouts, rewards and loss (token mean)
    args = GRPOConfig(
        output_dir=str(tmp_path / "trl"),
        per_device_train_batch_size=len(rollouts),
        num_generations=GENERATIONS,
        steps_per_generation=1,
        gradient_accumulation_steps=1,
        max_completion_length=8,
        max_steps=1,
        loss_type="dapo",
        beta=0.0,
        epsilon=0.2,
        scale_rewards="group",
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
    )
    trainer = NopadGRPOTrainer(
        model=trl_model,
        args=args,
        processing_class=tok,
        rollout_func=_fixed_rollout,
        reward_funcs=lambda completion_ids, **kw: [_reward(c) for c in completion_ids],
        train_dataset=datasets.Dataset.from_dict({"prompt": PROMPTS}),
    )
    trainer.train()
    _assert_same_parameters(model, trl_model, initial)


# ----------------------------------------------------------------------------- SFT
def test_sft_step_equals_nopad_sft_trainers_step(one_thread, tmp_path):
    from trl import SFTConfig

    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.sft import sft_step, use_attention
    from nopad.training.trl.sft_trainer import NopadSFTTrainer

    tok = make_tokenizer()
    model = tiny_model("llama")
    initial = {n: p.detach().clone() for n, p in model.named_parameters()}
    trl_model = copy.deepcopy(model)
    _reset_accelerate()
    args = SFTConfig(
        output_dir=str(tmp_path / "sft"),
        max_length=64,
        per_device_train_batch_size=2,
        gradient_accumulation_steps=2,
        max_steps=1,
        learning_rate=LR,
        optim="sgd",
        lr_scheduler_type="constant",
        max_grad_norm=0.0,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
    )
    trainer = NopadSFTTrainer(
        model=trl_model,
        args=args,
        processing_class=tok,
        train_dataset=datasets.Dataset.from_dict({"text": _texts(24, 0)}),
    )
    window = list(trainer.get_train_dataloader())[:2]  # the micro-batches of the trainer's first step
    trainer.train()
    _reset_accelerate()

    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True)
    use_attention(model, "nopad")
    model.train()
    optimizer = torch.optim.SGD(model.parameters(), lr=LR)
    prepared, optimizer = accelerator.prepare(model, optimizer)
    step_loss = sft_step(OptimizerStepper(prepared, optimizer, accelerator), window)
    _reset_accelerate()
    assert step_loss > 0
    _assert_same_parameters(model, trl_model, initial)


# ----------------------------------------------------------------------------- a failing window
def _state(accelerator) -> tuple:
    g = accelerator.gradient_state
    return (
        accelerator.gradient_accumulation_steps,
        accelerator.step,
        accelerator.sync_gradients,
        dict(g.plugin_kwargs),
    )


def test_an_exception_inside_a_window_leaves_the_accelerator_unchanged(one_thread, accelerator):
    from nopad.training.accumulation import OptimizerStepper

    model = torch.nn.Linear(4, 2)
    clean = copy.deepcopy(model)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    model, optimizer = accelerator.prepare(model, optimizer)
    stepper = OptimizerStepper(model, optimizer, accelerator)
    before = _state(accelerator)
    rows = [{"num_loss_tokens": 3}, {"num_loss_tokens": 1}]
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
    with pytest.raises(KeyError, match="a bad row"):
        with stepper.window(rows) as w:
            with w.row():
                w.backward(model(x).sum())
            with w.row():
                raise KeyError("a bad row")
    assert _state(accelerator) == before
    assert all(p.grad is None for p in model.parameters())  # the half window's gradient is gone
    assert stepper.optimizer_steps == 0
    # the next window is a whole step, as if the failed one had never begun
    with stepper.window(rows) as w:
        for _ in rows:
            with w.row():
                w.backward(model(x).sum())
    assert _state(accelerator) == before and stepper.optimizer_steps == 1
    (clean(x).sum() * 2 / 4).backward()  # two rows of the same loss over 4 loss tokens
    for p, q in zip(model.parameters(), clean.parameters()):
        torch.testing.assert_close(p, q.detach() - 0.1 * q.grad)


def test_rollouts_without_generator_logprobs_cannot_train_the_grpo_loss(one_thread):
    from nopad.packing.hf import use_nopad_attention
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.grpo import Rollout
    from nopad.training.grpo_step import GRPOStepConfig, train_on_rollouts

    model = tiny_model("llama")
    stepper = OptimizerStepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    refused = pytest.raises(ValueError, match="2 loss tokens but no generator log-probs")
    with use_nopad_attention(model), refused:
        train_on_rollouts(stepper, [Rollout([5, 6], [7, 8])], GRPOStepConfig())
    assert all(p.grad is None for p in model.parameters()) and stepper.optimizer_steps == 0


def test_an_optimizer_subclass_calling_super_step_is_one_step():
    """torch runs the step hooks at every wrapped ``step`` in a subclass chain; the window counts the
    outermost call only, so a user's SGD subclass is not taken for two steps per window."""
    from nopad.training.accumulation import OptimizerStepper

    class Recording(torch.optim.SGD):
        def step(self, closure=None):
            self.calls = getattr(self, "calls", 0) + 1
            return super().step(closure)

    torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)  # SGD.step itself wrapped now
    model = torch.nn.Linear(2, 1)
    optimizer = Recording(model.parameters(), lr=0.1)
    stepper = OptimizerStepper(model, optimizer)
    rows = [{"num_loss_tokens": 1}]
    with stepper.window(rows) as window:
        with window.row():
            window.backward(model(torch.ones(1, 2)).sum())
    assert optimizer.calls == 1 and stepper.optimizer_steps == 1


# ----------------------------------------------------------------------------- misuse, named with the rule
def test_misused_windows_and_rows_say_the_rule():
    """``w.backward`` outside ``w.row()`` used to run (and the window then failed with "ended after
    0 of its 1 rows"); a window inside a window failed as "2 optimizer steps in one window"."""
    from nopad.training.accumulation import OptimizerStepper

    model = torch.nn.Linear(2, 1)
    stepper = OptimizerStepper(model, torch.optim.SGD(model.parameters(), lr=0.1))
    rows = [{"num_loss_tokens": 1}]
    x = torch.ones(1, 2)
    with pytest.raises(
        RuntimeError,
        match=r"w.backward\(\) outside `with w.row\(\):`: .* write "
        r"`with w.row\(\): w.backward\(loss_sum\(row\)\)`",
    ):
        with stepper.window(rows) as w:
            w.backward(model(x).sum())
    with pytest.raises(
        RuntimeError,
        match=r"stepper.window\(\) inside another window of the same stepper: "
        r"windows do not nest.* End the first window's `with` block",
    ):
        with stepper.window(rows) as w:
            with w.row():
                with stepper.window(rows):
                    pass
    with pytest.raises(RuntimeError, match=r"w.row\(\) inside another w.row\(\): each row is one block"):
        with stepper.window(rows) as w:
            with w.row(), w.row():
                pass
    with pytest.raises(RuntimeError, match=r"w.row\(\) after its window ended"):
        with w.row():
            pass
    with pytest.raises(RuntimeError, match=r"w.backward\(\) outside"):
        w.backward(model(x).sum())
    assert stepper.optimizer_steps == 0 and all(p.grad is None for p in model.parameters())
    with stepper.window(rows) as w:  # the stepper is whole after each refusal
        with w.row():
            w.backward(model(x).sum())
    assert stepper.optimizer_steps == 1
