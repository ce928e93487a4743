"""How nopad's varlen mixers reach transformers' hybrid layers: through the layers' own kernel
functions, with no fork of model code.

Why this seam. A Gated DeltaNet, KDA or short-convolution layer (Qwen3.5, Qwen3-Next, OLMo-hybrid,
Kimi-Linear, LFM2...) does its token mixing in module-level functions - ``causal_conv1d_fn``,
``torch_chunk_gated_delta_rule``, ``chunk_kimi_delta_attention`` - each made by transformers'
kernel hook ``use_kernel_func_from_hub_with_fallback(kernel_name, package)`` (which swaps in
``fla`` / ``causal-conv1d`` / a hub kernel when there is one), and it calls them with the
model's ``**kwargs``, so a packed row's ``nopad_meta`` arrives there. The hook itself then drops
it (and without ``fla`` it cannot keep sequences apart). So nopad wraps each such function - by
its *kernel name*, not by model - with a dispatcher that runs nopad's varlen implementation when
the call carries a ``nopad_meta`` and the function as it was otherwise (HF ``generate``, unpacked
batches: unchanged). Wrapped are the functions of every transformers module already imported,
and, by wrapping the hook, every one imported later, so any family built on these kernels is
served; :func:`serves` tells the mixer check whether a layer's every kernel is wrapped.

The generator's steps reach the same functions: its ``nopad_kv_cache`` carries a per-sequence
state cache as ``.states`` (:mod:`nopad.inference.state_cache`), and a call that finds one starts each
sequence of the row from its slot's state and writes its final state back (decode steps and
prefill chunks alike). :func:`layer_state` declares that state (a ``conv`` tensor and, for a delta
rule, a ``recurrent`` one: :mod:`nopad.packing.mixers.state`) from a served layer's modules, through
the generator support registered below; a layer it cannot size is refused for the generator.
The cache-only kernels (``causal_conv1d_update``, the fused recurrent rules: transformers' own
cached decode) are wrapped to refuse a nopad row: nopad's steps run with ``use_cache=False`` and
keep the state themselves.
"""

from __future__ import annotations

import functools
import inspect
import sys
import types
from collections.abc import Callable

import torch
from torch import nn

from nopad.packing.mixers.conv import varlen_causal_conv1d
from nopad.packing.mixers.delta_rule import varlen_delta_rule
from nopad.packing.mixers.state import LayerState, StateSpec, step_states
from nopad.packing.mixers.support import GENERATE, PACKED, TREE, MixerSupport, register_mixer_support

_MARK = "_nopad_kernel"
# the names transformers' model modules give their kernel functions -> the kernel name
GLOBAL_NAMES = {
    "causal_conv1d_fn": "causal_conv1d_fn",
    "causal_conv1d_update": "causal_conv1d_update",
    "torch_chunk_gated_delta_rule": "chunk_gated_delta_rule",
    "torch_recurrent_gated_delta_rule": "fused_recurrent_gated_delta_rule",
    "chunk_kimi_delta_attention": "chunk_kda",
    "recurrent_kimi_delta_attention": "fused_recurrent_kda",
}
MIXING = ("causal_conv1d_fn", "chunk_gated_delta_rule", "chunk_kda")  # what a served layer runs on rows
CACHE_ONLY = ("causal_conv1d_update", "fused_recurrent_gated_delta_rule", "fused_recurrent_kda")
RECURRENT_KERNELS = ("chunk_gated_delta_rule", "chunk_kda")
# each chunked rule -> the global name of the same rule token by token in its modeling module (what
# transformers' cached decode calls; nopad.packing.batch_invariant() runs it on every row)
TOKEN_BY_TOKEN = {
    "chunk_gated_delta_rule": "torch_recurrent_gated_delta_rule",
    "chunk_kda": "recurrent_kimi_delta_attention",
}
RECURRENT_DTYPE = torch.float32  # the delta rules compute and return their state in fp32
CONV, RECURRENT = "conv", "recurrent"  # the state tensors these layers (and Mamba2's) declare


def _conv(original: Callable) -> Callable:
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, *, nopad_meta, **kwargs):
        if hidden_states.shape[0] != 1:
            raise ValueError(f"a nopad row has batch size 1; got hidden states {tuple(hidden_states.shape)}")
        states = step_states(kwargs)
        if states is None:
            return varlen_causal_conv1d(hidden_states[0], weight, bias, activation, meta=nopad_meta)[None]

        def step(meta, initial):
            return varlen_causal_conv1d(
                hidden_states[0], weight, bias, activation, meta=meta, initial_states=initial, return_final_states=True
            )

        return states.run(CONV, step)[None]

    return causal_conv1d_fn


