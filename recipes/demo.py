"""nopad's main job: what packing saves on real text, measured here and now.

    python -m recipes.demo

Tokenizes the embedded corpus (docstrings of Python's standard library, no downloads) with the
SmolLM2 tokenizer and compares, for a couple of row capacities, how many token slots a training
run would compute with nopad's best-fit packing versus padding each random micro-batch to its
longest sequence and padding every sequence to the capacity.
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TextIO

import numpy as np
from tqdm.auto import tqdm

from packing import pack
from packing.corpus import load_corpus

logger = logging.getLogger(__name__)


def token_lengths(texts: Sequence[str], tokenizer, batch_size: int = 256, add_eos: bool = True) -> np.ndarray:
    """Token count of every text (plus an EOS token), tokenized in batches with a progress bar."""
    lengths = []
    for start in tqdm(range(0, len(texts), batch_size), desc="tokenizing", unit="batch"):
        ids = tokenizer(list(texts[start : start + batch_size]), add_special_tokens=True)["input_ids"]
        lengths.extend(len(row) + int(add_eos) for row in ids)
    return np.asarray(lengths, dtype=np.int64)


def padded_to_longest(lengths: np.ndarray, micro_batch_size: int, seed: int = 0) -> tuple[int, int]:
    """``(rows, token slots)`` when random micro-batches are each padded to their longest sequence."""
    shuffled = np.random.default_rng(seed).permutation(lengths)
    slots = sum(
        int(batch.max()) * len(batch)
        for batch in np.array_split(shuffled, range(micro_batch_size, len(shuffled), micro_batch_size))
    )
    return len(lengths), slots


def packing_report(
    tokenizer=None,
    capacities: Sequence[int] = (1024, 2048),
    *,
    max_documents: int = 4000,
    micro_batch_size: int = 8,
    seed: int = 0,
    out: TextIO | None = None,
) -> list[dict]:
    """Print (to ``out``, default stdout) and return one row per (capacity, method): rows,
    token slots computed, efficiency = real tokens / slots."""
    out = out or sys.stdout
    if tokenizer is None:
        from packing.models import load_smollm2_tokenizer

        tokenizer = load_smollm2_tokenizer()
    documents = load_corpus(max_documents)
    lengths = token_lengths(documents, tokenizer)
    print(
        f"\nnopad packing report: {len(documents):,} documents, {int(lengths.sum()):,} tokens "
        f"(lengths {int(lengths.min())}..{int(lengths.max())}, median {int(np.median(lengths))}), "
        "embedded stdlib-docstring corpus",
        file=out,
    )
    header = f"{'capacity':>8}  {'method':<34} {'rows':>7} {'token slots':>13} {'efficiency':>10}"
    print(header, file=out)
    print("-" * len(header), file=out)
    report = []
    for capacity in capacities:
        clipped = np.minimum(lengths, capacity)  # every method sees the same (truncated) tokens
        tokens = int(clipped.sum())
        bins = pack(clipped, capacity, strategy="bfd", seed=seed)
        longest_rows, longest_slots = padded_to_longest(clipped, micro_batch_size, seed)
        rows = [
            ("nopad best-fit packing", len(bins), len(bins) * capacity),
            (f"pad to longest (micro-batch {micro_batch_size})", longest_rows, longest_slots),
            ("pad to capacity", len(clipped), len(clipped) * capacity),
        ]
        for method, num_rows, slots in rows:
            entry = dict(capacity=capacity, method=method, rows=num_rows, slots=slots, tokens=tokens,
                         efficiency=tokens / slots, truncated=int((lengths > capacity).sum()))
            report.append(entry)
            line = f"{capacity:>8}  {method:<34} {num_rows:>7,} {slots:>13,} {entry['efficiency']:>10.1%}"
            print(line, file=out)
        nopad_slots = rows[0][2]
        print(
            f"{'':>8}  => {longest_slots / nopad_slots:.1f}x fewer token slots than padding to the longest "
            f"({1 - nopad_slots / longest_slots:.0%} of the compute saved), "
            f"{rows[2][2] / nopad_slots:.1f}x fewer than padding to capacity"
            + (f"; {report[-1]['truncated']} documents truncated" if report[-1]["truncated"] else ""),
            file=out,
        )
    return report


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    packing_report()


if __name__ == "__main__":
    main()
