"""The varlen causal (depthwise, short) convolution: the one implementation nopad's hybrid
layers use - LFM2's short convolution, the convolution in front of Gated DeltaNet, KDA and Mamba.

Each output token reads the ``K - 1`` inputs before it *on its own sequence*: a packed row's
sequences start from a zero state (or a given initial state), and a prefix-tree row's segment
continues from its parent's last ``K - 1`` inputs, so every path computes what its flat sequence
computes. The reference (CPU, and CUDA without the package) gathers each token's window along its
path (``VarlenMeta.previous_rows``) and sums ``K`` weighted gathers: exact, differentiable, and
the same code for packed and tree rows. On CUDA with ``causal-conv1d`` installed a packed row
goes to its kernel with ``seq_idx`` (its documented way to keep sequences apart); tree rows and
initial states stay on the reference (that kernel takes no per-sequence initial state with
``seq_idx``). ``NOPAD_MIXER_KERNELS`` picks (:mod:`nopad.packing.mixers.kernels`). A generator decode step (static
or not) is one ``cat`` of each sequence's state and token and ``K`` products, no host lengths read,
so it compiles and captures. Inside
:func:`nopad.packing.batch_invariant` every row takes the gathers (elementwise ops in one fixed order:
oldest input first, then the bias), so a token gets the same bits in a training row, a prefill
chunk and a decode step; the one-call paths sum in an order of their own.

State convention (``causal-conv1d``'s): a sequence's conv state is its last ``K - 1`` inputs,
``(num_seqs, C, K - 1)``, oldest first, zeros before the sequence's first token.
"""

from __future__ import annotations

import weakref

import numpy as np
import torch
import torch.nn.functional as F

from nopad.packing import invariance
from nopad.packing.mixers.kernels import package_function
from nopad.packing.mixers.recurrence import parent_rows
from nopad.packing.varlen import VarlenMeta

_ACTIVATIONS = {None: None, "silu": F.silu, "swish": F.silu}
_WINDOWS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # meta -> {(K, init): (rows, final rows)}


def varlen_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    activation: str | None = None,
    *,
    meta: VarlenMeta | None = None,
    cu_seqlens: torch.Tensor | None = None,
    initial_states: torch.Tensor | None = None,
    return_final_states: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Depthwise causal convolution of a varlen row, each sequence apart.

    ``x``: ``(1, T, C)`` or ``(C, T)``; ``weight``: ``(C, K)``; ``bias``: ``(C,)``; ``activation``:
    None, ``"silu"`` or ``"swish"``. The row's sequences: ``meta`` (a packed or prefix-tree row)
    or ``cu_seqlens`` (int ``(N + 1,)``, a packed row). ``initial_states``: ``(N, C, K - 1)``, each
    sequence's conv state before its first token (packed rows only: a tree segment starts from
    its parent's inputs). Returns the output in ``x``'s layout and dtype, and with
    ``return_final_states`` each sequence's final conv state ``(N, C, K - 1)``."""
    meta = _boundaries(x, meta, cu_seqlens)
    if x.dim() == 3:
        if x.shape[0] != 1:
            raise ValueError(f"a varlen row has batch size 1; got x of shape {tuple(x.shape)}")
        tokens = x[0]
    elif x.dim() == 2:
        tokens = x.t()
    else:
        raise ValueError(f"x must be (1, T, C) or (C, T); got shape {tuple(x.shape)}")
    length, channels = tokens.shape
    if weight.dim() != 2 or weight.shape[0] != channels:
        raise ValueError(f"weight must be (C, K) = ({channels}, K); got {tuple(weight.shape)}")
    if activation not in _ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: use None, 'silu' or 'swish'")
    kernel = weight.shape[1]
    if initial_states is not None:
        expected = (meta.num_seqs, channels, kernel - 1)
        if tuple(initial_states.shape) != expected:
            raise ValueError(f"initial_states must be (N, C, K - 1) = {expected}; got {tuple(initial_states.shape)}")
        if meta.key_rows is not None:
            raise ValueError("initial_states apply to packed rows; a prefix-tree segment starts from its parent")
    if meta.is_static and initial_states is None:
        raise ValueError("a static decode step continues each row from its conv state: pass initial_states")
    out = None
    one_call = initial_states is None and meta.key_rows is None and not invariance.is_enabled()
    if one_call:
        kernel_fn = package_function("causal_conv1d", "causal_conv1d_fn", tokens)
        if kernel_fn is not None:  # (1, C, T) channel-last, as the kernel's seq_idx path wants
            out = kernel_fn(tokens.t()[None], weight, bias, seq_idx=meta.seq_idx[None], activation=activation)
            out = out[0].t()
    if out is None and one_call:
        out = _flat_conv(tokens.to(weight.dtype), weight, bias, activation, meta).to(x.dtype)
    if out is not None and not return_final_states:
        return out[None] if x.dim() == 3 else out.t()
    one_each = meta.is_static or (meta.max_seqlen_q == 1 and meta.total_q == meta.num_seqs)  # one token each
    if initial_states is not None and meta.key_rows is None and one_each:  # a decode step
        out, final = _decode_conv(tokens.to(weight.dtype), weight, bias, activation, initial_states)
        out = out.to(x.dtype)
        out = out[None] if x.dim() == 3 else out.t()
        return (out, final) if return_final_states else out
    rows, final_rows = _windows(meta, kernel, initial_states is not None)
    source = _source(tokens.to(weight.dtype), initial_states, kernel)
    if out is None:
        out = source[rows[:, 0]] * weight[:, 0]
        for j in range(1, kernel):
            out = out + source[rows[:, j]] * weight[:, j]
        if bias is not None:
            out = out + bias
        act = _ACTIVATIONS[activation]
        out = (act(out) if act is not None else out).to(x.dtype)
    out = out[None] if x.dim() == 3 else out.t()
    if not return_final_states:
        return out
    return out, source[final_rows].transpose(1, 2)


