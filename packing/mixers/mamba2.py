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

**What runs.** The convolution: :func:`packing.mixers.conv.varlen_causal_conv1d` (tree segments
start from their path's last inputs), or causal-conv1d with ``seq_idx`` on CUDA for plain packed
rows. The scan: transformers' own ``mamba2_chunk_scan`` once per run of tokens whose state starts
the same way (a sequence; in a tree, the stretch between branch points, seeded with the final
state of the run that ends at its parent), or mamba_ssm's ``mamba_chunk_scan_combined`` with
``seq_idx`` on CUDA for plain packed rows, where the fused training kernel
(``mamba_split_conv1d_scan_combined``) also gets ``seq_idx``. Elsewhere the fused hook answers
None, which makes the layer run the unfused path above.

The same modules' ``create_recurrent_attention_mask`` (called once per forward, before the
layers) is rebound too, to note a ``"nopad"`` forward's ``position_ids``: a packed row that
reaches a Mamba2 layer without ``nopad_meta`` is refused, not scanned across its documents.

Generation is not covered (the paged cache holds no per-sequence state yet): a step with cached
context is refused here, and ``Generator`` refuses these models through :mod:`packing.mixers`.
"""

from __future__ import annotations

import contextvars
import functools
import importlib
import importlib.util
import inspect
import logging
import warnings
import weakref
from dataclasses import dataclass

import numpy as np
import torch

from packing.mixers.conv import varlen_causal_conv1d
from packing.mixers.support import PACKED, TREE, MixerSupport, register_mixer_support
from packing.varlen import VarlenMeta

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
    "mamba2_chunk_scan": ("hidden_states", "dt", "A", "B", "C", "chunk_size", "initial_states",
                          "return_final_states"),
    "mamba2_split_conv1d_scan_combined": ("zxbcdt", "conv1d_weight", "conv1d_bias", "dt_bias", "A"),
}
# the CUDA kernels, at the paths and signatures causal-conv1d >= 1.4 and mamba_ssm >= 2 document
CONV_KERNEL = ("causal_conv1d", "causal_conv1d_fn")
SCAN_KERNEL = ("mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined")
FUSED_KERNEL = ("mamba_ssm.ops.triton.ssd_combined", "mamba_split_conv1d_scan_combined")
# the forward-level hook that sees position_ids (to refuse a packed row that came without nopad_meta)
MASK_HOOK = "create_recurrent_attention_mask"
NOPAD = "nopad"  # packing.hf.NOPAD_ATTENTION (packing.hf imports this package, so not imported here)
KERNEL_DEVICES = frozenset({"cuda"})  # where those kernels run (the tests widen it for a CPU stand-in)


# ----------------------------------------------------------------------------- the row's runs
@dataclass(frozen=True)
class RowPlan:
    """How one row's state flows: ``runs`` are ``(start, end, source)`` stretches of the row, in
    order, covering it, each scanned from the final state of the run ending at row ``source``
    (-1: from zeros); ``parents[i]`` is the row of segment ``i``'s parent token (-1: none)."""

    runs: tuple[tuple[int, int, int], ...]
    parents: np.ndarray
    context: np.ndarray  # keys of each segment before its own tokens (its path's length above it)
    tree: bool


_PLANS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # meta -> RowPlan (one per forward)


