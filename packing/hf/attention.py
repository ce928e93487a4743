"""nopad as a transformers attention implementation: packed training and paged generation on
any HF decoder that routes attention through ``AttentionInterface`` — no model fork.

Setup::

    from nopad.packing.hf import register_nopad_attention, use_nopad_attention
    register_nopad_attention()                       # idempotent
    model.set_attn_implementation("nopad")           # or, for a block: with use_nopad_attention(model):

Contract (keyword arguments of ``model(...)``; transformers forwards unknown keyword arguments
to every attention call, where ``nopad_attention`` reads them):

Packed training row — ``model(input_ids, position_ids=..., nopad_meta=meta, labels=...)``
    ``input_ids`` ``(1, T)`` holds the concatenated sequences, ``position_ids`` ``(1, T)`` is
    ``meta.position_ids[None]`` (RoPE needs it; it is checked against ``meta``), ``nopad_meta`` the
    row's :class:`~nopad.packing.varlen.VarlenMeta`. Without ``nopad_meta`` the boundaries are derived
    from ``position_ids`` (a sequence starts where the position is 0): attention-only models only,
    since a convolution or recurrent layer gets no boundaries that way. Without either, each batch
    row is one sequence. A 2-D ``attention_mask`` with padding is refused.

Generation step (paged K/V) — the generator passes::

    model(input_ids=ids[None], position_ids=meta.position_ids[None], use_cache=False,
          nopad_meta=meta, nopad_kv_cache=kv)

    ``meta = VarlenMeta.for_step(query_lens, context_lens, block_table=..., slot_mapping=...)``;
    ``kv[layer_idx] -> (k_cache, v_cache)`` each ``(num_blocks, block_size, kv_heads, head_dim)``
    (a list, a dict, or a callable ``kv(layer_idx)``). Each layer writes the step's new K/V at
    ``meta.slot_mapping`` and attends through ``meta.block_table``, with the backend the registry
    picks (:func:`nopad.packing.attention.choose_backend`: on CPU the compiled kernel, reading the blocks
    in place; on CUDA flash-attn, torch's varlen kernel or nopad's Triton kernel), or the one named by
    ``nopad_backend=`` (``"sdpa_loop"``...). ``use_cache=False`` keeps transformers' cache out.

Planned once per forward: transformers calls the mask hook (:func:`nopad_mask`) once per forward
(per mask kind) and passes its result to every layer as ``attention_mask``. nopad's hook returns an
:class:`~nopad.packing.attention.plan.AttentionPlan`, which reads ``NOPAD_ATTN_BACKEND`` and the
batch-invariant mode then; every layer reads its backend and the forward's resolved meta (derived,
moved, checked once) from it. A model whose forward builds no mask gets a plan per layer call.

Layer options come from the module call, as transformers passes them: ``scaling``,
``sliding_window`` (Mistral; Gemma2/Qwen2 per layer type), ``softcap`` (Gemma2), and
``module.is_causal`` / ``module.layer_idx``, and ``s_aux`` (GPT-OSS's attention sinks: one logit
per head in every softmax denominator, passed on as ``sinks``; only backends that take them run
such a layer). Any other attention argument that carries a value is an error naming the model:
nopad would otherwise compute attention without it.

Layouts: keys and values of different head sizes (MLA: DeepSeek-V3, Kimi) run as one size, the
values zero-padded (:func:`nopad.packing.attention.dispatch.one_head_dim`); a layer that reuses an
earlier layer's K/V (Gemma4's shared layers) gets that layer's keys from transformers and, in the
generator, that layer's blocks (:func:`nopad.inference.kv_cache.kv_layout`).

Precision and devices: q, k and v are cast to one compute dtype first, as transformers does for
flash-attn (the autocast dtype under ``torch.autocast``, else the layer's weight dtype: RoPE
leaves q/k in fp32 under bf16 autocast while v is bf16). Boundaries derived here are built on
the query's device, and a ``nopad_meta`` on another device (DDP does not scatter it) is moved
with :meth:`VarlenMeta.to` once per forward (by the first layer, kept in the plan).

Keeping ``attn_implementation="sdpa"``/``"eager"``/``"flash_attention_2"`` instead: transformers'
own packed path runs (it derives a block-diagonal mask, or FA2 varlen, from packed
``position_ids``) — but only with ``attention_mask=None`` and ``use_cache=False``; otherwise it
silently attends across sequences. :func:`~nopad.packing.hf.packed_call.packed_forward_guard` turns those
cases into errors.
"""

from __future__ import annotations

import contextlib
import logging

import torch
import transformers
from transformers.masking_utils import AttentionMaskInterface