def _decode_conv(
    tokens: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    initial_states: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per sequence after its state (a decode step): each window is the sequence's
    state and its token, ``(N, C, K)`` by one ``cat``, summed in the gathers' order (oldest input
    first, then the bias), so the bits are the reference's; the final state is the window's
    last ``K - 1`` inputs."""
    window = torch.cat([initial_states.to(tokens.dtype), tokens[:, :, None]], dim=2)
    out = window[:, :, 0] * weight[:, 0]
    for j in range(1, weight.shape[1]):
        out = out + window[:, :, j] * weight[:, j]
    if bias is not None:
        out = out + bias
    act = _ACTIVATIONS[activation]
    return (act(out) if act is not None else out), window[:, :, 1:]


def _flat_conv(
    tokens: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None, meta: VarlenMeta
) -> torch.Tensor:
    """A packed row from zero states: one depthwise ``F.conv1d`` over the row laid with ``K - 1``
    zero rows before each sequence, so no window crosses a boundary (the layer's own convolution,
    one call; the gather reference costs ``K`` gathers and their scatter-add backward)."""
    kernel = weight.shape[1]
    cache = _WINDOWS.setdefault(meta, {})
    if (kernel, "flat") not in cache:
        parent_rows(meta)  # refuses a row whose context is in a cache
        lens = np.asarray(meta.seqlens_q, dtype=np.int64)
        gap = kernel - 1
        seq = np.repeat(np.arange(lens.size), lens)
        laid = np.arange(meta.total_q) + gap * (seq + 1)  # each token's place in the laid-out row
        gather = np.full(meta.total_q + gap * lens.size, meta.total_q, dtype=np.int64)  # the zero row
        gather[laid] = np.arange(meta.total_q)
        cache[(kernel, "flat")] = (
            torch.from_numpy(gather).to(meta.device),
            torch.from_numpy(laid - gap).to(meta.device),
        )
    gather, place = cache[(kernel, "flat")]
    laid_out = torch.cat([tokens, tokens.new_zeros(1, tokens.shape[1])])[gather]
    out = F.conv1d(laid_out.t()[None], weight[:, None, :], bias, groups=weight.shape[0])[0]
    act = _ACTIVATIONS[activation]
    out = out.index_select(1, place).t()
    return act(out) if act is not None else out


def _boundaries(x: torch.Tensor, meta: VarlenMeta | None, cu_seqlens: torch.Tensor | None) -> VarlenMeta:
    if (meta is None) == (cu_seqlens is None):
        raise ValueError("give the row's sequences as exactly one of meta or cu_seqlens")
    if meta is None:
        lengths = torch.diff(cu_seqlens.detach().cpu().to(torch.int64))
        meta = VarlenMeta.from_lengths(lengths, device=x.device)
    length = x.shape[1] if x.dim() == 3 else x.shape[-1]
    if meta.is_static and meta.total_q == length:  # a static decode step: one token a row, on the device
        return meta
    if meta.seqlens_q is None or meta.total_q != length:
        raise ValueError(
            f"the row has {length} tokens but its boundaries describe "
            f"{None if meta.seqlens_q is None else meta.total_q}; a nopad row runs with "
            "use_cache=False"
        )
    return meta


def _source(tokens: torch.Tensor, initial_states: torch.Tensor | None, kernel: int) -> torch.Tensor:
    """The rows windows read: the tokens, then each sequence's initial state, then a zero row."""
    parts = [tokens]
    if initial_states is not None:
        parts.append(initial_states.to(tokens.dtype).transpose(1, 2).reshape(-1, tokens.shape[1]))
    parts.append(tokens.new_zeros(1, tokens.shape[1]))
    return torch.cat(parts)


