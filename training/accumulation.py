"""Exactly one optimizer step over a window of packed rows, whatever runs the model: a single
process, DDP, DeepSpeed ZeRO-1/2/3 (through Accelerate) or FSDP2 (through Accelerate, or
``fully_shard`` directly under ``torch.distributed``).

The pitfalls this module exists for, all silent otherwise: under DeepSpeed, Accelerate's
``backward`` also calls ``engine.step()``, so one backward per row outside ``accumulate`` is one
optimizer step per row; ``torch.nn.utils.clip_grad_norm_`` sees ``grad=None`` on ZeRO-partitioned
parameters and clips nothing (DeepSpeed clips inside its step, from its config); and under
ZeRO-3 / FSDP2 every forward and backward is a collective, so every rank must run the same number
of rows (:func:`pad_rows`).

Each row's loss is given as a sum; the window divides it by the *global* count (e.g. loss tokens
summed over all rows of all ranks) and undoes the engine's own divisions (rank averaging,
DeepSpeed's 1/gradient_accumulation_steps, Accelerate's 1/num_steps), so the summed gradient is
exactly the gradient of that global mean. SFT and GRPO, in the recipes and in the TRL-free tests,
take their steps through :class:`OptimizerStepper`.

A step whose loss or gradient norm is NaN or infinite on any rank is not taken: every rank stops
together with a :class:`~nopad.training.nonfinite.NonFiniteError` naming the step and what went
non-finite (``nonfinite="stop"``, the default), or every rank drops the step's gradient with a
warning (``nonfinite="skip"``). Taking it would make every weight NaN, and a run saved them.
"""

from __future__ import annotations

import contextlib
import logging
import math
from collections.abc import Iterator, Mapping, Sequence

import torch

from nopad.packing.distributed import any_rank, fsdp2_modules, global_max, global_sum, world_size
from nopad.training.nonfinite import NONFINITE_POLICIES, NonFiniteError

logger = logging.getLogger(__name__)


def check_engine_engaged(accelerator) -> None:
    """Fail when ``accelerate launch`` asked for DeepSpeed or FSDP but Accelerate runs something
    else: on CPU it silently drops FSDP (and DeepSpeed with ``cpu=True``)."""
    import os

    engaged = accelerator.distributed_type.name
    for env, wanted in (("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED"), ("ACCELERATE_USE_FSDP", "FSDP")):
        if os.environ.get(env, "false").lower() == "true" and engaged != wanted:
            raise RuntimeError(
                f"{env}=true but Accelerate runs {engaged}: {wanted} did not engage "
                "(on CPU Accelerate cannot run FSDP; use torch.distributed.fsdp.fully_shard "
                "under torchrun, and DS_ACCELERATOR=cpu for DeepSpeed)"
            )


