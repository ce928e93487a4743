"""SFT's data, from a source to the windows of packed micro-batches each optimizer step trains on:
token rows (synthetic, a ``.jsonl`` file or a saved dataset; text rows tokenized with the prompt
masked), the token budget checked against them, and the packed loader that shards itself over
the ranks (it is NOT passed to ``accelerator.prepare``, which would shard it a second time).

``data`` arguments are the SFT recipe's data section (``nopad.recipes.sft_config.SFTDataConfig``) or anything
with the same attributes.
"""

from __future__ import annotations

import itertools
import logging
from collections.abc import Iterator

import numpy as np

from nopad.dataloaders import sources
from nopad.dataloaders.balance import attention_cost_from_config
from nopad.dataloaders.dataset import BOUNDARY_COLUMNS
from nopad.dataloaders.loader import packed_dataloader
from nopad.dataloaders.streaming import StreamingPackedLoader
from nopad.dataloaders.trees import tree_dataloader
from nopad.inference.chat import assistant_turns, check_conversation
from nopad.packing.bins.tree import TreePath
from nopad.packing.row import IGNORE_INDEX

logger = logging.getLogger(__name__)

DEFAULT_TOKENS_PER_BATCH = 1024  # data.tokens_per_batch=null on data that is not pre-packed


def synthetic_rows(num_rows: int, min_len: int, max_len: int, vocab_size: int, seed: int) -> list[dict]:
    """Random token rows whose first quarter is a prompt (masked out of the loss)."""
    rng = np.random.default_rng(seed)
    rows = []
    for length in rng.integers(min_len, max_len + 1, size=num_rows):
        ids = rng.integers(3, vocab_size, size=length)
        labels = ids.copy()
        labels[: length // 4] = -100
        rows.append({"input_ids": ids.tolist(), "labels": labels.tolist()})
    return rows


def tokenize_rows(rows, tokenizer, prompt_column: str, completion_column: str) -> list[dict]:
    """Text rows (prompt, completion) -> token rows with the prompt masked; token rows pass through."""
    out = []
    for row in rows:
        if "input_ids" in row:
            out.append(row)
            continue
        if prompt_column not in row or completion_column not in row:
            raise KeyError(
                f"rows need 'input_ids' or text columns {prompt_column!r} and {completion_column!r}; got {sorted(row)}"
            )
        if tokenizer is None:
            raise ValueError("text rows need a tokenizer; this model has none")
        prompt = tokenizer(row[prompt_column], add_special_tokens=False)["input_ids"]
        completion = tokenizer(row[completion_column], add_special_tokens=False)["input_ids"]
        if tokenizer.eos_token_id is not None:
            completion = completion + [tokenizer.eos_token_id]
        out.append({"input_ids": prompt + completion, "labels": [-100] * len(prompt) + completion})
    return out


def per_turn_samples(conversations, tokenizer, messages_column: str = "messages") -> list[TreePath]:
    """Every assistant turn of every conversation as a sample of its own: the chat template
    applied to the conversation up to and including that turn, the loss on the turn's tokens
    (:func:`nopad.inference.chat.assistant_turns`, the spans preprocess labels too). Each sample renders
    the history as the template does at that turn (some templates drop the reasoning of earlier
    turns), so the samples of one conversation repeat its history; packed as prefix trees
    (:func:`nopad.dataloaders.trees.tree_dataloader`), what they share is computed once."""
    samples = []
    for c, row in enumerate(conversations):
        messages = row.get(messages_column) if hasattr(row, "get") else None
        if not isinstance(messages, list):
            raise ValueError(
                f"row {c} has no conversation in {messages_column!r} (a list of {{'role', "
                f"'content'}} messages); data.per_turn_samples needs chat rows"
            )
        check_conversation(messages, f"conversation {c}", messages_column)
        for ids, start in assistant_turns(tokenizer, messages):
            samples.append(TreePath(ids, [False] * start + [True] * (len(ids) - start)))
    return samples


def load_rows(data, tokenizer, vocab_size: int):
    """The rows of ``data.source``: ``synthetic``, or any file or saved dataset that
    :func:`nopad.dataloaders.sources.load_sft_rows` reads (tokenized or pre-packed datasets are read in
    place); with ``data.per_turn_samples``, the per-turn samples of its conversations."""
    source = data.source
    if data.per_turn_samples:
        if source == "synthetic":
            raise ValueError(
                "data.per_turn_samples needs chat rows; set data.source to a file or dataset of "
                f"{{{data.messages_column!r}: [{{'role': ..., 'content': ...}}, ...]}} records"
            )
        column = data.messages_column

        def chat_ok(record, where: str) -> None:  # each conversation checked where it was read
            check_conversation(record[column], where, column)

        rows = sources.load_records(source, [{column: list}], split=data.split, key="data.source", check=chat_ok)
        return per_turn_samples(rows, tokenizer, data.messages_column)
    if source == "synthetic":
        return synthetic_rows(data.num_rows, data.min_len, data.max_len, vocab_size, data.seed)
    rows = sources.load_sft_rows(source, data.prompt_column, data.completion_column, data.split, tokenizer)
    if "input_ids" in rows.column_names:  # tokenized or pre-packed (seq_lengths): read in place
        check_token_rows(rows, vocab_size, f"data.source={source}")
        return rows
    return tokenize_rows(rows, tokenizer, data.prompt_column, data.completion_column)


def check_token_rows(rows, vocab_size: int, where: str) -> None:
    """Token rows read in place must index the model's embedding (an id from another tokenizer was
    ``IndexError: index out of range in self`` from inside the first forward) and hold a loss token
    somewhere (all labels -100 trained nothing, at loss 0.0, without a word). One vectorised pass
    over the Arrow columns; the rows are read one by one only to name the first bad one."""
    import pyarrow.compute as pc

    ids = pc.list_flatten(rows.data.column("input_ids"))
    if len(ids) and (pc.min(ids).as_py() < 0 or pc.max(ids).as_py() >= vocab_size):
        row, token = next((i, t) for i, r in enumerate(rows["input_ids"]) for t in r if not 0 <= t < vocab_size)
        raise ValueError(
            f"{where}: row {row} holds token id {token}, outside the model's vocabulary "
            f"(ids 0..{vocab_size - 1}); the rows were tokenized for another model: tokenize "
            "them with this model's tokenizer (or give text rows, prompt and completion)"
        )
    if "labels" in rows.column_names:
        labels = pc.list_flatten(rows.data.column("labels"))
        if not pc.any(pc.not_equal(labels, IGNORE_INDEX)).as_py():
            raise ValueError(
                f"{where}: every label is {IGNORE_INDEX}, so no token has a loss and nothing "
                "would be trained; give labels (or drop the column to train on every token)"
            )


def is_prepacked(rows) -> bool:
    """True for rows that each hold several documents (``seq_lengths`` / ``position_ids``)."""
    columns = getattr(rows, "column_names", None)
    if columns is None:
        columns = rows[0].keys() if len(rows) else ()
    return any(c in columns for c in BOUNDARY_COLUMNS)


def plan_budget(data, rows) -> int:
    """``data.tokens_per_batch`` for these rows, checked against the rows before anything trains.

    Why: a pre-packed row is already a bin, so by default the budget is the longest row; and
    ``data.overflow=truncate`` must not drop a large share of the data quietly (it once dropped
    much of a pre-packed dataset, visible only in a stats line)."""
    prepacked = is_prepacked(rows)
    lengths = np.fromiter((len(ids) for ids in _input_ids(rows)), dtype=np.int64)
    longest = int(lengths.max()) if lengths.size else 0
    budget = data.tokens_per_batch or (longest if prepacked else DEFAULT_TOKENS_PER_BATCH)
    what = "pre-packed rows" if prepacked else "sequences"
    too_long = lengths > budget
    if not too_long.any() or data.overflow == "split":
        return budget
    if data.overflow == "error":
        raise ValueError(
            f"data.tokens_per_batch={budget} is smaller than {int(too_long.sum())} of the {what} of "
            f"data.source={data.source!r} (the longest has {longest} tokens); "
            + (
                f"leave data.tokens_per_batch unset (it then takes the longest pre-packed row) or set it >= {longest}"
                if prepacked
                else f"set data.tokens_per_batch >= {longest}, or "
                "data.overflow=split (pieces train as separate sequences) or data.overflow=truncate"
            )
        )
    sources.check_dropped_tokens(
        lengths,
        budget,
        data.max_dropped_fraction,
        key="data.max_dropped_fraction",
        capacity_key="data.tokens_per_batch",
        what=what,
    )
    return budget


def _input_ids(rows):
    if hasattr(rows, "column_names"):
        return rows["input_ids"]
    return (row["input_ids"] for row in rows)


def build_loader(data, rows, accelerator, grad_accum: int, model_config):
    """Map-style (global BFD per epoch) or streaming (bounded buffer) packed loader for this rank;
    every rank runs the same number of micro-batches. Per-turn samples (``data.per_turn_samples``)
    go to prefix-tree rows.

    The epoch is NOT rounded up to a multiple of ``grad_accum``: its last optimizer step may take
    fewer micro-batches (:func:`windows`). That step is exact, because each step divides by its own
    global loss-token count (:class:`nopad.training.accumulation.OptimizerStepper`), and rounding up meant
    repeating rows, loss-masked, as padding (3 pre-packed rows at grad_accum=2 were 4 micro-batches,
    a pad fraction of 0.33). Ranks still get equal counts: under ZeRO-3 / FSDP2 every forward is a
    collective, so a rank with no row left gets a repeated, loss-masked one, and only then
    (:func:`nopad.dataloaders.balance.equalize_bin_count` splits bins first)."""
    common = dict(
        num_replicas=accelerator.num_processes,
        rank=accelerator.process_index,
        seed=data.seed,
        max_seqs_per_batch=data.max_seqs_per_batch,
        steps_multiple_of=1,
        attention_cost=attention_cost_from_config(model_config),
    )
    if data.per_turn_samples:
        return tree_dataloader(
            rows, data.tokens_per_batch or DEFAULT_TOKENS_PER_BATCH, num_workers=data.num_workers, **common
        )
    common["overflow"] = data.overflow
    if data.streaming:
        return StreamingPackedLoader(
            rows, data.tokens_per_batch or DEFAULT_TOKENS_PER_BATCH, buffer_size=data.buffer_size, **common
        )
    budget = plan_budget(data, rows)
    return packed_dataloader(rows, budget, num_workers=data.num_workers, **common)


def total_steps(max_steps: int | None, epochs: int, data, loader, grad_accum: int) -> int:
    """Optimizer steps of the whole run: ``max_steps`` counts them, and the epochs repeat as
    needed to reach it; a stream has no length, so there it must be given."""
    if data.streaming:
        if not max_steps:
            raise ValueError("data.streaming=true needs train.max_steps (a stream's length is unknown)")
        return max_steps
    steps_per_epoch = -(-len(loader) // grad_accum)  # the last one may be short (build_loader)
    if max_steps and max_steps > steps_per_epoch * epochs:
        logger.warning(
            "train.max_steps=%d is more than train.epochs=%d x %d steps per epoch: the data repeats for %d epochs",
            max_steps,
            epochs,
            steps_per_epoch,
            -(-max_steps // steps_per_epoch),
        )
    return max(steps_per_epoch * epochs, max_steps or 0)


def windows(loader, size: int) -> Iterator[list]:
    """The loader's batches of one epoch in lists of ``size`` (one optimizer step each); the last
    list holds what is left, which may be fewer (the same number on every rank)."""
    batches = iter(loader)
    while window := list(itertools.islice(batches, size)):
        yield window


def micro_batches(loader, grad_accum: int, steps: int, streaming: bool = False) -> int:
    """Micro-batches in the run's first ``steps`` optimizer steps (what a progress bar counts):
    ``grad_accum`` each, but fewer in an epoch's last step (:func:`windows`); a stream's epoch has
    no length, so there every step counts ``grad_accum``."""
    if streaming:
        return steps * grad_accum
    per_epoch = len(loader)
    steps_per_epoch = -(-per_epoch // grad_accum)
    epochs, rest = divmod(steps, steps_per_epoch)
    return epochs * per_epoch + min(rest * grad_accum, per_epoch)


def epoch_stats(loader) -> dict | None:
    """The packing statistics of the loader's last epoch."""
    sampler = getattr(loader, "packed_sampler", None)
    return sampler.last_stats if sampler is not None else loader.last_stats
