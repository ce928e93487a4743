"""Rollouts on sharded models (DeepSpeed ZeRO-3, FSDP2) without deadlock.

Under ZeRO-3 and FSDP2 every forward all-gathers each layer's weights from all ranks, so every
rank must run the same number of forwards. RL ranks generate different prompts that stop at
different lengths, so a plain generation loop hangs (one rank waits in an all-gather the other
never joins). Two regimes, same tokens:

- ``"gather"`` (:func:`gathered_weights`): gather the full weights once for the whole rollout and
  detach the sharding hooks, so the generator's forwards are local and ranks step independently.
  One all-gather per rollout: fast, but each rank holds a full copy of the weights while it
  generates (what TRL's ``unwrap_model_for_generation`` does). Use it when the full model fits
  next to the KV cache.
- ``"lockstep"`` (:func:`generate_lockstep`): keep the weights sharded; each step every rank
  all-reduces "has work" and a rank with nothing left runs a one-token dummy forward, so all
  ranks join the same all-gathers until the last one is done (transformers' ``synced_gpus``).
  Only one layer is gathered at a time: memory-lean, but every decode step pays the all-gathers.
  Use it when the full weights do not fit on one device.

Either way the gathered weights are released before the training backward: the gathered copy
at the end of the ``with`` block, the per-layer copies after each forward.
"""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator, Sequence

import torch

from nopad.packing.distributed import any_rank, fsdp2_modules, world_size, zero3_engine

logger = logging.getLogger(__name__)

ROLLOUT_MODES = ("gather", "lockstep")


# ----------------------------------------------------------------------------- what is sharded
def sharding(model) -> str | None:
    """``"zero3"``, ``"fsdp2"`` or None (replicated weights: no collectives in a forward)."""
    if zero3_engine(model) is not None:
        return "zero3"
    module = getattr(model, "module", model)
    if isinstance(module, torch.nn.Module) and fsdp2_modules(module):
        return "fsdp2"
    return None


def sharded_weights(model: torch.nn.Module) -> str | None:
    """``"zero3"`` / ``"fsdp2"`` when ``model``'s parameters are sharded right now (partitioned
    ZeRO-3 parameters, FSDP2 DTensors), else None; inside :func:`gathered_weights` they are not.
    Reads the parameters themselves, so it works on the unwrapped module a user hands around."""
    from torch.distributed.tensor import DTensor

    for param in model.parameters():
        status = getattr(param, "ds_status", None)
        if status is not None and getattr(status, "name", "") == "NOT_AVAILABLE":
            return "zero3"
        if isinstance(param, DTensor):
            return "fsdp2"
    return None


def refuse_plain_generation(model: torch.nn.Module) -> None:
    """Raise instead of hanging: a plain generation loop on sharded weights with several ranks
    waits forever in an all-gather once one rank finishes first."""
    kind = sharded_weights(model)
    if kind is None or world_size() < 2:
        return
    raise RuntimeError(
        f"the model's weights are sharded ({kind}) over {world_size()} ranks, so a plain "
        "Generator.generate would hang as soon as one rank finishes before another. Write instead: "
        "`outs = nopad.inference.sharded.sharded_generate(generator, engine, prompts, params)` (pass the "
        "DeepSpeed engine or the FSDP2 module; mode='gather' by default, 'lockstep' if the full weights "
        "do not fit). With TRL, keep GRPOConfig(ds3_gather_for_generation=True)."
    )


# ----------------------------------------------------------------------------- gather once
@contextlib.contextmanager
def gathered_weights(model) -> Iterator[None]:
    """Full weights on every rank for the duration of the block, with no per-forward collectives;
    sharded again (memory released) on exit. A no-op for unsharded models. Collective: every
    rank must enter it, with or without prompts."""
    kind = sharding(model)
    if kind == "zero3":
        with _zero3_gathered(model):
            yield
    elif kind == "fsdp2":
        with _fsdp2_gathered(getattr(model, "module", model)):
            yield
    else:
        yield


@contextlib.contextmanager
def _zero3_gathered(engine) -> Iterator[None]:
    import deepspeed

    offload = getattr(engine.optimizer, "parameter_offload", engine.optimizer)
    if offload is None or not hasattr(offload, "forward_hooks"):
        raise ValueError(
            "gather-once rollouts need a ZeRO-3 engine built with an optimizer (its hooks live "
            "there); use mode='lockstep' for an engine without one"
        )
    module = offload.module
    with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
        # with the hooks attached, each submodule's post-forward hook would re-partition the
        # gathered weights after the first forward; detach them for the rollout
        for param in module.parameters():
            param.ds_active_sub_modules.clear()
        for hook in offload.forward_hooks + offload.backward_hooks:
            hook.remove()
        offload.forward_hooks, offload.backward_hooks = [], []
        try:
            yield
        finally:
            coordinator = offload.get_param_coordinator()
            if not coordinator.is_invalid_trace():
                coordinator._invalidate_trace()  # the rollout's forwards are not the training trace
            offload._register_deepspeed_module(module)


