"""Tokenize plain-text or chat data, pack it with one global best-fit pass, save it to disk.

    python -m nopad.recipes.preprocess [recipes/configs/preprocess.yaml] input=data.jsonl output=packed/

Chat data (a ``messages`` list per row) is rendered with the tokenizer's chat template and only
assistant turns get labels; prompt tokens are ``IGNORE_INDEX``. Plain text gets ``input_ids`` only (every
token is a target). The packed rows keep ``seq_lengths`` so a collator can rebuild per-sequence
positions and boundaries. Every step is also a function for use from Python.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from nopad.recipes.cli import run_recipe
from nopad.recipes.config import ConfigError, Section, parse_cli, setup_logging

if TYPE_CHECKING:  # datasets, dataloaders and packing are imported where they run: --help needs none
    import datasets

logger = logging.getLogger(__name__)
DEFAULT_CONFIG = Path(__file__).parent / "configs" / "preprocess.yaml"  # these defaults, with comments


@dataclass
class PreprocessConfig(Section):
    """The preprocess recipe's settings; ``recipes/configs/preprocess.yaml`` lists them with comments."""

    input: str | None = None  # {"text"}/{"messages"} records: JSONL(.gz), JSON, parquet, CSV, saved dataset
    split: str | None = None  # a saved DatasetDict's split (default: train, or its only one)
    output: str | None = None  # directory for the packed dataset
    tokenizer: str = "smollm2"  # the embedded SmolLM2 tokenizer, or a local HF tokenizer/model directory
    text_field: str = "text"  # plain text: every token is trained on
    messages_field: str = "messages"  # chat: the tokenizer's template; only assistant turns train
    add_eos: bool = True  # plain text: append the EOS token to every document
    capacity: int = 2048  # tokens per packed row
    strategy: Literal["bfd", "ffd", "nextfit"] = "bfd"  # best-fit / first-fit decreasing, next-fit
    overflow: Literal["error", "truncate", "split"] = "truncate"  # a sequence longer than capacity
    max_dropped_fraction: float = 0.05  # overflow=truncate may drop at most this share of the tokens
    max_seqs_per_bin: int | None = None  # null: no limit
    seed: int | None = None  # randomised tie-breaking (another, equally dense packing per seed)
    position_ids: bool = False  # also store position_ids (collators rebuild them from seq_lengths)
    num_proc: int | None = None  # processes for tokenization

    def check(self) -> None:
        self.at_least("capacity", 1)
        self.at_least("max_seqs_per_bin", 1)
        self.at_least("num_proc", 1)
        if not 0 <= self.max_dropped_fraction <= 1:
            raise ConfigError("max_dropped_fraction", f"must be a number in [0, 1], got {self.max_dropped_fraction!r}")


def load_records(
    path: str | Path, messages_field: str = "messages", text_field: str = "text", split: str | None = None
) -> datasets.Dataset:
    """Chat (``messages_field``) or text (``text_field``) records from any input
    :func:`nopad.dataloaders.sources.load_records` reads; a wrong record, or a wrong conversation
    (:func:`nopad.inference.chat.check_conversation`), is an error naming its line and field."""
    from nopad.dataloaders import sources
    from nopad.inference.chat import check_conversation

    def chat_ok(record, where: str) -> None:
        if messages_field in record:
            check_conversation(record[messages_field], where, messages_field)

    return sources.load_records(
        path, [{messages_field: list}, {text_field: str}], split=split, key="input", check=chat_ok
    )


def load_tokenizer(name: str):
    if name == "smollm2":
        from nopad.assets.smollm2 import load_smollm2_tokenizer

        return load_smollm2_tokenizer()
    if not Path(name).is_dir():
        raise FileNotFoundError(f"tokenizer={name!r} is not a directory; give a local tokenizer or 'smollm2'")
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name)


def tokenize_text(texts: list[str], tokenizer, add_eos: bool = True) -> list[list[int]]:
    ids = tokenizer(texts, add_special_tokens=True)["input_ids"]
    if add_eos:
        if tokenizer.eos_token_id is None:
            raise ValueError("add_eos=True but the tokenizer has no eos_token; set add_eos=false")
        ids = [row + [tokenizer.eos_token_id] for row in ids]
    return ids


