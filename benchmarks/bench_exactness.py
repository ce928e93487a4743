"""On-policy exactness: the generator's log-probs vs the packed training forward's, default numerics
vs ``packing.batch_invariant()``, and what the invariant mode costs, fp32 and bf16, in one run.

Workload (issue 11's): SmolLM2-135M-Instruct, 8 GRPO maths prompts x 4 samples x 24 new tokens,
temperature 1, seeded. For each dtype and mode:

  gap     |log pi_generator - log pi_trainer| per sampled token: the generator's raw log-prob
          (CompletionOutput.logprobs) against log_softmax(logits.float()) of the packed training
          forward (training.grpo.packed_logprobs) on the same weights
  cost    generator output tokens/s (rollout of the workload) and training tokens/s (forward +
          backward over the packed rows); the invariant mode's ratio to the default mode's

    python benchmarks/bench_exactness.py           # full run
    python benchmarks/bench_exactness.py --quick   # smoke run (fewer prompts and tokens)
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from assets.smollm2 import load_smollm2  # noqa: E402
from benchmarks._workloads import grpo_workload  # noqa: E402
from inference import Generator, SamplingParams  # noqa: E402
from packing.hf import use_nopad_attention  # noqa: E402
from packing.invariance import batch_invariant  # noqa: E402
from training.grpo import Rollout, pack_rollouts, packed_logprobs  # noqa: E402


def measure(model, tokenizer, prompts, params, invariant: bool, capacity: int) -> dict:
    """One rollout + one training forward/backward of its packed rows in the given mode."""
    with batch_invariant(invariant):
        gen = Generator(model, tokenizer, max_num_batched_tokens=512, max_num_seqs=64)
        start = time.perf_counter()
        outs = gen.generate(prompts, params, use_tqdm=False)
        rollout_s = time.perf_counter() - start
        gen.release()
        rollouts = [Rollout(list(p), list(c.token_ids), list(c.logprobs)) for p, o in zip(prompts, outs)
                    for c in o.outputs]
        rows = pack_rollouts(rollouts, capacity)
        model.train()
        with use_nopad_attention(model):
            start = time.perf_counter()
            gaps = []
            for row in rows:
                logp = packed_logprobs(model, row)
                logp.sum().backward()  # the backward a training step would run (gradient unused)
                gaps.append((logp.detach() - row["gen_logprobs"]).abs())
            train_s = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        model.eval()
    gap = torch.cat(gaps)
    new_tokens = sum(len(r.completion_ids) for r in rollouts)
    return {
        "gap_max": float(gap.max()), "gap_mean": float(gap.mean()),
        "over_1e3": float((gap > 1e-3).float().mean()), "exact": float((gap == 0).float().mean()),
        "rollout_tok_s": new_tokens / rollout_s,
        "train_tok_s": sum(int(r["input_ids"].numel()) for r in rows) / train_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="2 prompts x 2 samples x 8 tokens")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    num_prompts, n, max_tokens = (2, 2, 8) if args.quick else (8, 4, 24)
    params = SamplingParams(temperature=1.0, n=n, max_tokens=max_tokens, seed=0, ignore_eos=True)
    print(f"SmolLM2-135M-Instruct, {num_prompts} prompts x {n} samples x {max_tokens} new tokens, T=1, "
          f"{args.threads} threads, torch {torch.__version__}", flush=True)
    header = (f"{'dtype':9} {'mode':15} {'gap max':>9} {'gap mean':>9} {'>1e-3':>7} {'exact':>7} "
              f"{'rollout tok/s':>13} {'train tok/s':>11}")
    print(header + "\n" + "-" * len(header))
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        model, tokenizer = load_smollm2(dtype=dtype)
        prompts = grpo_workload(tokenizer, num_prompts)
        results = {}
        for invariant in (False, True, False, True):  # interleaved: both modes see the same machine
            r = measure(model, tokenizer, prompts, params, invariant, capacity=2048)
            best = results.setdefault(invariant, r)
            for key in ("rollout_tok_s", "train_tok_s"):
                best[key] = max(best[key], r[key])
        for invariant, r in results.items():
            mode = "batch-invariant" if invariant else "default"
            print(f"{name:9} {mode:15} {r['gap_max']:>9.3g} {r['gap_mean']:>9.3g} {r['over_1e3']:>7.1%} "
                  f"{r['exact']:>7.1%} {r['rollout_tok_s']:>13.1f} {r['train_tok_s']:>11.1f}")
        d, i = results[False], results[True]
        print(f"{name:9} {'invariant/default':15} {'':>9} {'':>9} {'':>7} {'':>7} "
              f"{i['rollout_tok_s'] / d['rollout_tok_s']:>12.2f}x "
              f"{i['train_tok_s'] / d['train_tok_s']:>10.2f}x", flush=True)
    print("(gap: generator raw log-prob vs the training forward's per sampled token; exact = share of "
          "tokens with gap 0.0; speeds: best of two interleaved runs per mode; target >= 0.8x)")


if __name__ == "__main__":
    main()
