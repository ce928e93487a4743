"""Prefix-tree packing: sequences that share prefixes, each shared token computed once.

Branched rollouts (samples forked at a turn, the turns of one episode, best-of-n) share long
prefixes; packed flat, every shared token is computed once per sequence. Here the sequences
(:class:`TreePath`, each with its own loss mask and per-token extras) become a trie whose nodes
are maximal runs of tokens shared by the same sequences. Each node's tokens are laid once in a row;
each segment reads its ancestors' rows and its own through ``VarlenMeta.key_index``, at positions
equal to its depth, so every path sees exactly the keys, positions and sliding window of its flat
sequence (exact on every backend that serves a key index). A node laid right after its parent
continues the parent's segment (a chain is one causal segment), so a row has about one segment
per leaf.

A tree stays in one row when it fits. A larger one is split at node boundaries: a node keeps as
many of its child subtrees as fit, and the others go to pieces that repeat its path from the root
(context, computed again, no loss) - recursively. Pieces are bin-packed across rows with
:func:`packing.pack`; pieces of one tree that share a row lay their common nodes once. A
sequence longer than the row capacity is an error: a path's keys must lie in one row.

The loss is per (path, token) pair, as in the flat sequences: a path's pairs all live in the row
that owns its last node, each naming the row position that predicts it (``loss_rows``, repeated
for a token that several paths train on), the target id and that path's extras. Shared positions
go through the LM head once (:func:`pair_logprobs`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace

import numpy as np
import torch

from packing.bins.binpack import pack
from packing.varlen import VarlenMeta

ROW_KEYS = ("input_ids", "position_ids", "nopad_meta", "seq_lens", "loss_rows", "loss_targets", "loss_paths",
            "indices", "num_loss_tokens", "num_loss_seqs")


@dataclass(frozen=True)
class TreePath:
    """One flat sequence of the tree: token ids, which tokens carry the loss (token ``t`` is
    predicted by token ``t - 1``, so ``loss_mask[0]`` must be False) and per-token extras (old
    log-probs, advantages...), each as long as ``ids``; only their loss-token values are used."""

    ids: Sequence[int]
    loss_mask: Sequence[bool] | None = None  # None: no loss (context only)
    extras: Mapping[str, Sequence[float]] = field(default_factory=dict)


@dataclass(eq=False)
class Node:
    """A run of tokens shared by the same paths: ``ids[path][start:end]`` of its representative
    ``path``; ``ends`` are the paths whose last token is the node's last."""

    start: int
    end: int
    path: int
    parent: Node | None = None
    children: list[Node] = field(default_factory=list)
    ends: list[int] = field(default_factory=list)

    def __len__(self) -> int:
        return self.end - self.start

    def ancestors(self) -> list[Node]:
        """The nodes from the root down to this node's parent."""
        out, node = [], self.parent
        while node is not None:
            out.append(node)
            node = node.parent
        return out[::-1]

    def preorder(self) -> list[Node]:
        out, stack = [], [self]
        while stack:
            node = stack.pop()
            out.append(node)
            stack.extend(reversed(node.children))
        return out

    def size(self) -> int:
        """Tokens of the subtree (each node once)."""
        return sum(len(n) for n in self.preorder())


@dataclass(frozen=True)
class Piece:
    """What one tree contributes to one row: ``context`` nodes (a path from the root, repeated
    from another row, no loss of their own) then the ``owned`` nodes, in preorder."""

    context: tuple[Node, ...]
    owned: tuple[Node, ...]

    def size(self) -> int:
        return sum(len(n) for n in self.context + self.owned)


def build_trie(sequences: Sequence[Sequence[int]]) -> list[Node]:
    """The radix trie of ``sequences`` (roots: one per distinct first token). Built from the
    sequences in sorted order and the common prefix of each with the one before, as a suffix
    tree is built from a suffix array: O(total tokens)."""
    arrays = [np.asarray(s, dtype=np.int64) for s in sequences]
    for i, a in enumerate(arrays):
        if a.ndim != 1 or a.size == 0:
            raise ValueError(f"sequence {i} is empty or not a list of token ids; every path needs tokens")
    order = sorted(range(len(arrays)), key=lambda i: tuple(sequences[i]))
    roots: list[Node] = []
    stack: list[Node] = []  # the previous sequence's path, root first
    previous = None
    for i in order:
        seq = arrays[i]
        common = 0 if previous is None else _common_prefix(previous, seq)
        while stack and stack[-1].start >= common:
            stack.pop()
        if stack and stack[-1].end > common:  # split the node the paths leave: top half shared
            bottom = stack.pop()
            top = Node(bottom.start, common, bottom.path, bottom.parent, [bottom])
            siblings = bottom.parent.children if bottom.parent is not None else roots
            siblings[siblings.index(bottom)] = top
            bottom.start, bottom.parent = common, top
            stack.append(top)
        if common == seq.size:  # the same sequence again: it ends where the previous one did
            stack[-1].ends.append(i)
        else:
            parent = stack[-1] if stack else None
            node = Node(common, seq.size, i, parent, ends=[i])
            (parent.children if parent is not None else roots).append(node)
            stack.append(node)
        previous = seq
    return roots


