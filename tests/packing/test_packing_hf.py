"""transformers integration: nopad as an attention implementation for packed training rows and
paged generation steps, and the guards against transformers' silent packed-path failures."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import transformers
from transformers.masking_utils import AttentionMaskInterface

from nopad.packing.hf import (
    NOPAD_ATTENTION,
    packed_forward_guard,
    register_nopad_attention,
    use_nopad_attention,
)
from nopad.packing.varlen import VarlenMeta
from tests.support.models import FAMILIES, SLIDING_WINDOW, random_sequences, tiny_model

pytestmark = pytest.mark.usefixtures("one_thread")


def alone_logits(model, seqs):
    with torch.no_grad():
        return [model(s[None], use_cache=False).logits[0] for s in seqs]


def test_register_is_idempotent_and_hooks_both_interfaces():
    assert register_nopad_attention() == NOPAD_ATTENTION
    register_nopad_attention()
    assert NOPAD_ATTENTION in transformers.AttentionInterface._global_mapping
    assert NOPAD_ATTENTION in AttentionMaskInterface._global_mapping


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("with_meta", [True, False], ids=["meta", "from_position_ids"])
def test_packed_row_logits_equal_each_sequence_alone(family, with_meta):
    model = tiny_model(family)
    capacity = 32
    # a length-1 sequence, sequences longer than the sliding window, and one of exactly capacity
    for lengths in ([1, 12, 2 * SLIDING_WINDOW + 3, 1], [capacity]):
        seqs = random_sequences(lengths)
        expected = alone_logits(model, seqs)
        meta = VarlenMeta.from_lengths(lengths)
        kwargs = {"nopad_meta": meta} if with_meta else {}
        with use_nopad_attention(model), torch.no_grad():
            logits = model(torch.cat(seqs)[None], position_ids=meta.position_ids[None], **kwargs).logits[0]
        bounds = meta.cu_seqlens_q.tolist()
        for i, exp in enumerate(expected):
            torch.testing.assert_close(logits[bounds[i] : bounds[i + 1]], exp, atol=1e-5, rtol=0)
    assert model.config._attn_implementation != NOPAD_ATTENTION  # restored


def test_unpacked_batch_and_hf_generate_run_through_nopad():
    model = tiny_model("llama")
    ids = torch.stack(random_sequences([9, 9, 9]))
    with torch.no_grad():
        expected = model(ids, use_cache=False).logits
        sdpa_tokens = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
        with use_nopad_attention(model):
            torch.testing.assert_close(model(ids, use_cache=False).logits, expected, atol=1e-5, rtol=0)
            nopad_tokens = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0)
    assert torch.equal(nopad_tokens, sdpa_tokens)


class PagedCache:
    """A minimal paged K/V store for the test: random blocks per sequence, one cache per layer."""

    def __init__(self, model, num_seqs, max_len, block_size, seed=0):
        cfg = model.config
        head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        blocks_per_seq = -(-max_len // block_size)
        num_blocks = num_seqs * blocks_per_seq + 2
        perm = np.random.default_rng(seed).permutation(num_blocks)[: num_seqs * blocks_per_seq]
        self.table = torch.from_numpy(perm.reshape(num_seqs, blocks_per_seq).astype(np.int32))
        self.block_size = block_size
        shape = (num_blocks, block_size, cfg.num_key_value_heads, head_dim)
        self.layers = [
            (torch.full(shape, float("nan")), torch.full(shape, float("nan"))) for _ in range(cfg.num_hidden_layers)
        ]

    def slots(self, seq, start, n):
        pos = torch.arange(start, start + n)
        return self.table[seq, pos // self.block_size].long() * self.block_size + pos % self.block_size


@pytest.mark.parametrize("family", ["llama", "gemma2", "mistral"])
@pytest.mark.parametrize("block_size", [1, 16, 256])
def test_paged_generation_steps_match_full_forward(family, block_size):
    """The generator's contract: chunked prefill, mixed prefill + decode steps, pure decode steps
    through model(..., nopad_meta=meta, nopad_kv_cache=layers) equal one full forward per sequence."""
    model = tiny_model(family)
    seqs = random_sequences([14, 20, 8], seed=1)
    expected = alone_logits(model, seqs)
    cache = PagedCache(model, len(seqs), 20, block_size, seed=block_size)
    # new tokens per sequence per step: prefill (1 chunked), mixed chunk + decodes, pure decodes
    schedule = [{0: 10, 1: 7, 2: 3}, {0: 1, 1: 13, 2: 1}] + [{0: 1, 2: 1}] * 3 + [{2: 1}]
    done = [0, 0, 0]
    with use_nopad_attention(model), torch.no_grad():
        for step in schedule:
            active = list(step)
            q_lens = [step[i] for i in active]
            ctx = [done[i] for i in active]
            slots = torch.cat([cache.slots(i, done[i], step[i]) for i in active])
            meta = VarlenMeta.for_step(q_lens, ctx, block_table=cache.table[active], slot_mapping=slots)
            ids = torch.cat([seqs[i][done[i] : done[i] + step[i]] for i in active])[None]
            logits = model(
                ids, position_ids=meta.position_ids[None], use_cache=False, nopad_meta=meta, nopad_kv_cache=cache.layers
            ).logits[0]
            bounds = meta.cu_seqlens_q.tolist()
            for j, i in enumerate(active):
                exp = expected[i][done[i] : done[i] + step[i]]
                torch.testing.assert_close(logits[bounds[j] : bounds[j + 1]], exp, atol=1e-5, rtol=0)
                done[i] += step[i]
    assert done == [14, 20, 8]


def test_kv_cache_as_callable():
    model = tiny_model("qwen3")
    (seq,) = random_sequences([6])
    cache = PagedCache(model, 1, 6, 4)
    meta = VarlenMeta.for_step([6], [0], block_table=cache.table, slot_mapping=cache.slots(0, 0, 6))
    with use_nopad_attention(model), torch.no_grad():
        logits = model(
            seq[None],
            position_ids=meta.position_ids[None],
            use_cache=False,
            nopad_meta=meta,
            nopad_kv_cache=lambda layer: cache.layers[layer],
        ).logits[0]
    torch.testing.assert_close(logits, alone_logits(model, [seq])[0], atol=1e-5, rtol=0)


# ------------------------------------------------------------------ transformers' own packed path
def _packed(lengths):
    seqs = random_sequences(lengths, seed=2)
    meta = VarlenMeta.from_lengths(lengths)
    return seqs, torch.cat(seqs)[None], meta.position_ids[None]


def test_transformers_silent_failures_are_real():
    """Why the guard exists (transformers 5.23, sdpa): packed position_ids are ignored when an
    attention mask is passed or when the default use_cache=True builds a cache."""
    model = tiny_model("llama")
    seqs, ids, pos = _packed([5, 9, 3])
    expected = torch.cat(alone_logits(model, seqs))
    with torch.no_grad():
        right = model(ids, position_ids=pos, use_cache=False).logits[0]
        with_cache = model(ids, position_ids=pos).logits[0]
        ones = torch.ones_like(ids)
        with_mask = model(ids, position_ids=pos, attention_mask=ones, use_cache=False).logits[0]
    assert float((right - expected).abs().max()) <= 1e-5
    assert float((with_cache - expected).abs().max()) > 1e-2
    assert float((with_mask - expected).abs().max()) > 1e-2


def test_guard_raises_instead_of_wrong_logits():
    model = tiny_model("llama")
    _, ids, pos = _packed([5, 9, 3])
    handle = packed_forward_guard(model)
    with pytest.raises(ValueError, match="use_cache=False"):
        model(ids, position_ids=pos)
    with pytest.raises(ValueError, match="attention_mask=None"):
        model(ids, position_ids=pos, attention_mask=torch.ones_like(ids), use_cache=False)
    with pytest.raises(ValueError, match="without position_ids"):
        model(ids, nopad_meta=VarlenMeta.from_lengths([5, 9, 3]), use_cache=False)
    model(ids, position_ids=pos, use_cache=False)  # the correct call passes
    model(ids[:, :5])  # an ordinary unpacked call is untouched
    handle.remove()
    model(ids, position_ids=pos)  # guard removed: no error (and, as tested above, wrong logits)


def test_a_compiled_packed_forward_is_one_graph_and_still_checks_its_positions():
    """``fullgraph=True`` compiles: the positions check, the backend choice's log line and the
    backends' first import each broke the graph; the check now runs inside it."""
    model = tiny_model("llama")
    _, ids, pos = _packed([5, 9, 3])
    meta = VarlenMeta.from_lengths([5, 9, 3])
    with use_nopad_attention(model), torch.no_grad():
        eager = model(ids, position_ids=pos, nopad_meta=meta, use_cache=False).logits
        forward = lambda p: model(ids, position_ids=p, nopad_meta=meta, use_cache=False).logits  # noqa: E731
        compiled = torch.compile(forward, fullgraph=True, backend="eager")
        assert torch.equal(compiled(pos), eager)
        assert torch.equal(compiled(meta.position_ids[None]), eager)
        with pytest.raises(RuntimeError, match="do not match nopad_meta"):
            compiled(torch.arange(ids.shape[1])[None])


def test_nopad_refuses_padding_and_mismatched_positions():
    model = tiny_model("llama")
    _, ids, pos = _packed([5, 9, 3])
    with use_nopad_attention(model):
        mask = torch.ones_like(ids)
        mask[0, -2:] = 0
        with pytest.raises(ValueError, match="padding attention_mask"):
            model(ids, attention_mask=mask, use_cache=False)
        with pytest.raises(ValueError, match="do not match nopad_meta"):
            model(ids, position_ids=pos, nopad_meta=VarlenMeta.from_lengths([9, 5, 3]), use_cache=False)
        # packed rows under nopad are fine with the default use_cache and an all-ones mask
        model(ids, position_ids=pos, attention_mask=torch.ones_like(ids))