def _delta_rule(kernel: str) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        reference = inspect.unwrap(original)  # transformers' own torch function

        def chunk_rule(
            query,
            key,
            value,
            g,
            beta,
            *args,
            nopad_meta,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=False,
            chunk_size=64,
            **kwargs,
        ):
            if args:
                raise TypeError(f"{kernel}: unexpected positional arguments after beta")
            if initial_state is not None:
                raise ValueError("a nopad row carries no recurrent cache; call the model with use_cache=False")
            recurrent = reference.__globals__.get(TOKEN_BY_TOKEN[kernel])
            common = dict(
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                fla_kernel=kernel,
                chunk_size=chunk_size,
                recurrent=recurrent and inspect.unwrap(recurrent),
            )
            states = step_states(kwargs)
            if states is None:
                return varlen_delta_rule(
                    reference,
                    query,
                    key,
                    value,
                    g,
                    beta,
                    meta=nopad_meta,
                    output_final_state=output_final_state,
                    **common,
                )

            def step(meta, initial):
                return varlen_delta_rule(
                    reference,
                    query,
                    key,
                    value,
                    g,
                    beta,
                    meta=meta,
                    initial_state=initial,
                    output_final_state=True,
                    in_place=True,
                    **common,
                )

            return states.run(RECURRENT, step), None

        return chunk_rule

    return make


def _refuse(kernel: str) -> Callable[[Callable], Callable]:
    def make(original: Callable) -> Callable:
        def cache_step(*args, nopad_meta, **kwargs):
            raise ValueError(
                f"{kernel} is transformers' cached decode step; nopad rows of hybrid layers run "
                "with use_cache=False (nopad's Generator keeps the per-sequence state itself)"
            )

        return cache_step

    return make


IMPLEMENTATIONS: dict[str, Callable[[Callable], Callable]] = {
    "causal_conv1d_fn": _conv,
    "chunk_gated_delta_rule": _delta_rule("chunk_gated_delta_rule"),
    "chunk_kda": _delta_rule("chunk_kda"),
    **{name: _refuse(name) for name in CACHE_ONLY},
}


def dispatcher(kernel: str, original: Callable) -> Callable:
    """``original`` (a kernel function of ``kernel``) that runs nopad's implementation when the
    call carries a ``nopad_meta``."""
    if getattr(original, _MARK, None) == kernel:
        return original
    nopad = IMPLEMENTATIONS[kernel](original)

    @functools.wraps(original)
    def call(*args, **kwargs):
        if kwargs.get("nopad_meta") is None:
            return original(*args, **kwargs)
        kwargs.pop("nopad_trace", None)
        return nopad(*args, **kwargs)

    setattr(call, _MARK, kernel)
    return call


def _wrap_module(module: types.ModuleType) -> None:
    for name, kernel in GLOBAL_NAMES.items():
        fn = module.__dict__.get(name)
        if isinstance(fn, types.FunctionType):
            setattr(module, name, dispatcher(kernel, fn))


def _wrapping_hook(hook: Callable) -> Callable:
    """transformers' ``use_kernel_func_from_hub_with_fallback``, whose functions of a served
    kernel name come out wrapped (modules imported after nopad)."""
    if getattr(hook, _MARK, None):
        return hook

    @functools.wraps(hook)
    def use_kernel_func_from_hub_with_fallback(func_name, package, internal_path=None):
        decorate = hook(func_name, package, internal_path)
        if func_name not in IMPLEMENTATIONS:
            return decorate
        return lambda fn: dispatcher(func_name, decorate(fn))

    setattr(use_kernel_func_from_hub_with_fallback, _MARK, "hook")
    return use_kernel_func_from_hub_with_fallback


def install() -> None:
    """Wrap the kernel functions of every transformers model module imported so far, and the
    hook that makes them for those imported later (idempotent). Run on first use (:func:`serves`,
    the mixer check), never on import: importing nopad leaves transformers as it found it."""
    try:
        from transformers.integrations import hub_kernels
    except ImportError:  # transformers absent: nothing to serve
        return
    import transformers.integrations as integrations

    from nopad.packing.hf import compat

    compat.check()  # the hook and globals rebound here are listed there
    hook = _wrapping_hook(hub_kernels.use_kernel_func_from_hub_with_fallback)
    hub_kernels.use_kernel_func_from_hub_with_fallback = hook
    integrations.use_kernel_func_from_hub_with_fallback = hook
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers.models.") and isinstance(module, types.ModuleType):
            _wrap_module(module)


