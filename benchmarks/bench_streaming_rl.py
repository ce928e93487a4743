"""Streaming GRPO against synchronous GRPO and TRL's ``GRPOTrainer``, side by side in one run, on a
long-tailed rollout workload.

Workload: the GRPO maths prompts (chat template, SmolLM2's tokenizer) with each prompt's completion
length set by the task: nine in ten prompts end after 8-48 tokens, one in ten runs to 384 (drawn
once with a fixed seed; ``ignore_eos``, so a random-weight model writes exactly that many). The
model is a random-weight SmolLM2-135M shape (30 layers, hidden 576; ``--quick``: a tiny random Llama
and short lengths), its weights and training in ``--dtype`` on both sides (float32 by default;
bfloat16 as RL runs train). ``num_generations`` samples per prompt, ``prompts_per_step`` groups
per optimizer step, fused AdamW on both sides (the recipe's ``make_adamw``; TRL's default), the same
seeds for every system.

Systems (each trains ``--steps`` optimizer steps from the same initial weights):
  - nopad sync: ``rollout.mode=sync``, i.e. streaming at ``max_staleness=0`` (a test holds the two
    bitwise equal): every completion of a step, then the step;
  - nopad streaming at ``max_staleness`` 1 and 4, ``stale_kv`` keep and recompute (and 2, keep: the
    largest staleness the issue's goal allows): the generator runs
    on across optimizer steps on the live weights, groups admitted as sequence slots free up;
  - TRL ``GRPOTrainer`` (its default ``model.generate`` rollout, padded training forward) on the same
    prompts. TRL takes one completion limit for all prompts, so its lengths come from a stop set
    whose rate gives a mean near the workload's, capped at 384; its measured mean is printed, and
    its rates are per its own trained tokens.

The prompt source is endless, as in an RL run that cycles its data: streaming keeps its generator
full up to the N-th step, and the generation still in flight then is paid for in the wall time but
never trained (``--finite`` admits only the groups the N steps take: the last steps then decode a
draining batch, the end of a run rather than its steady state).

Reported per system: trained tokens (completion tokens that entered a loss) per CPU second of the
process and per wall second, wall time to the N optimizer steps, mean rows per decode step (over
the steps while prompts were still being admitted, and overall, against ``max_num_seqs``), groups
and tokens dropped for staleness, the staleness histogram of the trained tokens, and the ratio of
trained tokens per wall second against nopad sync and against TRL.

    python benchmarks/bench_streaming_rl.py            # the full run (tens of minutes on 2 cores)
    python benchmarks/bench_streaming_rl.py --quick    # tiny model, short lengths, 2 steps: a smoke run
    python benchmarks/bench_streaming_rl.py --skip-trl --exact   # in the batch-invariant mode
    python benchmarks/bench_streaming_rl.py --learning # the learning check (below)
    python benchmarks/bench_streaming_rl.py --dtype bfloat16   # bf16 weights and training on both sides
    python benchmarks/bench_streaming_rl.py --device cuda --systems sync,s=1,s=2   # a GPU (gpu_session.sh streaming)

On a GPU (``--device cuda``) the same run: a decode step there costs nearly the same at 4 rows as at
32, so the thinning tail that streaming removes is where sync loses most. On a CPU an fp32 step's cost
grows with its rows (its GEMMs are compute-bound); in bf16 on a CPU with AMX the GEMMs are several
times faster while the weights' reads are not, which brings the CPU closer to the GPU's economics.
``--systems`` runs a subset of the nopad systems (by the names' words: ``sync``, ``s=1``, ``s=2 keep``...),
to fit one device call.

The learning check (``--learning``): the GRPO recipe on its arithmetic task with the embedded
SmolLM2-135M-Instruct (2 prompts x 8 completions of <= 40 tokens at temperature 0.7 per step, lr
1e-5), 20 optimizer steps, synchronous under three seeds and streaming (``max_staleness=1``, keep)
under the first of them; prints each run's reward curve and whether
streaming's mean reward stays within the sync seeds' spread (their min..max, step by step and over
the last 10 steps).
"""

