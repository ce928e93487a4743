"""Mamba2 layers (Nemotron-H, Granite-4 hybrid, Bamba, Falcon-H1) exact on packed and prefix-tree
rows: each sequence's convolution and state-space scan start from zeros at its boundary, and a
tree segment's from its parent's last token, so every path computes what its flat sequence does.

**The seam.** Each family's modeling module computes the layer through three module-level kernel
hooks (``use_kernel_func_from_hub_with_fallback``): ``causal_conv1d_fn``, ``mamba2_chunk_scan``
and, in training, ``mamba2_split_conv1d_scan_combined``, and its mixer hands every one of them
the ``**kwargs`` of the forward - so ``model(..., nopad_meta=meta)`` reaches them. transformers
looks these names up when the layer runs, so we rebind them in the modeling module (no model
code copied): with a ``nopad_meta`` our function runs, without one transformers' own runs
unchanged. The alternatives are worse: transformers' own ``seq_idx`` keyword raises without
mamba_ssm and cannot carry a tree's parent states, and wrapping the mixer's ``forward`` would
mean rebuilding its cache objects to pass state between segments.

**What runs.** The convolution: :func:`nopad.packing.mixers.conv.varlen_causal_conv1d` (tree segments
start from their path's last inputs; plain packed rows go to causal-conv1d with ``seq_idx`` on
CUDA). The scan: nopad's own chunked scan (:mod:`nopad.packing.mixers.chunked_ssd`, transformers'
``mamba2_chunk_scan`` arithmetic on every piece of a wave at once) over the waves of the row's
:func:`nopad.packing.mixers.recurrence.recurrence_plan` (a piece is a sequence; in a tree, the stretch
between branch points, seeded with the final state of the piece that ends at its parent), or
mamba_ssm's ``mamba_chunk_scan_combined`` with ``seq_idx`` on CUDA for plain packed rows, where the fused
training kernel (``mamba_split_conv1d_scan_combined``) also gets ``seq_idx``. Elsewhere the fused
hook answers None, which makes the layer run the unfused path above. ``NOPAD_MIXER_KERNELS``
picks between the packages and PyTorch (:mod:`nopad.packing.mixers.kernels`).

The same modules' ``create_recurrent_attention_mask`` (called once per forward, before the
layers) is rebound too, to note a ``"nopad"`` forward's ``position_ids``: a packed row that
reaches a Mamba2 layer without ``nopad_meta`` is refused, not scanned across its documents.

**In the generator** (:mod:`nopad.inference.state_cache`) a step's ``nopad_kv_cache`` carries the
per-sequence state cache as ``.states``; the same two hooks then start each sequence of the step
from its slot (its conv inputs, its ``(heads, head_dim, state)`` SSM state) and write its final
state back, so a prefill chunk continues the previous chunk and a decode step continues the last
token. The sequences of several tokens run that chunked scan together, each from its slot (HF's
own prefill runs ``mamba2_chunk_scan`` from ``initial_states``); the one-token sequences of the
step (decode) run together through the arithmetic of the module's ``mamba2_selective_state_update``
(HF's own decode step; mamba_ssm's kernel where chosen), in place in their slots, with ``dt_limit``
applied as the chunk scan applies it (so decode computes what a training forward computes).
Anything else with cached context is refused here. A static decode step (the generator's
``static_decode`` / ``compile_decode``: one token a row, lengths on the device only) runs that
recurrent step on every row, so the step compiles and captures.

**Inside** :func:`nopad.packing.batch_invariant` the trainer's rows and the generator's steps all scan
token by token (:mod:`nopad.packing.mixers.ssm_steps`; the conv takes its ordered gathers), so rollout
log-probs equal the trainer's bitwise; the chunk scan and the CUDA kernels run outside the mode.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import inspect
import logging
import sys
import warnings

import torch

from nopad.packing import invariance
from nopad.packing.mixers import chunked_ssd
from nopad.packing.mixers.conv import varlen_causal_conv1d
from nopad.packing.mixers.hf_kernels import conv_recurrent_state
from nopad.packing.mixers.kernels import package_function
from nopad.packing.mixers.mamba2_steps import check_row, step_chunk_scan, step_conv
from nopad.packing.mixers.mamba2_steps import matches as step_matches
from nopad.packing.mixers.recurrence import recurrence_plan
from nopad.packing.mixers.ssm_steps import row_scan
from nopad.packing.mixers.state import LayerState, step_states
from nopad.packing.mixers.support import (
    GENERATE,
    NOPAD_ATTENTION,
    PACKED,
    TREE,
    MixerSupport,
    register_mixer_support,
)
from nopad.packing.varlen import VarlenMeta

logger = logging.getLogger(__name__)

# modeling module -> its Mamba2 mixer class (the module whose hooks we rebind)
FAMILIES = {
    "transformers.models.nemotron_h.modeling_nemotron_h": "NemotronHMamba2Mixer",
    "transformers.models.granitemoehybrid.modeling_granitemoehybrid": "GraniteMoeHybridMambaLayer",
    "transformers.models.bamba.modeling_bamba": "BambaMixer",
    "transformers.models.falcon_h1.modeling_falcon_h1": "FalconH1Mixer",
}
# each hook we rebind, and the parameters of transformers' function we rely on
HOOK_PARAMETERS = {
    "causal_conv1d_fn": ("hidden_states", "weight", "bias", "activation"),
    "mamba2_chunk_scan": ("hidden_states", "dt", "A", "B", "C", "chunk_size", "initial_states", "return_final_states"),
    "mamba2_split_conv1d_scan_combined": ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A"),
}
# the CUDA kernels, at the paths and signatures causal-conv1d >= 1.4 and mamba_ssm >= 2 document
CONV_KERNEL = ("causal_conv1d", "causal_conv1d_fn")
SCAN_KERNEL = ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
FUSED_KERNEL = ("mamba_ssm.ops.triton.ssd_combined", "mamba_split_conv1d_scan_combined")
# the recurrent (one-token) step the generator's decode runs, as each mixer's own decode calls it
STEP_FUNCTION = "mamba2_selective_state_update"
STEP_PARAMETERS = ("state", "hidden_states", "dt", "A", "B", "C", "D", "dt_bias", "dt_softplus", "z")
# the forward-level hook that sees position_ids (to refuse a packed row that came without nopad_meta)
MASK_HOOK = "create_recurrent_attention_mask"


# ----------------------------------------------------------------------------- CUDA kernels
def _fast(tensor: torch.Tensor, meta: VarlenMeta, which: tuple[str, str]):
    """The kernel ``which`` for a plain packed row, when installed and chosen for ``tensor``
    (``NOPAD_MIXER_KERNELS``, :mod:`nopad.packing.mixers.kernels`); None for a tree row, whose segments
    start from their parents' states, which these kernels do not take per sequence."""
    if meta.key_rows is not None:
        return None
    return package_function(*which, tensor)


