"""Run one planned step through the HF model: build the step's VarlenMeta (block table, slot
mapping) with numpy, call the model once on the flat row, and return the logits of the last
token of every sequence that samples this step (the lm_head runs on those rows only)."""

from __future__ import annotations

import numpy as np
import torch

from inference.kv_cache import KVCache
from inference.scheduler import StepPlan
from packing.varlen import VarlenMeta


def build_step(
    plan: StepPlan, block_size: int, device
) -> tuple[torch.Tensor, VarlenMeta, list[int], list[int]]:
    """Input ids ``(1, T)``, the step's metadata, the flat token indices whose logits are needed
    and the ``plan.seqs`` index each of them belongs to (the sequences that sample)."""
    q = np.asarray(plan.query_lens, dtype=np.int64)
    ctx = np.fromiter((s.num_computed for s in plan.seqs), dtype=np.int64, count=len(plan.seqs))
    ids: list[int] = []
    for seq, n in zip(plan.seqs, plan.query_lens):
        ids.extend(seq.token_ids[seq.num_computed : seq.num_computed + n])
    width = max(len(s.block_table) for s in plan.seqs)
    table = np.zeros((len(plan.seqs), width), dtype=np.int64)
    for i, seq in enumerate(plan.seqs):
        table[i, : len(seq.block_table)] = seq.block_table
    seq_idx = np.repeat(np.arange(q.size), q)
    cu_q = np.concatenate(([0], np.cumsum(q)))
    pos = np.arange(int(cu_q[-1])) - np.repeat(cu_q[:-1] - ctx, q)
    slots = table[seq_idx, pos // block_size] * block_size + pos % block_size
    meta = VarlenMeta.for_step(
        q, ctx, block_table=torch.from_numpy(table), slot_mapping=torch.from_numpy(slots), device=device
    )
    ends = cu_q[1:] - 1
    sampling_rows = [i for i, (seq, n) in enumerate(zip(plan.seqs, plan.query_lens))
                     if seq.num_computed + n == seq.num_tokens]
    keep = ends[sampling_rows].tolist()
    input_ids = torch.tensor(ids, dtype=torch.long, device=device)[None]
    return input_ids, meta, keep, sampling_rows


class ModelRunner:
    """Owns nothing but references: the live model and the generator's KV cache."""

    def __init__(self, model: torch.nn.Module, kv_cache: KVCache, backend: str | None = None):
        self.model = model
        self.kv_cache = kv_cache
        self.device = next(model.parameters()).device
        self.backend = backend or "auto"  # "auto": NOPAD_ATTN_BACKEND, else choose_backend's rule

    @torch.no_grad()
    def run(self, plan: StepPlan) -> tuple[torch.Tensor, list[int]]:
        """Logits ``(num_sampling, vocab)`` and, for each, its index into ``plan.seqs``."""
        self.kv_cache.copy_blocks(plan.copies)
        input_ids, meta, keep, rows = build_step(plan, self.kv_cache.block_size, self.device)
        if not keep:  # only partial prefill chunks: no logits needed, still one forward
            keep = [0]
        out = self.model(
            input_ids=input_ids,
            position_ids=meta.position_ids[None],
            use_cache=False,
            logits_to_keep=torch.tensor(keep, device=self.device),
            nopad_meta=meta,
            nopad_kv_cache=self.kv_cache,
            nopad_backend=self.backend,
        )
        logits = out.logits[0]
        return (logits if rows else logits[:0]), rows


class NopadAttention:
    """Use nopad attention (and eval mode) for one step; restore the user's setting after."""

    def __init__(self, model):
        self.model = model

    def __enter__(self):
        from packing.hf import NOPAD_ATTENTION, register_nopad_attention

        register_nopad_attention()
        config = self.model.config
        self.saved = (config._attn_implementation, self.model.training)
        if config._attn_implementation != NOPAD_ATTENTION:
            config._attn_implementation = NOPAD_ATTENTION
        if self.model.training:
            self.model.eval()

    def __exit__(self, *exc):
        attn, training = self.saved
        if self.model.config._attn_implementation != attn:
            self.model.config._attn_implementation = attn
        if training:
            self.model.train()
        return False