from __future__ import annotations

import argparse
import copy
import random
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from benchmarks._workloads import GRPO_QUESTIONS, chat_prompt_ids, sync_device, tiny_llama  # noqa: E402

SYSTEMS = [
    ("nopad sync", 0, "keep"),
    ("streaming s=1 keep", 1, "keep"),
    ("streaming s=1 recompute", 1, "recompute"),
    ("streaming s=2 keep", 2, "keep"),
    ("streaming s=4 keep", 4, "keep"),
    ("streaming s=4 recompute", 4, "recompute"),
]


def smollm2_shape(tokenizer):
    """A random-weight model of SmolLM2-135M's shape (no download: its config written out)."""
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=576,
        intermediate_size=1536,
        num_hidden_layers=30,
        num_attention_heads=9,
        num_key_value_heads=3,
        max_position_embeddings=2048,
        rope_theta=100000.0,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config).float()


def completion_lengths(num_prompts: int, short: tuple[int, int], long: int, seed: int = 0) -> list[int]:
    """Each prompt's completion length: one in ten ``long``, the others uniform in ``short``."""
    rng = random.Random(seed)
    return [long if rng.random() < 0.1 else rng.randint(*short) for _ in range(num_prompts)]


class IdsText:
    """What the reward reads: the completion's token ids (a random model writes no maths)."""

    def decode(self, ids, skip_special_tokens=True) -> str:
        return " ".join(map(str, ids))


def id_reward(text: str, example: dict) -> float:
    return float(sum(map(int, text.split())) % 5)


