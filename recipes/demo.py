"""nopad's main job, measured here and now on the embedded SmolLM2-135M-Instruct, offline:

    python -m nopad.recipes.demo        # or: make demo

1. packing report: tokenizes the embedded corpus (docstrings of Python's standard library) and
   compares the token slots computed with nopad's best-fit packing versus padding each random
   micro-batch to its longest sequence and padding every sequence to the capacity;
2. a few packed SFT steps on those documents (``nopad.recipes.sft``), with tokens/s;
3. GRPO steps on the built-in arithmetic task (``nopad.recipes.grpo``): rollouts from the in-flight
   generator on the very weights being trained, packed into varlen rows for the update, with
   rollout and training tokens/s, packed vs padded tokens, and the log-prob gap between the
   generator and the training forward; then where to run multi-turn tool episodes
   (``task.name=calculator``; not run here, to keep the demo short).
"""

from __future__ import annotations

import logging
import sys
from collections.abc import Sequence
from typing import TextIO

import numpy as np
from tqdm.auto import tqdm

from nopad.assets.corpus import load_corpus

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
    from nopad.packing import pack  # (here: --help answers without torch)

    out = out or sys.stdout
    if tokenizer is None:
        from nopad.assets.smollm2 import load_smollm2_tokenizer

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
            entry = dict(
                capacity=capacity,
                method=method,
                rows=num_rows,
                slots=slots,
                tokens=tokens,
                efficiency=tokens / slots,
                truncated=int((lengths > capacity).sum()),
            )
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


def sft_demo(
    model,
    tokenizer,
    *,
    steps: int = 3,
    tokens_per_batch: int = 512,
    max_documents: int = 600,
    out: TextIO | None = None,
) -> dict:
    """A few packed SFT steps on corpus documents (one packed row per optimizer step), timed."""
    import tempfile
    import time

    from nopad.recipes.sft import SFTRecipeConfig, train

    out = out or sys.stdout
    ids = tokenizer(load_corpus(max_documents), add_special_tokens=False)["input_ids"]
    rows = [{"input_ids": row[: tokens_per_batch - 1] + [tokenizer.eos_token_id]} for row in ids]
    with tempfile.TemporaryDirectory() as tmp:
        cfg = SFTRecipeConfig(
            data={"tokens_per_batch": tokens_per_batch},
            train={"max_steps": steps, "grad_accum": 1, "lr": 1e-5},
            checkpoint={"output_dir": tmp, "save_final": False},
            log={"record_indices": True},
        )
        start = time.perf_counter()
        result = train(cfg, model=model, tokenizer=tokenizer, rows=rows)
        seconds = time.perf_counter() - start
    batches = result["indices_per_step"]
    tokens = sum(len(rows[i]["input_ids"]) for batch in batches for i in batch)
    longest = sum(len(batch) * max(len(rows[i]["input_ids"]) for i in batch) for batch in batches)
    losses = result["losses"]
    summary = {
        "steps": result["steps"],
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": tokens / seconds,
        "row_efficiency": tokens / (len(batches) * tokens_per_batch),
        "padded_tokens": longest,
        "loss_first": losses[0],
        "loss_last": losses[-1],
    }
    print(
        f"\npacked SFT: {summary['steps']} steps, {tokens:,} tokens in {len(batches)} rows of "
        f"{tokens_per_batch} ({summary['row_efficiency']:.1%} full), "
        f"{summary['tokens_per_s']:.0f} tokens/s;"
        f" padding the same sequences to their longest would compute {longest:,} tokens "
        f"({longest / tokens:.1f}x); loss per step (different rows each step): "
        + ", ".join(f"{x:.3f}" for x in losses),
        file=out,
    )
    return summary


