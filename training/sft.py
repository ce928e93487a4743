"""SFT's training step and its bookkeeping, for the recipe (``recipes/sft.py``) and any loop like
it: one optimizer step per window of packed micro-batches (:func:`sft_step`, through
:class:`nopad.training.accumulation.OptimizerStepper`), the optimizer and its schedule, and the per-step
and per-run records (the progress a checkpoint keeps: :class:`nopad.training.progress.Progress`).
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from nopad.packing.row import as_row
from nopad.training import checkpoint
from nopad.training.accumulation import OptimizerStepper
from nopad.training.curves import finish_trackers, write_curves
from nopad.training.loss import COUNT_KEYS, row_nll_sum
from nopad.training.optimizer import make_adamw
from nopad.training.progress import Progress as Progress  # (one record for SFT and GRPO; its old name)

logger = logging.getLogger(__name__)


def sft_step(
    stepper: OptimizerStepper,
    window: list[dict],
    weighting: str = "token",
    seen: list | None = None,
    step: int | None = None,
    on_micro_batch: Callable[[], None] | None = None,
) -> float:
    """Forward and backward every micro-batch of ``window``, then one optimizer step; the loss is
    the mean over the window's loss tokens (or sequences) on all ranks. Returns this rank's share
    of the step's loss; appends each micro-batch's dataset indices to ``seen`` when given.
    ``step`` (the optimizer step's number) names the step when its loss or gradient is not finite;
    ``on_micro_batch()`` is called after each micro-batch's backward (a progress bar's tick)."""
    if weighting not in COUNT_KEYS:
        raise ValueError(f"unknown weighting {weighting!r}; choose one of {tuple(COUNT_KEYS)}")
    model = stepper.model
    device = next(model.parameters()).device if stepper.accelerator is None else stepper.accelerator.device
    step_loss = 0.0
    with stepper.window(window, COUNT_KEYS[weighting], step=step) as w:
        for batch in window:
            batch = as_row(batch).to(device)
            if seen is not None:
                seen.append(batch.indices.tolist())
            with w.row():
                loss_sum = row_nll_sum(model, batch, weighting=weighting)  # the chunked LM head
                step_loss += float(w.backward(loss_sum))
            if on_micro_batch is not None:
                on_micro_batch()
    return step_loss


def make_optimizer(model, lr: float, weight_decay: float, warmup_steps: int, total_steps: int):
    """AdamW over the trainable parameters (a LoRA adapter's alone; fused where torch can:
    :func:`nopad.training.optimizer.make_adamw`) with a linear warm-up, then a linear decay to 0 at
    ``total_steps``."""
    optimizer = make_adamw(model, lr, weight_decay)
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer,
        lambda s: min(1.0, (s + 1) / (warmup_steps + 1)) * max(0.0, 1 - s / max(total_steps, 1)),
    )
    return optimizer, scheduler


def use_attention(model, name: str) -> None:
    """Switch ``model`` to the attention ``name`` (``"nopad"`` is registered first)."""
    if name == "nopad":
        from nopad.packing.hf import register_nopad_attention
        from nopad.packing.mixers import PACKED, check_model

        check_model(model, PACKED)  # a layer nopad cannot keep packed sequences apart in
        register_nopad_attention()
    model.set_attn_implementation(name)


def record_step(accelerator, output_dir: Path, step: int, step_loss: float, bar=None) -> float:
    """The step's loss over all ranks, to the trackers, ``metrics.jsonl`` and the progress bar."""
    loss = accelerator.reduce(torch.tensor([step_loss], device=accelerator.device), "sum").item()
    accelerator.log({"loss": loss}, step=step)  # to the log_with trackers
    if accelerator.is_main_process:
        checkpoint.append_metrics(output_dir, {"step": step, "loss": loss})
    if bar is not None:  # (the bar itself moves per micro-batch: see progress_bar)
        bar.set_postfix(step=step, loss=f"{loss:.4f}")
    return loss


def progress_bar(
    show: bool,
    total_steps: int,
    initial_step: int,
    grad_accum: int,
    desc: str = "sft",
    micro_batches: Callable[[int], int] | None = None,
):
    """A bar over micro-batches (``grad_accum`` per optimizer step), so it moves within a step:
    on a small machine one step of a few micro-batches takes minutes. ``micro_batches(n)``: those
    of the first ``n`` steps, where an epoch's last step takes fewer (:func:`nopad.training.sft_data.windows`)."""
    if not show:
        return None
    from tqdm.auto import tqdm

    count = micro_batches or (lambda steps: steps * grad_accum)
    return tqdm(total=count(total_steps), initial=count(initial_step), desc=desc, unit="micro-batch")


def write_result(accelerator, output_dir: Path, result: dict, title: str = "nopad SFT") -> None:
    """``result_rank*.json`` (this run), ``results_rank*.jsonl`` (every run), the curves; then the
    trackers are closed."""
    output_dir.mkdir(parents=True, exist_ok=True)
    (output_dir / f"result_rank{accelerator.process_index}.json").write_text(json.dumps(result))
    with open(output_dir / f"results_rank{accelerator.process_index}.jsonl", "a") as f:
        f.write(json.dumps(result) + "\n")  # every run's result, so a resumed run loses none
    if accelerator.is_main_process:
        write_curves(output_dir / "metrics.jsonl", ["loss"], title)
    finish_trackers(accelerator)
