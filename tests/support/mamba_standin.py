"""Strict CPU stand-ins for causal-conv1d and mamba_ssm, for tests only (put on ``sys.modules``
by the ``mamba_kernels`` fixture of tests/packing/test_packing_mamba2.py, never on the library's path).

Written from the packages' own signatures and checks (causal-conv1d
``causal_conv1d/causal_conv1d_interface.py`` and ``csrc/causal_conv1d.cpp``; mamba_ssm
``mamba_ssm/ops/triton/ssd_combined.py``), so a call that would fail on a GPU fails here:

- ``causal_conv1d_fn(x, weight, bias, seq_idx, initial_states, return_final_states,
  final_states_out, activation)``: activation None/silu/swish; width 2..4; ``seq_idx`` int32
  ``(batch, seqlen)`` only with the channel-last layout (``x.stride(1) == 1``), and then no
  ``initial_states`` and no final states;
- ``mamba_chunk_scan_combined(x, dt, A, B, C, chunk_size, D, z, dt_bias, initial_states,
  seq_idx, cu_seqlens, dt_softplus, dt_limit, return_final_states, return_varlen_states)`` and
  ``mamba_split_conv1d_scan_combined(zxbcdt, conv1d_weight, conv1d_bias, dt_bias, A, D,
  chunk_size, initial_states, seq_idx, dt_limit, return_final_states, activation,
  rmsnorm_weight, rmsnorm_eps, outproj_weight, outproj_bias, headdim, ngroups,
  norm_before_gate)``: the shape asserts of ``_mamba_chunk_scan_combined_fwd``; ``seq_idx`` int32
  ``(batch, seqlen)``.

The answers are computed token by token (the recurrence itself, not the chunked form nopad
uses), the state reset wherever ``seq_idx`` changes, differentiable through autograd. Every call
is recorded in ``calls``.
"""

from __future__ import annotations

import importlib.machinery
import types

import torch
import torch.nn.functional as F


