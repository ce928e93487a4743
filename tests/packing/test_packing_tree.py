"""Prefix-tree rows (packing/bins/tree.py): the trie and the row layout pinned on hand-made trees,
and every path's log-probs and the parameter gradients equal to each path run as its own flat
sequence, on several model families and with each attention backend forced."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from nopad.packing.attention import BACKEND_ENV, triton_kernel, varlen_attention
from nopad.packing.bins.tree import (
    TreePath,
    build_trie,
    pack_tree_rows,
    plan_rows,
    unique_tokens,
)
from nopad.packing.hf import use_nopad_attention
from nopad.packing.row import IGNORE_INDEX
from nopad.packing.varlen import VarlenMeta
from nopad.training.grpo import packed_logprobs
from tests.support.models import tiny_model

X = IGNORE_INDEX


def _mask(n, start):
    return [False] * start + [True] * (n - start)


# ----------------------------------------------------------------------------- layout, pinned
def test_depth_one_is_the_shared_prefix_layout():
    """A prompt and three completions: the prompt once, the first completion continuing its
    segment, the others reading it through the key index."""
    prompt = [10, 11, 12]
    paths = [TreePath(prompt + c, _mask(3 + len(c), 3)) for c in ([20, 21], [30], [40, 41, 42])]
    (row,) = pack_tree_rows(paths, capacity=16)
    meta = row["nopad_meta"]
    assert row["input_ids"].tolist() == [[10, 11, 12, 20, 21, 30, 40, 41, 42]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 3, 4, 3, 3, 4, 5]]
    assert meta.seqlens_q == (5, 1, 3) and meta.seqlens_k == (5, 4, 6)
    assert meta.key_rows.tolist() == [0, 1, 2, 3, 4, 0, 1, 2, 5, 0, 1, 2, 6, 7, 8]
    assert row.labels.tolist() == [[X, X, X, 20, 21, 30, 40, 41, 42]]
    predict_at, targets = row.loss_tokens()
    assert predict_at.tolist() == [2, 3, 2, 2, 6, 7]  # the prompt's last token predicts 3 firsts
    assert targets.tolist() == [20, 21, 30, 40, 41, 42]
    assert row.pair_tokens.tolist() == [0, 1, 2, 3, 4, 5] and row.pair_seqs.tolist() == [0, 0, 1, 2, 2, 2]
    assert row.indices.tolist() == [0, 1, 2] and (row.num_loss_tokens, row.num_loss_seqs) == (6, 3)


# depth 5, a path that ends inside another (a), a duplicate (c, e), single-token nodes ([9], [8], [7])
DEEP = {
    "a": [1, 2, 3, 4, 5, 6],
    "b": [1, 2, 3, 4, 5, 6, 7],
    "c": [1, 2, 3, 4, 9],
    "d": [1, 2, 8],
    "e": [1, 2, 3, 4, 9],
    "f": [1, 2, 3, 4, 5, 6, 7, 11, 12],
}


def _deep_paths(extras=False):
    out = []
    for i, ids in enumerate(DEEP.values()):
        more = {"advantages": [float(10 * i + t) for t in range(len(ids))]} if extras else {}
        out.append(TreePath(ids, _mask(len(ids), 1), more))
    return out


def _nodes(node, depth=0):
    ids = list(DEEP.values())[node.path][node.start : node.end]
    yield depth, ids, node.ends
    for child in node.children:
        yield from _nodes(child, depth + 1)


def test_trie_of_a_deep_tree():
    (root,) = build_trie(list(DEEP.values()))
    assert list(_nodes(root)) == [
        (0, [1, 2], []),
        (1, [3, 4], []),
        (2, [5, 6], [0]),
        (3, [7], [1]),
        (4, [11, 12], [5]),
        (2, [9], [2, 4]),
        (1, [8], [3]),
    ]
    assert unique_tokens(_deep_paths()) == 11
    assert len(build_trie([[1, 2], [3], [1, 4]])) == 2  # one tree per distinct first token


def test_deep_tree_in_one_row():
    (row,) = pack_tree_rows(_deep_paths(extras=True), capacity=32)
    meta = row["nopad_meta"]
    assert row["input_ids"].tolist() == [[1, 2, 3, 4, 5, 6, 7, 11, 12, 9, 8]]
    assert row["position_ids"].tolist() == [[0, 1, 2, 3, 4, 5, 6, 7, 8, 4, 2]]
    assert meta.seqlens_q == (9, 1, 1) and meta.seqlens_k == (9, 5, 3)  # the chain is one segment
    assert meta.key_rows.tolist() == [*range(9), 0, 1, 2, 3, 9, 0, 1, 10]
    assert row.indices.tolist() == [0, 1, 5, 2, 4, 3]
    assert row.num_loss_tokens == sum(len(ids) - 1 for ids in DEEP.values()) == 29  # pairs, as flat
    assert row.labels.tolist() == [[X, 2, 3, 4, 5, 6, 7, 11, 12, 9, 8]]  # each trained token labelled once
    predict_at, targets = row.loss_tokens()
    seqs = row.pair_seqs
    # path c and its duplicate e: the same tokens, each pair with its own extras
    c, e = (seqs == 3), (seqs == 4)
    assert row.pair_tokens[c].tolist() == row.pair_tokens[e].tolist() == [0, 1, 2, 8]
    assert predict_at[row.pair_tokens[c]].tolist() == [0, 1, 2, 3]
    assert targets[row.pair_tokens[c]].tolist() == [2, 3, 4, 9]
    assert row.token_values["advantages"][c].tolist() == [21.0, 22.0, 23.0, 24.0]
    assert row.token_values["advantages"][e].tolist() == [41.0, 42.0, 43.0, 44.0]
    d = seqs == 5
    assert predict_at[row.pair_tokens[d]].tolist() == [0, 1]
    assert targets[row.pair_tokens[d]].tolist() == [2, 8]
    assert row.per_pair(torch.arange(10)).tolist() == row.pair_tokens.tolist()


def test_a_tree_too_big_for_a_row_is_split_at_node_boundaries():
    """Capacity 9: [3,4]'s subtree does not fit beside the root, so it goes to a piece that repeats
    the root; [5,6]'s subtree and [9] do not fit together under [1,2,3,4], so [9] goes to a third
    piece. Two pieces sharing a row lay their common nodes once."""
    paths = _deep_paths()
    rows = plan_rows(paths, capacity=9)
    assert [[(len(p.context), len(p.owned)) for p in row] for row in rows] == [[(1, 4)], [(0, 2), (2, 1)]]
    first, second = pack_tree_rows(paths, capacity=9)
    assert first.input_ids.tolist() == [[1, 2, 3, 4, 5, 6, 7, 11, 12]]
    assert first.nopad_meta.key_index is None  # one plain segment
    assert first.indices.tolist() == [0, 1, 5]
    assert second.input_ids.tolist() == [[1, 2, 8, 3, 4, 9]]
    assert second.position_ids.tolist() == [[0, 1, 2, 2, 3, 4]]
    assert second.nopad_meta.key_rows.tolist() == [0, 1, 2, 0, 1, 3, 4, 5]
    assert second.indices.tolist() == [3, 2, 4]
    predict_at, _ = second.loss_tokens()
    assert predict_at[second.pair_tokens[second.pair_seqs == 1]].tolist() == [0, 1, 3, 4]  # path 2
    computed = sum(r.num_tokens for r in (first, second))
    assert computed == unique_tokens(paths) + 4  # [1, 2, 3, 4] again in the second row
    assert sum(r.num_loss_tokens for r in (first, second)) == 29


def test_a_node_with_no_path_ending_is_only_context_when_its_children_move_out():
    paths = [TreePath([1, 2, 3, 4, 5], _mask(5, 1)), TreePath([1, 2, 6, 7, 8], _mask(5, 1))]
    rows = pack_tree_rows(paths, capacity=5)
    assert [r.input_ids.tolist() for r in rows] == [[[1, 2, 3, 4, 5]], [[1, 2, 6, 7, 8]]]


def test_bad_input_is_refused():
    long_root = [TreePath(list(range(3, 13)) + [20], _mask(11, 10)), TreePath(list(range(3, 13)) + [21])]
    with pytest.raises(ValueError, match="path 0 has 11 tokens > the row capacity 8"):
        pack_tree_rows(long_root, capacity=8)
    with pytest.raises(ValueError, match="nothing predicts a sequence's first token"):
        pack_tree_rows([TreePath([1, 2], [True, True])], capacity=8)
    with pytest.raises(ValueError, match="loss_mask has 1 entries for 2 tokens"):
        pack_tree_rows([TreePath([1, 2], [False])], capacity=8)
    with pytest.raises(ValueError, match="extra 'advantages' has 1 values for 2 tokens; give one value per "):
        pack_tree_rows([TreePath([1, 2], [False, True], {"advantages": [1.0]})], capacity=8)
    with pytest.raises(ValueError, match=r"extra 'advantages' is 0.5 for 2 tokens; .* \[a\] \* len\(ids\)"):
        pack_tree_rows([TreePath([1, 2], [False, True], {"advantages": 0.5})], capacity=8)
    with pytest.raises(ValueError, match="same extras"):
        pack_tree_rows(
            [TreePath([1, 2], [False, True], {"advantages": [0.0, 1.0]}), TreePath([1, 3], [False, True])], capacity=8
        )
    with pytest.raises(ValueError, match="sequence 1 is empty"):
        pack_tree_rows([TreePath([1, 2]), TreePath([])], capacity=8)


# ----------------------------------------------------------------------------- the attention core
def _attention_vs_paths(meta, backend, window, softcap, dtype=torch.float32):
    """Attention of a tree row vs each segment's keys copied out as a flat sequence; returns the
    max errors of the output and of dq, dk, dv, relative to the reference's largest value."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(meta.total_q, h, 16, generator=g).to(dtype).requires_grad_() for h in (4, 2, 2))
    rows = meta.key_rows
    flat = VarlenMeta.from_lengths(meta.seqlens_k)
    opts = dict(sliding_window=window, softcap=softcap)
    ref_full = varlen_attention(
        *(t.float().index_select(0, rows) for t in (q, k, v)), flat, backend="sdpa_loop", **opts
    )
    ends = flat.cu_seqlens_q[1:].tolist()
    ref = torch.cat([ref_full[end - lq : end] for end, lq in zip(ends, meta.seqlens_q)])
    out = varlen_attention(q, k, v, meta, backend=backend, **opts)
    w = torch.randn(out.shape, generator=g)
    grads = torch.autograd.grad((out.float() * w).sum(), (q, k, v))
    refs = torch.autograd.grad((ref * w).sum(), (q, k, v))
    pairs = zip((out.detach(), *grads), (ref.detach(), *refs))
    return [float((a.float() - b).abs().max() / b.abs().max()) for a, b in pairs]


