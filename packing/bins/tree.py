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
:func:`nopad.packing.pack`; pieces of one tree that share a row lay their common nodes once. A
sequence longer than the row capacity is an error: a path's keys must lie in one row.

The loss is per (path, token) pair, as in the flat sequences. A row is a
:class:`nopad.packing.row.PackedRow`: labels on the tokens its paths train on, each predicted by the
token before it on its path (``nopad_meta.previous_rows()``: a node's first token by its
parent's last), and the pairs (``pair_tokens``, ``pair_seqs``) of the paths whose last node the
row owns, so a token that m paths train on counts m times, each with its own path's per-token
values (the row's ``token_values``), while the LM head runs on it once. The one-level shared
prefix of a GRPO group (a prompt and its completions) is the depth-1 case
(:func:`nopad.training.grpo.pack_rollouts`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

import numpy as np

from nopad.packing.bins.binpack import pack
from nopad.packing.row import IGNORE_INDEX, PackedRow
from nopad.packing.varlen import VarlenMeta


@dataclass(frozen=True)
class TreePath:
    """One flat sequence of the tree: token ids, which tokens carry the loss (token ``t`` is
    predicted by token ``t - 1``, so ``loss_mask[0]`` must be False) and named per-token
    ``extras`` (a weight per token, say), each as long as ``ids``; only their loss-token values are
    used, as the row's ``token_values``."""

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
            raise ValueError(
                f"path {i} has {len(p.ids)} tokens > the row capacity {capacity}: a tree row "
                "holds each path's whole context; raise the capacity or truncate the path"
            )
    pieces = [piece for root in build_trie([p.ids for p in paths]) for piece in split_tree(root, capacity)]
    if not pieces:
        return []
    bins = pack([piece.size() for piece in pieces], capacity, strategy=strategy)
    return [[pieces[i] for i in sorted(row.tolist())] for row in bins]


def tree_row(paths: Sequence[TreePath], pieces: Sequence[Piece]) -> PackedRow:
    """One training row from its pieces: tokens, positions (depths) and ``nopad_meta`` (segments
    reading their ancestors through ``key_index``); labels on every token that a path whose last
    node the row owns trains on, and the loss pairs of those paths (``pair_tokens``,
    ``pair_seqs``: see :class:`nopad.packing.row.PackedRow`), path after path, each in token order,
    with the paths' extras per pair; ``indices`` are those paths."""
    ids: list[int] = []
    segments: list[list] = []  # [query tokens, context tokens, last node]
    path_rows: dict[int, np.ndarray] = {}  # id(node) -> rows of its path in this row, root first
    previous = None  # the node laid last: a node laid right after its parent continues its segment
    for piece in pieces:
        for node in piece.context + piece.owned:
            if id(node) in path_rows:  # another piece of the same tree laid it in this row already
                continue
            start = len(ids)
            ids += list(paths[node.path].ids[node.start : node.end])
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
        meta = meta.with_key_lists([path_rows[id(s[2])] for s in segments])

    owned = [p for piece in pieces for node in piece.owned for p in node.ends]
    names = sorted({name for p in owned for name in paths[p].extras})
    ends_at = {p: node for piece in pieces for node in piece.owned for p in node.ends}
    at_rows, which, extras = [], [], {name: [] for name in names}
    for k, p in enumerate(owned):
        at = _loss_positions(paths[p], p)
        at_rows.append(path_rows[id(ends_at[p])][at])  # the row position of each loss token
        which.append(np.full(at.size, k, dtype=np.int64))
        for name in names:
            values = paths[p].extras.get(name)
            if values is None:
                raise ValueError(
                    f"path {p} has no extra {name!r} but other paths in its row do; give every path the same extras"
                )
            if np.ndim(values) != 1 or len(values) != len(paths[p].ids):
                got = f"is {values!r}" if np.ndim(values) == 0 else f"has {np.size(values)} values"
                raise ValueError(
                    f"path {p}: extra {name!r} {got} for {len(paths[p].ids)} tokens; give one "
                    "value per token, as long as ids (a sequence's advantage a: [a] * len(ids))"
                )
            extras[name].append(np.asarray(values, dtype=np.float32)[at])
    targets = _cat(at_rows, np.int64)
    token_ids = np.asarray(ids, dtype=np.int64)
    labels = np.full(token_ids.size, IGNORE_INDEX, dtype=np.int64)
    labels[targets] = token_ids[targets]
    label_order = np.cumsum(labels != IGNORE_INDEX) - 1  # row position -> index among the loss tokens
    return PackedRow.build(
        token_ids,
        labels,
        meta,
        indices=owned,
        pairs=(label_order[targets], _cat(which, np.int64)),
        token_values={name: _cat(values, np.float32) for name, values in extras.items()},
    )


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


def pack_tree_rows(paths: Sequence[TreePath], capacity: int, *, strategy: str = "bfd") -> list[PackedRow]:
    """Tree rows of at most ``capacity`` tokens holding every path of ``paths`` (see the module
    docstring); each path's loss pairs are in exactly one row."""
    return [tree_row(paths, pieces) for pieces in plan_rows(paths, capacity, strategy=strategy)]


def unique_tokens(paths: Sequence[TreePath]) -> int:
    """Tokens of the trie of ``paths`` (each shared token once): what tree rows compute when no
    tree is split."""
    return sum(root.size() for root in build_trie([p.ids for p in paths]))
