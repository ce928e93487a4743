"""The attention backends and the one rule that picks among them.

Each backend module declares a :class:`Backend`: what it runs on, what a layer may ask of it, and
whether it reads a paged cache (or a shared-prefix key index) in place. :func:`choose` reads those
declarations; it knows no backend by its code. Adding a backend is one module and one entry in
:data:`_MODULES` (and, if ``"auto"`` should pick it, a place in :data:`AUTO_ORDER`).

Nothing here reads global state: the caller (:class:`nopad.packing.attention.plan.AttentionPlan`, once
per forward) puts ``NOPAD_ATTN_BACKEND`` and the batch-invariant mode into the request and the
:class:`Call`.
"""

from __future__ import annotations

import importlib
import logging
import warnings
from collections.abc import Callable
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

BACKEND_ENV = "NOPAD_ATTN_BACKEND"  # overrides backend="auto" everywhere (training and generator)
NO_SINKS = "does not take attention sinks"  # a gap no install fixes


@dataclass(frozen=True)
class Call:
    """What one attention call needs, as :func:`choose_backend` sees it."""

    device: torch.device
    dtype: torch.dtype
    softcap: float | None = None
    window: int | None = None
    paged: bool = False  # keys in a paged cache (a generation step)
    block_size: int = 1  # the paged cache's block size
    shared_prefix: bool = False  # keys read through meta.key_index (a shared-prefix training row)
    grad: bool = False  # a training forward that needs a backward
    static: bool = False  # a static-shape decode step (CUDA graphs / torch.compile): lengths on the device
    invariant: bool = False  # inside nopad.packing.batch_invariant(): a fixed per-query order is required
    kernels: str | None = None  # the mode's forced kernel set ("cpu" / "triton"), None: by device
    sinks: bool = False  # the layer has attention sinks (gpt-oss): a per-head logit in every softmax


@dataclass(frozen=True)
class Backend:
    """One attention implementation and what it supports.

    ``forward(q, k, v, meta, opts, table=None, block_size=1)`` returns ``(total_q, heads, dim)``;
    with ``table`` the keys are a paged cache flattened to ``(blocks * block_size, kv_heads,
    dim)`` read through ``table`` (``meta.key_index`` with ``block_size=1`` for a shared-prefix
    row). ``opts`` is an :class:`Opts`."""

    name: str
    forward: Callable
    devices: tuple[str, ...]  # where "auto" may pick it ("cpu", "cuda")
    dtypes: tuple[torch.dtype, ...]
    grad: bool = True  # differentiable itself; else the dispatcher recomputes the backward
    invariant: bool = False  # a fixed per-query order: allowed in nopad.packing.batch_invariant()
    reads_pages: Callable[[int], bool] | None = None  # block sizes it reads in place (None: gathered)
    static_decode: Callable | None = None  # decode with device-only lengths, CUDA-graph safe
    missing: Callable[[Call], str | None] | None = None  # what the installed library lacks for a call
    install: str = ""  # what to install when missing (for messages)
    sinks: bool = False  # takes attention sinks (Opts.sinks); "auto" never picks one that does not

    def reads_in_place(self, call: Call) -> bool:
        """True when this backend reads the call's paged cache or key index without a gather."""
        if call.shared_prefix:
            return self.reads_pages is not None and self.reads_pages(1)
        return call.paged and self.reads_pages is not None and self.reads_pages(call.block_size)

    def gap(self, call: Call, *, forced: bool = False) -> str | None:
        """Why this backend cannot serve ``call`` (None when it can). A forced backend is not
        held to its device list (the tests run GPU backends' stand-ins on CPU)."""
        if not forced and call.device.type not in self.devices:
            return f"does not run on {call.device.type}"
        if call.dtype not in self.dtypes:
            names = ", ".join(str(d).removeprefix("torch.") for d in self.dtypes)
            return f"runs {names} only, not {str(call.dtype).removeprefix('torch.')}"
        if call.invariant and not self.invariant:
            return "has no fixed per-query order (nopad.packing.batch_invariant() is on)"
        if call.static and self.static_decode is None:
            return "has no static-shape decode path"
        if call.sinks and not self.sinks:
            return NO_SINKS
        return self.missing(call) if self.missing is not None else None


@dataclass(frozen=True)
class Opts:
    """The layer's attention options, spelled once for every backend."""

    causal: bool = True
    scale: float = 1.0
    window: int | None = None
    softcap: float | None = None
    # attention sinks: one logit per query head ``(heads,)`` in each row's softmax denominator,
    # with no value (gpt-oss's ``s_aux``); only backends declared ``sinks=True`` receive them
    sinks: torch.Tensor | None = None