def tokenize_dataset(
    ds: datasets.Dataset,
    tokenizer,
    *,
    text_field: str = "text",
    messages_field: str = "messages",
    add_eos: bool = True,
    num_proc: int | None = None,
) -> datasets.Dataset:
    """Chat rows (``messages_field``) -> ``input_ids`` + ``labels``; text rows -> ``input_ids``."""
    if messages_field in ds.column_names:
        from nopad.inference.chat import check_conversation, tokenize_conversation

        def chat(row, index):
            check_conversation(row[messages_field], f"record {index}", messages_field)
            input_ids, labels = tokenize_conversation(tokenizer, row[messages_field])
            return {"input_ids": input_ids, "labels": labels}

        return ds.map(
            chat, with_indices=True, remove_columns=ds.column_names, num_proc=num_proc, desc="tokenizing chats"
        )
    if text_field in ds.column_names:
        return ds.map(
            lambda batch: {"input_ids": tokenize_text(batch[text_field], tokenizer, add_eos)},
            batched=True,
            remove_columns=ds.column_names,
            num_proc=num_proc,
            desc="tokenizing text",
        )
    raise ValueError(
        f"found neither a {messages_field!r} (chat) nor a {text_field!r} (text) column in {ds.column_names}; "
        "set messages_field= or text_field="
    )


def check_output_dir(output: str | Path) -> None:
    """``output`` must be new, empty or an earlier packed dataset (which is replaced): writing into a
    training run or a model directory would mix a dataset into it."""
    from nopad.training.checkpoint import dir_kind

    kind = dir_kind(output) if Path(output).exists() else "empty"
    if Path(output).exists() and not Path(output).is_dir():
        raise FileExistsError(f"output={output} is a file; give a directory for the packed dataset")
    if kind not in ("empty", "dataset"):
        what = {
            "run": "a training run's output directory",
            "model": "a model directory",
            "training_state": "a checkpoint's training state",
        }.get(kind, "a directory but not a dataset")
        raise FileExistsError(
            f"output={output} is {what}; writing the packed dataset there would mix "
            "the two. Give a new directory, e.g. output=runs/packed"
        )


def run_preprocess(cfg: PreprocessConfig) -> datasets.Dataset:
    from nopad.dataloaders import sources
    from nopad.packing import pack_dataset

    if not cfg.input or not cfg.output:
        raise ValueError("set both input=<JSONL file or dataset directory> and output=<directory>")
    check_output_dir(cfg.output)
    tokenizer = load_tokenizer(cfg.tokenizer)
    ds = load_records(cfg.input, cfg.messages_field, cfg.text_field, cfg.split)
    tokenized = tokenize_dataset(
        ds,
        tokenizer,
        text_field=cfg.text_field,
        messages_field=cfg.messages_field,
        add_eos=cfg.add_eos,
        num_proc=cfg.num_proc,
    )
    lengths = [len(ids) for ids in tokenized["input_ids"]]
    empty = [i for i, n in enumerate(lengths) if n == 0]
    if empty:  # else the packer's own error, which names a library argument the recipe does not have
        raise ValueError(
            f"{len(empty)} of {cfg.input}'s records tokenize to no tokens (the first: record "
            f"{empty[0]}, an empty {cfg.text_field!r}); remove them from the input, or set "
            "add_eos=true so every document has at least its EOS token"
        )
    if cfg.overflow == "truncate":  # the same rule, and key, as SFT's data.max_dropped_fraction
        sources.check_dropped_tokens(
            lengths, cfg.capacity, cfg.max_dropped_fraction, key="max_dropped_fraction", capacity_key="capacity"
        )
    packed, bins = pack_dataset(
        tokenized,
        cfg.capacity,
        strategy=cfg.strategy,
        overflow=cfg.overflow,
        seed=cfg.seed,
        max_seqs_per_bin=cfg.max_seqs_per_bin,
        position_ids=cfg.position_ids,
        return_bins=True,
    )
    packed.save_to_disk(cfg.output)
    sources.save_tokenizer_fingerprint(cfg.output, tokenizer)  # SFT compares it with the model's
    print(bins.stats)
    print(f"saved {len(packed)} packed rows of <= {cfg.capacity} tokens to {cfg.output}")
    return packed


def main(argv: list[str] | None = None) -> datasets.Dataset:
    cfg = parse_cli(PreprocessConfig, argv, "nopad.recipes.preprocess", __doc__)  # --help: before torch loads
    setup_logging("%(message)s")
    return run_preprocess(cfg)


def cli() -> None:
    """The ``nopad-preprocess`` console script: the recipe from any directory once nopad is installed."""
    run_recipe(main, "nopad.recipes.preprocess")


if __name__ == "__main__":
    cli()
