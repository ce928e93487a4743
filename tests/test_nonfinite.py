"""Non-finite numbers stop a run where they appear: a NaN or infinite reward, scorer
value, loss or gradient norm stops the run naming the function, step and sample, before anything
is saved from that step on; a reward or scorer that returns something else than a number names
itself and what it returned. ``train.nonfinite=skip`` drops such a step instead."""

from __future__ import annotations

import json
import logging
import math
import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from nopad.recipes.config import load_config, with_overrides
from nopad.recipes.tiny_model import AsciiTokenizer, tiny_causal_lm
from nopad.training.accumulation import OptimizerStepper
from nopad.training.nonfinite import NonFiniteError, reward_value

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1", "DS_ACCELERATOR": "cpu"}

BAD = {"value": float("nan")}  # what bad_reward returns; a test sets it
NAME = r"(tests\.)?test_nonfinite:bad_reward"  # pytest imports this file as test_nonfinite


def bad_reward(completion: str, example: dict) -> object:
    return BAD["value"]


def nan_reward(completion: str, example: dict) -> float:
    return float("nan")


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _saved_weights(directory: Path) -> list[Path]:
    return sorted(directory.rglob("*.safetensors")) + sorted(directory.rglob("config.json"))


# ----------------------------------------------------------------------------- reward values
@pytest.mark.parametrize("value, kind", [("1.0", "str"), ([1.0], "list"), (None, "NoneType")])
def test_a_reward_that_is_not_a_number_names_the_function_and_what_it_returned(value, kind):
    where = "grpo step 3, prompt 1, completion 2"
    with pytest.raises(
        TypeError,
        match=rf"^reward {NAME} returned .* \(a {kind}\) "
        r"for grpo step 3, prompt 1, completion 2; a reward must return one",
    ):
        reward_value(value, bad_reward, where)


def test_numbers_of_any_kind_are_rewards():
    import numpy as np

    assert [reward_value(v, bad_reward, "x") for v in (True, 2, 0.5, np.float32(0.25), torch.tensor(3.0))] == [
        1.0,
        2.0,
        0.5,
        0.25,
        3.0,
    ]
    with pytest.raises(NonFiniteError, match=rf"^scorer {NAME} returned -inf for x"):
        reward_value(-math.inf, bad_reward, "x", kind="scorer")


# ----------------------------------------------------------------------------- GRPO
def grpo_config(tmp_path, **overrides):
    from nopad.recipes.grpo_config import GRPORecipeConfig

    base = {
        "model": {"path": None, "chat_template": False},
        "reward": bad_reward,
        "task": {"num_prompts": 4},
        "rollout": {"prompts_per_step": 2, "num_generations": 2, "max_tokens": 4},
        "generator": {"num_blocks": 32, "max_num_batched_tokens": 128},
        "train": {"steps": 2, "lr": 1e-3},
        "output_dir": str(tmp_path),
    }
    return with_overrides(load_config(GRPORecipeConfig, overrides=base), overrides)


@pytest.mark.parametrize(
    "value, error, message",
    [
        (float("nan"), NonFiniteError, "returned nan"),
        (float("inf"), NonFiniteError, "returned inf"),
        ("1", TypeError, r"returned '1' \(a str\)"),
        ([1.0, 0.0], TypeError, r"returned \[1.0, 0.0\] \(a list\)"),
        (None, TypeError, r"returned None \(a NoneType\)"),
    ],
)
def test_a_bad_reward_stops_grpo_naming_it_the_step_and_the_sample(
    tmp_path, monkeypatch, one_thread, value, error, message
):
    from nopad.recipes.grpo import run_grpo

    _reset_accelerate()
    monkeypatch.setitem(BAD, "value", value)
    model, _ = tiny_causal_lm()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        error,
        match=rf"^reward {NAME} {message} for grpo step 0, "
        r"prompt 0 of this rank's step \(prompt '.*'\), completion 0 '.*'",
    ):
        run_grpo(grpo_config(tmp_path), model=model, tokenizer=AsciiTokenizer(), progress=False)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # no step was taken
    assert _saved_weights(tmp_path) == []


