"""``pack_dataset``: pack a tokenized Hugging Face ``datasets.Dataset`` in one global pass.

Unlike per-chunk packing inside ``Dataset.map`` (1000 rows at a time by default), the bins are
chosen over the whole dataset at once by the compiled packer, and the packed rows are assembled
from the raw Arrow buffers: one compiled memcpy per sequence (or piece, when split/truncated)
into a new values buffer, plus new list offsets. No Python loop over sequences or tokens.
"""

from __future__ import annotations

import logging

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from nopad.packing._native import native_packer
from nopad.packing.bins import algorithms
from nopad.packing.bins.binpack import pack
from nopad.packing.bins.stats import Bins

logger = logging.getLogger(__name__)


def pack_dataset(
    ds,
    capacity: int,
    *,
    strategy: str = "bfd",
    seed: int | None = None,
    overflow: str = "error",
    max_seqs_per_bin: int | None = None,
    skip_empty: bool = False,
    columns: list[str] | None = None,
    position_ids: bool = False,
    return_bins: bool = False,
):
    """Pack the rows of ``ds`` (column ``input_ids``) into rows of at most ``capacity`` tokens.

    The result has one row per bin with the packed token columns (``input_ids`` and every other
    list column aligned with it, e.g. ``labels``, a loss mask; or exactly ``columns``; never
    ``attention_mask``, which would make the packed row one sequence to transformers) plus
    ``seq_lengths`` (the lengths of the sequences in the row, in order) and,
    if ``position_ids=True``, positions restarting at 0 for every sequence. Other columns (e.g.
    raw text) cannot be concatenated and are dropped with a log message. ``strategy``, ``seed``,
    ``overflow``, ``max_seqs_per_bin`` and ``skip_empty`` mean the same as in :func:`nopad.packing.pack`.
    A ``DatasetDict`` is packed split by split. With ``return_bins=True`` returns
    ``(dataset, bins)`` where ``bins.indices`` are row numbers of ``ds``.
    """
    import datasets

    if isinstance(ds, datasets.DatasetDict):
        kwargs = dict(
            strategy=strategy,
            seed=seed,
            overflow=overflow,
            max_seqs_per_bin=max_seqs_per_bin,
            skip_empty=skip_empty,
            columns=columns,
            position_ids=position_ids,
        )
        return datasets.DatasetDict({name: pack_dataset(d, capacity, **kwargs) for name, d in ds.items()})
    if not isinstance(ds, datasets.Dataset):
        raise TypeError(f"pack_dataset needs a datasets.Dataset or DatasetDict; got {type(ds).__name__}")
    if "input_ids" not in ds.column_names:
        raise ValueError(f"pack_dataset needs an 'input_ids' column; the dataset has {ds.column_names}")
    if len(ds) == 0:
        raise ValueError("the dataset is empty: there is nothing to pack")

    table = ds.with_format("arrow")[:]  # zero-copy unless ds has an indices mapping (select/shuffle)
    token_columns = _token_columns(table, columns)
    lengths = pc.list_value_length(table.column("input_ids"))
    if lengths.null_count:
        row = pc.index(pc.is_null(lengths), True).as_py()
        raise ValueError(f"row {row} has no input_ids (null); drop or fix such rows before packing")
    lengths = lengths.to_numpy(zero_copy_only=False)
    bins = pack(
        lengths.astype(np.int64, copy=False),
        capacity,
        strategy=strategy,
        seed=seed,
        overflow=overflow,
        max_seqs_per_bin=max_seqs_per_bin,
        skip_empty=skip_empty,
    )

    fingerprint = _fingerprint(
        ds, capacity, strategy, seed, overflow, max_seqs_per_bin, skip_empty, token_columns, position_ids
    )
    packed = _packed_dataset(ds, table, token_columns, bins, position_ids, fingerprint)
    logger.info(
        "packed %d rows into %d rows of %d tokens: %s",
        len(ds),
        len(bins),
        capacity,
        f"efficiency {bins.stats.efficiency:.2%}",
    )
    return (packed, bins) if return_bins else packed


def _fingerprint(ds, *options) -> str:
    """The packed dataset's fingerprint, from ``ds``'s and the packing options. Given explicitly:
    otherwise datasets hashes every packed token to make one."""
    from datasets.fingerprint import Hasher

    return Hasher.hash((ds._fingerprint, "nopad.pack_dataset", *options))