def _common_prefix(a: np.ndarray, b: np.ndarray) -> int:
    n = min(a.size, b.size)
    diff = np.flatnonzero(a[:n] != b[:n])
    return int(diff[0]) if diff.size else n


def split_tree(node: Node, capacity: int, context: tuple[Node, ...] = ()) -> list[Piece]:
    """The pieces of ``node``'s subtree for rows of ``capacity`` tokens, ``context`` being its
    ancestors (repeated in each piece). One piece when it fits; else the node with the child
    subtrees that fit beside it (first-fit decreasing), more pieces of the other fitting children
    under the node's path, and the children too large for that split recursively."""
    head = sum(len(n) for n in context) + len(node)
    if head > capacity:
        raise ValueError(f"a path of {head} tokens exceeds the row capacity {capacity}")
    if head - len(node) + node.size() <= capacity:
        return [Piece(context, tuple(node.preorder()))]
    room = capacity - head
    fitting = sorted((c for c in node.children if c.size() <= room), key=lambda c: -c.size())
    groups: list[list[Node]] = []
    used: list[int] = []
    for child in fitting:
        for g, group in enumerate(groups):
            if used[g] + child.size() <= room:
                group.append(child)
                used[g] += child.size()
                break
        else:
            groups.append([child])
            used.append(child.size())
    below = context + (node,)
    pieces = []
    if node.ends or groups:  # else the node is only context: its descendants' pieces repeat it
        first = groups.pop(0) if groups else []
        pieces.append(Piece(context, (node,) + _preorder(first)))
    pieces += [Piece(below, _preorder(group)) for group in groups]
    for child in node.children:
        if child.size() > room:
            pieces += split_tree(child, capacity, below)
    return pieces


def _preorder(subtrees: Sequence[Node]) -> tuple[Node, ...]:
    return tuple(n for s in subtrees for n in s.preorder())


def plan_rows(paths: Sequence[TreePath], capacity: int, *, strategy: str = "bfd") -> list[list[Piece]]:
    """The pieces of each row: the trie of ``paths`` split to ``capacity`` and bin-packed."""
    for i, p in enumerate(paths):
        if len(p.ids) > capacity:
            raise ValueError(f"path {i} has {len(p.ids)} tokens > the row capacity {capacity}: a tree row "
                             "holds each path's whole context; raise the capacity or truncate the path")
    pieces = [piece for root in build_trie([p.ids for p in paths]) for piece in split_tree(root, capacity)]
    if not pieces:
        return []
    bins = pack([piece.size() for piece in pieces], capacity, strategy=strategy)
    return [[pieces[i] for i in sorted(row.tolist())] for row in bins]


