"""One reader for every data input of the recipes: JSONL (plain, ``.gz``, with a UTF-8 BOM), JSON,
parquet, CSV, and directories written by ``save_to_disk`` (a ``Dataset`` or a ``DatasetDict``).

Why: each recipe used to read its input its own way, plain JSONL and saved single datasets only, so a
user's ``.jsonl.gz`` or parquet failed with a bare ``UnicodeDecodeError`` or pyarrow error, and a
``null`` prompt was sent to the model as the text "None". Here every record is checked against the
kinds of record the caller takes (``{"text": str}`` or ``{"messages": list}``...), and a wrong one is
an error that names the file, the line (or row) and the field.

Parquet, CSV and saved datasets are read by ``datasets``' own loaders. JSON and JSONL are parsed
line by line here (``datasets``' JSON loader cannot name the line of a bad record).
"""

from __future__ import annotations

import gzip
import hashlib
import json
import logging
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import datasets
import numpy as np

logger = logging.getLogger(__name__)

Kind = Mapping[str, type | tuple[type, ...]]  # a record kind: field -> the type(s) it must have
TOKENIZER_FILE = "nopad_tokenizer.json"  # beside a packed dataset: the tokenizer that made its ids
ANY: Sequence[Kind] = ({},)  # any JSON object
FORMATS = ".jsonl, .jsonl.gz, .json, .json.gz, .parquet, .csv, or a save_to_disk directory"


def load_records(
    path: str | Path,
    kinds: Sequence[Kind] = (),
    *,
    split: str | None = None,
    key: str = "data",
    check: Callable[[Mapping, str], None] | None = None,
) -> datasets.Dataset:
    """The records of ``path`` as a ``Dataset``, each of one of ``kinds`` (all of the same kind).

    ``split`` picks one split of a ``DatasetDict`` (default: ``train``, or its only split); ``key``
    is the config key that named ``path``, for the messages; ``check(record, where)`` is the
    caller's own check of each record (``where`` names the file and line)."""
    path = Path(path)
    if path.is_dir():
        ds = _load_saved(path, split, key)
        rows = ds if check else _first_rows_checked(ds, kinds, path)
    elif path.is_file():
        name = path.name.lower()
        if name.endswith((".jsonl", ".jsonl.gz", ".json", ".json.gz")):
            rows = _read_json(path)
            ds = None
        elif name.endswith((".parquet", ".csv")):
            if name.endswith(".parquet"):
                ds = datasets.load_dataset("parquet", data_files=str(path), split="train")
            else:  # CSV cells are text: "2" stays "2", not the integer pandas would guess
                ds = datasets.load_dataset("csv", data_files=str(path), split="train", features=_text_columns(path))
            rows = ds if check else _first_rows_checked(ds, kinds, path)
        else:
            raise ValueError(f"{key}={path}: unknown file type; give {FORMATS}")
    else:
        raise FileNotFoundError(f"{key}={str(path)!r} does not exist; give {FORMATS}")
    records = []
    first_kind = None
    for where, record in _located(path, rows):
        kind = check_record(record, kinds or ANY, where)
        if check is not None:
            check(record, where)
        if first_kind is None:
            first_kind = kind
        elif kind is not first_kind:
            raise ValueError(
                f"{where} is a {_kind_name(kind)} record, but the first record is a "
                f"{_kind_name(first_kind)} record; one input holds one kind of record"
            )
        if ds is None:
            records.append(record)
    if ds is None:
        if not records:
            raise ValueError(f"{key}={path} holds no records")
        ds = datasets.Dataset.from_list(records)
    if len(ds) == 0:
        raise ValueError(f"{key}={path} holds no records")
    return ds


def load_sft_rows(
    source: str | Path, prompt_column: str, completion_column: str, split: str | None = None, tokenizer=None
) -> datasets.Dataset:
    """SFT's ``data.source``: token rows (``input_ids``, e.g. a packed dataset, whose tokenizer must
    be the model's) or text rows (``prompt_column`` and ``completion_column``, strings)."""
    kinds = [{"input_ids": list}, {prompt_column: str, completion_column: str}]
    rows = load_records(source, kinds, split=split, key="data.source")
    if Path(source).is_dir():
        check_tokenizer(source, tokenizer)
    return rows