def _windows(meta: VarlenMeta, kernel: int, with_initial: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """``(T, K)`` source rows of each token's window (oldest first, the token last) and ``(N, K - 1)``
    source rows of each sequence's final state; cached per meta."""
    cache = _WINDOWS.setdefault(meta, {})
    key = (kernel, with_initial)
    if key not in cache:
        cache[key] = _build_windows(meta, kernel, with_initial)
    return cache[key]


def _build_windows(meta: VarlenMeta, kernel: int, with_initial: bool) -> tuple[torch.Tensor, torch.Tensor]:
    total, num = meta.total_q, meta.num_seqs
    lens = np.asarray(meta.seqlens_q, dtype=np.int64)
    cu = np.concatenate(([0], np.cumsum(lens)))
    if meta.key_rows is None:
        parent_rows(meta)  # refuses a row whose context is in a cache
        prev = np.arange(total, dtype=np.int64) - 1
        prev[cu[:-1][lens > 0]] = -1
    else:
        prev = meta.previous_rows().cpu().numpy().astype(np.int64)
    # rows[:, j] for j = K-1 (the token) down to 0; -m means m steps before the sequence's start
    rows = np.empty((total, kernel), dtype=np.int64)
    rows[:, kernel - 1] = np.arange(total)
    for j in range(kernel - 2, -1, -1):
        after = rows[:, j + 1]
        rows[:, j] = np.where(after >= 0, prev[np.maximum(after, 0)], after - 1)
    # each sequence's final window: its last token's (or all before-start rows when empty)
    final = np.empty((num, kernel - 1), dtype=np.int64)
    has = lens > 0
    final[has] = rows[cu[1:][has] - 1, 1:]
    final[~has] = -np.arange(kernel - 1, 0, -1)
    seq_of_rows = np.repeat(np.arange(num), lens)
    zero_row = total + (num * (kernel - 1) if with_initial else 0)
    rows = _resolve(rows, seq_of_rows, total, kernel, with_initial, zero_row)
    final = _resolve(final, np.arange(num), total, kernel, with_initial, zero_row)
    return torch.from_numpy(rows).to(meta.device), torch.from_numpy(final).to(meta.device)


def _resolve(
    rows: np.ndarray, seq: np.ndarray, total: int, kernel: int, with_initial: bool, zero_row: int
) -> np.ndarray:
    """Map ``-m`` (m steps before the start of the row's sequence ``seq``) to that sequence's
    initial-state row, or to the zero row."""
    before = rows < 0
    if not with_initial:
        return np.where(before, zero_row, rows)
    state_rows = total + seq[:, None] * (kernel - 1) + (kernel - 1) + rows  # m = -rows back from the end
    return np.where(before, state_rows, rows)