from nopad.packing.attention import registry, varlen_attention
from nopad.packing.attention.plan import AttentionPlan, PlannedRow
from nopad.packing.distributed import compute_dtype
from nopad.packing.hf.packed_call import packed_forward_guard
from nopad.packing.hf.rope import check_row_lengths, rope_switch_length
from nopad.packing.mixers import GENERATE, PACKED, TREE, UnsupportedMixerError, check_calling_model, check_model
from nopad.packing.mixers.patches import install as install_patches
from nopad.packing.mixers.support import NOPAD_ATTENTION, POSITIONS
from nopad.packing.varlen import VarlenMeta

logger = logging.getLogger(__name__)


# keyword arguments transformers passes to every attention call that need nothing from us:
# TransformersKwargs / FlashAttentionKwargs (the boundaries come from nopad_meta/position_ids)
HARMLESS_KWARGS = frozenset(
    {
        "use_cache",
        "cache_position",
        "past_key_values",
        "output_attentions",
        "output_hidden_states",
        "output_router_logits",
        "return_dict",
        "num_items_in_batch",
        "cu_seq_lens_q",
        "cu_seq_lens_k",
        "max_length_q",
        "max_length_k",
        "seq_idx",
        "layer_idx",
        "nopad_trace",
    }
)


def _derive_meta(
    position_ids: torch.Tensor | None, batch: int, q_len: int, k_len: int, device: torch.device
) -> VarlenMeta:
    """Boundaries when the caller passed no ``nopad_meta``: transformers' own cache (decode with
    ``generate``), packed ``position_ids``, or one sequence per batch row, on the query's
    ``device``."""
    if k_len != q_len:  # transformers' DynamicCache: each row is one sequence with context
        return VarlenMeta.for_step([q_len] * batch, [k_len - q_len] * batch, device=device)
    if position_ids is None:
        return VarlenMeta.from_lengths([q_len] * batch, device=device)
    pos = position_ids.expand(batch, -1) if position_ids.shape[0] != batch else position_ids
    return VarlenMeta.from_position_ids(pos.reshape(-1)).to(device)


def _no_meta_error(module: torch.nn.Module, err: ValueError) -> ValueError:
    """Why a row's boundaries could not come from ``position_ids``: usually a decoder layer that does
    not hand its keyword arguments on to attention (StableLM, Nemotron), so a tree row's or a
    generator step's ``nopad_meta`` never arrives and its positions are read as a flat row."""
    name = type(module).__name__
    return ValueError(
        f"{name} got no nopad_meta, and its position_ids are not one flat packed row ({err}). If you passed "
        f"nopad_meta (a prefix-tree row, a Generator step), a layer between the model and {name} did not "
        "hand it on: this model's decoder layers drop the attention keyword arguments, so nopad can run it "
        "on flat packed rows only (boundaries from position_ids), not on tree rows or in the Generator. "
        "Train it on flat rows (no shared prefix) and generate with HF generate (docs/models.md)"
    )


def _forward_meta(
    plan: AttentionPlan,
    module: torch.nn.Module,
    nopad_meta: VarlenMeta | None,
    position_ids: torch.Tensor | None,
    shape: tuple,
) -> VarlenMeta:
    """The forward's meta: resolved by its first layer and kept in the plan for the others."""
    if plan.row is not None and plan.row.matches(nopad_meta, position_ids, shape):
        return plan.row.meta
    batch, q_len, k_len, device = shape
    if nopad_meta is None:
        try:
            meta = _derive_meta(position_ids, batch, q_len, k_len, device)
        except ValueError as err:
            raise _no_meta_error(module, err) from None
    else:
        meta = nopad_meta.to(device)
        if not meta.is_static:
            _check_positions(meta, position_ids)
    plan.row = PlannedRow(nopad_meta, position_ids, shape, meta)
    return meta


def _check_kwargs(module: torch.nn.Module, kwargs: dict) -> None:
    """An attention argument we do not implement but that carries a value would be silently
    dropped: refuse it, naming the model."""
    unknown = [k for k, v in kwargs.items() if v is not None and k not in HARMLESS_KWARGS]
    if unknown:
        unknown.sort()
        config = getattr(module, "config", None)
        family = getattr(config, "model_type", None) or "unknown"
        raise ValueError(
            f"{type(module).__name__} (model_type {family!r}) passes attention argument(s) {unknown} that "
            "nopad attention does not implement; its output would be wrong without them. Keep this model on "
            "attn_implementation='eager'/'sdpa', or open an issue to add support."
        )


POSITIONS_MISMATCH = (
    "position_ids do not match nopad_meta.position_ids; pass "
    "position_ids=meta.position_ids[None] so rotary embeddings see each sequence's "
    "own positions"
)


