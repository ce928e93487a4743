"""Shared-prefix packing: a group's prompt once, then each of its completions, in one row.

GRPO trains on ``n`` completions of each prompt; packed the usual way every row repeats the
prompt ``n`` times. Here a group (prompt + its completions) is one packing item, so the prompt's
tokens are computed once and attended to by every completion through
:meth:`packing.varlen.VarlenMeta.shared_prefix`. A group is split across rows only when it does
not fit the token budget; the prompt is then repeated in each row that holds some of its
completions. Also fits SFT data with shared prefixes (several answers to one question).
"""

from __future__ import annotations

from collections.abc import Sequence

from packing.bins.binpack import pack
from packing.row import IGNORE_INDEX, PackedRow
from packing.varlen import VarlenMeta

Piece = tuple[int, list[int]]  # (group index, indices of the group's completions in this piece)


def split_group(prompt_len: int, completion_lens: Sequence[int], capacity: int,
                group: int = 0) -> list[list[int]]:
    """The completions of one group in pieces of at most ``capacity`` tokens each, prompt
    included (one piece when the whole group fits; else first-fit in order)."""
    total = prompt_len + sum(completion_lens)
    if total <= capacity:
        return [list(range(len(completion_lens)))]
    pieces: list[list[int]] = []
    used: list[int] = []
    for j, c in enumerate(completion_lens):
        if prompt_len + c > capacity:
            raise ValueError(f"group {group}: prompt ({prompt_len} tokens) + completion {j} ({c} tokens) "
                             f"exceed the row capacity {capacity}; raise the capacity or truncate the "
                             "completion")
        for p, piece in enumerate(pieces):
            if used[p] + c <= capacity:
                piece.append(j)
                used[p] += c
                break
        else:
            pieces.append([j])
            used.append(prompt_len + c)
    return pieces


def pack_groups(groups: Sequence[tuple[int, Sequence[int]]], capacity: int, *,
                strategy: str = "bfd") -> list[list[Piece]]:
    """Pack ``groups = [(prompt_len, [completion_len, ...]), ...]`` into rows of at most
    ``capacity`` tokens, each group's prompt counted once per row that holds it. Returns, per
    row, its pieces ``(group, [completion indices])``; rows are filled by :func:`packing.pack`."""
    pieces: list[Piece] = []
    for g, (prompt_len, completions) in enumerate(groups):
        if prompt_len < 1 or not len(completions):
            raise ValueError(f"group {g} needs a prompt and at least one completion, got ({prompt_len}, "
                             f"{list(completions)})")
        for part in split_group(prompt_len, completions, capacity, g):
            pieces.append((g, part))
    sizes = [groups[g][0] + sum(groups[g][1][j] for j in part) for g, part in pieces]
    rows = pack(sizes, capacity, strategy=strategy)
    return [[pieces[i] for i in sorted(row.tolist())] for row in rows]


def shared_prefix_row(pieces: Sequence[tuple[Sequence[int], Sequence[Sequence[int]]]], *,
                      indices: Sequence[int] | None = None, gen_logprobs: Sequence[float] | None = None,
                      advantages: Sequence[float] | None = None) -> PackedRow:
    """One training row from ``[(prompt_ids, [completion_ids, ...]), ...]``: tokens
    ``[prompt, c1, c2, ...]`` per piece, labels ``IGNORE_INDEX`` on prompt tokens, and
    ``nopad_meta`` (:meth:`VarlenMeta.shared_prefix`). The logits that predict label ``t`` are at
    row ``nopad_meta.previous_rows()[t]`` (a completion's first token is predicted by its prompt's
    last token), not ``t - 1``: read them with ``logits_to_keep``. ``indices`` (one per completion),
    ``gen_logprobs`` and ``advantages`` (one per completion token) go into the row as given."""
    ids, labels, groups = [], [], []
    for prompt, completions in pieces:
        prompt = list(prompt)
        if not prompt or not completions or not all(len(c) for c in completions):
            raise ValueError("every piece needs a non-empty prompt and non-empty completions")
        ids += prompt
        labels += [IGNORE_INDEX] * len(prompt)
        for c in completions:
            ids += list(c)
            labels += list(c)
        groups.append((len(prompt), [len(c) for c in completions]))
    return PackedRow.build(ids, labels, VarlenMeta.shared_prefix(groups), indices=indices,
                           gen_logprobs=gen_logprobs, advantages=advantages)
