"""The recipes' AdamW (``nopad.training.optimizer.make_adamw``): fused where torch has the kernel, the
adapter's parameters alone under LoRA, torch's default implementation (logged) where fused is
refused, and a checkpoint of the unfused optimizer still resumes, exactly as it would have run on."""

from __future__ import annotations

import copy
import logging

import torch

from nopad.recipes.grpo import run_grpo
from nopad.recipes.tiny_model import AsciiTokenizer
from nopad.training import optimizer as optimizer_module
from nopad.training.lora import apply_lora
from nopad.training.optimizer import make_adamw
from nopad.training.sft import make_optimizer
from tests.recipes.test_recipes_grpo import tiny_config
from tests.support.models import tiny_model


def _steps(model, optimizer, steps: int, seed: int = 0) -> None:
    """``steps`` AdamW steps on seeded gradients (one set per step)."""
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        for p in model.parameters():
            if p.requires_grad:
                p.grad = torch.randn(p.shape, generator=gen, dtype=p.dtype)
        optimizer.step()
        optimizer.zero_grad()


def test_both_recipes_build_the_fused_adamw_on_cpu(tmp_path, monkeypatch):
    sft_optimizer, _ = make_optimizer(tiny_model("llama"), lr=1e-3, weight_decay=0.1, warmup_steps=0, total_steps=4)
    assert sft_optimizer.param_groups[0]["fused"] is True
    built = []

    def spy(*args, **kwargs):
        built.append(make_adamw(*args, **kwargs))
        return built[-1]

    monkeypatch.setattr(optimizer_module, "make_adamw", spy)
    cfg = tiny_config(output_dir=str(tmp_path), train={"steps": 1})
    run_grpo(cfg, model=tiny_model("llama"), tokenizer=AsciiTokenizer(), progress=False)
    assert len(built) == 1 and built[0].param_groups[0]["fused"] is True


def test_fused_steps_agree_with_the_default_implementation_to_rounding():
    fused_model, default_model = tiny_model("llama"), tiny_model("llama")
    default_model.load_state_dict(fused_model.state_dict())
    start = [p.detach().clone() for p in fused_model.parameters()]
    fused = make_adamw(fused_model, lr=1e-2, weight_decay=0.1)
    default = torch.optim.AdamW(default_model.parameters(), lr=1e-2, weight_decay=0.1)
    _steps(fused_model, fused, 3)
    _steps(default_model, default, 3)
    moved = 0.0
    for p, q, p0 in zip(fused_model.parameters(), default_model.parameters(), start):
        torch.testing.assert_close(p, q)  # float32 rounding: fused is not bitwise the for-loop
        moved = max(moved, float((p.detach() - p0).abs().max()))
    assert moved > 1e-2  # the steps really moved the weights


def test_lora_steps_the_adapter_alone():
    model = apply_lora(
        tiny_model("llama"), rank=4, alpha=8.0, dropout=0.0, target_modules="all-linear", base="tiny:llama"
    )
    optimizer = make_adamw(model, lr=1e-3, weight_decay=0.0)
    params = optimizer.param_groups[0]["params"]
    assert optimizer.param_groups[0]["fused"] is True
    assert {id(p) for p in params} == {id(p) for n, p in model.named_parameters() if "lora_" in n}


def test_parameters_without_a_fused_kernel_get_the_default_adamw_and_say_so(caplog):
    model = torch.nn.Linear(3, 2, dtype=torch.complex64)  # torch's fused AdamW takes real floats only
    with caplog.at_level(logging.INFO, logger="nopad.training.optimizer"):
        optimizer = make_adamw(model, lr=1e-3, weight_decay=0.0)
    assert not optimizer.param_groups[0]["fused"]
    model.weight.grad = torch.ones_like(model.weight)
    optimizer.step()  # and it steps
    assert "not the fused one (cpu/torch.complex64: `fused=True` requires" in caplog.text


def test_fused_and_unfused_state_dicts_have_one_format():
    fused_model, default_model = tiny_model("llama"), tiny_model("llama")
    fused = make_adamw(fused_model, lr=1e-2, weight_decay=0.1)
    default = torch.optim.AdamW(default_model.parameters(), lr=1e-2, weight_decay=0.1)
    _steps(fused_model, fused, 1)
    _steps(default_model, default, 1)
    ours, theirs = fused.state_dict(), default.state_dict()
    assert ours["state"].keys() == theirs["state"].keys()
    for i, state in ours["state"].items():
        assert {k: (v.dtype, v.shape) for k, v in state.items()} == {
            k: (v.dtype, v.shape) for k, v in theirs["state"][i].items()
        }
    assert ours["param_groups"][0]["fused"] is True and theirs["param_groups"][0]["fused"] is None


def test_a_checkpoint_of_the_unfused_optimizer_resumes_as_its_run_went_on():
    """The state dict has one format for both; torch restores the saved ``fused`` flag, so the
    resumed run steps exactly as the uninterrupted unfused run (bitwise)."""
    old = tiny_model("llama")
    old_optimizer = torch.optim.AdamW(old.parameters(), lr=1e-2, weight_decay=0.1)  # before fused
    _steps(old, old_optimizer, 2)
    saved_model, saved_optimizer = copy.deepcopy((old.state_dict(), old_optimizer.state_dict()))  # a save
    _steps(old, old_optimizer, 2, seed=1)  # the uninterrupted run

    resumed = tiny_model("llama")
    optimizer = make_adamw(resumed, lr=1e-2, weight_decay=0.1)
    resumed.load_state_dict(saved_model)
    optimizer.load_state_dict(saved_optimizer)
    _steps(resumed, optimizer, 2, seed=1)
    assert optimizer.param_groups[0]["fused"] is None  # the checkpoint's (torch's default) implementation
    assert all(torch.equal(p, q) for p, q in zip(resumed.parameters(), old.parameters()))