def row_plan(meta: VarlenMeta) -> RowPlan:
    """The :class:`RowPlan` of ``meta``: a packed row's runs are its sequences; a tree row's
    segments are cut again after every token some other segment branches from."""
    plan = _PLANS.get(meta)
    if plan is not None:
        return plan
    if meta.seqlens_q is None or meta.seqlens_k is None:
        raise ValueError("a Mamba2 layer needs the row's sequence lengths on the host; a static decode step "
                         "has none")
    lens_q = np.asarray(meta.seqlens_q, dtype=np.int64)
    context = np.asarray(meta.seqlens_k, dtype=np.int64) - lens_q
    starts = np.concatenate(([0], np.cumsum(lens_q)[:-1])).astype(np.int64)
    tree = meta.key_index is not None
    if not tree and context.any():
        raise ValueError("nopad's Mamba2 support covers packed and prefix-tree rows; this step continues "
                         "sequences from a cache (the generator), which keeps no per-sequence Mamba2 state "
                         "yet")
    parents = np.full(lens_q.size, -1, dtype=np.int64)
    if tree:
        rows = meta.host_key_index
        has = context > 0
        parents[has] = rows[np.flatnonzero(has), context[has] - 1]
    cuts = set((parents[parents >= 0] + 1).tolist())
    runs = []
    for i, (start, length) in enumerate(zip(starts.tolist(), lens_q.tolist())):
        end = start + length
        inner = sorted(c for c in cuts if start < c < end)
        source = int(parents[i])
        for a, b in zip([start] + inner, inner + [end]):
            if source >= a:
                raise ValueError(f"segment {i} of the tree row starts at row {start} but its parent token is "
                                 f"row {source}: a parent must be laid before its children")
            runs.append((a, b, source))
            source = b - 1
    plan = RowPlan(tuple(r for r in runs if r[1] > r[0]), parents, context, tree)
    _PLANS[meta] = plan
    return plan


def _check_row(batch: int, length: int, meta: VarlenMeta, what: str) -> None:
    if batch != 1 or length != meta.total_q:
        raise ValueError(f"{what}: nopad_meta describes one row of {meta.total_q} tokens, but the layer got "
                         f"a batch of {batch} x {length}; pass the packed row as input_ids (1, T) with no "
                         "cache")


# ----------------------------------------------------------------------------- CUDA kernels
def _spec_exists(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


@functools.cache
def kernel(module: str, name: str):
    """The installed kernel ``module.name``, or None. Cached: call ``kernel.cache_clear()`` after
    installing one in a running process (the tests do)."""
    if not _spec_exists(module.split(".")[0]):
        return None
    try:
        return getattr(importlib.import_module(module), name)
    except (ImportError, OSError, AttributeError) as error:
        warnings.warn(f"{module}.{name} is installed but does not import ({error}); nopad's Mamba2 layers "
                      "use PyTorch instead", RuntimeWarning, stacklevel=2)
        return None


def _fast(device: torch.device, plan: RowPlan, which: tuple[str, str]):
    """The kernel for a plain packed row on a device it runs on; None elsewhere (a tree row's
    segments start from their parents' states, which these kernels do not take per sequence)."""
    if plan.tree or device.type not in KERNEL_DEVICES:
        return None
    return kernel(*which)


def _parameters(function) -> frozenset[str]:
    return frozenset(inspect.signature(function).parameters)


# ----------------------------------------------------------------------------- the hooks
def packed_conv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None,
                meta: VarlenMeta) -> torch.Tensor:
    """The layer's causal conv (``x``: ``(1, dim, T)``) with each sequence on its own, a tree
    segment continuing its path."""
    _check_row(x.shape[0], x.shape[-1], meta, "causal_conv1d_fn")
    plan = row_plan(meta)
    fast = _fast(x.device, plan, CONV_KERNEL)
    if fast is not None:
        return fast(x, weight, bias, seq_idx=meta.seq_idx[None], activation=activation)
    return varlen_causal_conv1d(x[0], weight, bias, activation, meta=meta)[None]  # a tree row along its paths


def packed_chunk_scan(original, hidden_states, dt, A, B, C, chunk_size, meta: VarlenMeta, **kwargs):
    """The layer's SSD scan over a packed or tree row: one call of transformers' ``original``
    per run of the row's plan, each seeded with its source's final state."""
    _check_row(hidden_states.shape[0], hidden_states.shape[1], meta, "mamba2_chunk_scan")
    if kwargs.pop("initial_states", None) is not None or kwargs.pop("return_final_states", False):
        raise ValueError("a Mamba2 layer got nopad_meta and a cache; nopad's packed and tree rows run with "
                         "use_cache=False")
    plan = row_plan(meta)
    fast = _fast(hidden_states.device, plan, SCAN_KERNEL)
    if fast is not None:
        params = _parameters(fast)
        return fast(hidden_states, dt, A, B, C, chunk_size, seq_idx=meta.seq_idx[None],
                    **{k: v for k, v in kwargs.items() if k in params})
    finals: dict[int, torch.Tensor] = {}
    outs = []
    for start, end, source in plan.runs:
        out, finals[end - 1] = original(
            hidden_states[:, start:end], dt[:, start:end], A, B[:, start:end], C[:, start:end], chunk_size,
            initial_states=finals[source] if source >= 0 else None, return_final_states=True, **kwargs)
        outs.append(out)
    return torch.cat(outs, dim=1)


