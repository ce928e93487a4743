"""Which layers of a model nopad computes exactly, judged by what each layer is and does, and a
clear refusal for the rest.

A packed row, a prefix-tree row and a generator step are exact only if every layer keeps the
sequences of the row apart. nopad's attention does that for every layer that routes attention
through transformers' ``AttentionInterface``. A layer that mixes tokens any other way - a
recurrent state (Gated DeltaNet, Mamba, an RNN), a convolution over time (LFM2's short
convolution, the convolutions inside Mamba and Gated DeltaNet), attention sinks, or something
nopad cannot see at all - runs straight across the boundaries and gives a different answer with
no error. So before the first packed forward, tree row, ``verify`` or ``Generator``, the model is
scanned and every such layer must be handled by a registered :class:`MixerSupport` for that use
(``packed``, ``tree``, ``generate``), or the call is refused naming the layer class.

The scan decides by structure, not by model names, so next month's family is caught too:

- a ``Conv1d`` with a kernel longer than one token (a convolution over time);
- a recurrent module (``nn.RNNBase``) or a state-space decay parameter (``A_log``);
- an attention-sink parameter (``sinks``; gpt-oss passes it as ``s_aux``);
- a decoder layer the config declares as another kind than attention (``layer_types`` /
  ``layers_block_type``: ``linear_attention``, ``conv``, ``mamba``...);
- a decoder layer with no module that calls the attention interface, unless declared position-
  wise (``mlp``/``moe``);
- a model class transformers marks stateful (``_is_stateful``) where none of the above named the
  layer;
- positions nopad cannot set: a model whose forward takes no ``position_ids`` (it counts positions
  itself, so a packed row's later sequences would sit past their own), or a learned position table
  with a padding index (Roberta's convention: positions start past it, not at 0 as nopad's do).
  No support can lift these.
"""

from __future__ import annotations

import inspect
import logging
import weakref
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn

from nopad.packing.model_config import text_config

if TYPE_CHECKING:
    from nopad.packing.mixers.state import LayerState
logger = logging.getLogger(__name__)

# the attention implementation transformers knows nopad by (registered by nopad.packing.hf, which
# re-exports it; defined here, below nopad.packing.hf, so that the mixers can read it without a cycle)
NOPAD_ATTENTION = "nopad"
PACKED, TREE, GENERATE = "packed", "tree", "generate"
# a row packed by its position_ids alone (no nopad_meta): only the attention layers derive its
# boundaries; a mixer layer gets none and would run across them, so nothing supports this context
POSITIONS = "positions"
CONTEXTS = (PACKED, TREE, GENERATE)  # what nopad's entry points ask of a model
ALL_CONTEXTS = (*CONTEXTS, POSITIONS)
_WHERE = {
    PACKED: "packed rows",
    TREE: "prefix-tree rows",
    GENERATE: "the generator (paged steps)",
    POSITIONS: "rows packed by position_ids without nopad_meta",
}

# (not "chunked_attention": Llama4's chunk-local mask is built by transformers' mask functions,
# which nopad's attention replaces, so a sequence longer than a chunk would attend past its chunk)
ATTENTION_KINDS = frozenset({"attention", "full_attention", "sliding_attention"})
POSITIONWISE_KINDS = frozenset({"mlp", "moe", "ffn"})  # declared layers that mix no tokens
_DECAY_PARAMETERS = ("A_log",)
_SINK_PARAMETERS = ("sinks", "s_aux")
_ATTENTION_CALL_MARKERS = ("ALL_ATTENTION_FUNCTIONS", "AttentionInterface")


class UnsupportedMixerError(ValueError):
    """A model layer mixes tokens in a way nopad does not compute exactly for the requested use."""


@dataclass(frozen=True)
class MixerSupport:
    """A kind of token mixer nopad computes exactly: ``handles(module)`` says whether ``module``
    (a layer's mixer, e.g. a Gated DeltaNet module) is served, ``contexts`` for which uses;
    ``state(module, path)``, what a stateful one keeps per sequence in the generator (None: nothing).
    Registering one is how a new mixing kind becomes supported (one module, like a backend)."""

    name: str
    handles: Callable[[nn.Module], bool]
    contexts: frozenset[str] = field(default_factory=lambda: frozenset(CONTEXTS))
    # the layer kinds a config may declare (``layer_types``) that this support stands for: None,
    # any (a recurrent or convolution mixer is the layer, whatever the config calls it); empty,
    # none (attention sinks are a property of an attention layer: a layer declared as some other
    # kind of attention, e.g. a compressed one, that also has sinks is not served by them)
    layer_kinds: frozenset[str] | None = None
    state: Callable[[nn.Module, str], LayerState | None] | None = None