@pytest.mark.parametrize("backend", ["auto", "kernel", "sdpa_loop", "sdpa_padded", "per_token"])
@pytest.mark.parametrize("window,softcap", [(None, None), (3, None), (None, 20.0)])
def test_attention_of_a_tree_row_forward_and_backward(backend, window, softcap, one_thread):
    (row,) = pack_tree_rows(_deep_paths(), capacity=32)
    assert max(_attention_vs_paths(row["nopad_meta"], backend, window, softcap)) <= 1e-5


def test_flash_attention_gets_the_gathered_keys_of_a_tree_row(monkeypatch):
    """flash-attn's varlen kernel (the strict CPU stand-in, bf16) on a tree row's gathered keys."""
    import sys

    from nopad.packing import attention
    from nopad.packing.attention import flash
    from tests.support.flash_standin import FlashStandIn

    standin = FlashStandIn("2.6")
    for name in ("flash_attn", "flash_attn_interface"):
        monkeypatch.delitem(sys.modules, name, raising=False)
    monkeypatch.setitem(sys.modules, standin.module.__name__, standin.module)
    flash.flash_attn_info.cache_clear()
    attention.registry._said.clear()
    try:
        (row,) = pack_tree_rows(_deep_paths(), capacity=32)
        errors = _attention_vs_paths(row["nopad_meta"], "flash", 3, None, torch.bfloat16)
        assert standin.calls and standin.calls[-1]["num_seqs"] == row["nopad_meta"].num_seqs
        assert max(errors) <= 2e-2
    finally:
        flash.flash_attn_info.cache_clear()
        attention.registry._said.clear()