def check_record(record, kinds: Sequence[Kind], where: str) -> Kind:
    """The kind ``record`` is (the first whose fields it has), after checking those fields' types."""
    if not isinstance(record, Mapping):
        raise ValueError(
            f"{where} is a JSON {type(record).__name__}, not an object like {' or '.join(_example(k) for k in kinds)}"
        )
    for kind in kinds:
        if all(field in record for field in kind):
            for field, types in kind.items():
                value = record[field]
                if not isinstance(value, types) or isinstance(value, bool):
                    got = "null" if value is None else f"{type(value).__name__} {value!r}"[:80]
                    raise ValueError(f"{where}: field {field!r} must be {_type_words(types)}, got {got}")
            return kind
    expected = " or ".join(_example(k) for k in kinds)
    raise ValueError(f"{where} has fields {sorted(record)}; expected {expected}")


def tokenizer_fingerprint(tokenizer) -> dict:
    """Name, vocabulary size and a hash of the vocabulary: what makes token ids mean the same."""
    vocab = tokenizer.get_vocab() if hasattr(tokenizer, "get_vocab") else {}
    digest = hashlib.sha256(json.dumps(sorted(vocab.items())).encode()).hexdigest()[:16] if vocab else None
    size = len(tokenizer) if hasattr(tokenizer, "__len__") else getattr(tokenizer, "vocab_size", None)
    return {
        "name": str(getattr(tokenizer, "name_or_path", type(tokenizer).__name__)),
        "vocab_size": size,
        "vocab_hash": digest,
    }


def save_tokenizer_fingerprint(directory: str | Path, tokenizer) -> None:
    (Path(directory) / TOKENIZER_FILE).write_text(json.dumps(tokenizer_fingerprint(tokenizer)))


def check_tokenizer(directory: str | Path, tokenizer, key: str = "data.source") -> None:
    """A packed dataset's token ids must come from ``tokenizer``'s vocabulary (a mismatch used to
    end in an ``IndexError`` inside the embedding, or train on the wrong tokens)."""
    saved_file = Path(directory) / TOKENIZER_FILE
    if tokenizer is None or not saved_file.is_file():
        return
    saved, ours = json.loads(saved_file.read_text()), tokenizer_fingerprint(tokenizer)
    same = (
        saved["vocab_hash"] == ours["vocab_hash"]
        if saved["vocab_hash"] and ours["vocab_hash"]
        else saved["vocab_size"] == ours["vocab_size"]
    )
    if not same:
        raise ValueError(
            f"{key}={directory} was tokenized with {saved['name']} (vocabulary of "
            f"{saved['vocab_size']}, hash {saved['vocab_hash']}), but the model's tokenizer is "
            f"{ours['name']} (vocabulary of {ours['vocab_size']}, hash {ours['vocab_hash']}); "
            "run nopad.recipes.preprocess again with tokenizer=<the model's directory>"
        )


def check_dropped_tokens(
    lengths, capacity: int, max_fraction: float, *, key: str, capacity_key: str, what: str = "sequences"
) -> int:
    """The one truncation rule (preprocess and SFT): cutting sequences to ``capacity`` may drop at
    most ``max_fraction`` of all tokens (the setting ``key``), else a ValueError that says how many
    and what to change. Returns the number of tokens dropped (logged when > 0)."""
    lengths = np.asarray(lengths, dtype=np.int64)
    too_long = lengths > capacity
    dropped = int((lengths[too_long] - capacity).sum())
    total = max(int(lengths.sum()), 1)
    share = dropped / total
    section = key.rpartition(".")[0] + "." if "." in key else ""
    if share > max_fraction:
        raise ValueError(
            f"{section}overflow=truncate would drop {dropped:,} of {total:,} tokens ({share:.0%}) of the "
            f"{int(too_long.sum())} {what} longer than {capacity_key}={capacity}, more than {key}="
            f"{max_fraction:g}; raise {capacity_key} (>= {int(lengths.max())} drops nothing), use "
            f"{section}overflow=split, or accept the loss with {key}={share:.2f}"
        )
    if dropped:
        logger.warning(
            "%soverflow=truncate drops %d tokens (%.1f%%) of %d %s longer than %d",
            section,
            dropped,
            100 * share,
            int(too_long.sum()),
            what,
            capacity,
        )
    return dropped