_SUPPORTS: list[MixerSupport] = []
_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # model -> contexts that passed
# attention module -> contexts its calling model passed (nopad.packing.mixers.calling_model)
MODULE_CHECKED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
# the boundary probe, which has the last word once the scan passes (nopad.packing.hf.boundary_probe registers
# it: it runs nopad's attention, which this package cannot import); ids of the models it is running
BOUNDARY_PROBE: list[Callable[[nn.Module, str, bool], bool]] = []
PROBING: set[int] = set()


def register_mixer_support(support: MixerSupport) -> None:
    """Declare a mixer kind nopad handles (idempotent by name); clears the cached scans."""
    unknown = set(support.contexts) - set(ALL_CONTEXTS)
    if unknown:
        raise ValueError(f"MixerSupport {support.name!r}: unknown contexts {sorted(unknown)}; use {ALL_CONTEXTS}")
    unregister_mixer_support(support.name)
    _SUPPORTS.append(support)


def unregister_mixer_support(name: str) -> None:
    """Withdraw a registered support (tests; a backend found broken at run time)."""
    _SUPPORTS[:] = [s for s in _SUPPORTS if s.name != name]
    _CHECKED.clear()
    MODULE_CHECKED.clear()


@dataclass(frozen=True)
class Finding:
    """One reason a layer is not known to keep a row's sequences apart."""

    layer: int | None  # decoder layer index (None: outside the decoder layers)
    path: str  # the mixer module's path in the model, e.g. "model.layers.0.linear_attn"
    cls: str  # its class name
    what: str  # what it does, e.g. "a convolution over time (conv1d: Conv1d, kernel 4)"
    module: nn.Module | None = field(default=None, compare=False, repr=False)
    declared: str | None = None  # the layer kind the config declares, for a finding made from it


_FORWARD_SOURCES: dict[type, str] = {}


def _forward_source(cls: type) -> str:
    """``cls.forward``'s source, read once per class ("" where there is none to read)."""
    if cls not in _FORWARD_SOURCES:
        try:
            _FORWARD_SOURCES[cls] = inspect.getsource(cls.forward)
        except (OSError, TypeError):
            _FORWARD_SOURCES[cls] = ""
    return _FORWARD_SOURCES[cls]


def calls_attention(module: nn.Module) -> bool:
    """Whether the module's forward routes attention through transformers' interface (where
    ``"nopad"`` gets called)."""
    source = _forward_source(type(module))
    return any(marker in source for marker in _ATTENTION_CALL_MARKERS)


def _counts_positions(module: nn.Module) -> bool:
    """An attention module that builds positions of its own from the row's length
    (``torch.arange`` in its forward: Llama4's attention temperature on its NoPE layers, others'
    cache positions): in a packed row those run on from the row's start, not from each sequence's."""
    return calls_attention(module) and "torch.arange(" in _forward_source(type(module))


def _own_parameter_names(module: nn.Module) -> set[str]:
    return {name for name, _ in module.named_parameters(recurse=False)}


def _what(module: nn.Module, name: str) -> str | None:
    """What token mixing ``module`` itself does besides attention (None: nothing found)."""
    if isinstance(module, nn.Conv1d) and module.kernel_size[0] > 1:
        kernel = module.kernel_size[0]
        return f"a convolution over time ({name or 'conv'}: {type(module).__name__}, kernel {kernel})"
    if isinstance(module, nn.RNNBase):
        return f"a recurrent state ({type(module).__name__})"
    decay = sorted(_own_parameter_names(module) & set(_DECAY_PARAMETERS))
    if decay:
        return f"a recurrent state (state-space decay parameter {decay[0]})"
    return _sinks(module)