def _check_positions(meta: VarlenMeta, position_ids: torch.Tensor | None) -> None:
    """RoPE used ``position_ids``; attention uses ``meta``. They must describe the same row."""
    if position_ids is None:
        return
    flat = position_ids.reshape(-1)
    mine = meta.position_ids
    if torch.compiler.is_compiling():
        # a traced forward: no data pointers, no Python bool of a tensor (each broke the graph);
        # the comparison runs in the graph and fails the step with the same message (on CUDA a
        # device-side assert: inductor compiles its Triton kernels with asserts on, message to stderr)
        if flat.numel() != meta.total_q:
            raise ValueError(POSITIONS_MISMATCH)
        torch._assert_async((flat.to(mine.device) == mine).all(), POSITIONS_MISMATCH)
        return
    if (
        flat.device == mine.device
        and flat.data_ptr() == mine.data_ptr()
        and flat.shape == mine.shape
        and flat.stride() == mine.stride()
        and flat.dtype == mine.dtype
    ):
        return  # the runner passed meta.position_ids[None] itself: nothing to compare, no sync
    if flat.numel() != meta.total_q or not torch.equal(flat.to(meta.position_ids.device), meta.position_ids):
        raise ValueError(POSITIONS_MISMATCH)


def _row_context(meta: VarlenMeta, kv_cache, batch: int) -> str | None:
    """What the forward asks of every other layer of the model (``nopad.packing.mixers``): a paged step,
    a prefix-tree row, a row holding several sequences; None for one sequence per batch row,
    which any layer computes as it would alone."""
    if kv_cache is not None:
        return GENERATE
    if meta.key_index is not None:
        return TREE
    return PACKED if meta.num_seqs > batch else None


def _check_rope_row(module: torch.nn.Module, meta: VarlenMeta, context: str) -> None:
    """A row whose rotary scaling the longest sequence would switch for all (:mod:`nopad.packing.hf.rope`);
    the generator keeps every sequence under the switch instead (``nopad.inference.Generator``)."""
    config = getattr(module, "config", None)
    if config is None or context == GENERATE or rope_switch_length(config) is None:
        return
    why = check_row_lengths(config, meta.seqlens_k, tree=context == TREE)
    if why:
        raise UnsupportedMixerError(f"{type(module).__name__}: {why}")


def _refuse_bidirectional(module: torch.nn.Module, sliding_window: int | None, kv_cache) -> None:
    """Bidirectional attention (Gemma3/4 with ``use_bidirectional_attention``): nopad's varlen core
    keeps each sequence's tokens apart, but its window over a bidirectional layer reaches the whole
    future (transformers': ``|q - k| < window``), and a paged step sees no future at all. Both
    gave other answers with no error, even for one sequence alone; refused instead."""
    where = (
        "a paged generator step"
        if kv_cache is not None
        else (f"a sliding window of {sliding_window}" if sliding_window else None)
    )
    if where is not None:
        raise UnsupportedMixerError(
            f"{type(module).__name__} (layer {getattr(module, 'layer_idx', None)}) is bidirectional (not "
            f"causal), which nopad's attention does not compute with {where}: keep this model on sdpa, "
            "unpacked (docs/models.md)"
        )


def _layer_cache(kv, module: torch.nn.Module, plan: AttentionPlan):
    """The layer's paged K/V, once per forward: a layer that calls the attention twice in one step
    (DiffLlama's differential attention: the same keys, two halves of the values) would write its
    second values over its first in the one K/V its layer holds, and read them back for both
    calls on every later step, silently wrong; it is refused instead."""
    if kv is None:
        return None
    layer_idx = getattr(module, "layer_idx", None)
    if layer_idx is None:
        raise ValueError("nopad_kv_cache needs module.layer_idx to pick the layer's cache")
    if layer_idx in plan.cache_layers:
        raise UnsupportedMixerError(
            f"{type(module).__name__} (layer {layer_idx}) calls the attention interface more than once per "
            "step: the generator's paged cache holds one K/V per layer, and the second call's values would "
            "overwrite the first's. Generate with HF generate for this model; packed training is unaffected."
        )
    plan.cache_layers.add(layer_idx)
    return kv(layer_idx) if callable(kv) else kv[layer_idx]