def uninstall() -> None:
    """Give transformers its own hook and kernel functions back (tests; the next check reinstalls)."""
    hub_kernels = sys.modules.get("transformers.integrations.hub_kernels")
    if hub_kernels is None:
        return
    hook = hub_kernels.use_kernel_func_from_hub_with_fallback
    if getattr(hook, _MARK, None):
        hub_kernels.use_kernel_func_from_hub_with_fallback = hook.__wrapped__
        sys.modules["transformers.integrations"].use_kernel_func_from_hub_with_fallback = hook.__wrapped__
    for name, module in list(sys.modules.items()):
        if name.startswith("transformers.models.") and isinstance(module, types.ModuleType):
            for global_name in GLOBAL_NAMES:
                fn = module.__dict__.get(global_name)
                if getattr(fn, _MARK, None):
                    setattr(module, global_name, fn.__wrapped__)


def kernels_called(cls: type) -> dict[str, Callable]:
    """The kernel-hook functions ``cls.forward`` calls (module globals made by transformers'
    kernel hook, recognisable by ``__wrapped__``), by global name."""
    forward = inspect.unwrap(cls.forward)
    names = set(forward.__code__.co_names)
    found = {}
    for name in names:
        fn = forward.__globals__.get(name)
        if isinstance(fn, types.FunctionType) and hasattr(fn, "__wrapped__"):
            found[name] = fn
    return found


def serves(module: nn.Module) -> bool:
    """Whether nopad computes ``module`` exactly on packed and tree rows: it mixes tokens through
    kernel functions only, every one of them dispatched here, at least one that runs on rows."""
    if type(module).forward is nn.Module.forward or not hasattr(type(module).forward, "__code__"):
        return False
    called = kernels_called(type(module))
    if any(getattr(fn, _MARK, None) is None and name in GLOBAL_NAMES for name, fn in called.items()):
        install()  # first use, or its module's functions were made (or replaced) after the last install
        called = kernels_called(type(module))
    kernels = [getattr(fn, _MARK, None) for fn in called.values()]
    return bool(kernels) and None not in kernels and any(k in MIXING for k in kernels)


def conv_recurrent_state(path: str, conv: tuple[int, int], recurrent: tuple[int, int, int] | None) -> LayerState:
    """A layer's conv state ``(C, K - 1)`` (the model's dtype) and, unless None, its fp32 recurrent
    state (a delta rule's ``(heads, K, V)``, a Mamba2 scan's ``(heads, head_dim, state)``)."""
    specs = (StateSpec(CONV, conv),) + (
        () if recurrent is None else (StateSpec(RECURRENT, recurrent, RECURRENT_DTYPE),)
    )
    return LayerState(path, specs)


def layer_state(module: nn.Module, path: str = "") -> LayerState | None:
    """``module``'s per-sequence state, read from its modules (one causal ``Conv1d``) and, for a
    delta rule, its head sizes; None when nopad does not serve it or cannot size its state."""
    if not serves(module):
        return None
    convs = [m for m in module.modules() if isinstance(m, nn.Conv1d) and m.kernel_size[0] > 1]
    if len(convs) != 1:
        return None
    conv = (convs[0].in_channels, convs[0].kernel_size[0] - 1)
    kernels = {getattr(fn, _MARK, None) for fn in kernels_called(type(module)).values()}
    if not kernels & set(RECURRENT_KERNELS):
        return conv_recurrent_state(path, conv, None)
    sizes = [getattr(module, n, None) for n in ("num_v_heads", "head_k_dim", "head_v_dim")]
    if None in sizes:  # KDA: one head size for keys and values
        heads, dim = getattr(module, "num_heads", None), getattr(module, "head_dim", None)
        sizes = [heads, dim, dim]
    if not all(isinstance(s, int) and s > 0 for s in sizes):
        return None
    return conv_recurrent_state(path, conv, tuple(sizes))


def _serves_generate(module: nn.Module) -> bool:
    return layer_state(module) is not None


register_mixer_support(
    MixerSupport("hf-kernel-functions (gated delta rule, KDA, short convolution)", serves, frozenset({PACKED, TREE}))
)
register_mixer_support(
    MixerSupport(
        "hf-kernel-functions in the generator (per-sequence state slots)",
        _serves_generate,
        frozenset({GENERATE}),
        state=layer_state,
    )
)