# ----------------------------------------------------------------------------- exactness
def branched_paths(seed, root_len, levels, vocab=128):
    """Paths of a random tree: a root of ``root_len`` tokens, then at each level ``(branching,
    (lo, hi))`` every node gets ``branching`` children of lo..hi tokens. Odd levels are model
    turns (loss), even levels tool output (no loss); every internal node also ends a path of its
    own, and the first leaf is given twice. Extras: a random weight per token (as advantages)."""
    rng = np.random.default_rng(seed)
    frontier = [(rng.integers(3, vocab, root_len).tolist(), [False] * root_len)]
    paths = []
    for depth, (branching, (lo, hi)) in enumerate(levels, start=1):
        grown = []
        for ids, mask in frontier:
            paths.append((ids, mask))
            for _ in range(branching):
                n = int(rng.integers(lo, hi + 1))
                grown.append((ids + rng.integers(3, vocab, n).tolist(), mask + [depth % 2 == 1] * n))
        frontier = grown
    paths += frontier + frontier[:1]
    return [TreePath(ids, mask, {"advantages": rng.standard_normal(len(ids)).tolist()}) for ids, mask in paths]


TREES = {  # windows are 8 tokens: nodes shorter and longer than a window
    "deep": (11, [(2, (1, 6)), (2, (1, 4)), (1, (1, 3)), (2, (2, 9))]),
    "wide": (13, [(4, (3, 12))]),
}