def nopad_attention(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: AttentionPlan | torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    softcap: float | None = None,
    nopad_meta: VarlenMeta | None = None,
    nopad_kv_cache=None,
    nopad_backend: str = "auto",
    position_ids: torch.Tensor | None = None,
    nopad_trace: list | None = None,
    s_aux: torch.Tensor | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers attention function: ``query`` ``(B, heads, T, dim)``, ``key``/``value``
    ``(B, kv_heads, S, dim)``; returns ``((B, T, heads, dim), None)``. ``attention_mask`` is the
    forward's plan (what :func:`nopad_mask` returned)."""
    if nopad_trace is not None:  # the caller's own record of the calls (nopad.packing.verify counts them)
        nopad_trace.append(getattr(module, "layer_idx", None))
    if dropout:
        raise ValueError("nopad attention does not implement attention dropout; set attention_dropout=0")
    if isinstance(attention_mask, torch.Tensor):
        raise ValueError("nopad attention takes no attention mask; pack the sequences instead of padding")
    plan = attention_mask if isinstance(attention_mask, AttentionPlan) else AttentionPlan()
    is_causal = kwargs.pop("is_causal", None)
    _check_kwargs(module, kwargs)
    batch, heads, q_len, dim = query.shape
    if nopad_meta is None and nopad_kv_cache is not None:
        raise ValueError("nopad_kv_cache needs nopad_meta (with block_table and slot_mapping)")
    meta = _forward_meta(plan, module, nopad_meta, position_ids, (batch, q_len, key.shape[2], query.device))
    if meta.total_q != batch * q_len:
        raise ValueError(f"nopad_meta describes {meta.total_q} tokens but the batch has {batch} x {q_len}")
    context = _row_context(meta, nopad_kv_cache, batch)
    if context == PACKED and nopad_meta is None:  # boundaries derived here: no other layer has them
        context = POSITIONS
    if context is not None and context not in plan.checked:
        check_calling_model(module, context)  # checks the whole model: once per forward is enough
        _check_rope_row(module, meta, context)
        plan.checked.add(context)
    causal = getattr(module, "is_causal", True) if is_causal is None else bool(is_causal)
    if not causal:
        _refuse_bidirectional(module, sliding_window, nopad_kv_cache)
    dtype = compute_dtype(module, query)
    q = query.transpose(1, 2).reshape(batch * q_len, heads, dim)
    k = key.transpose(1, 2).reshape(-1, key.shape[1], dim)
    v = value.transpose(1, 2).reshape(-1, value.shape[1], value.shape[-1])
    if not q.dtype == k.dtype == v.dtype == dtype:
        q, k, v = q.to(dtype), k.to(dtype), v.to(dtype)
    out = varlen_attention(
        q,
        k,
        v,
        meta,
        causal=causal,
        softmax_scale=scaling,
        sliding_window=sliding_window,
        softcap=softcap,
        kv_cache=_layer_cache(nopad_kv_cache, module, plan),
        backend=nopad_backend,
        plan=plan,
        sinks=s_aux,
    )
    return out.view(batch, q_len, heads, -1), None


def nopad_mask(*, attention_mask: torch.Tensor | None = None, **kwargs) -> AttentionPlan:
    """Mask hook, called once per forward: nopad needs no dense ``T x T`` mask (boundaries come
    from the meta), so the "mask" every layer receives is the forward's :class:`AttentionPlan`.
    A 2-D padding mask with zeros would be silently dropped, so refuse it."""
    if attention_mask is not None and not bool(attention_mask.all()):
        raise ValueError(
            "nopad attention got a padding attention_mask; pack the sequences into one row "
            "(see nopad.packing.pack) or use attn_implementation='sdpa' for padded batches"
        )
    return AttentionPlan()


def register_nopad_attention() -> str:
    """Register ``"nopad"`` with transformers' attention and mask interfaces and patch transformers
    for the hybrid mixers (:mod:`nopad.packing.mixers.patches`); idempotent. The attention backends load
    here, outside any trace (loaded by a compiled forward's first call, their imports broke its graph)."""
    install_patches()
    registry.backends()
    transformers.AttentionInterface.register(NOPAD_ATTENTION, nopad_attention)
    AttentionMaskInterface.register(NOPAD_ATTENTION, nopad_mask)
    return NOPAD_ATTENTION


@contextlib.contextmanager
def use_nopad_attention(model: transformers.PreTrainedModel, *, eval_mode: bool = False, context: str = PACKED):
    """Switch ``model`` to nopad attention (with :func:`packed_forward_guard`) for the block, and
    with ``eval_mode`` to eval mode (the generator's steps); restore both after, also on error.
    The one way nopad switches a model's attention for a block. A model with a layer nopad does not
    compute exactly for ``context`` (``nopad.packing.mixers``: packed rows, tree rows, generation) is
    refused first, naming the layer."""
    check_model(model, context)  # before anything is switched: a refusal leaves the model as it was
    register_nopad_attention()
    previous, training = model.config._attn_implementation, model.training
    if previous != NOPAD_ATTENTION:
        model.set_attn_implementation(NOPAD_ATTENTION)
    if eval_mode and training:
        model.eval()
    handle = packed_forward_guard(model, context)
    try:
        yield model
    finally:
        handle.remove()
        if eval_mode and training:
            model.train()
        if model.config._attn_implementation != previous:
            model.set_attn_implementation(previous)