def _parameters(function) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


# ----------------------------------------------------------------------------- the hooks
def packed_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, meta: VarlenMeta
) -> torch.Tensor:
    """The layer's causal conv (``x``: ``(1, dim, T)``) with each sequence on its own, a tree
    segment continuing its path."""
    check_row(x.shape[0], x.shape[-1], meta, "causal_conv1d_fn")
    return varlen_causal_conv1d(x[0], weight, bias, activation, meta=meta)[None]


def packed_chunk_scan(hidden_states, dt, A, B, C, chunk_size, meta: VarlenMeta, **kwargs):
    """The layer's SSD scan over a packed or tree row: nopad's own chunked scan once per wave of
    the row's plan (once for a packed row), each piece seeded with its parent's final state."""
    check_row(hidden_states.shape[0], hidden_states.shape[1], meta, "mamba2_chunk_scan")
    if kwargs.pop("initial_states", None) is not None or kwargs.pop("return_final_states", False):
        raise ValueError(
            "a Mamba2 layer got nopad_meta and a cache; nopad's packed and tree rows run with use_cache=False"
        )
    plan = recurrence_plan(meta)
    if invariance.is_enabled():
        return row_scan(hidden_states, dt, A, B, C, plan, kwargs)
    fast = _fast(hidden_states, meta, SCAN_KERNEL)
    if fast is not None:
        params = _parameters(fast)
        return fast(
            hidden_states,
            dt,
            A,
            B,
            C,
            chunk_size,
            seq_idx=meta.seq_idx[None],
            **{k: v for k, v in kwargs.items() if k in params},
        )
    return row_scan(
        hidden_states, dt, A, B, C, plan, kwargs, functools.partial(chunked_ssd.chunked_ssd_scan, chunk_size=chunk_size)
    )


def packed_fused(args: tuple, kwargs: dict, meta: VarlenMeta):
    """The fused training kernel with ``seq_idx`` on a plain packed row where mamba_ssm runs;
    None elsewhere, so the layer takes its unfused path (conv and scan hooks)."""
    zxbcdt = args[0]
    check_row(zxbcdt.shape[0], zxbcdt.shape[1], meta, "mamba2_split_conv1d_scan_combined")
    recurrence_plan(meta)  # refuses a step whose context is in a cache
    if invariance.is_enabled():  # the unfused path runs the mode's order
        return None
    fast = _fast(zxbcdt, meta, FUSED_KERNEL)
    if fast is None or _fast(zxbcdt, meta, CONV_KERNEL) is None:  # it runs causal-conv1d inside
        return None
    params = _parameters(fast)
    return fast(*args, seq_idx=meta.seq_idx[None], **{k: v for k, v in kwargs.items() if k in params})


