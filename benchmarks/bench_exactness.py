"""On-policy exactness: the generator's log-probs vs the packed training forward's, default numerics
vs ``nopad.packing.batch_invariant()``, and what the invariant mode costs, fp32 and bf16, in one run.

Workload (the default): SmolLM2-135M-Instruct, 8 GRPO maths prompts x 4 samples x 24 new tokens,
temperature 1, seeded. On CUDA (``--device cuda``, the Triton kernel set) also a random-weight
Qwen2.5-0.5B of real shape (``--model qwen2.5-0.5b``), and ``--prompts/--samples/--new-tokens``
size the run (64 x 8 x 24 = 12,288 sampled tokens checked). For each dtype and mode:

  gap     |log pi_generator - log pi_trainer| per sampled token: the generator's raw log-prob
          (CompletionOutput.logprobs) against log_softmax(logits.float()) of the packed training
          forward (nopad.training.grpo.packed_logprobs) on the same weights
  cost    generator output tokens/s (rollout of the workload) and training tokens/s (forward +
          backward over the packed rows); the invariant mode's ratio to the default mode's

    python benchmarks/bench_exactness.py           # full run
    python benchmarks/bench_exactness.py --quick   # smoke run: a tiny random Llama, fewer prompts and tokens
    python benchmarks/bench_exactness.py --dtypes bfloat16 --workload chat --prompts 16 --samples 4 \\
        --new-tokens 48                            # the bf16 cost workload, longer chats
    python benchmarks/bench_exactness.py --device cuda --dtypes bfloat16 --prompts 64 --samples 8
    python benchmarks/bench_exactness.py --device cuda --model qwen2.5-0.5b --dtypes bfloat16 \\
        --prompts 64 --samples 8
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from benchmarks._workloads import chat_workload, grpo_workload, sync_device, tiny_llama  # noqa: E402
from nopad.assets.smollm2 import load_smollm2  # noqa: E402
from nopad.dataloaders.loader import move_batch  # noqa: E402
from nopad.inference import Generator, SamplingParams  # noqa: E402
from nopad.packing.hf import use_nopad_attention  # noqa: E402
from nopad.packing.invariance import batch_invariant  # noqa: E402
from nopad.training.grpo import Rollout, pack_rollouts, packed_logprobs  # noqa: E402

QWEN25_05B = dict(
    vocab_size=151936,
    hidden_size=896,
    intermediate_size=4864,
    num_hidden_layers=24,
    num_attention_heads=14,
    num_key_value_heads=2,
    max_position_embeddings=32768,
    rope_theta=1e6,
    tie_word_embeddings=True,
)


def load(name: str, dtype: torch.dtype, device: str):
    """``(model, tokenizer)``: the demo SmolLM2 (its real weights), or a random-weight Qwen2.5-0.5B
    of real shape or a tiny Llama (``--quick``) (no download; no tokenizer: prompts are token ids)."""
    if name == "tiny":
        return tiny_llama().to(device=device, dtype=dtype).eval(), None
    if name == "smollm2":
        model, tokenizer = load_smollm2(dtype=dtype)
        return model.to(device), tokenizer
    import transformers

    torch.manual_seed(0)
    config = transformers.Qwen2Config(**QWEN25_05B)
    return transformers.Qwen2ForCausalLM(config).to(device=device, dtype=dtype).eval(), None


def workload(tokenizer, vocab_size: int, num_prompts: int, kind: str = "grpo") -> list[list[int]]:
    if tokenizer is not None and kind == "chat":  # the chat questions, ~35-200 tokens
        return chat_workload(tokenizer, num_prompts, 1, 1, seed=0)[0]
    if tokenizer is not None:
        return grpo_workload(tokenizer, num_prompts)
    g = torch.Generator().manual_seed(0)
    lengths = torch.randint(40, 240, (num_prompts,), generator=g).tolist()
    return [torch.randint(100, vocab_size - 100, (k,), generator=g).tolist() for k in lengths]


def measure(model, tokenizer, prompts, params, invariant: bool, capacity: int) -> dict:
    """One rollout + one training forward/backward of its packed rows in the given mode."""
    device = next(model.parameters()).device
    with batch_invariant(invariant):
        gen = Generator(model, tokenizer, max_num_batched_tokens=2048, max_num_seqs=512)
        sync_device(device)
        start = time.perf_counter()
        outs = gen.generate(prompts, params, use_tqdm=False)
        sync_device(device)
        rollout_s = time.perf_counter() - start
        gen.release()
        rollouts = [
            Rollout(list(p), list(c.token_ids), list(c.logprobs)) for p, o in zip(prompts, outs) for c in o.outputs
        ]
        rows = pack_rollouts(rollouts, capacity)
        model.train()
        with use_nopad_attention(model):
            start = time.perf_counter()
            gaps = []
            for row in rows:
                row = move_batch(row, device)
                logp = packed_logprobs(model, row)
                logp.sum().backward()  # the backward a training step would run (gradient unused)
                gaps.append((logp.detach() - row.token_values["gen_logprobs"]).abs())
            sync_device(device)
            train_s = time.perf_counter() - start
        model.zero_grad(set_to_none=True)
        model.eval()
    gap = torch.cat(gaps).cpu()
    new_tokens = sum(len(r.completion_ids) for r in rollouts)
    return {
        "tokens": int(gap.numel()),
        # TRL's importance ratio pi_train / pi_rollout per token: exactly 1 where the gap is 0
        "is_ratio_min": float(torch.exp(-gap).min()),
        "gap_max": float(gap.max()),
        "gap_mean": float(gap.mean()),
        "over_1e3": float((gap > 1e-3).float().mean()),
        "exact": float((gap == 0).float().mean()),
        "rollout_tok_s": new_tokens / rollout_s,
        "train_tok_s": sum(int(r["input_ids"].numel()) for r in rows) / train_s,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="a tiny random Llama, 2 prompts x 2 samples x 8 tokens")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--model",
        choices=["smollm2", "qwen2.5-0.5b", "tiny"],
        default=None,
        help="default: smollm2 (tiny with --quick)",
    )
    parser.add_argument("--prompts", type=int, default=None)
    parser.add_argument("--samples", type=int, default=None)
    parser.add_argument("--new-tokens", type=int, default=None)
    parser.add_argument(
        "--rounds",
        type=int,
        default=None,
        help="interleaved runs per mode, best kept (default 2; quick 1: a smoke run's speeds mean nothing)",
    )
    parser.add_argument(
        "--workload",
        choices=["grpo", "chat"],
        default="grpo",
        help="grpo: the maths prompts (at most 8); chat: the chat questions of varied length",
    )
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    args.model = args.model or ("tiny" if args.quick else "smollm2")
    args.rounds = args.rounds or (1 if args.quick else 2)
    num_prompts, n, max_tokens = (2, 2, 8) if args.quick else (8, 4, 24)
    num_prompts, n, max_tokens = args.prompts or num_prompts, args.samples or n, args.new_tokens or max_tokens
    params = SamplingParams(temperature=1.0, n=n, max_tokens=max_tokens, seed=0, ignore_eos=True)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {args.threads} threads"
    print(
        f"{args.model}, {num_prompts} prompts x {n} samples x {max_tokens} new tokens, T=1, {where}, "
        f"torch {torch.__version__}",
        flush=True,
    )
    header = (
        f"{'dtype':9} {'mode':16} {'gap max':>9} {'gap mean':>9} {'>1e-3':>7} {'exact':>7} "
        f"{'rollout tok/s':>13} {'train tok/s':>11}"
    )
    print(header + "\n" + "-" * len(header))
    for name in args.dtypes.split(","):
        dtype = getattr(torch, name)
        model, tokenizer = load(args.model, dtype, args.device)
        prompts = workload(tokenizer, model.config.vocab_size, num_prompts, args.workload)
        modes = ["default", "batch-invariant"]
        results = {}
        for r in range(args.rounds):  # interleaved, order rotated each round: all modes see one machine
            for mode in modes[r % len(modes) :] + modes[: r % len(modes)]:
                r = measure(model, tokenizer, prompts, params, mode != "default", capacity=2048)
                best = results.setdefault(mode, r)
                for key in ("rollout_tok_s", "train_tok_s"):
                    best[key] = max(best[key], r[key])
        for mode, r in results.items():
            print(
                f"{name:9} {mode:16} {r['gap_max']:>9.3g} {r['gap_mean']:>9.3g} {r['over_1e3']:>7.1%} "
                f"{r['exact']:>7.1%} {r['rollout_tok_s']:>13.1f} {r['train_tok_s']:>11.1f}  "
                f"({r['tokens']} tokens, IS ratio min {r['is_ratio_min']:.6g})"
            )
        d = results["default"]
        for mode in modes[1:]:
            i = results[mode]
            print(
                f"{name:9} {mode + '/default':16} {'':>9} {'':>9} {'':>7} {'':>7} "
                f"{i['rollout_tok_s'] / d['rollout_tok_s']:>12.2f}x "
                f"{i['train_tok_s'] / d['train_tok_s']:>10.2f}x",
                flush=True,
            )
    print(
        "(gap: generator raw log-prob vs the training forward's per sampled token; exact = share of "
        f"tokens with gap 0.0; speeds: best of {args.rounds} interleaved runs per mode; "
        "on CPU the invariant mode runs every GEMM on 32-row tiles; the GPU goal is an "
        "invariant/default ratio >= 0.8x, i.e. <= 1.25x the time)"
    )


if __name__ == "__main__":
    main()