class MambaKernelsStandIn:
    """``modules``: what to put on ``sys.modules`` (causal_conv1d and the mamba_ssm chain)."""

    def __init__(self):
        self.calls: list[tuple[str, dict]] = []
        conv = _module("causal_conv1d")
        conv.causal_conv1d_fn = self.causal_conv1d_fn
        combined = _module("mamba_ssm.ops.triton.ssd_combined")
        combined.mamba_chunk_scan_combined = self.mamba_chunk_scan_combined
        combined.mamba_split_conv1d_scan_combined = self.mamba_split_conv1d_scan_combined
        self.modules = {
            "causal_conv1d": conv,
            "mamba_ssm": _module("mamba_ssm"),
            "mamba_ssm.ops": _module("mamba_ssm.ops"),
            "mamba_ssm.ops.triton": _module("mamba_ssm.ops.triton"),
            "mamba_ssm.ops.triton.ssd_combined": combined,
        }

    def names(self) -> list[str]:
        return [name for name, _ in self.calls]

    # ------------------------------------------------------------------ causal-conv1d
    def causal_conv1d_fn(
        self,
        x,
        weight,
        bias=None,
        seq_idx=None,
        initial_states=None,
        return_final_states=False,
        final_states_out=None,
        activation=None,
    ):
        self.calls.append(("causal_conv1d_fn", {"seq_idx": seq_idx}))
        if activation not in (None, "silu", "swish"):
            raise NotImplementedError("activation must be None, silu, or swish")
        batch, dim, seqlen = x.shape
        width = weight.shape[-1]
        if weight.shape != (dim, width) or not 2 <= width <= 4:
            raise RuntimeError("causal_conv1d only supports width between 2 and 4")
        if bias is not None and bias.shape != (dim,):
            raise RuntimeError("bias must be (dim,)")
        if seq_idx is not None:
            assert initial_states is None, "initial_states must be None if seq_idx is not None"
            assert not return_final_states, "If seq_idx is not None, we don't return final_states_out"
            if x.stride(1) != 1:
                raise RuntimeError("seq_idx is only supported for channel last layout")
            _check_seq_idx(seq_idx, batch, seqlen, x.device)
        out = torch.zeros(batch, dim, seqlen, dtype=weight.dtype, device=x.device)
        xs = x.to(weight.dtype)
        for b in range(batch):
            for t in range(seqlen):
                for j in range(width):  # tap j reads token t - (width - 1) + j
                    s = t - (width - 1) + j
                    if s < 0 or (seq_idx is not None and seq_idx[b, s] != seq_idx[b, t]):
                        continue
                    out[b, :, t] = out[b, :, t] + weight[:, j] * xs[b, :, s]
        if bias is not None:
            out = out + bias[:, None]
        return (F.silu(out) if activation else out).to(x.dtype)

    # ------------------------------------------------------------------ mamba_ssm
    def mamba_chunk_scan_combined(
        self,
        x,
        dt,
        A,
        B,
        C,
        chunk_size,
        D=None,
        z=None,
        dt_bias=None,
        initial_states=None,
        seq_idx=None,
        cu_seqlens=None,
        dt_softplus=False,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        return_varlen_states=False,
    ):
        self.calls.append(("mamba_chunk_scan_combined", {"seq_idx": seq_idx, "z": z}))
        return self._scan(
            x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit, return_final_states
        )

    def _scan(self, x, dt, A, B, C, D, z, dt_bias, initial_states, seq_idx, dt_softplus, dt_limit, final):
        batch, seqlen, nheads, headdim = x.shape
        _, _, ngroups, dstate = B.shape
        assert nheads % ngroups == 0
        assert B.shape == (batch, seqlen, ngroups, dstate)
        assert dt.shape == (batch, seqlen, nheads)
        assert A.shape == (nheads,)
        assert C.shape == B.shape
        if z is not None:
            assert z.shape == x.shape
        if D is not None:
            assert D.shape == (nheads, headdim) or D.shape == (nheads,)
        if seq_idx is not None:
            _check_seq_idx(seq_idx, batch, seqlen, x.device)
        if initial_states is not None:
            assert initial_states.shape == (batch, nheads, headdim, dstate)
        dt = dt.float() + (dt_bias.float() if dt_bias is not None else 0)
        dt = (F.softplus(dt) if dt_softplus else dt).clamp(dt_limit[0], dt_limit[1])
        rep = nheads // ngroups
        Bh, Ch = B.float().repeat_interleave(rep, 2), C.float().repeat_interleave(rep, 2)
        outs, finals = [], []
        for b in range(batch):
            h = (
                initial_states[b].float()
                if initial_states is not None
                else x.new_zeros(nheads, headdim, dstate, dtype=torch.float32)
            )
            ys = []
            for t in range(seqlen):
                if t and seq_idx is not None and seq_idx[b, t] != seq_idx[b, t - 1]:
                    h = torch.zeros_like(h)
                decay = torch.exp(dt[b, t] * A.float())[:, None, None]
                h = h * decay + (dt[b, t][:, None, None] * x[b, t].float()[:, :, None] * Bh[b, t][:, None, :])
                ys.append((h * Ch[b, t][:, None, :]).sum(-1))
            finals.append(h)
            outs.append(torch.stack(ys))
        out = torch.stack(outs)
        if D is not None:
            out = out + x.float() * (D.float()[:, None] if D.dim() == 1 else D.float())
        if z is not None:
            out = out * F.silu(z.float())
        out = out.to(x.dtype)
        return (out, torch.stack(finals)) if final else out

    def mamba_split_conv1d_scan_combined(
        self,
        zxbcdt,
        conv1d_weight,
        conv1d_bias,
        dt_bias,
        A,
        D,
        chunk_size,
        initial_states=None,
        seq_idx=None,
        dt_limit=(0.0, float("inf")),
        return_final_states=False,
        activation="silu",
        rmsnorm_weight=None,
        rmsnorm_eps=1e-6,
        outproj_weight=None,
        outproj_bias=None,
        headdim=None,
        ngroups=1,
        norm_before_gate=True,
    ):
        self.calls.append(("mamba_split_conv1d_scan_combined", {"seq_idx": seq_idx}))
        assert activation in (None, "silu", "swish")
        if D.dim() == 1:
            assert headdim is not None
            (nheads,) = D.shape
        else:
            nheads, headdim = D.shape
        batch, seqlen, _ = zxbcdt.shape
        dim = nheads * headdim
        dstate = (conv1d_weight.shape[0] - dim) // ngroups // 2
        d_nonssm = (zxbcdt.shape[-1] - 2 * dim - 2 * ngroups * dstate - nheads) // 2
        assert d_nonssm == 0, "the stand-in does not model the non-SSM (swiglu) part"
        assert dt_bias.shape == (nheads,) and A.shape == (nheads,)
        z, xBC, dt = torch.split(zxbcdt, [dim, dim + 2 * ngroups * dstate, nheads], dim=-1)
        calls = len(self.calls)
        xBC = self.causal_conv1d_fn(
            xBC.transpose(1, 2), conv1d_weight, conv1d_bias, seq_idx=seq_idx, activation=activation
        ).transpose(1, 2)
        x, B, C = torch.split(xBC, [dim, ngroups * dstate, ngroups * dstate], dim=-1)
        x = x.reshape(batch, seqlen, nheads, headdim)
        B, C = B.reshape(batch, seqlen, ngroups, dstate), C.reshape(batch, seqlen, ngroups, dstate)
        gate = z.reshape(batch, seqlen, nheads, headdim)
        out = self._scan(
            x,
            dt,
            A,
            B,
            C,
            D,
            gate if rmsnorm_weight is None else None,
            dt_bias,
            initial_states,
            seq_idx,
            True,
            dt_limit,
            False,
        ).reshape(batch, seqlen, dim)
        del self.calls[calls:]  # the inner calls are the fused kernel's own
        if rmsnorm_weight is not None:
            assert not norm_before_gate, "the stand-in models transformers' norm_before_gate=False only"
            gated = (out.float() * F.silu(z.float())).reshape(batch, seqlen, ngroups, dim // ngroups)
            normed = gated * torch.rsqrt(gated.pow(2).mean(-1, keepdim=True) + rmsnorm_eps)
            out = (normed.reshape(batch, seqlen, dim) * rmsnorm_weight.float()).to(zxbcdt.dtype)
        if outproj_weight is not None:
            out = F.linear(out, outproj_weight, outproj_bias)
        return out


def _module(name: str) -> types.ModuleType:
    module = types.ModuleType(name)
    module.__spec__ = importlib.machinery.ModuleSpec(name, loader=None)
    return module


def _check_seq_idx(seq_idx, batch, seqlen, device):
    if seq_idx.dtype != torch.int32:
        raise RuntimeError("seq_idx must have dtype int32")
    if seq_idx.shape != (batch, seqlen):
        raise RuntimeError(f"seq_idx must be (batch, seqlen) = {(batch, seqlen)}, got {tuple(seq_idx.shape)}")
    if seq_idx.device != device:
        raise RuntimeError("seq_idx must be on the device of x")
