"""Exactly one optimizer step over a window of packed rows, whatever runs the model: a single
process, DDP, DeepSpeed ZeRO-1/2/3 (through Accelerate) or FSDP2 (through Accelerate, or
``fully_shard`` directly under ``torch.distributed``).

The pitfalls this module exists for, all silent otherwise: under DeepSpeed, Accelerate's
``backward`` also calls ``engine.step()``, so one backward per row outside ``accumulate`` is one
optimizer step per row; ``torch.nn.utils.clip_grad_norm_`` sees ``grad=None`` on ZeRO-partitioned
parameters and clips nothing (DeepSpeed clips inside its step, from its config); and under
ZeRO-3 / FSDP2 every forward and backward is a collective, so every rank must run the same number
of rows (:func:`pad_rows`).

Each row's loss is given already normalised by the *global* count (e.g. loss tokens summed over
all rows of all ranks); :meth:`RowAccumulator.backward` undoes the engine's own divisions (rank
averaging, DeepSpeed's 1/gradient_accumulation_steps, Accelerate's 1/num_steps) so the summed
gradient is exactly the gradient of that global loss.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)


def world_size(accelerator=None) -> int:
    if accelerator is not None:
        return accelerator.num_processes
    return dist.get_world_size() if dist.is_available() and dist.is_initialized() else 1


def global_sum(value: float, accelerator=None, op: str = "sum") -> float:
    """``value`` summed (or maxed) over all ranks; the value itself in one process."""
    if world_size(accelerator) == 1:
        return float(value)
    device = accelerator.device if accelerator is not None else _collective_device()
    t = torch.tensor([float(value)], device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM if op == "sum" else dist.ReduceOp.MAX)
    return float(t.item())


def _collective_device() -> torch.device:
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def check_engine_engaged(accelerator) -> None:
    """Fail when ``accelerate launch`` asked for DeepSpeed or FSDP but Accelerate runs something
    else: on CPU it silently drops FSDP (and DeepSpeed with ``cpu=True``)."""
    import os

    engaged = accelerator.distributed_type.name
    for env, wanted in (("ACCELERATE_USE_DEEPSPEED", "DEEPSPEED"), ("ACCELERATE_USE_FSDP", "FSDP")):
        if os.environ.get(env, "false").lower() == "true" and engaged != wanted:
            raise RuntimeError(f"{env}=true but Accelerate runs {engaged}: {wanted} did not engage "
                               "(on CPU Accelerate cannot run FSDP; use torch.distributed.fsdp.fully_shard "
                               "under torchrun, and DS_ACCELERATOR=cpu for DeepSpeed)")


def set_deepspeed_clipping(accelerator, max_grad_norm: float | None) -> None:
    """DeepSpeed clips inside its own step, from its config; Accelerate fills a ``"auto"``
    gradient_clipping with 1.0 whatever the recipe asked. Set it to ``max_grad_norm`` (0 = off)
    before ``prepare``; an explicit different value is left for :class:`RowAccumulator` to reject."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None and plugin.deepspeed_config.get("gradient_clipping", "auto") == "auto":
        plugin.deepspeed_config["gradient_clipping"] = float(max_grad_norm or 0.0)


def pad_rows(rows: list[dict], empty_row, accelerator=None) -> list[dict]:
    """Append ``empty_row()`` rows (zero-weight, tiny) until every rank has as many rows as the
    busiest one, and at least one: under ZeRO-3 / FSDP2 a rank that skips a forward leaves the
    others waiting in its all-gathers forever. Works when this rank has no rows at all."""
    if world_size(accelerator) == 1:
        return rows
    target = max(int(global_sum(len(rows), accelerator, op="max")), 1)
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