def set_deepspeed_clipping(accelerator, max_grad_norm: float | None) -> None:
    """DeepSpeed clips inside its own step, from its config; Accelerate fills a ``"auto"``
    gradient_clipping with 1.0 whatever the recipe asked. Set it to ``max_grad_norm`` (0 = off)
    before ``prepare``; an explicit different value is left for :class:`OptimizerStepper` to reject."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto":
        plugin.deepspeed_config["gradient_clipping"] = float(max_grad_norm or 0.0)


def pad_rows(rows: list[dict], empty_row) -> list[dict]:
    """Append ``empty_row()`` rows (zero-weight, tiny) until every rank has as many rows as the
    busiest one, and at least one: under ZeRO-3 / FSDP2 a rank that skips a forward leaves the
    others waiting in its all-gathers forever. Works when this rank has no rows at all."""
    if world_size() == 1:
        return rows
    target = max(int(global_max(len(rows))), 1)
    return rows + [empty_row() for _ in range(target - len(rows))]


def _torch_optimizer(optimizer) -> torch.optim.Optimizer:
    """The innermost ``torch.optim.Optimizer`` under Accelerate's / DeepSpeed's wrappers."""
    found, obj = None, optimizer
    while obj is not None:
        if isinstance(obj, torch.optim.Optimizer):
            found = obj
        obj = getattr(obj, "optimizer", None)
    if found is None:
        raise TypeError(f"no torch.optim.Optimizer inside {type(optimizer).__name__}")
    return found


class OptimizerStepper:
    """Exactly one globally normalised optimizer step per window of rows, on every rank.

        stepper = OptimizerStepper(model, optimizer, accelerator, max_grad_norm=1.0)
        with stepper.window(rows, step=3) as w: # every rank, with its own rows (pad_rows first)
            for row in rows:
                with w.row():                   # the forward inside too (DDP's no_sync)
                    w.backward(loss_sum(row))   # the row's summed, not yet normalised, loss
        w.grad_norm                             # the step's pre-clip gradient norm

    The window divides each row's loss by the global count (``count_key`` summed over all rows of
    all ranks) and undoes the engines' own divisions, so the accumulated gradient is the gradient
    of the window's mean loss. It changes the Accelerator (accumulation steps, step counter, sync
    flag) and an FSDP2 model's sync flag only inside the block, and restores them when the block
    ends, also by an exception (whose partial gradients are discarded).

    ``nonfinite``: what a window whose loss or gradient norm is NaN / infinite on any rank does:
    ``"stop"`` raises :class:`~nopad.training.nonfinite.NonFiniteError` on every rank before the step,
    ``"skip"`` drops its gradient with a warning (not under DeepSpeed, which steps inside the
    backward, before the window can look at the gradient).
    """

    def __init__(self, model, optimizer, accelerator=None, max_grad_norm: float | None = None, nonfinite: str = "stop"):
        self.model, self.optimizer, self.accelerator = model, optimizer, accelerator
        self.max_grad_norm = max_grad_norm
        if nonfinite not in NONFINITE_POLICIES:
            raise ValueError(f"nonfinite must be one of {NONFINITE_POLICIES}, got {nonfinite!r}")
        self.nonfinite = nonfinite
        self.world = world_size()  # Accelerate, DeepSpeed and FSDP2 all run on torch.distributed
        self.engine = None  # a DeepSpeedEngine (any ZeRO stage) when Accelerate runs DeepSpeed
        if accelerator is not None and accelerator.distributed_type.name == "DEEPSPEED":
            self.engine = model
        self.fsdp2 = accelerator is None and bool(fsdp2_modules(model))
        if (
            accelerator is None
            and self.world > 1
            and not self.fsdp2
            and not isinstance(model, torch.nn.parallel.DistributedDataParallel)
        ):
            raise ValueError(
                "a multi-process run without an Accelerator needs a model wrapped in "
                "DistributedDataParallel or fully_shard (FSDP2); the gradients would "
                "not be reduced otherwise"
            )
        if nonfinite == "skip" and self.engine is not None:
            raise ValueError(
                "train.nonfinite=skip cannot skip a step under DeepSpeed, which takes the "
                "optimizer step inside the last backward, before the loss and gradient can be "
                "checked; use train.nonfinite=stop"
            )
        # a loss scaler (fp16 mixed precision) skips overflowing gradients itself and lowers its scale:
        # only the loss says the run went wrong there
        self.loss_scaled = (accelerator is not None and getattr(accelerator, "scaler", None) is not None) or (
            self.engine is not None and bool(getattr(model, "fp16_enabled", lambda: False)())
        )
        self.torch_optimizer = _torch_optimizer(optimizer)
        self.optimizer_steps = 0  # counted by a hook on the real torch optimizer, inside windows
        self.skipped_steps = 0  # windows dropped by nonfinite="skip"
        self._step_depth = 0  # nested step() calls of the optimizer now running
        self._open: Window | None = None  # the window whose block is running (windows do not nest)

    @contextlib.contextmanager
    def window(
        self, rows: Sequence[Mapping], count_key: str = "num_loss_tokens", step: int | str | None = None
    ) -> Iterator[Window]:
        """One accumulation window over ``rows`` (this rank's), ending in one optimizer step;
        ``step`` names it in messages: the run's step number, or a label (``"grpo step 3"``)."""
        if not rows:
            raise ValueError("an optimizer step needs at least one row on every rank (pad with pad_rows)")
        if self._open is not None:
            raise RuntimeError(
                "stepper.window() inside another window of the same stepper: windows do not "
                "nest, each is one optimizer step over its rows. End the first window's "
                "`with` block before opening the next, or open one window with every row "
                "of the step"
            )
        count = global_sum(sum(int(r[count_key]) for r in rows))
        window = self._open = Window(self, len(rows), count, step)
        saved = self._accelerator_state()
        steps_before = self.optimizer_steps
        hooks = (
            self.torch_optimizer.register_step_pre_hook(self._enter_step),
            self.torch_optimizer.register_step_post_hook(self._count),
        )
        try:
            if self.accelerator is not None:  # one Accelerate accumulation window of exactly these rows
                self.accelerator.gradient_accumulation_steps = len(rows)
                self.accelerator.step = 0
            yield window
            if window.done != window.num_rows:
                raise RuntimeError(
                    f"the window ended after {window.done} of its {window.num_rows} rows: "
                    "run each row of stepper.window(rows) in its own `with w.row():` block, "
                    "or open the window with only the rows this step trains on"
                )
            window.grad_norm = self._clip_and_step(window)
        except BaseException:
            self._discard_gradients()
            raise
        finally:
            self._open = None
            for hook in hooks:
                hook.remove()
            self._restore(saved)
        taken = self.optimizer_steps - steps_before
        if taken > 1:
            raise RuntimeError(f"{taken} optimizer steps in one accumulation window of {len(rows)} rows")
        if taken == 0 and not window.skipped:
            logger.warning("the optimizer step was skipped (DeepSpeed loss-scale overflow?)")

    def _enter_step(self, *_):
        self._step_depth += 1

    def _count(self, *_):
        # torch wraps each class's ``step`` with the hooks, so an optimizer subclass whose ``step``
        # calls ``super().step()`` runs them twice: only the outermost call is a step
        self._step_depth -= 1
        if self._step_depth == 0:
            self.optimizer_steps += 1

    def _accelerator_state(self) -> tuple | None:
        a = self.accelerator
        return None if a is None else (a.gradient_accumulation_steps, a.step, a.gradient_state.sync_gradients)

    def _restore(self, saved: tuple | None) -> None:
        if saved is not None:
            a = self.accelerator
            a.gradient_accumulation_steps, a.step = saved[0], saved[1]
            a.gradient_state._set_sync_gradients(saved[2])
        if self.fsdp2:
            self.model.set_requires_gradient_sync(True)  # FSDP2's default

    def _discard_gradients(self) -> None:
        """A window that failed leaves no partial gradient for the next one."""
        if self.engine is not None:
            self.engine.zero_grad()
        else:
            self.model.zero_grad(set_to_none=True)

    def _clip_and_step(self, window: Window) -> float:
        """Clip (on sharded gradients too) and step once, unless the loss or the gradient norm is
        non-finite on some rank (:meth:`_check_finite`); the pre-clip gradient norm."""
        max_norm = self.max_grad_norm
        limit = float(max_norm) if max_norm else float("inf")
        if self.engine is not None:
            # DeepSpeed already clipped and stepped inside the last backward, with its config's
            # gradient_clipping: it must be the one asked for, or clipping would silently differ
            configured = float(self.engine.gradient_clipping() or 0.0)
            if configured != (limit if max_norm else 0.0):
                raise ValueError(
                    f"DeepSpeed's gradient_clipping is {configured} but train.max_grad_norm="
                    f'{max_norm}; set "gradient_clipping": "auto" in the DeepSpeed '
                    "config (the recipe fills it in) or make them equal"
                )
        if self.accelerator is not None:
            norm = self.accelerator.clip_grad_norm_(self.model.parameters(), limit)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit)
        norm = None if norm is None else _as_float(norm)  # None: DeepSpeed did not report it
        if self._check_finite(window, norm):
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        return float("nan") if norm is None else norm

    def _check_finite(self, window: Window, grad_norm: float | None) -> bool:
        """True when the step may be taken. Every rank joins one all-reduce, so all of them stop
        (or skip) together; a rank acting alone would leave the others waiting in a collective."""
        what = []
        if window.loss is not None and not bool(torch.isfinite(window.loss)):
            what.append(f"the loss is {float(window.loss)}")
        if grad_norm is not None and not self.loss_scaled and not math.isfinite(grad_norm):
            what.append(f"the gradient norm is {grad_norm}")
        if not any_rank(bool(what)):
            return True
        step = (
            window.step
            if isinstance(window.step, str)
            else ("an optimizer step" if window.step is None else f"step {window.step}")
        )
        found = " and ".join(what) if what else "the loss or the gradient norm is not finite on another rank"
        if self.nonfinite == "skip":
            self.skipped_steps += 1
            window.skipped = True
            logger.warning(
                "%s: %s; skipping the step (train.nonfinite=skip): the weights stay as they were", step, found
            )
            return False
        damaged = (
            " (DeepSpeed already took the step: the weights in memory are damaged)" if self.engine is not None else ""
        )
        raise NonFiniteError(
            f"{step}: {found}; stopped before this step changed the weights{damaged}, and nothing from this "
            "step on is saved. Usual causes: a learning rate too high (train.lr), float16 overflow (use "
            "model.dtype=bfloat16 or float32), a broken reward or data row. Set train.nonfinite=skip to skip "
            "such steps instead"
        )