@contextlib.contextmanager
def _fsdp2_gathered(model: torch.nn.Module) -> Iterator[None]:
    modules = fsdp2_modules(model)
    saved = []
    for m in modules:  # FSDP2 reshards after each forward unless told not to
        state = m._get_fsdp_state()
        saved.append(
            (
                state,
                state._auto_reshard_after_forward,
                [(g, g.post_forward_mesh_info) for g in state._fsdp_param_groups],
            )
        )
        m.set_reshard_after_forward(False, recurse=False)
    for m in modules:
        m.unshard()
    try:
        yield
    finally:
        for m in modules:
            m.reshard()
        for state, auto, groups in saved:
            state._auto_reshard_after_forward = auto
            for group, info in groups:
                group.post_forward_mesh_info = info


# ----------------------------------------------------------------------------- lockstep
@torch.no_grad()
def dummy_forward(model: torch.nn.Module) -> None:
    """One token through the whole model: joins the same per-layer collectives as a real step."""
    device = next(model.parameters()).device
    ids = torch.zeros(1, 1, dtype=torch.long, device=device)
    was_training = model.training
    model.eval()
    try:
        model(input_ids=ids, position_ids=torch.zeros_like(ids), use_cache=False, logits_to_keep=1)
    finally:
        model.train(was_training)


def agreed_requests(generator, prompts: Sequence, sampling_params=None, group=None) -> list:
    """Validate this rank's prompts and agree with the other ranks that all are valid before any
    rank starts a collective rollout: a rank that raised alone would leave the others waiting."""
    error = None
    try:
        requests = generator.make_requests(list(prompts), sampling_params) if prompts else []
    except (ValueError, RuntimeError) as err:
        error, requests = err, []
    if any_rank(error is not None, group):
        if error is not None:
            raise error
        raise RuntimeError("another rank's rollout prompts are invalid (see its error); no rank generates")
    return requests


def _drive(generator, requests: list, lockstep: bool, group=None) -> list:
    """Run ``requests`` to completion through :meth:`Generator.run`; in lockstep, one forward
    per round on every rank."""
    if not lockstep:
        return generator.run(requests)
    forwards = [0]
    handle = generator.model.register_forward_pre_hook(lambda *_: forwards.__setitem__(0, forwards[0] + 1))

    def one_round() -> list:
        before = forwards[0]
        outs = generator.step() if generator.has_unfinished() else []
        if forwards[0] == before:
            dummy_forward(generator.model)
        elif forwards[0] != before + 1:
            raise RuntimeError(
                f"a generator step ran {forwards[0] - before} forwards; lockstep needs exactly one per round"
            )
        return outs

    try:
        results = generator.run(requests, step=one_round, more=lambda: any_rank(generator.has_unfinished(), group))
    finally:
        handle.remove()
    logger.debug("lockstep rollout: %d forwards", forwards[0])
    return results


def generate_lockstep(generator, prompts: Sequence, sampling_params=None, group=None) -> list:
    """``generator.generate(prompts, sampling_params)`` that keeps all ranks stepping together:
    each round every rank all-reduces whether it still has work; a rank whose step ran no forward
    (nothing left, or nothing schedulable this round) runs :func:`dummy_forward`. Every rank calls
    this the same way, also with no prompts; returns outputs in prompt order."""
    return _drive(generator, agreed_requests(generator, prompts, sampling_params, group), True, group)


def sharded_generate(
    generator, model, prompts: Sequence, sampling_params=None, mode: str = "gather", use_tqdm: bool = False
) -> list:
    """Generate on ``model`` (the training engine/module the ``generator`` reads through) in the
    chosen regime; plain ``generator.generate`` when the weights are not sharded."""
    if mode not in ROLLOUT_MODES:
        raise ValueError(f"rollout mode must be one of {ROLLOUT_MODES}, got {mode!r}")
    if sharding(model) is None:
        return generator.generate(list(prompts), sampling_params, use_tqdm=use_tqdm) if prompts else []
    requests = agreed_requests(generator, prompts, sampling_params)
    if mode == "lockstep":
        return _drive(generator, requests, lockstep=True)
    with gathered_weights(model):
        return _drive(generator, requests, lockstep=False)