def _flat_reference(model, paths):
    """Each path alone through the model's own attention: per-path log-probs of its loss tokens,
    and the gradients of -sum(weight * logp)."""
    model.zero_grad(set_to_none=True)
    logps = []
    for p in paths:
        at = torch.tensor(np.flatnonzero(p.loss_mask), dtype=torch.long)
        ids = torch.tensor(p.ids)[None]
        logits = model(input_ids=ids, use_cache=False).logits[0]
        lp = torch.log_softmax(logits.float(), -1)[at - 1].gather(1, ids[0, at][:, None])[:, 0]
        (-(lp * torch.tensor(p.extras["advantages"])[at]).sum()).backward()
        logps.append(lp.detach())
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return logps, grads


def _tree_run(model, paths, capacity):
    rows = pack_tree_rows(paths, capacity)
    got = [[] for _ in paths]
    with use_nopad_attention(model):
        for row in rows:
            lp = packed_logprobs(model, row)
            (-(lp * row.token_values["advantages"]).sum()).backward()
            for k, p in enumerate(row.indices.tolist()):
                got[p] = lp.detach()[row.pair_seqs == k]
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    model.zero_grad(set_to_none=True)
    return rows, got, grads


def _close(got, want, rtol, what):
    if not want.numel():
        return
    err = float((got - want).abs().max())
    assert err <= rtol * float(want.abs().max()) + 1e-12, f"{what}: max error {err:.3g}"


def _check_exact(family, tree, capacity, backend, monkeypatch):
    monkeypatch.setenv(BACKEND_ENV, backend)
    model = tiny_model(family)
    root_len, levels = TREES[tree]
    paths = branched_paths(0, root_len, levels)
    ref_logps, ref_grads = _flat_reference(model, paths)
    rows, logps, grads = _tree_run(model, paths, capacity)
    computed = sum(r.num_tokens for r in rows)
    assert computed < sum(len(p.ids) for p in paths)
    assert sum(r.num_loss_tokens for r in rows) == sum(int(np.sum(p.loss_mask)) for p in paths)
    for i, (got, want) in enumerate(zip(logps, ref_logps)):
        assert got.shape == want.shape, f"path {i}"
        _close(got, want, 1e-5, f"path {i} log-probs")
    for name, want in ref_grads.items():
        _close(grads[name], want, 1e-5, f"grad of {name}")
    return rows


@pytest.mark.parametrize("family", ["llama", "mistral", "gemma2", "qwen3"])
@pytest.mark.parametrize("backend", ["kernel", "sdpa_loop", "per_token"])
def test_tree_rows_equal_each_path_alone(family, backend, monkeypatch, one_thread):
    rows = _check_exact(family, "deep", 1024, backend, monkeypatch)
    assert len(rows) == 1 and rows[0].nopad_meta.key_index is not None


@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("backend", ["kernel", "sdpa_loop"])
@pytest.mark.parametrize("tree", ["deep", "wide"])
def test_split_trees_equal_each_path_alone(family, backend, tree, monkeypatch, one_thread):
    capacity = 40 if tree == "deep" else 30
    rows = _check_exact(family, tree, capacity, backend, monkeypatch)
    assert len(rows) > 1


@pytest.mark.skipif(
    triton_kernel.triton is None or not triton_kernel.interpreted(),
    reason="the Triton kernel runs here only under TRITON_INTERPRET=1",
)
@pytest.mark.parametrize("family", ["llama", "gemma2"])
@pytest.mark.parametrize("tree,capacity", [("deep", 1024), ("wide", 30)])
def test_tree_rows_through_the_triton_kernel(family, tree, capacity, monkeypatch, one_thread):
    launches = []
    launch = triton_kernel._launch
    monkeypatch.setattr(triton_kernel, "_launch", lambda *a, **k: launches.append(1) or launch(*a, **k))
    _check_exact(family, tree, capacity, "triton", monkeypatch)
    assert launches
