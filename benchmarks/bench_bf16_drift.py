"""Which side drifts in bf16 generation on hybrid models: nopad's ``Generator`` or HF ``generate``.

``bench_hybrid.py`` finds bf16 greedy outputs of the two sides identical on few sequences of the
random-weight hybrid shapes, while fp32 outputs are identical on all. Two bf16 runs that round at
different points (paged attention vs sdpa, chunked prefill, a decode step's state update) part at
the first near-tied pair of logits, so disagreement alone says nothing about which is right. This
script measures each side against the same reference: an fp32 forward of the very bf16 weights
(cast up, so the weights are equal and only the arithmetic differs) over that side's own greedy
sequence, with the whole sequence at once (no cache, no chunking).

Per model and prompt, for each side:

  off-argmax  generated tokens that are not the reference's argmax at their position, and the
              reference's log-prob gap between its argmax and the pick (a near-tie is a small gap)
  |logp err|  the side's own log-prob of each generated token (nopad: ``logprobs=0``; HF:
              ``output_logits``) against the reference's, mean and max

A side that computes something else (a state crossing sequences, a stale slot) shows as large
errors and picks far from the argmax; rounding shows as errors of a few bf16 ulps and off-argmax
picks only at gaps of that size. HF runs each prompt alone (batch 1: no padding of its own).

    python benchmarks/bench_bf16_drift.py            # the bench_hybrid shapes, 4 prompts, 40 tokens
    python benchmarks/bench_bf16_drift.py --quick    # a tiny Qwen3.5, 2 prompts, 6 tokens
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from benchmarks.bench_hybrid import bamba, lfm2, qwen3_5  # noqa: E402
from nopad.inference import Generator, SamplingParams  # noqa: E402


def reference_logprobs(reference, seq: list[int]) -> torch.Tensor:
    """fp64 log-softmax of the fp32 model's logits over the whole sequence, no cache."""
    with torch.no_grad():
        return torch.log_softmax(reference(input_ids=torch.tensor([seq])).logits[0].double(), -1)


def drift(reference, prompt: list[int], tokens: list[int], logps: list[float]) -> dict:
    """How far one side's greedy ``tokens`` and their log-probs are from the reference's."""
    lp = reference_logprobs(reference, prompt + tokens)
    at = range(len(prompt) - 1, len(prompt) + len(tokens) - 1)
    gaps = [float(lp[p].max() - lp[p, t]) for p, t in zip(at, tokens) if int(lp[p].argmax()) != t]
    errors = [abs(mine - float(lp[p, t])) for p, t, mine in zip(at, tokens, logps)]
    return dict(
        off=len(gaps),
        n=len(tokens),
        max_gap=max(gaps, default=0.0),
        mean_err=float(np.mean(errors)),
        max_err=max(errors),
    )


def hf_greedy(model, prompt: list[int], new: int) -> tuple[list[int], list[float]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            max_new_tokens=new,
            min_new_tokens=new,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    tokens = out.sequences[0, len(prompt) :].tolist()
    return tokens, [float(torch.log_softmax(z[0].float(), -1)[t]) for z, t in zip(out.logits, tokens)]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny Qwen3.5, 2 prompts, 6 tokens")
    parser.add_argument(
        "--models", default=None, help="comma-separated: qwen3_5, lfm2, bamba (default all; --quick: qwen3_5)"
    )
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    vocab, new = (512, args.new_tokens or 6) if args.quick else (2048, args.new_tokens or 40)
    rng = np.random.default_rng(1)
    lengths = (9, 30) if args.quick else (27, 60, 120, 197)
    prompts = [rng.integers(3, vocab, n).tolist() for n in lengths]
    builders = {"qwen3_5": qwen3_5, "lfm2": lfm2, "bamba": bamba}
    print(
        f"bf16 weights, greedy, {new} new tokens per prompt, each side against an fp32 forward of the same "
        f"weights over its own sequence; {args.threads} threads"
    )
    print(
        f"{'model':8s} {'prompt':>6s} {'side':6s} {'off-argmax':>10s} {'largest gap':>11s} "
        f"{'mean |logp err|':>15s} {'max':>8s}"
    )
    models = args.models if args.models is not None else "qwen3_5" if args.quick else "qwen3_5,lfm2,bamba"
    unknown = set(filter(None, models.split(","))) - set(builders)
    if unknown:
        parser.error(f"unknown --models {sorted(unknown)}; choose from {sorted(builders)}")
    for name in filter(None, models.split(",")):
        model = builders[name](vocab, args.quick).eval().to(torch.bfloat16)
        reference = builders[name](vocab, args.quick).eval()
        reference.load_state_dict({k: v.float() for k, v in model.state_dict().items()})
        gen = Generator(model, None, max_num_seqs=len(prompts), max_num_batched_tokens=512)
        params = SamplingParams(temperature=0, max_tokens=new, ignore_eos=True, logprobs=0)
        outs = gen.generate(prompts, params, use_tqdm=False)
        gen.release()
        totals = {"nopad": [], "HF": []}
        for prompt, out in zip(prompts, outs):
            sides = {
                "nopad": (list(out.outputs[0].token_ids), list(out.outputs[0].logprobs)),
                "HF": hf_greedy(model, prompt, new),
            }
            for side, (tokens, logps) in sides.items():
                d = drift(reference, prompt, tokens, logps)
                totals[side].append(d)
                print(
                    f"{name:8s} {len(prompt):6d} {side:6s} {d['off']:>4d} of {d['n']:<3d} "
                    f"{d['max_gap']:11.4f} {d['mean_err']:15.5f} {d['max_err']:8.4f}"
                )
        mean = {side: float(np.mean([d["mean_err"] for d in ds])) for side, ds in totals.items()}
        off = {side: sum(d["off"] for d in ds) for side, ds in totals.items()}
        print(
            f"{name:8s} {'all':>6s} nopad vs HF: mean |logp err| {mean['nopad']:.5f} vs {mean['HF']:.5f} "
            f"({mean['nopad'] / mean['HF']:.2f}x HF's), off-argmax picks {off['nopad']} vs {off['HF']}"
        )


if __name__ == "__main__":
    main()