def packed_fused(args: tuple, kwargs: dict, meta: VarlenMeta):
    """The fused training kernel with ``seq_idx`` on a plain packed row where mamba_ssm runs;
    None elsewhere, so the layer takes its unfused path (conv and scan hooks)."""
    zxbcdt = args[0]
    _check_row(zxbcdt.shape[0], zxbcdt.shape[1], meta, "mamba2_split_conv1d_scan_combined")
    fast = _fast(zxbcdt.device, row_plan(meta), FUSED_KERNEL)
    if fast is None or kernel(*CONV_KERNEL) is None:  # mamba_ssm's fused kernel runs causal-conv1d inside
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
        raise ValueError("a Mamba2 layer got a packed row (position_ids restart at 0) without nopad_meta: it "
                         "reads the boundaries from nopad_meta only. Pass nopad_meta=meta (as "
                         "row.model_kwargs() does) with position_ids=meta.position_ids[None]")
    return meta


def _hook(name: str, original):
    """transformers' hook ``original`` with a ``nopad_meta`` branch; the same call without one."""
    if name == "causal_conv1d_fn":
        def hooked(hidden_states, weight, bias=None, activation=None, **kwargs):
            meta = _take_meta(kwargs, hidden_states.shape[-1])
            if meta is None:
                return original(hidden_states, weight, bias, activation=activation, **kwargs)
            return packed_conv(hidden_states, weight, bias, activation, meta)
    elif name == "mamba2_chunk_scan":
        def hooked(hidden_states, dt, A, B, C, chunk_size, **kwargs):
            meta = _take_meta(kwargs, hidden_states.shape[1])
            if meta is None:
                return original(hidden_states, dt, A, B, C, chunk_size, **kwargs)
            return packed_chunk_scan(original, hidden_states, dt, A, B, C, chunk_size, meta, **kwargs)
    elif name == "mamba2_split_conv1d_scan_combined":
        def hooked(*args, **kwargs):
            meta = _take_meta(kwargs, args[0].shape[1])
            if meta is None:
                return original(*args, **kwargs)
            return packed_fused(args, kwargs, meta)
    else:  # create_recurrent_attention_mask: once per forward, before the layers
        def hooked(*args, **kwargs):
            config = kwargs.get("config", args[0] if args else None)
            nopad = getattr(config, "_attn_implementation", None) == NOPAD  # no sync: the check is lazy
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
    try:
        source = inspect.getsource(mixer.forward)
    except (OSError, TypeError):
        return f"the source of {mixer_name}.forward is not readable"
    if not all(f"{name}(" in source for name in HOOK_PARAMETERS) or "**kwargs" not in source:
        return f"{mixer_name}.forward no longer calls the kernel hooks with the forward's **kwargs"
    return None


def install() -> tuple[type, ...]:
    """Rebind the kernel hooks of every family transformers has (idempotent); the mixer classes
    now exact on packed and tree rows. A family whose module lacks what we rely on stays
    refused, with a warning naming what changed."""
    classes = []
    for module_name, mixer_name in FAMILIES.items():
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            logger.debug("nopad: %s is not in this transformers; its Mamba2 layers stay refused", module_name)
            continue
        problem = _fence(module, mixer_name)
        if problem is not None:
            warnings.warn(f"nopad: {module_name} changed ({problem}); its {mixer_name} layers stay refused "
                          "on packed and tree rows", RuntimeWarning, stacklevel=2)
            continue
        for name in (*HOOK_PARAMETERS, MASK_HOOK):
            current = getattr(module, name)
            if not hasattr(current, "nopad_original"):
                setattr(module, name, _hook(name, current))
        classes.append(getattr(module, mixer_name))
    return tuple(classes)


MIXERS = install()
register_mixer_support(MixerSupport("mamba2", lambda module: isinstance(module, MIXERS),
                                    frozenset({PACKED, TREE})))