def run_nopad(name: str, base, prompts, lengths, args, max_staleness: int, stale_kv: str) -> dict:
    from accelerate import Accelerator

    from nopad.inference import Generator, SamplingParams
    from nopad.packing.hf import use_nopad_attention
    from nopad.training.accumulation import OptimizerStepper
    from nopad.training.grpo_step import GRPOStepConfig
    from nopad.training.optimizer import make_adamw
    from nopad.training.streaming import StreamingRollouts, streaming_step

    model = copy.deepcopy(base)
    on_cpu = next(model.parameters()).device.type == "cpu"
    # the recipe's optimizer (fused AdamW where torch has it; torch.optim.AdamW's default weight decay)
    stepper = OptimizerStepper(model, make_adamw(model, 1e-6, 0.01), Accelerator(cpu=on_cpu))
    generator = Generator(
        model,
        block_size=16,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=512,
        kv_memory_bytes=2 << 30,
        overlap=args.overlap,
    )
    admitted_at: list[int] = []  # decode steps run when each group was admitted

    def source(i: int):
        admitted_at.append(len(generator.scheduler.stats.seqs_per_step))
        k = i % len(prompts)
        return prompts[k], SamplingParams(
            n=args.num_generations, max_tokens=lengths[k], temperature=1.0, seed=i, ignore_eos=True
        )

    stream = StreamingRollouts(
        generator,
        source,
        groups_per_step=args.prompts_per_step,
        max_staleness=max_staleness,
        stale_kv=stale_kv,
        # the prompts never run out (an RL run cycles its data): the generator stays full up to the N-th
        # step, and what is still in flight then is paid for in the wall time but never trained.
        # --finite: admit only the groups N steps take, so the last steps decode a draining batch
        total_groups=args.steps * args.prompts_per_step if args.finite else None,
    )
    loss = GRPOStepConfig(max_tokens_per_batch=4096, batch_invariant=args.exact)
    trained, rollout_s = 0, 0.0
    wall, cpu = time.perf_counter(), time.process_time()
    with use_nopad_attention(model):
        for step in range(args.steps):
            m = streaming_step(
                stepper,
                stream,
                lambda g: ({}, prompts[g % len(prompts)]),
                id_reward,
                IdsText(),
                loss,
                step=step,
                temperature=1.0,
            )
            trained += m["completion_tokens"]
            rollout_s += m["rollout_s"]
    sync_device(next(model.parameters()).device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    stream.close()
    rows = generator.scheduler.stats.seqs_per_step
    admitting = rows[: max(admitted_at[-1], 1)]
    return {
        "name": name,
        "trained_tokens": trained,
        "wall_s": wall,
        "cpu_s": cpu,
        "rollout_s": rollout_s,
        "rows_admitting": sum(admitting) / max(len(admitting), 1),
        "rows_all": sum(rows) / max(len(rows), 1),
        "dropped_groups": stream.stats.dropped_groups,
        "dropped_tokens": stream.stats.dropped_tokens,
        "staleness": dict(sorted(stream.stats.staleness.items())),
        "decode_steps": len(rows),
        "overlap_breaks_per_100": 100 * generator.stats()["overlap_breaks"] / max(len(rows), 1),
    }


def run_trl(base, tokenizer, prompts_text, lengths, args, out_dir: Path) -> dict:
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    mean = sum(lengths) / len(lengths)
    vocab = len(tokenizer)
    stops = random.Random(1).sample(range(vocab), max(1, round(vocab / mean)))  # per-token stop rate 1/mean
    stops = sorted(set(stops) | {tokenizer.eos_token_id})
    trained = Counter()

    def reward(completions, completion_ids=None, **kwargs) -> list[float]:
        trained["tokens"] += sum(len(c) for c in completion_ids)
        return [float(sum(c) % 5) for c in completion_ids]

    settings = dict(
        output_dir=str(out_dir / "trl"),
        per_device_train_batch_size=args.prompts_per_step * args.num_generations,
        num_generations=args.num_generations,
        max_completion_length=max(lengths),
        max_steps=args.steps,
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        use_cpu=next(base.parameters()).device.type == "cpu",
        bf16=False,
        save_strategy="no",
        seed=0,
        beta=0.0,
        temperature=1.0,
        generation_kwargs={"eos_token_id": stops},
    )
    model = copy.deepcopy(base).train()
    trainer = GRPOTrainer(
        model=model,
        reward_funcs=reward,
        args=GRPOConfig(**settings),
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts_text}),
        processing_class=tokenizer,
    )
    wall, cpu = time.perf_counter(), time.process_time()
    trainer.train()
    sync_device(next(model.parameters()).device)
    wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    mean_len = sum(h["completions/mean_length"] for h in logs) / max(len(logs), 1)
    return {
        "name": "TRL GRPOTrainer",
        "trained_tokens": trained["tokens"],
        "wall_s": wall,
        "cpu_s": cpu,
        "rollout_s": float("nan"),
        "rows_admitting": float("nan"),
        "rows_all": float("nan"),
        "dropped_groups": 0,
        "dropped_tokens": 0,
        "staleness": {0: trained["tokens"]},
        "decode_steps": 0,
        "mean_len": mean_len,
    }


def chosen_systems(spec: str | None) -> list[tuple[str, int, str]]:
    """The nopad systems whose names contain every word of one of ``spec``'s comma-separated
    entries (``sync``, ``s=1``, ``s=4 recompute``); all of them when ``spec`` is None."""
    if spec is None:
        return SYSTEMS
    wanted = [entry.split() for entry in spec.split(",") if entry.strip()]
    chosen = [system for system in SYSTEMS if any(all(w in system[0] for w in words) for words in wanted)]
    if not chosen or chosen[0] != SYSTEMS[0]:
        names = ", ".join(name for name, _, _ in SYSTEMS)
        raise SystemExit(f"--systems {spec!r} must name nopad sync and match at least one of: {names}")
    return chosen