class Window:
    """The rows of one optimizer step, as :meth:`OptimizerStepper.window` hands them out."""

    def __init__(self, stepper: OptimizerStepper, num_rows: int, count: float, step: int | str | None = None):
        self.stepper, self.num_rows, self.count, self.step = stepper, num_rows, count, step
        self.done = 0
        self.grad_norm = float("nan")  # set when the window's step is taken
        self.loss: torch.Tensor | None = None  # this rank's share of the step's loss, summed over its rows
        self.skipped = False  # nonfinite="skip" dropped this step
        self.in_row = False  # inside a row() block: where backward() belongs

    @contextlib.contextmanager
    def row(self) -> Iterator[None]:
        """One row's forward and backward: gradient sync only on the window's last row."""
        s = self.stepper
        if self.in_row:
            raise RuntimeError(
                "w.row() inside another w.row(): each row is one block, one after the other "
                "(`for row in rows: with w.row(): w.backward(loss_sum(row))`)"
            )
        if s._open is not self:
            raise RuntimeError(
                "w.row() after its window ended: rows belong inside the `with "
                "stepper.window(rows) as w:` block that opened w"
            )
        if self.done >= self.num_rows:
            raise RuntimeError(
                f"more rows than the {self.num_rows} this window was opened for: open it with "
                "every row this step trains on, stepper.window(rows), one `w.row()` per row"
            )
        self.in_row = True
        try:
            yield from self._synced_row(s)
        finally:
            self.in_row = False
        self.done += 1

    def _synced_row(self, s: OptimizerStepper) -> Iterator[None]:
        """The row's block under the engine's gradient-sync control: sync on the last row only."""
        last = self.done == self.num_rows - 1
        if s.accelerator is not None:
            with s.accelerator.accumulate(s.model):
                if s.accelerator.sync_gradients != last:
                    raise RuntimeError(f"internal: Accelerate would sync after row {self.done + 1} of {self.num_rows}")
                yield
        elif s.fsdp2:
            s.model.set_requires_gradient_sync(last)
            yield
        elif isinstance(s.model, torch.nn.parallel.DistributedDataParallel) and not last:
            with s.model.no_sync():
                yield
        else:
            yield

    def backward(self, loss_sum: torch.Tensor) -> torch.Tensor:
        """Backward of one row's summed loss over the window's global count; the engines' own
        averaging is undone. Returns the row's share of the step's loss (detached)."""
        s = self.stepper
        if not self.in_row:
            raise RuntimeError(
                "w.backward() outside `with w.row():`: a row's forward and backward go inside "
                "its own row block, which decides the gradient sync and counts the row; write "
                "`with w.row(): w.backward(loss_sum(row))`"
            )
        loss = loss_sum / max(self.count, 1.0)  # a window with no loss token anywhere: 0 gradient
        scale = s.world  # DDP, DeepSpeed and FSDP2 all average the gradient over ranks
        if s.engine is not None:
            scale *= s.engine.gradient_accumulation_steps()  # DeepSpeed divides by its config's
        elif s.accelerator is not None:
            scale *= s.accelerator.gradient_accumulation_steps  # Accelerate divides by num_steps
        scaled = loss * scale if scale != 1 else loss
        if s.accelerator is not None:
            s.accelerator.backward(scaled)  # under DeepSpeed: engine.step() at the boundary only
        else:
            scaled.backward()
        loss = loss.detach()
        self.loss = loss if self.loss is None else self.loss + loss
        return loss


def _as_float(norm) -> float:
    if norm is None:
        return float("nan")
    if hasattr(norm, "full_tensor"):  # a DTensor norm from FSDP2's sharded gradients
        norm = norm.full_tensor()
    return float(norm)