# Backend modules; each defines BACKENDS, a tuple of Backend declarations. Imported on first use.
_MODULES = ("flash", "torch_varlen", "flex", "cpu_kernel", "triton_kernel", "sdpa")

# "auto": the first backend in a list that can serve the call. A paged step first looks for one
# that reads the blocks in place, then takes the training list on gathered keys.
AUTO_ORDER = {
    ("cuda", "train"): ("flash", "torch_varlen", "flex", "sdpa_loop"),
    ("cuda", "paged"): ("flash", "torch_varlen", "triton"),
    ("cpu", "train"): ("sdpa_loop",),
    ("cpu", "paged"): ("kernel",),
    # nopad.packing.batch_invariant(): only backends with a fixed per-query order
    ("cuda", "invariant"): ("triton",),
    ("cpu", "invariant"): ("kernel", "per_token"),
    ("triton", "invariant"): ("triton",),  # the Triton kernel set forced (e.g. on CPU, interpreted)
}
# "auto" takes these only for calls that need them: FlexAttention for a score mod (softcap)
AUTO_ONLY_FOR = {"flex": lambda call: call.softcap is not None}
_FALLBACK = "sdpa_loop"  # exact everywhere; the last resort of every list

_registry: dict[str, Backend] = {}
_said: set = set()  # decisions and warnings already logged (each once per process)


def backends() -> dict[str, Backend]:
    """Every registered backend by name."""
    if not _registry:
        for module in _MODULES:
            for backend in importlib.import_module(f"nopad.packing.attention.{module}").BACKENDS:
                _registry[backend.name] = backend
    return _registry


def names() -> tuple[str, ...]:
    """Accepted values of ``backend=`` / ``NOPAD_ATTN_BACKEND``."""
    return ("auto", *backends())


def say_once(key, message: str, *args, warn: bool = False) -> None:
    """Log (or warn) ``message`` the first time ``key`` is seen in this process."""
    if torch.compiler.is_compiling():
        _say_while_tracing(key, message, args, warn)
        return
    _say(key, message, args, warn)


@torch._dynamo.assume_constant_result
def _say_while_tracing(key, message: str, args: tuple, warn: bool) -> bool:
    """:func:`say_once` from a compiled forward: run by dynamo once, as it traces, and kept in the
    graph as a constant. Logged or warned from traced code, it broke the graph."""
    _say(key, message, args, warn)
    return True


def _say(key, message: str, args: tuple, warn: bool) -> None:
    if key in _said:
        return
    _said.add(key)
    if warn:
        warnings.warn(message % args, RuntimeWarning, stacklevel=4)
    else:
        logger.info(message, *args)


def invariant_names(device_type: str) -> tuple[str, ...]:
    """The backends declared ``invariant`` (a fixed per-query order) that run on ``device_type``."""
    return tuple(name for name, b in backends().items() if b.invariant and device_type in b.devices)


def requested_backend(override: str | None, env: str | None) -> str:
    """``override`` (``backend=``) unless it is "auto", else ``env`` (the value of
    ``NOPAD_ATTN_BACKEND``, read by the caller), else "auto"."""
    keyword = override not in (None, "auto")
    name = override if keyword else (env or "auto")
    if name not in names():
        source = "backend=" if keyword else f"{BACKEND_ENV}="
        raise ValueError(f"unknown attention backend {source}{name!r}; choose one of {names()}")
    return name


def choose(call: Call, requested: str = "auto") -> Backend:
    """The one rule for which attention backend runs a call: ``requested`` (a name of
    :func:`names`, already resolved by :func:`requested_backend`) or "auto" (see
    :func:`nopad.packing.attention.plan.choose_backend`)."""
    table = backends()
    if requested != "auto":
        backend = table[requested]
        gap = backend.gap(call, forced=True)
        if gap is None:
            return _decided(call, requested, backend)
        if requested == "flash" and call.dtype not in backend.dtypes:  # flash on fp32: exact SDPA instead
            say_once(("dtype", call.dtype), _DTYPE_ADVICE, call.dtype, warn=True)
            return _decided(call, requested, table[_FALLBACK])
        raise _refusal(requested, backend, gap, call)
    return _decided(call, requested, _auto(call, table))


_DTYPE_ADVICE = (
    "nopad: the FlashAttention kernels (flash-attn, torch varlen) run fp16/bf16 only, so %s "
    "attention runs per-sequence SDPA (exact, slower). To use them, train under "
    "torch.autocast('cuda', dtype=torch.bfloat16) (Accelerate mixed_precision='bf16') or load "
    "the model with dtype=torch.bfloat16."
)