def test_the_grpo_recipe_exits_non_zero_on_a_nan_reward_and_saves_no_policy(tmp_path):
    """The reported case: a NaN reward used to be saved as "the policy" with exit code 0."""
    out = tmp_path / "grpo"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nopad.recipes.grpo",
            "model.path=tiny:llama",
            "model.chat_template=false",
            "reward=tests.test_nonfinite:nan_reward",
            "task.num_prompts=4",
            "rollout.prompts_per_step=2",
            "rollout.num_generations=2",
            "rollout.max_tokens=4",
            "generator.num_blocks=32",
            f"output_dir={out}",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0
    # nopad's own error reaches the user as one line, no traceback
    expected = (
        "nopad.recipes.grpo: error: reward tests.test_nonfinite:nan_reward returned nan for grpo step 0, prompt 0"
    )
    assert expected in proc.stderr, proc.stderr[-3000:]
    assert _saved_weights(out) == []


def test_a_nan_loss_stops_grpo_before_the_step(tmp_path, monkeypatch, one_thread):
    """Finite rewards, a forward gone non-finite (a float16 overflow, say): the step's guard stops it."""
    from nopad.recipes.grpo import run_grpo

    _reset_accelerate()
    monkeypatch.setitem(BAD, "value", 0.0)
    model, _ = tiny_causal_lm()
    calls = []

    def nan_logits(module, args, output):  # the training forwards only (rollouts run under no_grad)
        if torch.is_grad_enabled():
            calls.append(1)
            return output * float("nan")
        return output

    final_norm(model).register_forward_hook(nan_logits)  # the head's input: the loss reads no logits
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(
        NonFiniteError,
        match=r"^grpo step 0: the loss is nan and the gradient norm is nan; "
        "stopped before this step changed the weights",
    ):
        run_grpo(grpo_config(tmp_path), model=model, tokenizer=AsciiTokenizer(), progress=False)
    assert calls and all(torch.equal(v, before[k]) for k, v in model.state_dict().items())
    assert _saved_weights(tmp_path) == []


# ----------------------------------------------------------------------------- SFT
def sft_config(tmp_path, **overrides):
    from nopad.recipes.sft_config import SFTRecipeConfig

    base = {
        "model": {"path": "tiny:llama"},
        "data": {"num_rows": 16},
        "train": {"max_steps": 3, "grad_accum": 1, "progress": False},
        "checkpoint": {"output_dir": str(tmp_path), "every": 1},
    }
    return with_overrides(load_config(SFTRecipeConfig, overrides=base), overrides)


def final_norm(model):
    """The module whose output the LM head reads: the loss runs the head on those hidden states
    (nopad.packing.head.chunked), so a NaN put there reaches the loss as a forward gone bad would."""
    return model.get_decoder().norm


def nan_from_call(model, first_bad: int):
    """Make the model's hidden states (so its logits and loss) NaN from its ``first_bad``-th forward
    on (1-based); forwards without autograd (nopad's boundary probe when the model is first checked)
    are not counted."""
    calls = []

    def hook(module, args, output):
        if not torch.is_grad_enabled():
            return output
        calls.append(1)
        if len(calls) >= first_bad:
            return output * float("nan")
        return output

    final_norm(model).register_forward_hook(hook)


def test_sft_stops_at_the_step_whose_loss_is_nan_and_saves_nothing_from_it_on(tmp_path, one_thread):
    from nopad.recipes.sft import train

    _reset_accelerate()
    model, _ = tiny_causal_lm()
    nan_from_call(model, first_bad=2)  # grad_accum=1: the second forward is step 2's
    with pytest.raises(
        NonFiniteError,
        match=r"^step 2: the loss is nan and the gradient norm is nan; "
        "stopped before this step changed the weights, and nothing",
    ):
        train(sft_config(tmp_path), model=model, tokenizer=AsciiTokenizer())
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1"]
    assert [json.loads(line)["step"] for line in (tmp_path / "metrics.jsonl").read_text().splitlines()] == [1]
    assert all(torch.isfinite(p).all() for p in model.parameters())  # step 2 changed nothing