class RowAccumulator:
    """Accumulate gradients over ``num_rows`` rows, then take exactly one optimizer step.

        acc = RowAccumulator(model, optimizer, accelerator)
        acc.begin(len(rows))
        for row in rows:
            with acc.row():
                acc.backward(loss_of(row))      # forward inside the block too (DDP no_sync)
        grad_norm = acc.step(max_grad_norm)
    """

    def __init__(self, model, optimizer, accelerator=None):
        from inference.sharded import fsdp2_modules, zero3_engine

        self.model, self.optimizer, self.accelerator = model, optimizer, accelerator
        self.world = world_size(accelerator)
        self.engine = None  # a DeepSpeedEngine (any ZeRO stage) when Accelerate runs DeepSpeed
        if accelerator is not None and accelerator.distributed_type.name == "DEEPSPEED":
            self.engine = model
        self.fsdp2 = accelerator is None and bool(fsdp2_modules(model))
        if accelerator is None and self.world > 1 and not self.fsdp2 and not isinstance(
                model, torch.nn.parallel.DistributedDataParallel):
            raise ValueError("a multi-process run without an Accelerator needs a model wrapped in "
                             "DistributedDataParallel or fully_shard (FSDP2); the gradients would "
                             "not be reduced otherwise")
        self._zero3 = zero3_engine(model) is not None
        self.optimizer_steps = 0  # counted by a hook on the real torch optimizer
        self._hook = _torch_optimizer(optimizer).register_step_post_hook(self._count)
        self.num_rows = self._done = 0
        self._saved_num_steps = None

    def _count(self, *_):
        self.optimizer_steps += 1

    def begin(self, num_rows: int) -> None:
        if num_rows < 1:
            raise ValueError("an optimizer step needs at least one row (pad with pad_rows)")
        self.num_rows, self._done = num_rows, 0
        self._steps_before = self.optimizer_steps
        if self.accelerator is not None:  # one accumulation window of exactly num_rows
            self._saved_num_steps = self.accelerator.gradient_accumulation_steps
            self.accelerator.gradient_accumulation_steps = num_rows
            self.accelerator.step = 0

    @contextlib.contextmanager
    def row(self) -> Iterator[None]:
        """One row's forward and backward: gradient sync only on the window's last row."""
        last = self._done == self.num_rows - 1
        if self.accelerator is not None:
            with self.accelerator.accumulate(self.model):
                if self.accelerator.sync_gradients != last:
                    raise RuntimeError(f"internal: Accelerate would sync after row {self._done + 1} of "
                                       f"{self.num_rows}")
                yield
        elif self.fsdp2:
            self.model.set_requires_gradient_sync(last)
            yield
        elif isinstance(self.model, torch.nn.parallel.DistributedDataParallel) and not last:
            with self.model.no_sync():
                yield
        else:
            yield
        self._done += 1

    def backward(self, loss: torch.Tensor) -> None:
        """Backward of a globally normalised loss; the engines' own averaging is undone."""
        scale = self.world  # DDP, DeepSpeed and FSDP2 all average the gradient over ranks
        if self.engine is not None:
            scale *= self.engine.gradient_accumulation_steps()  # DeepSpeed divides by its config's
        elif self.accelerator is not None:
            scale *= self.accelerator.gradient_accumulation_steps  # Accelerate divides by num_steps
        loss = loss * scale if scale != 1 else loss
        if self.accelerator is not None:
            self.accelerator.backward(loss)  # under DeepSpeed: engine.step() at the boundary only
        else:
            loss.backward()

    def step(self, max_grad_norm: float | None) -> float:
        """Clip (on sharded gradients too) and step once; returns the pre-clip gradient norm."""
        if self._done != self.num_rows:
            raise RuntimeError(f"step() after {self._done} of {self.num_rows} rows")
        limit = float(max_grad_norm) if max_grad_norm else float("inf")
        if self.engine is not None:
            # DeepSpeed already clipped and stepped inside the last backward, with its config's
            # gradient_clipping: it must be the one asked for, or clipping would silently differ
            configured = float(self.engine.gradient_clipping() or 0.0)
            if configured != (limit if max_grad_norm else 0.0):
                raise ValueError(f"DeepSpeed's gradient_clipping is {configured} but train.max_grad_norm="
                                 f"{max_grad_norm}; set \"gradient_clipping\": \"auto\" in the DeepSpeed "
                                 "config (the recipe fills it in) or make them equal")
            norm = self.accelerator.clip_grad_norm_(self.model.parameters(), limit)
        elif self.accelerator is not None:
            norm = self.accelerator.clip_grad_norm_(self.model.parameters(), limit)
        else:
            norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), limit)
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        if self.accelerator is not None:  # hand the caller's accelerator back as it was
            self.accelerator.gradient_accumulation_steps = self._saved_num_steps
        taken = self.optimizer_steps - self._steps_before
        if taken > 1:
            raise RuntimeError(f"{taken} optimizer steps in one accumulation window of {self.num_rows} rows")
        if taken == 0:
            logger.warning("the optimizer step was skipped (DeepSpeed loss-scale overflow?)")
        return _as_float(norm)


    def close(self) -> None:
        """Stop counting (remove the optimizer hook)."""
        self._hook.remove()


def _as_float(norm) -> float:
    if norm is None:
        return float("nan")
    if hasattr(norm, "full_tensor"):  # a DTensor norm from FSDP2's sharded gradients
        norm = norm.full_tensor()
    return float(norm)