def learning_check(args) -> None:
    """Reward curves of the recipe, sync under three seeds and streaming under the first."""
    from nopad.recipes.config import load_config, with_overrides
    from nopad.recipes.grpo import run_grpo
    from nopad.recipes.grpo_config import GRPORecipeConfig

    steps = 3 if args.quick else 20
    base = {
        "model": {"path": "tiny:llama" if args.quick else "smollm2"},
        "task": {"name": "arithmetic"},
        "train": {"steps": steps, "lr": 1e-5},
        "rollout": {"prompts_per_step": 2, "num_generations": 8, "max_tokens": 40, "temperature": 0.7},
    }
    runs = [("sync", seed, {}) for seed in (0, 1, 2)] + [("streaming s=1 keep", 0, {"mode": "streaming"})]
    curves = {}
    for name, seed, rollout in runs:
        cfg = with_overrides(
            load_config(GRPORecipeConfig, overrides=base),
            {"train": {"seed": seed}, "rollout": {"seed": seed, **rollout}},
        )
        t0 = time.perf_counter()
        with tempfile.TemporaryDirectory() as out:
            history = run_grpo(with_overrides(cfg, {"output_dir": out}), progress=False)
        curves[(name, seed)] = [h["reward_mean"] for h in history]
        print(f"  ran {name} seed {seed}: {time.perf_counter() - t0:.0f} s", flush=True)
    sync = [c for (name, _), c in curves.items() if name == "sync"]
    low = [min(c[i] for c in sync) for i in range(steps)]
    high = [max(c[i] for c in sync) for i in range(steps)]
    print("\nreward_mean per step")
    for (name, seed), c in curves.items():
        print(f"  {name:20s} seed {seed}: " + " ".join(f"{r:.2f}" for r in c))
    streamed = curves[("streaming s=1 keep", 0)]
    inside = sum(lo <= r <= hi for lo, r, hi in zip(low, streamed, high))
    tail = slice(max(0, steps - 10), steps)
    means = [sum(c[tail]) / len(c[tail]) for c in sync]
    mine = sum(streamed[tail]) / len(streamed[tail])
    print(
        f"streaming inside the sync seeds' min..max at {inside} of {steps} steps; mean reward over the last "
        f"{len(streamed[tail])} steps {mine:.3f}, sync seeds {', '.join(f'{m:.3f}' for m in means)} "
        f"({'within' if min(means) <= mine <= max(means) else 'outside'} their spread)"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="tiny random Llama, short lengths (seconds)")
    parser.add_argument("--steps", type=int, default=6, help="optimizer steps per system")
    parser.add_argument("--prompts-per-step", type=int, default=4)
    parser.add_argument("--num-generations", type=int, default=4)
    parser.add_argument("--max-num-seqs", type=int, default=32, help="the generator's sequence slots")
    parser.add_argument("--exact", action="store_true", help="in nopad.packing.batch_invariant() (bitwise log-probs)")
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument(
        "--finite", action="store_true", help="streaming admits only the groups the N steps take (a run's last steps)"
    )
    parser.add_argument(
        "--overlap", action="store_true", help="nopad's generator with overlap scheduling (prints its pipeline breaks)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="where both sides run")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="both sides' weights, trained in that dtype (bfloat16: as RL runs train; on a CPU with AMX its "
        "GEMMs are several times fp32's, so compute is cheap beside the weights' reads, as on a GPU)",
    )
    parser.add_argument(
        "--systems", default=None, help="nopad systems to run, comma-separated words of their names (sync first)"
    )
    parser.add_argument("--learning", action="store_true", help="the learning check: reward curves, sync vs streaming")
    args = parser.parse_args()
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False)")
    torch.set_num_threads(args.threads)
    if args.learning:
        return learning_check(args)
    from nopad.assets.smollm2 import load_smollm2_tokenizer

    tokenizer = load_smollm2_tokenizer()
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    systems = chosen_systems(args.systems)
    if args.quick:  # every code path once: sync, keep, recompute, TRL
        args.steps, args.max_num_seqs, systems = 2, 8, systems[:3]
        args.prompts_per_step, args.num_generations = 2, 2
        base, lengths = tiny_llama(tokenizer=tokenizer), completion_lengths(len(GRPO_QUESTIONS), (2, 6), 24)
        model_name = "tiny random Llama (2 layers, hidden 64)"
    else:
        base, lengths = smollm2_shape(tokenizer), completion_lengths(len(GRPO_QUESTIONS), (8, 48), 384)
        model_name = "random-weight SmolLM2-135M shape (30 layers, hidden 576)"
    base = base.to(args.device, getattr(torch, args.dtype))
    prompts = chat_prompt_ids(tokenizer, GRPO_QUESTIONS)
    where = torch.cuda.get_device_name() if args.device == "cuda" else f"CPU, {torch.get_num_threads()} threads"
    print(
        f"model: {model_name}; {len(prompts)} prompts, completion lengths set by the task: "
        f"{sum(x == max(lengths) for x in lengths)} of {len(lengths)} run to {max(lengths)} tokens, the others "
        f"{min(lengths)}-{max(x for x in lengths if x != max(lengths))} (mean {sum(lengths) / len(lengths):.1f}); "
        f"{args.prompts_per_step} groups x {args.num_generations} per step, {args.steps} steps, "
        f"max_num_seqs={args.max_num_seqs}, {where}, {args.dtype}, batch_invariant={args.exact}"
    )
    results = []
    for name, staleness, kv in systems:
        results.append(run_nopad(name, base, prompts, lengths, args, staleness, kv))
        print(f"  ran {name}: {results[-1]['wall_s']:.1f} s", flush=True)
    if not args.skip_trl:
        with tempfile.TemporaryDirectory() as out:
            results.append(run_trl(base, tokenizer, GRPO_QUESTIONS, lengths, args, Path(out)))
        print(
            f"  ran TRL GRPOTrainer: {results[-1]['wall_s']:.1f} s (its mean completion "
            f"{results[-1]['mean_len']:.1f} tokens)",
            flush=True,
        )
    report(results, args.max_num_seqs)


