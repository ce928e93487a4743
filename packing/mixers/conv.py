"""A causal depthwise convolution over a packed row: each sequence sees only its own past (and
its ``initial_state``), never the tail of the sequence before it.

The short convolutions inside Mamba2, Gated DeltaNet and LFM2 layers are this operation. A
packed row run through ``F.conv1d`` lets the first ``width - 1`` tokens of a sequence read the
last tokens of the one before; here every sequence is preceded by its own ``width - 1`` columns
of state (zeros, or a prefix-tree parent's last inputs) and the window of each token is gathered
from there, in one vectorised pass on any device. It is nopad's reference: causal-conv1d
(``seq_idx``) is the CUDA fast path of the same thing where a caller has it.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

ACTIVATIONS = (None, "silu", "swish")


def varlen_causal_conv1d(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    cu_seqlens: torch.Tensor,
    initial_state: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Causal depthwise conv of the sequences of one row, each on its own.

    ``x``: ``(1, dim, T)``, the row laid out as causal-conv1d takes it; ``weight``: ``(dim,
    width)``; ``bias``: ``(dim,)`` or None; ``activation``: None, ``"silu"`` or ``"swish"``;
    ``cu_seqlens``: ``(n + 1,)`` sequence boundaries in the row; ``initial_state``: ``(n, dim,
    width - 1)``, the inputs before each sequence (None: zeros). Returns the output ``(1, dim,
    T)`` in ``x``'s dtype (computed in ``weight``'s, as transformers does) and each sequence's
    final state ``(n, dim, width - 1)``: its last ``width - 1`` inputs, the initial state's tail
    included when the sequence is shorter."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation must be one of {ACTIVATIONS}, got {activation!r}")
    if x.dim() != 3 or x.shape[0] != 1:
        raise ValueError(f"x must be one packed row (1, dim, T), got shape {tuple(x.shape)}")
    dim, total = x.shape[1], x.shape[2]
    width = weight.shape[-1]
    pad = width - 1
    device = x.device
    cu = cu_seqlens.to(device=device, dtype=torch.int64)
    lens = cu.diff()
    n = lens.numel()
    if int(cu[-1]) != total:
        raise ValueError(f"cu_seqlens covers {int(cu[-1])} tokens but x has {total}")
    if initial_state is None:
        initial_state = x.new_zeros(n, dim, pad)
    elif initial_state.shape != (n, dim, pad):
        raise ValueError(f"initial_state must be (sequences, dim, width - 1) = {(n, dim, pad)}, got "
                         f"{tuple(initial_state.shape)}")
    # the extended row: sequence i's pad state columns, then its tokens, then sequence i + 1's...
    seq = torch.arange(n, device=device)
    state_start = cu[:-1] + seq * pad  # column of sequence i's first state column
    token_col = torch.arange(total, device=device) + pad * (torch.repeat_interleave(seq, lens) + 1)
    state_cols = (state_start[:, None] + torch.arange(pad, device=device)).reshape(-1)
    source = torch.empty(total + n * pad, dtype=torch.int64, device=device)
    source[token_col] = torch.arange(total, device=device)
    source[state_cols] = total + torch.arange(n * pad, device=device)
    states = initial_state.to(x.dtype).permute(1, 0, 2).reshape(dim, n * pad)
    extended = torch.cat([x[0], states], dim=1)[:, source].to(weight.dtype)
    windows = extended[:, token_col[:, None] - pad + torch.arange(width, device=device)]  # (dim, T, width)
    out = (windows * weight[:, None, :]).sum(-1)
    if bias is not None:
        out = out + bias[:, None]
    if activation is not None:
        out = F.silu(out)
    final_cols = (state_start + lens)[:, None] + torch.arange(pad, device=device)  # last pad columns
    final = extended[:, final_cols].permute(1, 0, 2).to(x.dtype)
    return out.to(x.dtype)[None], final