_NOPAD_POSITIONS: contextvars.ContextVar = contextvars.ContextVar("nopad_mamba2_positions", default=None)


def _take_meta(kwargs: dict, length: int) -> VarlenMeta | None:
    """The call's ``nopad_meta``. Without one, a ``"nopad"`` forward whose ``position_ids``
    restart is a packed row whose boundaries only the attention layers derive: refused, since
    this layer would run across them."""
    meta = kwargs.pop("nopad_meta", None)
    positions = _NOPAD_POSITIONS.get() if meta is None else None
    if positions is not None and positions.shape == (1, length) and bool((positions[0, 1:] == 0).any()):
        raise ValueError(
            "a Mamba2 layer got a packed row (position_ids restart at 0) without nopad_meta: it "
            "reads the boundaries from nopad_meta only. Pass nopad_meta=meta (as "
            "row.model_kwargs() does) with position_ids=meta.position_ids[None]"
        )
    return meta


def _hook(name: str, original, module):
    """transformers' hook ``original`` with a ``nopad_meta`` branch (a generator step's when the
    call carries the step's state cache); the same call without one."""
    if name == "causal_conv1d_fn":

        def hooked(hidden_states, weight, bias=None, activation=None, **kwargs):
            meta = _take_meta(kwargs, hidden_states.shape[-1])
            if meta is None:
                return original(hidden_states, weight, bias, activation=activation, **kwargs)
            states = step_states(kwargs)
            if states is not None:
                return step_conv(hidden_states, weight, bias, activation, states)
            return packed_conv(hidden_states, weight, bias, activation, meta)
    elif name == "mamba2_chunk_scan":

        def hooked(hidden_states, dt, A, B, C, chunk_size, **kwargs):
            meta = _take_meta(kwargs, hidden_states.shape[1])
            if meta is None:
                return original(hidden_states, dt, A, B, C, chunk_size, **kwargs)
            states = step_states(kwargs)
            if states is not None:
                if kwargs.get("initial_states") is not None or kwargs.get("return_final_states"):
                    raise ValueError("a generator step of a Mamba2 layer runs with use_cache=False")
                update = getattr(module, STEP_FUNCTION)
                return step_chunk_scan(update, hidden_states, dt, A, B, C, chunk_size, states, **kwargs)
            return packed_chunk_scan(hidden_states, dt, A, B, C, chunk_size, meta, **kwargs)
    elif name == "mamba2_split_conv1d_scan_combined":

        def hooked(*args, **kwargs):
            meta = _take_meta(kwargs, args[0].shape[1])
            if meta is None:
                return original(*args, **kwargs)
            return packed_fused(args, kwargs, meta)
    else:  # create_recurrent_attention_mask: once per forward, before the layers

        def hooked(*args, **kwargs):
            # dynamo cannot trace ContextVar.set (a graph break, which would split the generator's
            # compiled decode step): the check is an eager one; a compiled forward passes nopad_meta
            if not torch.compiler.is_compiling():
                config = kwargs.get("config", args[0] if args else None)
                nopad = getattr(config, "_attn_implementation", None) == NOPAD_ATTENTION
                # no sync here: the positions are only read when a layer gets no nopad_meta
                _NOPAD_POSITIONS.set(kwargs.get("position_ids") if nopad else None)
            return original(*args, **kwargs)

    functools.update_wrapper(hooked, original)
    hooked.nopad_original = original
    return hooked


# ----------------------------------------------------------------------------- installing
def _fence(module, mixer_name: str) -> str | None:
    """What of the borrowed names ``module`` lacks (None: all there, with the parameters we pass)."""
    mixer = getattr(module, mixer_name, None)
    if mixer is None:
        return f"no class {mixer_name}"
    for name, needed in HOOK_PARAMETERS.items():
        function = getattr(module, name, None)
        if function is None:
            return f"no function {name}"
        original = getattr(function, "nopad_original", function)
        missing = [p for p in needed if p not in inspect.signature(original).parameters]
        if missing:
            return f"{name} takes no {missing}"
    if getattr(module, MASK_HOOK, None) is None:
        return f"no function {MASK_HOOK}"
    scan = getattr(module.mamba2_chunk_scan, "nopad_original", module.mamba2_chunk_scan)
    if not chunked_ssd.matches(inspect.unwrap(scan)):
        return "its mamba2_chunk_scan computes other than nopad's chunked scan"
    try:
        source = inspect.getsource(mixer.forward)
    except (OSError, TypeError):
        return f"the source of {mixer_name}.forward is not readable"
    if not all(f"{name}(" in source for name in HOOK_PARAMETERS) or "**kwargs" not in source:
        return f"{mixer_name}.forward no longer calls the kernel hooks with the forward's **kwargs"
    return None


