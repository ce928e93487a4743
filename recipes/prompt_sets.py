"""Prompt sets read from a user's file for the GRPO and evaluation recipes (``task.prompts``,
``data.path``), checked before any model loads: a prompt set that cannot train or score is an
error naming its records, not a run of all-zero rewards."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from pathlib import Path


def load_examples(
    path: str | Path,
    prompt_field: str = "prompt",
    key: str = "data.path",
    split: str | None = None,
    needs: Sequence[str] = (),
    reader: str = "the reward",
) -> list[dict]:
    """Prompt examples from any input :func:`nopad.dataloaders.sources.load_records` reads (JSONL,
    parquet, CSV, a saved dataset...). Every example needs a string ``prompt_field``: a null prompt
    is an error naming its line, not the text "None". Null fields besides it are left out.

    Checked before anything runs, naming the records (an empty prompt was "raise
    max_prompt_tokens", a missing answer a run of all-zero rewards): no prompt is empty, and each
    example has the fields ``needs`` that ``reader`` (e.g. ``"reward=exact_match"``) compares against."""
    from nopad.dataloaders.sources import load_records

    empty: list[str] = []
    missing: dict[str, list[str]] = {name: [] for name in needs}

    def note(record: Mapping, where: str) -> None:
        if not str(record[prompt_field]).strip():
            empty.append(where)
        for name in needs:
            if record.get(name) is None:
                missing[name].append(where)

    ds = load_records(path, [{prompt_field: str}], split=split, key=key, check=note)
    if empty:
        raise ValueError(
            f"{key}={path}: {len(empty)} prompt(s) are empty ({prompt_field!r} holds no "
            f"text), so there is nothing to generate from: {_some(empty)}; write the question "
            "there, or remove the record"
        )
    for name, where in missing.items():
        if where:
            raise ValueError(
                f"{key}={path}: {len(where)} of {len(ds)} prompts have no {name!r} field, "
                f"which {reader} compares each completion against, so their reward would "
                f"always be 0: {_some(where)}; add {name!r} to every record (rename your "
                "answer field to it), or choose a reward that does not read it"
            )
    return [{k: v for k, v in row.items() if v is not None} for row in ds]


def _some(where: list[str], shown: int = 5) -> str:
    """The first ``shown`` locations, and how many more."""
    more = f" and {len(where) - shown} more" if len(where) > shown else ""
    return ", ".join(where[:shown]) + more
