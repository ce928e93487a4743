"""The boundary probe: whether a model keeps a packed row's sequences apart, judged by what it does.

The structural scan (:mod:`nopad.packing.mixers.support`) knows token mixers by what they are
(``Conv1d``, RNN modules, ``A_log``, sinks, declared layer kinds). A mixer written with plain
tensor ops - a running mean (``cumsum`` over time) inside an MLP, a decoder layer subclass that adds
a prefix sum - shows none of that, and ran packed rows, tree rows and the generator 0.4-1.0 off each
sequence alone, with no error. So once the scan passes, the model runs one short row of two
sequences through nopad's attention, twice, with only the first sequence changed: a change in the
second sequence's hidden states means something crosses the boundary, and the model is refused,
naming the first layer where it appears. The scan keeps its messages; the probe has the last word.

Once per model (the verdict is cached; every context shares it), in eval mode, without autograd or
autocast, on fixed token ids, consuming no random numbers: seeded runs stay bitwise as before, and
every rank of a sharded model (ZeRO-3, FSDP2) runs the same forward at the same point, so its
collectives stay matched. Registered with :mod:`nopad.packing.mixers.support` on import (``nopad.packing.hf``
imports it), since it needs nopad's attention, which ``nopad.packing.mixers`` cannot import.
"""

from __future__ import annotations

import logging
import time
import weakref
from dataclasses import dataclass

import torch
from torch import nn

from nopad.packing.hf.attention import register_nopad_attention
from nopad.packing.mixers import support
from nopad.packing.mixers.support import NOPAD_ATTENTION, PACKED, UnsupportedMixerError, decoder_layers
from nopad.packing.varlen import VarlenMeta

logger = logging.getLogger(__name__)

PROBE_LENGTHS = (6, 6)  # the first sequence (changed in the second run) and the second (compared)
# largest change of the second sequence's hidden states, relative to their scale, still read as
# rounding: far above fp noise (a recurrence scanned in chunks across the boundary cancels to ~1e-7 in
# fp32, a bf16 ulp is 4e-3), far below a real crossing (a running mean moves them by 0.3-1)
TOLERANCE = {torch.float64: 1e-4, torch.float32: 1e-4}
LOW_PRECISION_TOLERANCE = 5e-2


@dataclass(frozen=True)
class Crossing:
    """Where the probe saw the first sequence reach into the second."""

    layer: int | None  # decoder layer index (None: after the decoder layers, the model's output)
    path: str  # that layer's path, e.g. "model.layers.0"
    cls: str  # its class name
    seen_in: str  # the first module (in call order) whose output changed, e.g. "model.layers.0.mlp"
    seen_cls: str
    change: float  # max |change| of the second sequence there, relative to its max |value|


@dataclass(frozen=True)
class ProbeResult:
    """One probe's outcome: a crossing (refused) or none (passed), and what it cost."""

    crossing: Crossing | None
    ms: float
    skipped: str = ""  # why no verdict was reached (the probe's forward raised): passes, logged


_VERDICTS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> ProbeResult


def _first_tensor(output) -> torch.Tensor | None:
    if isinstance(output, torch.Tensor):
        return output
    if isinstance(output, (tuple, list)):
        return next((o for o in output if isinstance(o, torch.Tensor)), None)
    for name in ("logits", "last_hidden_state"):
        if isinstance(getattr(output, name, None), torch.Tensor):
            return getattr(output, name)
    return None


def _second_sequence(output, total: int, start: int) -> torch.Tensor | None:
    """The second sequence's rows of a module output laid ``(1, T, ...)`` or ``(T, ...)`` (None:
    another layout, not compared)."""
    t = _first_tensor(output)
    if t is None or not t.is_floating_point():
        return None
    if t.dim() >= 3 and t.shape[0] == 1 and t.shape[1] == total:
        return t[0, start:].detach().float()
    if t.dim() >= 2 and t.shape[0] == total:
        return t[start:].detach().float()
    return None