_INSTALLED: dict[str, tuple[type, ...]] = {}  # "mixers" / "generate": what install() found


def install() -> tuple[type, ...]:
    """Rebind the kernel hooks of every family transformers has (idempotent); the mixer classes
    now exact on packed and tree rows. A family whose module lacks what we rely on stays
    refused, with a warning naming what changed. Run on first use (:func:`mixers`), never on
    import: it imports model modules and runs the scan's probe (torch ops, whose OpenMP threads
    a process forked afterwards would inherit in a state that can hang it)."""
    from nopad.packing.hf import compat

    compat.check()  # the globals rebound here are listed there
    classes = []
    for module_name, mixer_name in FAMILIES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            logger.debug("nopad: %s is not in this transformers; its Mamba2 layers stay refused", module_name)
            continue
        problem = _fence(module, mixer_name)
        if problem is not None:
            warnings.warn(
                f"nopad: {module_name} changed ({problem}); its {mixer_name} layers stay refused "
                "on packed and tree rows",
                RuntimeWarning,
                stacklevel=2,
            )
            continue
        for name in (*HOOK_PARAMETERS, MASK_HOOK):
            current = getattr(module, name)
            if not hasattr(current, "nopad_original"):
                setattr(module, name, _hook(name, current, module))
        classes.append(getattr(module, mixer_name))
    _INSTALLED["mixers"] = tuple(classes)
    _INSTALLED["generate"] = tuple(m for m in classes if _steps(m))
    return _INSTALLED["mixers"]


def uninstall() -> None:
    """Give every family's module its own hooks back (tests; the next :func:`mixers` reinstalls)."""
    for module_name in FAMILIES:
        module = importlib.import_module(module_name) if module_name in sys.modules else None
        for name in (*HOOK_PARAMETERS, MASK_HOOK) if module is not None else ():
            original = getattr(getattr(module, name, None), "nopad_original", None)
            if original is not None:
                setattr(module, name, original)
    _INSTALLED.clear()


def mixers(generate: bool = False) -> tuple[type, ...]:
    """The Mamba2 mixer classes nopad serves (``generate``: those the generator can step),
    installing the hooks on first use."""
    if not _INSTALLED:
        install()
    return _INSTALLED["generate" if generate else "mixers"]


def _steps(mixer: type) -> bool:
    """Whether ``mixer``'s module has the recurrent step its own decode calls, and nopad's decode
    step computes what it does (:func:`nopad.packing.mixers.mamba2_steps.matches`)."""
    function = getattr(inspect.getmodule(mixer), STEP_FUNCTION, None)
    if function is None:
        return False
    params = inspect.signature(inspect.unwrap(function)).parameters
    return all(p in params for p in STEP_PARAMETERS) and step_matches(function)


def layer_state(module, path: str = "") -> LayerState | None:
    """A served Mamba2 mixer's per-sequence generator state: conv inputs ``(conv_dim, K - 1)``
    and SSM state ``(heads, head_dim, state)`` (the shape of the chunk scan's final state); None
    for any other module, or one whose sizes do not add up (refused in the generator)."""
    if not isinstance(module, mixers(generate=True)):
        return None
    conv = getattr(module, "conv1d", None)
    names = ("num_heads", "head_dim", "ssm_state_size", "intermediate_size")
    sizes = [getattr(module, n, None) for n in names]
    if not isinstance(conv, torch.nn.Conv1d) or not all(isinstance(s, int) and s > 0 for s in sizes):
        return None
    heads, head_dim, size, inner = sizes
    if heads * head_dim != inner:
        return None
    return conv_recurrent_state(path, (conv.in_channels, conv.kernel_size[0] - 1), (heads, head_dim, size))


register_mixer_support(MixerSupport("mamba2", lambda module: isinstance(module, mixers()), frozenset({PACKED, TREE})))
register_mixer_support(
    MixerSupport(
        "mamba2 in the generator (per-sequence state slots)",
        lambda module: layer_state(module) is not None,
        frozenset({GENERATE}),
        state=layer_state,
    )
)