def grpo_demo(model, tokenizer, *, steps: int = 2, out: TextIO | None = None) -> list[dict]:
    """GRPO steps on the built-in arithmetic task with generator rollouts on the live weights."""
    from nopad.recipes.grpo import GRPORecipeConfig, run_grpo

    out = out or sys.stdout
    cfg = GRPORecipeConfig(model={"path": None}, train={"steps": steps})
    history = run_grpo(cfg, model=model, tokenizer=tokenizer)
    ro = cfg.rollout
    print(
        f"\nGRPO on the live model ({ro.prompts_per_step} arithmetic prompts x {ro.num_generations} "
        f"samples per step, up to {ro.max_tokens} new tokens):",
        file=out,
    )
    header = (
        f"{'step':>4} {'reward':>7} {'rollout tok/s':>13} {'train tok/s':>11} {'packed':>7} "
        f"{'padded':>7} {'logprob gap max':>15} {'mean':>9} {'IS ratio range':>16}"
    )
    print(header + "\n" + "-" * len(header), file=out)
    for m in history:
        print(
            f"{m['step']:>4} {m['reward_mean']:>7.3f} {m['rollout_tokens_per_s']:>13.1f} "
            f"{m['train_tokens_per_s']:>11.1f} {m['train_tokens']:>7} {m['padded_train_tokens']:>7} "
            f"{m['logprob_gap_max']:>15.2e} {m['logprob_gap_mean']:>9.2e} "
            f"{m['is_ratio_min']:>7.5f}-{m['is_ratio_max']:<8.5f}",
            file=out,
        )
    mode = "batch-invariant mode" if history and history[0]["batch_invariant"] else "default numerics"
    print(
        f"(gap: the generator's sampled-token log-probs vs the training forward's, same weights, {mode}; "
        "IS ratio: pi_train / pi_rollout per token, 1 = exactly on-policy)",
        file=out,
    )
    return history


class PhaseClock:
    """Wall and process CPU seconds of each phase of the demo, for its last line: CPU seconds
    (all threads) say how much work a phase was, which wall seconds do not on a shared machine."""

    def __init__(self) -> None:
        import time

        self._wall, self._cpu = time.perf_counter, time.process_time
        self.start_wall, self.start_cpu = self._wall(), self._cpu()
        self.phases: list[tuple[str, float, float]] = []
        self._mark = (self.start_wall, self.start_cpu)

    def lap(self, name: str) -> None:
        """Close the phase ``name``: the time since the previous lap (or the start)."""
        wall, cpu = self._wall(), self._cpu()
        self.phases.append((name, wall - self._mark[0], cpu - self._mark[1]))
        self._mark = (wall, cpu)

    def summary(self, threads: int) -> str:
        wall, cpu = self._wall() - self.start_wall, self._cpu() - self.start_cpu
        parts = ", ".join(f"{name} {w:.0f} s ({c:.0f} CPU s)" for name, w, c in self.phases)
        return f"demo finished in {wall:.0f} s, {cpu:.0f} CPU s on {threads} threads: {parts}"


def main() -> None:
    """The whole job: packing report, packed SFT steps, GRPO steps with in-process rollouts."""
    argv = sys.argv[1:]
    if argv and argv[0] in ("-h", "--help"):
        print(f"usage: nopad-demo  (python -m nopad.recipes.demo)\n\n{__doc__.strip()}\n\nIt takes no settings.")
        raise SystemExit(0)
    if argv:
        print(
            f"nopad-demo: error: it takes no arguments, got {' '.join(argv)} (see nopad-demo --help)", file=sys.stderr
        )
        raise SystemExit(2)
    import torch

    from nopad.assets.smollm2 import load_smollm2

    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    clock = PhaseClock()
    model, tokenizer = load_smollm2()
    clock.lap("model load")
    packing_report(tokenizer)
    clock.lap("packing report")
    sft_demo(model, tokenizer)
    clock.lap("packed SFT")
    grpo_demo(model, tokenizer)
    clock.lap("GRPO")
    print(
        "\nmulti-turn tool episodes (a sequence pauses at a tool call with its KV kept, resumes by "
        "prefilling the result; only the model's tokens are trained on): python -m nopad.recipes.grpo "
        "output_dir=runs/grpo_calc task.name=calculator (recipes/tool_tasks.py), or NopadGRPOTrainer("
        "tools=[...]) / environment_factory= in TRL (docs/trl.md)",
        file=sys.stdout,
    )
    print(f"\n{clock.summary(torch.get_num_threads())}", file=sys.stdout)


if __name__ == "__main__":
    main()