def tree_row(paths: Sequence[TreePath], pieces: Sequence[Piece]) -> dict:
    """One training row from its pieces: ``input_ids``, ``position_ids`` (depths), ``nopad_meta``
    (segments reading their ancestors through ``key_index``), and the loss pairs of the paths whose
    last node it owns: ``loss_rows`` (row position whose logits predict the pair), ``loss_targets``,
    ``loss_paths`` (input path of each pair) and one float tensor per extra name, in pair order;
    ``indices`` are those paths. No ``labels``: a row position can predict several targets."""
    ids: list[int] = []
    segments: list[list] = []  # [query tokens, context tokens, last node]
    path_rows: dict[int, np.ndarray] = {}  # id(node) -> rows of its path in this row, root first
    previous = None  # the node laid last: a node laid right after its parent continues its segment
    for piece in pieces:
        for node in piece.context + piece.owned:
            if id(node) in path_rows:  # another piece of the same tree laid it in this row already
                continue
            start = len(ids)
            ids += list(paths[node.path].ids[node.start:node.end])
            above = path_rows[id(node.parent)] if node.parent is not None else np.zeros(0, np.int64)
            path_rows[id(node)] = np.concatenate([above, np.arange(start, start + len(node))])
            if previous is not None and node.parent is previous:
                segments[-1][0] += len(node)
                segments[-1][2] = node
            else:
                segments.append([len(node), above.size, node])
            previous = node
    q_lens = np.asarray([s[0] for s in segments], dtype=np.int64)
    ctx_lens = np.asarray([s[1] for s in segments], dtype=np.int64)
    meta = VarlenMeta.for_step(q_lens, ctx_lens)
    if ctx_lens.any():
        meta = _with_key_lists(meta, [path_rows[id(s[2])] for s in segments])

    owned = [p for piece in pieces for node in piece.owned for p in node.ends]
    names = sorted({name for p in owned for name in paths[p].extras})
    clash = set(names) & set(ROW_KEYS)
    if clash:
        raise ValueError(f"extras named {sorted(clash)} clash with the row's own keys; rename them")
    ends_at = {p: node for piece in pieces for node in piece.owned for p in node.ends}
    rows, targets, which, extras = [], [], [], {name: [] for name in names}
    for p in owned:
        at = _loss_positions(paths[p], p)
        token_ids = np.asarray(paths[p].ids, dtype=np.int64)
        rows.append(path_rows[id(ends_at[p])][at - 1])
        targets.append(token_ids[at])
        which.append(np.full(at.size, p, dtype=np.int64))
        for name in names:
            values = paths[p].extras.get(name)
            if values is None:
                raise ValueError(f"path {p} has no extra {name!r} but other paths in its row do; give every "
                                 "path the same extras")
            if len(values) != len(token_ids):
                raise ValueError(f"path {p}: extra {name!r} has {len(values)} values for {len(token_ids)} "
                                 "tokens; give one per token")
            extras[name].append(np.asarray(values, dtype=np.float32)[at])
    row = {
        "input_ids": torch.tensor(ids, dtype=torch.int64)[None],
        "position_ids": meta.position_ids[None],
        "nopad_meta": meta,
        "seq_lens": torch.tensor(meta.seqlens_q, dtype=torch.int64),
        "loss_rows": torch.from_numpy(_cat(rows, np.int64)),
        "loss_targets": torch.from_numpy(_cat(targets, np.int64)),
        "loss_paths": torch.from_numpy(_cat(which, np.int64)),
        "indices": torch.tensor(owned, dtype=torch.int64),
        "num_loss_seqs": len(owned),
    }
    row["num_loss_tokens"] = int(row["loss_rows"].numel())
    row.update({name: torch.from_numpy(_cat(values, np.float32)) for name, values in extras.items()})
    return row


def _loss_positions(path: TreePath, index: int) -> np.ndarray:
    if path.loss_mask is None:
        return np.zeros(0, dtype=np.int64)
    mask = np.asarray(path.loss_mask, dtype=bool)
    if mask.shape != (len(path.ids),):
        raise ValueError(f"path {index}: loss_mask has {mask.size} entries for {len(path.ids)} tokens")
    if mask.size and mask[0]:
        raise ValueError(f"path {index}: loss_mask[0] is set, but nothing predicts a sequence's first token")
    return np.flatnonzero(mask)


def _cat(parts: list[np.ndarray], dtype) -> np.ndarray:
    return np.concatenate(parts).astype(dtype, copy=False) if parts else np.zeros(0, dtype=dtype)


def _with_key_lists(meta: VarlenMeta, key_lists: list[np.ndarray]) -> VarlenMeta:
    """``meta`` whose segment ``i`` reads the row's K/V rows ``key_lists[i]`` (as
    :meth:`VarlenMeta.shared_prefix` builds its key index)."""
    index = np.zeros((len(key_lists), max(meta.max_seqlen_k, 1)), dtype=np.int32)
    for i, rows in enumerate(key_lists):
        index[i, : rows.size] = rows
    rows = np.concatenate(key_lists)
    return replace(meta, key_index=torch.from_numpy(index), key_rows=torch.from_numpy(rows))


def pack_tree_rows(paths: Sequence[TreePath], capacity: int, *, strategy: str = "bfd") -> list[dict]:
    """Tree rows of at most ``capacity`` tokens holding every path of ``paths`` (see the module
    docstring); each path's loss pairs are in exactly one row."""
    return [tree_row(paths, pieces) for pieces in plan_rows(paths, capacity, strategy=strategy)]


def unique_tokens(paths: Sequence[TreePath]) -> int:
    """Tokens of the trie of ``paths`` (each shared token once): what tree rows compute when no
    tree is split."""
    return sum(root.size() for root in build_trie([p.ids for p in paths]))


def pair_logprobs(model, row: Mapping, temperature: float = 1.0) -> torch.Tensor:
    """Log-probs ``(pairs,)`` of a tree row's loss pairs under ``model``, in pair order: the LM
    head runs once on each distinct predicting position, and each pair gathers its target there,
    so a shared token that m paths train on counts m times, each with its own path's extras."""
    keep, inverse = torch.unique(row["loss_rows"], return_inverse=True)
    out = model(input_ids=row["input_ids"], position_ids=row["position_ids"], nopad_meta=row["nopad_meta"],
                logits_to_keep=keep, use_cache=False)
    logits = out.logits[0].float()
    logp = torch.log_softmax(logits if temperature == 1.0 else logits / temperature, dim=-1)
    return logp[inverse.to(logp.device), row["loss_targets"].to(logp.device)]