def _first_rows_checked(ds: datasets.Dataset, kinds: Sequence[Kind], path: Path) -> list:
    """A typed table (Arrow) holds one type per column, so its first row stands for the types; its
    nulls are found per column, without reading every row (a packed dataset can be large)."""
    if not kinds or len(ds) == 0:
        return []
    kind = check_record(ds[0], kinds, f"{path} row 1")
    for field in kind:
        column = ds.data.column(field)
        if column.null_count:
            import pyarrow.compute as pc

            row = pc.index(pc.is_null(column), True).as_py()
            raise ValueError(f"{path} row {row + 1}: field {field!r} must be {_type_words(kind[field])}, got null")
    return []


def _text_columns(path: Path) -> datasets.Features:
    import csv

    with open(path, newline="", encoding="utf-8-sig") as f:
        header = next(csv.reader(f), [])
    return datasets.Features({name: datasets.Value("string") for name in header})


def _load_saved(path: Path, split: str | None, key: str) -> datasets.Dataset:
    try:
        ds = datasets.load_from_disk(str(path))
    except FileNotFoundError as err:
        raise ValueError(
            f"{key}={path} is a directory but not one written by datasets' save_to_disk ({err}); give {FORMATS}"
        ) from None
    if isinstance(ds, datasets.DatasetDict):
        names = list(ds)
        chosen = split or ("train" if "train" in ds else names[0] if len(names) == 1 else None)
        if chosen not in ds:
            raise ValueError(
                f"{key}={path} holds splits {names}; choose one with its split key (e.g. split={names[0]})"
            )
        logger.info("%s=%s: using split %r of %s", key, path, chosen, names)
        ds = ds[chosen]
    return ds


def _read_json(path: Path) -> list:
    """The records of a JSON Lines file (or one JSON array), gzip and a UTF-8 BOM allowed."""
    opener = gzip.open if path.name.lower().endswith(".gz") else open
    try:
        with opener(path, "rt", encoding="utf-8-sig") as f:
            text = f.read()
    except UnicodeDecodeError as err:
        raise ValueError(f"{path} is not UTF-8 text ({err.reason} at byte {err.start}); save it as UTF-8") from None
    if text.lstrip().startswith("[") and path.name.lower().endswith((".json", ".json.gz")):
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}:{err.lineno} is not valid JSON ({err.msg})") from None
    records = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            records.append((number, json.loads(line)))
        except json.JSONDecodeError as err:
            raise ValueError(
                f"{path}:{number} is not valid JSON ({err.msg} at column {err.colno}); each "
                "line must be one JSON object"
            ) from None
    return records


def _located(path: Path, rows):
    """``(where, record)`` pairs: ``file:line`` for JSON Lines, ``file row i`` otherwise."""
    for i, row in enumerate(rows):
        if isinstance(row, tuple) and len(row) == 2 and isinstance(row[0], int):  # (line, record)
            yield f"{path}:{row[0]}", row[1]
        else:
            yield f"{path} row {i + 1}", row


def _type_words(types) -> str:
    types = types if isinstance(types, tuple) else (types,)
    names = {str: "a string", list: "a list", int: "an integer", float: "a number", dict: "an object"}
    return " or ".join(names.get(t, t.__name__) for t in types)


def _example(kind: Kind) -> str:
    return "{" + ", ".join(f'"{f}": <{_type_words(t).split()[-1]}>' for f, t in kind.items()) + "}"


def _kind_name(kind: Kind | None) -> str:
    return "/".join(kind) if kind else "any"