def _sinks(module: nn.Module) -> str | None:
    sinks = sorted(_own_parameter_names(module) & set(_SINK_PARAMETERS))
    return f"attention sinks (parameter {sinks[0]})" if sinks else None


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList] | tuple[None, None]:
    """The text decoder's layer list and its path: the ``ModuleList`` with one entry per
    ``num_hidden_layers`` (the first found, so a vision tower's blocks are not taken for it)."""
    config = getattr(model, "config", None)
    text = text_config(config)
    count = getattr(text, "num_hidden_layers", None)
    for path, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and count is not None and len(module) == count:
            return path, module
    return None, None


def declared_kinds(model: nn.Module) -> list[str] | None:
    """The config's own per-layer kinds (``layer_types`` or ``layers_block_type``), if any."""
    config = getattr(model, "config", None)
    text = text_config(config)
    for key in ("layer_types", "layers_block_type"):
        kinds = getattr(text, key, None)
        if isinstance(kinds, (list, tuple)) and kinds and all(isinstance(k, str) for k in kinds):
            return [k.lower() for k in kinds]
    return None


def _mixer_of(layer_path: str, path: str) -> str:
    """The layer's direct child that contains ``path`` (the layer's mixer, e.g. ``linear_attn``)."""
    rest = path[len(layer_path) + 1 :] if layer_path and path.startswith(layer_path + ".") else path
    head = rest.split(".", 1)[0]
    return f"{layer_path}.{head}" if layer_path and head else path


def _position_findings(model: nn.Module) -> list[Finding]:
    """Where the model's positions are not the row's ``position_ids`` counted from 0 per sequence
    (module None: a support for a mixer does not make positions right)."""
    from transformers import PreTrainedModel

    top = next((m for m in model.modules() if isinstance(m, PreTrainedModel)), None)
    findings = []
    if top is not None and "position_ids" not in inspect.signature(type(top).forward).parameters:
        findings.append(
            Finding(
                None,
                "",
                type(top).__name__,
                "positions counted by the model itself (its "
                "forward takes no position_ids): each packed sequence would start where the "
                "last one ended",
            )
        )
    for path, module in model.named_modules():
        if _counts_positions(module):
            what = "positions of its own (torch.arange in its forward), counted from the row's start"
            findings.append(Finding(None, path, type(module).__name__, what + ", not each sequence's"))
        if (
            isinstance(module, nn.Embedding)
            and "position" in path.rsplit(".", 1)[-1]
            and module.padding_idx is not None
        ):
            what = f"a learned position table with a padding index ({module.padding_idx})"
            what += ": its positions start past it, not at 0"
            findings.append(Finding(None, path, type(module).__name__, what))
    return findings


def scan(model: nn.Module) -> list[Finding]:
    """Every place in ``model`` where tokens are mixed other than through the attention
    interface (see the module docstring). Uncached: :func:`check_model` caches per model."""
    modules = dict(model.named_modules())
    layers_path, layers = decoder_layers(model)
    kinds = declared_kinds(model)
    findings: list[Finding] = []
    named: set[int | None] = set()  # layers whose mixer was named by what it holds
    layer_of = {}
    if layers is not None:
        for i, layer in enumerate(layers):
            prefix = f"{layers_path}.{i}" if layers_path else str(i)
            for sub_path, _ in layer.named_modules():
                layer_of[f"{prefix}.{sub_path}" if sub_path else prefix] = (i, prefix)
    for path, module in modules.items():
        what = _what(module, path.rsplit(".", 1)[-1])
        if what is None:
            continue
        index, prefix = layer_of.get(path, (None, ""))
        mixer_path = _mixer_of(prefix, path) if prefix else path
        mixer = modules.get(mixer_path, module)
        findings.append(Finding(index, mixer_path, type(mixer).__name__, what, mixer))
        if what != _sinks(module):  # sinks name no mixer: they sit on an attention module, which
            named.add(index)  # may still be a kind of attention nopad does not know
    if layers is not None:
        for i, layer in enumerate(layers):
            prefix = f"{layers_path}.{i}" if layers_path else str(i)
            kind = kinds[i] if kinds is not None and i < len(kinds) else None
            if i in named:
                continue
            if kind is not None and kind not in ATTENTION_KINDS | POSITIONWISE_KINDS:
                what = f"declared as {kind!r} by the config"
                findings.append(Finding(i, prefix, type(layer).__name__, what, layer, declared=kind))
            elif kind not in POSITIONWISE_KINDS and not any(calls_attention(m) for m in layer.modules()):
                children = ", ".join(f"{n}: {type(c).__name__}" for n, c in layer.named_children())
                what = f"no module that calls the attention interface (mixing nopad cannot see; {children})"
                findings.append(Finding(i, prefix, type(layer).__name__, what, layer))
    findings += _position_findings(model)
    if not findings and getattr(type(model), "_is_stateful", False):
        findings.append(
            Finding(
                None,
                "",
                type(model).__name__,
                "a model transformers marks stateful (_is_stateful: it carries a recurrent state between tokens)",
                model,
            )
        )
    return findings