def report(results: list[dict], max_num_seqs: int) -> None:
    sync = results[0]["trained_tokens"] / results[0]["wall_s"]
    trl = next((r["trained_tokens"] / r["wall_s"] for r in results if r["name"].startswith("TRL")), None)
    print(
        f"\n{'system':26s} {'tok/CPU s':>9s} {'tok/wall s':>10s} {'wall s':>7s} {'x sync':>6s} {'x TRL':>6s} "
        f"{'rows (admitting / all)':>22s} {'dropped groups/tokens':>21s}"
    )
    for r in results:
        rate = r["trained_tokens"] / r["wall_s"]
        rows = (
            f"{r['rows_admitting']:.1f} / {r['rows_all']:.1f} of {max_num_seqs}"
            if r["rows_all"] == r["rows_all"]
            else "n/a (padded batch)"
        )
        print(
            f"{r['name']:26s} {r['trained_tokens'] / r['cpu_s']:9.1f} {rate:10.1f} {r['wall_s']:7.1f} "
            f"{rate / sync:6.2f} {(rate / trl) if trl else float('nan'):6.2f} {rows:>22s} "
            f"{r['dropped_groups']:>10d}/{r['dropped_tokens']:<10d}"
        )
    base = results[0]
    share = base["rollout_s"] / base["wall_s"]
    print(
        "\nwhere the wall time went (rollout: the trainer waiting for groups; the rest: scoring and training):\n"
        + "\n".join(
            f"  {r['name']:26s} rollout {r['rollout_s']:7.1f} s ({r['rollout_s'] / r['wall_s']:4.0%}), "
            f"train {r['wall_s'] - r['rollout_s']:7.1f} s, "
            f"{1e3 * (r['wall_s'] - r['rollout_s']) / max(r['trained_tokens'], 1):.1f} ms a trained token"
            for r in results
            if r["rollout_s"] == r["rollout_s"]
        )
        + f"\nnopad sync spent {share:.0%} of its wall time waiting for rollouts: even rollouts that cost "
        f"nothing would give streaming at most {1 / max(1 - share, 1e-9):.2f}x sync's trained tokens per wall "
        "second (the training per token is the same in both)"
    )
    if any(r.get("overlap_breaks_per_100") for r in results):
        print(
            "overlap scheduling, pipeline breaks per 100 generator steps: "
            + ", ".join(
                f"{r['name']} {r['overlap_breaks_per_100']:.1f}" for r in results if "overlap_breaks_per_100" in r
            )
        )
    print("\nstaleness of the trained tokens (optimizer steps old: tokens)")
    for r in results:
        print(f"  {r['name']:26s} {r['staleness']}")


if __name__ == "__main__":
    main()