def _packed_dataset(ds, table: pa.Table, token_columns: list[str], bins: Bins, position_ids: bool, fingerprint: str):
    """The packed rows as a ``datasets.Dataset`` in ``ds``'s format: every token column re-cut
    into one list per bin, ``seq_lengths`` and (if asked) ``position_ids``. The Arrow assembly, on
    its own so that :func:`pack_dataset` reads as checks, bin choice, result."""
    import datasets
    from datasets.table import InMemoryTable

    row_tokens = np.zeros(len(bins) + 1, dtype=np.int64)
    np.cumsum(bins.bin_tokens, out=row_tokens[1:])
    arrays = {name: _packed_column(table.column(name), bins, row_tokens) for name in token_columns}
    arrays["seq_lengths"] = pa.ListArray.from_arrays(
        bins.offsets.astype(np.int32), pa.array(bins.lengths.astype(np.int32))
    )
    if position_ids:
        arrays["position_ids"] = pa.ListArray.from_arrays(row_tokens.astype(np.int32), _positions(bins))
    packed = datasets.Dataset(InMemoryTable(pa.Table.from_pydict(arrays)), fingerprint=fingerprint)
    if ds.format["type"] is not None:
        packed = packed.with_format(ds.format["type"])
    return packed


# A concatenated all-ones mask over a packed row tells transformers "one sequence": its SDPA/eager
# paths then attend across the documents. The boundaries live in seq_lengths (and position_ids).
DROPPED_MASK = (
    "a packed row cannot carry a concatenated attention_mask (transformers would read the row "
    "as one sequence and attend across documents; boundaries are in seq_lengths)"
)


def _token_columns(table: pa.Table, columns: list[str] | None) -> list[str]:
    """List columns with one entry per token of ``input_ids`` (checked row by row)."""
    lengths = pc.list_value_length(table.column("input_ids"))
    if columns is not None:
        missing = [c for c in columns if c not in table.column_names]
        if missing:
            raise ValueError(f"columns {missing} are not in the dataset (it has {table.column_names})")
        names = ["input_ids"] + [c for c in columns if c != "input_ids"]
        if "attention_mask" in names:
            raise ValueError(DROPPED_MASK + "; leave it out of columns=[...]")
    else:
        names = [c for c in table.column_names if _is_list(table.schema.field(c).type)]
        dropped = [c for c in table.column_names if c not in names]
        if dropped:
            logger.info("pack_dataset drops columns %s (not per-token lists)", dropped)
        if "attention_mask" in names:
            names.remove("attention_mask")
            logger.info(DROPPED_MASK + "; it is dropped")
    for name in names:
        if not _is_list(table.schema.field(name).type):
            raise ValueError(
                f"column {name!r} is not a list column ({table.schema.field(name).type}); "
                "only per-token list columns can be packed"
            )
        aligned = pc.all(pc.equal(pc.list_value_length(table.column(name)), lengths)).as_py()
        if name != "input_ids" and not aligned:
            raise ValueError(
                f"column {name!r} does not have one entry per token of 'input_ids' in every "
                "row; fix the tokenization or leave it out with columns=[...]"
            )
    return names


def _is_list(dtype: pa.DataType) -> bool:
    return pa.types.is_list(dtype) or pa.types.is_large_list(dtype)


def _packed_column(column: pa.ChunkedArray, bins: Bins, row_tokens: np.ndarray) -> pa.Array:
    """The tokens of every bin's items, concatenated, re-cut into one list per bin."""
    array = column.combine_chunks() if column.num_chunks != 1 else column.chunk(0)
    offsets = array.offsets.to_numpy().astype(np.int64, copy=False)  # absolute, into array.values
    starts = offsets[bins.indices] + bins.starts  # first value of each item
    values = array.values
    if pa.types.is_primitive(values.type) and not pa.types.is_boolean(values.type) and values.null_count == 0:
        # fixed-width values: one memcpy per item (compiled) on the raw buffer
        src = values.to_numpy(zero_copy_only=True)
        itemsize = src.dtype.itemsize
        gather = (native_packer() or algorithms).gather_bytes
        out = gather(src.view(np.uint8), starts * itemsize, bins.lengths * itemsize).view(src.dtype)
        packed_values = pa.array(out, type=values.type)
    else:  # nulls, booleans, nested values: Arrow take on a token index
        first = np.cumsum(bins.lengths) - bins.lengths
        index = np.arange(int(bins.lengths.sum()), dtype=np.int64) + np.repeat(starts - first, bins.lengths)
        packed_values = pc.take(values, pa.array(index))
    return type(array).from_arrays(row_tokens.astype(array.offsets.type.to_pandas_dtype()), packed_values)


def _positions(bins: Bins) -> np.ndarray:
    """0, 1, ... restarting at every packed item (each piece of a split sequence restarts too,
    as it is attended on its own)."""
    total = int(bins.lengths.sum())
    item_first_token = np.cumsum(bins.lengths) - bins.lengths
    positions = np.arange(total, dtype=np.int64) - np.repeat(item_first_token, bins.lengths)
    return positions.astype(np.int32)