def registered_supports() -> tuple[MixerSupport, ...]:  # in registration order
    return tuple(_SUPPORTS)


def _handled(finding: Finding, context: str, model: nn.Module) -> bool:
    """A finding is handled when a registered support serves its mixer (the layer's child that
    holds it: the Conv1d inside a supported Gated DeltaNet), or, for a layer the config declares
    (``linear_attention``), a module of that layer. Not another mixer of the same layer: Qwen4-Exp's
    n-gram block (a dilated convolution over time) sits beside a supported Gated DeltaNet and ran
    across the row's boundaries, let through because its layer held one."""
    supports = [
        s
        for s in _SUPPORTS
        if context in s.contexts
        and (finding.declared is None or s.layer_kinds is None or finding.declared in s.layer_kinds)
    ]
    if not supports or finding.module is None:
        return False
    return any(s.handles(m) for m in finding.module.modules() for s in supports)


def unsupported(model: nn.Module, context: str = PACKED) -> list[Finding]:
    """The findings of :func:`scan` that no registered support handles for ``context``."""
    if context not in ALL_CONTEXTS:
        raise ValueError(f"unknown context {context!r}; use one of {ALL_CONTEXTS}")
    return [f for f in scan(model) if not _handled(f, context, model)]


def _message(model: nn.Module, context: str, findings: list[Finding]) -> str:
    groups: dict[str, list[Finding]] = {}
    for f in findings:
        groups.setdefault(f.cls, []).append(f)
    lines = []
    for cls, group in groups.items():
        where = sorted({f.layer for f in group if f.layer is not None})
        at = f", layers {where}" if where else ""
        whats = "; ".join(dict.fromkeys(f.what for f in group))
        lines.append(f"  - {cls} ({group[0].path or type(model).__name__}{at}): {whats}")
    return (
        f"nopad cannot run {type(model).__name__} on {_WHERE[context]} exactly: it would give a different "
        f"answer with no error. These layers mix tokens in ways nopad does not handle there (a recurrent or "
        f"convolution state, or keys pooled or picked over the whole row, would run across the boundaries "
        f"between sequences):\n"
        + "\n".join(lines)
        + (
            "\nPass the row's boundaries to every layer: model(..., position_ids=meta.position_ids[None], "
            "nopad_meta=meta) (row.model_kwargs() does), not position_ids alone."
            if context == POSITIONS
            else "\nKeep this model unpacked (attn_implementation='sdpa' with one sequence per row or padded "
            "batches, and HF generate), or see docs/models.md for the families nopad supports and how."
        )
    )


@torch.compiler.disable  # never traced: dynamo's replay of the scan named attention layers as unseen
def check_model(model: nn.Module, context: str = PACKED, *, inside_forward: bool = False) -> None:
    """Raise :class:`UnsupportedMixerError` naming every layer of ``model`` that nopad does not
    compute exactly for ``context`` (``packed``, ``tree`` or ``generate``), by the scan, then by the
    boundary probe (``inside_forward``: called from the model's own forward); cached per model."""
    model = getattr(model, "module", model)  # DDP / DeepSpeed engine: the model they wrap
    passed = _CHECKED.get(model)
    if passed is not None and context in passed:
        return
    from nopad.packing.hf import compat

    compat.check()  # the scan reads transformers' private names and model source
    findings = unsupported(model, context)
    if findings:
        raise UnsupportedMixerError(_message(model, context, findings))
    if BOUNDARY_PROBE and not BOUNDARY_PROBE[0](model, context, inside_forward):
        return  # no verdict yet (a sharded model inside its forward): not cached as passed
    _CHECKED.setdefault(model, set()).add(context)