def test_sft_with_nonfinite_skip_drops_the_step_and_goes_on(tmp_path, one_thread, caplog):
    from nopad.recipes.sft import train

    _reset_accelerate()
    model, _ = tiny_causal_lm()
    calls = []

    def nan_once(module, args, output):  # only step 2's forward (the boundary probe's runs no autograd)
        if not torch.is_grad_enabled():
            return output
        calls.append(1)
        if len(calls) == 2:
            return output * float("nan")
        return output

    final_norm(model).register_forward_hook(nan_once)
    with caplog.at_level(logging.WARNING, logger="nopad.training.accumulation"):
        result = train(
            sft_config(tmp_path, **{"train": {"nonfinite": "skip"}}), model=model, tokenizer=AsciiTokenizer()
        )
    assert result["steps"] == 3 and math.isnan(result["losses"][1]) and math.isfinite(result["losses"][2])
    assert "step 2: the loss is nan and the gradient norm is nan; skipping the step" in caplog.text
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert sorted(p.name for p in tmp_path.glob("step_*")) == ["step_1", "step_2", "step_3"]


def test_the_sft_recipe_exits_non_zero_when_float16_overflows(tmp_path):
    """model.dtype=float16 going NaN (SmolLM2 did at step 2) is caught by the same guard: here a
    tiny model whose logits are finite in float32 but overflow float16, from the command line."""
    model, _ = tiny_causal_lm()
    with torch.no_grad():  # logits of about 1e5: float16 tops out at 65504
        model.lm_head.weight.copy_(
            torch.randn(model.lm_head.weight.shape, generator=torch.Generator().manual_seed(0)) * 1e4
        )
    model.save_pretrained(tmp_path / "model")
    AsciiTokenizer().save_pretrained(tmp_path / "model")
    out = tmp_path / "run"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "nopad.recipes.sft",
            f"model.path={tmp_path / 'model'}",
            "model.dtype=float16",
            "data.num_rows=16",
            "train.max_steps=2",
            "train.progress=false",
            "checkpoint.every=1",
            f"checkpoint.output_dir={out}",
        ],
        cwd=ROOT,
        env=ENV,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0
    assert "nopad.recipes.sft: error: step 1: the loss is nan" in proc.stderr, proc.stderr[-3000:]
    assert "float16 overflow (use model.dtype=bfloat16 or float32)" in proc.stderr
    assert list(out.glob("step_*")) == [] and _saved_weights(out) == []


# ----------------------------------------------------------------------------- the optimizer step
def _linear_stepper(nonfinite="stop"):
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 1)
    return model, OptimizerStepper(model, torch.optim.SGD(model.parameters(), lr=0.1), nonfinite=nonfinite)


def _step(stepper, model, grad_scale=1.0, step=7):
    rows = [{"num_loss_tokens": 1}]
    with stepper.window(rows, step=step) as w:
        with w.row():
            out = model(torch.ones(1, 4)).sum()
            out.register_hook(lambda g: g * grad_scale)
            w.backward(out)
    return w


def test_an_infinite_gradient_with_a_finite_loss_stops_the_step():
    model, stepper = _linear_stepper()
    before = [p.detach().clone() for p in model.parameters()]
    with pytest.raises(NonFiniteError, match=r"^step 7: the gradient norm is inf; stopped before"):
        _step(stepper, model, grad_scale=float("inf"))
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    assert all(p.grad is None for p in model.parameters())  # the failed window left no gradient


