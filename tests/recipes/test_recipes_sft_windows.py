"""SFT does not pad an epoch to a multiple of ``train.grad_accum`` with repeated, loss-masked
rows. The last optimizer step takes the micro-batches that are left, and is exact: the step
divides by its own global loss-token count."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F

from nopad.recipes.config import load_config
from nopad.recipes.sft import train
from nopad.recipes.sft_config import SFTRecipeConfig
from nopad.recipes.tiny_model import tiny_causal_lm

# three pre-packed rows of 16 tokens, two documents each (what nopad.recipes.preprocess writes)
ROWS = [{"input_ids": [3 + (7 * r + 5 * i) % 120 for i in range(16)], "seq_lengths": [10, 6]} for r in range(3)]


def _reset_accelerate():
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)
    GradientState._reset_state()


def _unpacked_mean_loss(model, row: dict) -> float:
    """Mean next-token loss over the row's documents, each run alone (no packing)."""
    total, count, start = 0.0, 0, 0
    with torch.no_grad():
        for n in row["seq_lengths"]:
            ids = torch.tensor(row["input_ids"][start : start + n])
            logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
            total += F.cross_entropy(logits.float(), ids[1:], reduction="sum").item()
            count += n - 1
            start += n
    return total / count


def test_three_prepacked_rows_at_grad_accum_2_are_steps_of_2_and_1_micro_batches_not_4(tmp_path, caplog):
    from transformers import AutoModelForCausalLM

    cfg = load_config(
        SFTRecipeConfig,
        None,
        [
            "train.grad_accum=2",
            "train.epochs=1",
            "train.lr=1e-3",
            "train.progress=false",
            "log.record_indices=true",
            "checkpoint.every=1",
            f"checkpoint.output_dir={tmp_path}",
        ],
    )
    model, tok = tiny_causal_lm()
    with caplog.at_level(logging.INFO, logger="nopad.dataloaders"):
        result = train(cfg, model=model, tokenizer=tok, rows=ROWS)
    _reset_accelerate()
    assert result["steps"] == 2 and result["micro_batches_per_epoch"] == 3  # 2 + 1, not 2 + 2
    batches = [sorted(set(batch)) for batch in result["indices_per_step"]]  # the rows of its documents
    assert sorted(batches) == [[0], [1], [2]]  # each row once: nothing repeated
    stats = result["stats"][0]
    assert stats["sequences_duplicated"] == 0 and stats["pad_fraction"] == 0.0
    logged = [r.getMessage() for r in caplog.records if r.name == "nopad.dataloaders"]
    assert any("pad fraction 0.000" in m for m in logged) and not any("repeated" in m for m in logged)
    # the short window's loss is the unpacked mean over its row's tokens at the weights it saw
    after_first = AutoModelForCausalLM.from_pretrained(str(tmp_path / "step_1")).eval()
    [last_row] = batches[2]
    assert result["losses"][1] == pytest.approx(_unpacked_mean_loss(after_first, ROWS[last_row]), rel=1e-5)


def test_a_short_window_has_the_gradient_of_the_unpacked_mean():
    """One micro-batch where grad_accum would be 2: the gradient of its own mean loss, not half of it."""
    from nopad.dataloaders import packed_dataloader
    from nopad.packing.hf import register_nopad_attention
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.sft import sft_step

    model, _ = tiny_causal_lm()
    model.zero_grad()
    loss, count, start = 0.0, 0, 0
    row = ROWS[0]
    for n in row["seq_lengths"]:
        ids = torch.tensor(row["input_ids"][start : start + n])
        logits = model(input_ids=ids[None], use_cache=False).logits[0, :-1]
        loss = loss + F.cross_entropy(logits.float(), ids[1:], reduction="sum")
        count, start = count + n - 1, start + n
    (loss / count).backward()
    reference = {name: p.grad.clone() for name, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    register_nopad_attention()
    model.set_attn_implementation("nopad")
    [batch] = list(packed_dataloader([row], 16, num_replicas=1, rank=0, shuffle=False))
    grads = {}
    hooks = [
        p.register_post_accumulate_grad_hook(lambda p, n=name: grads.__setitem__(n, p.grad.clone()))
        for name, p in model.named_parameters()
    ]
    stepper = OptimizerStepper(model, torch.optim.SGD(model.parameters(), lr=0.0))
    step_loss = sft_step(stepper, [batch])
    for hook in hooks:
        hook.remove()
    assert step_loss == pytest.approx(float(loss.detach() / count), rel=1e-5)
    for name, grad in reference.items():
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6)


def test_the_progress_bar_counts_the_short_steps_micro_batches():
    from nopad.training.sft_data import micro_batches

    epoch = [None] * 3  # a loader of 3 micro-batches an epoch, at grad_accum=2: steps of 2 and 1
    assert [micro_batches(epoch, 2, n) for n in range(5)] == [0, 2, 3, 5, 6]
    assert micro_batches(epoch, 2, 3, streaming=True) == 6  # a stream has no epoch length
