"""GRPO training forward+backward per step: shared-prefix rows vs usual packing vs padding.

SmolLM2-135M-Instruct (``nopad.assets.smollm2.load_smollm2``, fp32, CPU; ``--quick``: a tiny random
Llama). One GRPO step's training data is ``groups`` prompts of ``P`` tokens with ``n`` completions
each (lengths uniform in [C/2, C], fixed seed); the loss is the GRPO policy-gradient surrogate
(advantage-weighted log-probs of the completion tokens, LM head only on the positions that predict
them). Timed: forward + backward of every row of the step, the best of ``--repeats``:

  (a) shared   each prompt once per row, its completions attending to it
               (``nopad.training.grpo.pack_rollouts(shared_prefix=True)``), nopad attention
  (b) packed   every prompt+completion its own sequence, BFD-packed rows
               (``shared_prefix=False``), nopad attention
  (c) padded   micro-batches of the same token budget padded to the longest, sdpa attention

    python benchmarks/bench_grpo_train.py            # 3 shapes, 2 prompts per step, best of 2
    python benchmarks/bench_grpo_train.py --quick    # tiny random Llama, 1 prompt, shapes /8, 1 timed run
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere (recipes/)

from benchmarks._workloads import tiny_llama  # noqa: E402
from nopad.assets.smollm2 import load_smollm2  # noqa: E402
from nopad.packing.hf import use_nopad_attention  # noqa: E402
from nopad.training.grpo import Rollout, pack_rollouts, pair_advantages  # noqa: E402

SHAPES = [(512, 128, 8), (128, 512, 8), (64, 64, 4)]  # (prompt, completion, n)


def make_rollouts(prompt_len, completion_len, n, groups, vocab, seed=0):
    rng = np.random.default_rng(seed)
    rollouts = []
    for _ in range(groups):
        prompt = rng.integers(3, vocab, prompt_len).tolist()
        for _ in range(n):
            c = int(rng.integers(completion_len // 2, completion_len + 1))
            rollouts.append(
                Rollout(prompt, rng.integers(3, vocab, c).tolist(), [0.0] * c, advantage=float(rng.standard_normal()))
            )
    return rollouts


def surrogate(model, hidden, predict_at, targets, advantages):
    logits = model.lm_head(hidden[predict_at]).float()
    logp = torch.log_softmax(logits, -1).gather(1, targets[:, None])[:, 0]
    return -(logp * advantages).sum()


def packed_rows(rollouts, budget, shared_prefix):
    """The rollouts' rows, each with its pairs' advantages (what the surrogate weighs) on it."""
    return [
        row.with_token_values({"advantages": pair_advantages(row, rollouts)})
        for row in pack_rollouts(rollouts, budget, shared_prefix=shared_prefix)
    ]


def packed_step(model, rows):
    for row in rows:
        meta = row["nopad_meta"]
        labels = row["labels"][0]
        at = torch.nonzero(labels != -100).squeeze(1)
        hidden = model.model(
            input_ids=row["input_ids"], position_ids=row["position_ids"], nopad_meta=meta, use_cache=False
        ).last_hidden_state[0]
        surrogate(model, hidden, meta.previous_rows()[at], labels[at], row.token_values["advantages"]).backward()


def padded_batches(rollouts, budget):
    width = max(len(r.prompt_ids) + len(r.completion_ids) for r in rollouts)
    per_batch = max(1, budget // width)
    batches = []
    for s in range(0, len(rollouts), per_batch):
        chunk = rollouts[s : s + per_batch]
        w = max(len(r.prompt_ids) + len(r.completion_ids) for r in chunk)
        ids = torch.zeros(len(chunk), w, dtype=torch.long)
        mask = torch.zeros(len(chunk), w, dtype=torch.long)
        predict, targets, adv = [], [], []
        for b, r in enumerate(chunk):
            seq = r.prompt_ids + r.completion_ids
            ids[b, : len(seq)] = torch.tensor(seq)
            mask[b, : len(seq)] = 1
            for t in range(len(r.prompt_ids), len(seq)):
                predict.append(b * w + t - 1)
                targets.append(seq[t])
                adv.append(r.advantage)
        batches.append((ids, mask, torch.tensor(predict), torch.tensor(targets), torch.tensor(adv)))
    return batches


def padded_step(model, batches):
    for ids, mask, predict, targets, adv in batches:
        hidden = model.model(input_ids=ids, attention_mask=mask, use_cache=False).last_hidden_state
        surrogate(model, hidden.reshape(-1, hidden.shape[-1]), predict, targets, adv).backward()


def best_time(step, model, data, repeats, warmup):
    times = []
    for _ in range(repeats + warmup):
        model.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        step(model, data)
        times.append(time.perf_counter() - t0)
    return min(times[warmup:])


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--quick",
        action="store_true",
        help="smoke run: a tiny random Llama, 1 prompt per step, shapes / 8, 1 timed run",
    )
    parser.add_argument("--budget", type=int, default=4096, help="tokens per training row / padded batch")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    groups, repeats, warmup = (1, 1, 0) if args.quick else (2, 2, 1)
    if args.quick:
        name, model, shapes = "tiny random Llama", tiny_llama(), [(p // 8, c // 8, n) for p, c, n in SHAPES]
    else:
        name, (model, _), shapes = "SmolLM2-135M-Instruct", load_smollm2(torch.float32), SHAPES
    model.train()
    vocab = model.config.vocab_size
    print(
        f"{name} fp32, {args.threads} threads, {groups} prompt(s) per step, row budget "
        f"{args.budget} tokens, best of {repeats} after {warmup} warm-up (forward+backward per step)"
    )
    header = (
        f"{'P/C, n':>14} {'tokens s/p/pad':>20} {'shared s':>9} {'packed s':>9} {'padded s':>9} "
        f"{'packed/shared':>14} {'padded/shared':>14}"
    )
    print(header)
    for prompt_len, completion_len, n in shapes:
        rollouts = make_rollouts(prompt_len, completion_len, n, groups, vocab)
        shared = packed_rows(rollouts, args.budget, shared_prefix=True)
        usual = packed_rows(rollouts, args.budget, shared_prefix=False)
        padded = padded_batches(rollouts, args.budget)
        tokens = (
            sum(r["input_ids"].numel() for r in shared),
            sum(r["input_ids"].numel() for r in usual),
            sum(b[0].numel() for b in padded),
        )
        with use_nopad_attention(model):
            t_shared = best_time(packed_step, model, shared, repeats, warmup)
            t_usual = best_time(packed_step, model, usual, repeats, warmup)
        t_padded = best_time(padded_step, model, padded, repeats, warmup)
        print(
            f"{f'{prompt_len}/{completion_len}, {n}':>14} {'/'.join(map(str, tokens)):>20} {t_shared:9.2f} "
            f"{t_usual:9.2f} {t_padded:9.2f} {t_usual / t_shared:13.2f}x {t_padded / t_shared:13.2f}x",
            flush=True,
        )


if __name__ == "__main__":
    main()