def test_skip_drops_the_step_and_the_next_one_trains():
    model, stepper = _linear_stepper("skip")
    before = [p.detach().clone() for p in model.parameters()]
    w = _step(stepper, model, grad_scale=float("inf"))
    assert w.skipped and stepper.skipped_steps == 1 and stepper.optimizer_steps == 0
    assert all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    w = _step(stepper, model, step=8)
    assert not w.skipped and stepper.optimizer_steps == 1 and math.isfinite(w.grad_norm)
    assert not any(torch.equal(p, b) for p, b in zip(model.parameters(), before))


def test_skip_is_refused_where_deepspeed_steps_inside_the_backward():
    model = torch.nn.Linear(2, 1)
    deepspeed = SimpleNamespace(distributed_type=SimpleNamespace(name="DEEPSPEED"))
    with pytest.raises(ValueError, match="train.nonfinite=skip cannot skip a step under DeepSpeed"):
        OptimizerStepper(model, torch.optim.SGD(model.parameters(), lr=0.1), deepspeed, nonfinite="skip")
    with pytest.raises(ValueError, match=r"nonfinite must be one of \('stop', 'skip'\), got 'ignore'"):
        OptimizerStepper(model, torch.optim.SGD(model.parameters(), lr=0.1), nonfinite="ignore")


def _two_rank_worker(rank: int, port: int, nonfinite: str, results) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    try:
        torch.manual_seed(0)
        model = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(4, 1))
        stepper = OptimizerStepper(model, torch.optim.SGD(model.parameters(), lr=0.1), nonfinite=nonfinite)
        # only rank 1's loss is NaN; the added constant leaves the (reduced) gradient finite
        bad = torch.tensor(float("nan") if rank == 1 else 0.0)
        try:
            with stepper.window([{"num_loss_tokens": 1}], step=5) as w:
                with w.row():
                    w.backward(model(torch.ones(1, 4)).sum() + bad)
            results[rank] = f"skipped={w.skipped}"
        except NonFiniteError as err:
            results[rank] = str(err)
        dist.barrier()  # both ranks got here: nobody is left waiting in a collective
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(600)  # two joins of 240 s
@pytest.mark.parametrize("nonfinite", ["stop", "skip"])
def test_every_rank_stops_or_skips_together_when_one_rank_goes_non_finite(nonfinite):
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_two_rank_worker, args=(r, port, nonfinite, results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=240)  # this test's own timeout: a rank left in a collective would hang
        alive = [p.is_alive() for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert not any(alive), "a rank hung"
        got = dict(results)
    if nonfinite == "skip":
        assert got == {0: "skipped=True", 1: "skipped=True"}
    else:
        assert got[1].startswith("step 5: the loss is nan")
        assert got[0].startswith("step 5: the loss or the gradient norm is not finite on another rank")


# ----------------------------------------------------------------------------- evaluate
@pytest.mark.parametrize(
    "value, error, message",
    [
        (float("nan"), NonFiniteError, "returned nan"),
        ("yes", TypeError, r"returned 'yes' \(a str\)"),
    ],
)
def test_a_bad_scorer_stops_evaluate_naming_it_and_the_sample(tmp_path, monkeypatch, one_thread, value, error, message):
    from nopad.recipes.evaluate import EvaluateConfig, run_evaluate

    monkeypatch.setitem(BAD, "value", value)
    model, _ = tiny_causal_lm()
    out = tmp_path / "results.jsonl"
    cfg = load_config(
        EvaluateConfig,
        overrides={
            "scorer": bad_reward,
            "data": {"num_prompts": 2},
            "sampling": {"max_tokens": 4},
            "model": {"chat_template": False},
            "output": str(out),
        },
    )
    with pytest.raises(
        error,
        match=rf"^scorer {NAME} {message} for prompt 0 "
        r"\(prompt '.*'\), completion '.*'",
    ):
        run_evaluate(cfg, model=model, tokenizer=AsciiTokenizer(), progress=False)
    assert "NaN" not in out.read_text()