def _probe_ids(vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of fixed ids inside the vocabulary, equal only in the second sequence."""
    first, second = PROBE_LENGTHS
    k = torch.arange(max(first, second))
    a, changed, b = (3 + 7 * k) % vocab, (5 + 11 * k) % vocab, (4 + 13 * k) % vocab
    rows = (torch.cat([a[:first], b[:second]]), torch.cat([changed[:first], b[:second]]))
    return rows[0].to(device), rows[1].to(device)


def _input_device_and_vocab(model: nn.Module) -> tuple[torch.device, int]:
    try:
        embeddings = model.get_input_embeddings()
    except (AttributeError, NotImplementedError):
        embeddings = None
    weight = getattr(embeddings, "weight", None)
    device = weight.device if weight is not None else next(model.parameters()).device
    vocab = getattr(embeddings, "num_embeddings", None) or getattr(model.config, "vocab_size", None)
    if not vocab:
        raise ValueError("no vocabulary size to pick token ids from")
    return device, int(vocab)


def _recording_hooks(model: nn.Module, record: list) -> list:
    """Forward hooks on every decoder layer, each of its direct children and the model itself,
    appending ``(path, module, output)`` in call order."""
    path, layers = decoder_layers(model)
    watched = [("", model)]
    if layers is not None:
        for i, layer in enumerate(layers):
            prefix = f"{path}.{i}" if path else str(i)
            watched += [(prefix, layer)] + [(f"{prefix}.{n}", c) for n, c in layer.named_children()]

    def hook_for(name):
        return lambda module, args, output: record.append((name, module, output))

    return [m.register_forward_hook(hook_for(name)) for name, m in watched]


def _changed(a: torch.Tensor, b: torch.Tensor, dtype: torch.dtype) -> float:
    scale = float(a.abs().max()) if a.numel() else 0.0
    change = float((a - b).abs().max()) if a.numel() else 0.0
    tolerance = TOLERANCE.get(dtype, LOW_PRECISION_TOLERANCE)
    return change / max(scale, 1e-6) if change > tolerance * max(scale, 1e-6) else 0.0


def _crossing(model: nn.Module, runs: list[list]) -> Crossing | None:
    """The first recorded output (in call order) where the second sequence differs between runs."""
    path, layers = decoder_layers(model)
    index = {id(layer): i for i, layer in enumerate(layers)} if layers is not None else {}
    start, total = PROBE_LENGTHS[0], sum(PROBE_LENGTHS)
    for (name, module, out), (_, _, other) in zip(*runs):
        a, b = _second_sequence(out, total, start), _second_sequence(other, total, start)
        if a is None or b is None or a.shape != b.shape:
            continue
        change = _changed(a, b, _first_tensor(out).dtype)
        if not change:
            continue
        layer_path = name if id(module) in index else name.rpartition(".")[0] if name else ""
        layer = model.get_submodule(layer_path) if layer_path else model
        return Crossing(
            index.get(id(layer)),
            layer_path,
            type(layer).__name__,
            name or type(model).__name__,
            type(module).__name__,
            change,
        )
    return None


def _run(model: nn.Module) -> Crossing | None:
    device, vocab = _input_device_and_vocab(model)
    if device.type == "meta":
        raise ValueError("the model's weights are on the meta device")
    meta = VarlenMeta.from_lengths(PROBE_LENGTHS, device=device)
    runs = []
    for ids in _probe_ids(vocab, device):
        record: list = []
        hooks = _recording_hooks(model, record)
        try:
            model(input_ids=ids[None], position_ids=meta.position_ids[None], nopad_meta=meta, use_cache=False)
        finally:
            for hook in hooks:
                hook.remove()
        runs.append(record)
    return _crossing(model, runs)


def probe(model: nn.Module) -> ProbeResult:
    """Run the probe on ``model`` (uncached; :func:`check_boundaries` caches): nopad's attention,
    eval mode, no autograd, no autocast, the global RNG untouched; the model is left as it was."""
    start = time.perf_counter()
    config = getattr(model, "config", None)
    if config is None:
        return ProbeResult(None, 0.0, "no config: not a transformers model, no attention to switch")
    modes = [(m, m.training) for m in model.modules()]
    previous = config._attn_implementation
    support.PROBING.add(id(model))
    try:
        if previous != NOPAD_ATTENTION:
            register_nopad_attention()
            model.set_attn_implementation(NOPAD_ATTENTION)
        model.eval()
        device, _ = _input_device_and_vocab(model)
        cuda = [device] if device.type == "cuda" else []
        with torch.no_grad(), torch.random.fork_rng(devices=cuda), torch.autocast(device.type, enabled=False):
            result = ProbeResult(torch.compiler.disable(_run)(model), 0.0)  # eager inside a trace too
    except Exception as error:  # noqa: BLE001  the model's own forward refuses it with its own words
        result = ProbeResult(None, 0.0, f"{type(error).__name__}: {error}")
    finally:
        support.PROBING.discard(id(model))
        for module, training in modes:
            module.training = training
        if config._attn_implementation != previous:
            model.set_attn_implementation(previous)
    ms = (time.perf_counter() - start) * 1e3
    return ProbeResult(result.crossing, ms, result.skipped)


def _sharded(model: nn.Module) -> bool:
    """ZeRO-3 (``ds_id``) or FSDP2 (DTensor) parameters: a forward nested in the model's own
    forward would gather and free them under it."""
    from torch.distributed.tensor import DTensor

    return any(hasattr(p, "ds_id") or isinstance(p, DTensor) for p in model.parameters())


def refusal(model: nn.Module, context: str, crossing: Crossing) -> str:
    """The refusal for ``context``, in the words of the structural scan's."""
    at = (
        f"layer {crossing.layer} ({crossing.path}: {crossing.cls})"
        if crossing.layer is not None
        else f"the model's output ({crossing.cls})"
    )
    return (
        f"nopad cannot run {type(model).__name__} on {support._WHERE[context]} exactly: it would give a "
        f"different answer with no error. A boundary probe (one row of two short sequences, run again with "
        f"the first one changed) changed the second sequence's hidden states at {at}, first in the output of "
        f"{crossing.seen_in} ({crossing.seen_cls}), by {crossing.change:.1e} of their scale: something there "
        f"mixes tokens across the sequences of a row with plain tensor ops (a cumsum or running mean over "
        f"time, a prefix sum, a pooling over the row) that nopad's scan of the layers cannot see.\n"
        f"Keep this model unpacked (attn_implementation='sdpa' with one sequence per row or padded batches, "
        f"and HF generate), or make that mixing restart at each sequence (nopad_meta holds the row's "
        f"boundaries); docs/models.md says how nopad supports a mixer."
    )


def check_boundaries(model: nn.Module, context: str, inside_forward: bool = False) -> bool:
    """Raise :class:`UnsupportedMixerError` if the probe sees ``model`` cross a row's boundaries
    (probed once per model). False: no verdict yet (a sharded model inside its own forward, probed
    at the next entry point instead), so the caller must not cache a pass."""
    result = _VERDICTS.get(model)
    if result is None:
        if inside_forward and _sharded(model):
            logger.info("boundary probe of %s deferred: sharded parameters, inside its forward", type(model).__name__)
            return False
        if context != PACKED and support.unsupported(model, PACKED):
            return True  # mixers served in this context only: a packed row cannot judge them
        result = _VERDICTS[model] = probe(model)
        if result.skipped:
            logger.warning(
                "boundary probe of %s could not run (%s): judged by its layers' structure only",
                type(model).__name__,
                result.skipped,
            )
        else:
            logger.info(
                "boundary probe of %s: %s in %.1f ms",
                type(model).__name__,
                "crossing" if result.crossing else "passed",
                result.ms,
            )
    if result.crossing is not None:
        raise UnsupportedMixerError(refusal(model, context, result.crossing))
    return True


support.BOUNDARY_PROBE[:] = [check_boundaries]