def _auto(call: Call, table: dict[str, Backend]) -> Backend:
    device = call.device.type if call.device.type in ("cpu", "cuda") else "cuda"
    if call.invariant:
        key = "triton" if call.kernels == "triton" else device
        candidates = [n for n in AUTO_ORDER[(key, "invariant")] if n in table]
        for name in candidates:
            if table[name].gap(call, forced=key == "triton") is None:
                return table[name]
        asked = "batch_invariant(kernels='triton')" if key == "triton" else "batch_invariant()"
        advice = (
            "; use CUDA, or on CPU leave kernels=None for nopad's CPU set"
            if key == "triton" and call.device.type == "cpu"
            else ""
        )
        raise ValueError(
            f"{asked} needs an attention backend with a fixed per-query order, and none of "
            f"{candidates} can serve {call.dtype} on {call.device}: "
            + "; ".join(f"{n} {table[n].gap(call, forced=True)}" for n in candidates)
            + advice
        )
    if call.paged or call.static:  # a shared-prefix row takes the training rule (gathered keys)
        for name in AUTO_ORDER.get((device, "paged"), ()):
            backend = table.get(name)
            if backend is None:
                continue
            if (call.static or backend.reads_in_place(call)) and backend.gap(call) is None:
                return backend
    gaps = []  # (name, why) of the preferred backends that could not serve the call
    for name in AUTO_ORDER[(device, "train")]:
        backend = table[name]
        if name in AUTO_ONLY_FOR and not AUTO_ONLY_FOR[name](call):
            continue
        gap = backend.gap(call)
        if gap is None:
            _explain(call, gaps, backend)
            return backend
        if not gap.startswith("does not run"):
            gaps.append((name, gap))
    _explain(call, gaps, table[_FALLBACK])
    return table[_FALLBACK]


def choose_differentiable(call: Call) -> Backend:
    """A backend with its own backward for ``call``, ignoring :func:`nopad.packing.batch_invariant`
    (the mode fixes the forward only): what a forward-only kernel's backward recomputes with."""
    device = call.device.type if call.device.type in ("cpu", "cuda") else "cuda"
    table = backends()
    for name in AUTO_ORDER[(device, "train")]:
        backend = table[name]
        if name in AUTO_ONLY_FOR and not AUTO_ONLY_FOR[name](call):
            continue
        if (
            backend.grad
            and call.device.type in backend.devices
            and call.dtype in backend.dtypes
            and (backend.sinks or not call.sinks)
            and (backend.missing is None or backend.missing(call) is None)
        ):
            return backend
    return table[_FALLBACK]


def _explain(call: Call, gaps: list[tuple[str, str]], chosen: Backend) -> None:
    """Say once why the preferred backends did not run and what would make them run: a warning
    when a CUDA call falls back to per-sequence SDPA, an info line otherwise."""
    if not gaps:
        return
    if any(name == "flash" and call.dtype not in backends()[name].dtypes for name, _ in gaps):
        say_once(("dtype", call.dtype), _DTYPE_ADVICE, call.dtype, warn=True)
        return
    fallback = chosen.name == _FALLBACK and call.device.type == "cuda"
    hints = {name: f" ({b.install})" if b.install else "" for name, b in backends().items()}
    reasons = "; ".join(f"{name} {gap}{hints[name] if gap != NO_SINKS else ''}" for name, gap in gaps)
    say_once(
        ("gaps", tuple(gaps), chosen.name),
        "nopad: attention runs %s%s: %s",
        chosen.name,
        " (a Python loop over sequences, slow on a GPU)" if fallback else "",
        reasons,
        warn=fallback,
    )


def _refusal(requested: str, backend: Backend, gap: str, call: Call) -> Exception:
    hint = f" ({backend.install})" if backend.install and "not installed" in gap else ""
    if call.invariant and not backend.invariant:
        return ValueError(
            f"batch_invariant() needs an attention path with a fixed per-query order, but "
            f"backend {requested!r} was requested; use backend='auto' in the mode"
        )
    error = RuntimeError if "not installed" in gap or "does not import" in gap else ValueError
    return error(
        f"attention backend {requested!r} was requested ({BACKEND_ENV} or backend=) but it {gap}"
        f"{hint}; use backend='auto'"
    )


def _decided(call: Call, requested: str, backend: Backend) -> Backend:
    key = ("choice", str(call.device), call.dtype, requested, backend.name, call.paged, call.shared_prefix)
    say_once(
        key,
        "nopad attention on %s %s%s: %s (requested %s)",
        call.device,
        call.dtype,
        " (paged)" if call.paged else "",
        backend.name,
        requested,
    )
    return backend
