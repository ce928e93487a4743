"""nopad inside TRL's trainers vs TRL's own paths, same model, data and config, in ONE run.

Model: SmolLM2-135M-Instruct (fp32, CPU), loaded once per system from the same weights.

GRPO (``GRPOTrainer``, gsm8k-style chat prompts, ``num_generations`` samples each, the same
reward, seed and steps; generation happens every step):
  - TRL default generation (padded ``model.generate``),
  - TRL ``use_transformers_continuous_batching=True``,
  - nopad ``rollout_func`` (in-process generator on the live policy),
  - nopad ``rollout_func(importance_sampling=True)``: TRL then recomputes the old log-probs and
    applies its IS correction to ours, and logs the gap it feeds the loss.
  Reported: seconds per step (after one warm-up step), of which generation, and the log-prob gap
  |log pi_trainer - log pi_sampler| each path feeds the loss (the TRL paths feed none: TRL then
  treats the samples as exactly on-policy). Completions are sampled, so their lengths (and the
  training cost) differ a little between systems; mean completion length is printed.

SFT (``SFTTrainer`` / nopad, an offline dataset of mixed-length texts, lognormal token lengths):
  - nopad: ``NopadSFTTrainer`` (global BFD bins of ``per_device_train_batch_size * max_length``
    tokens, nopad varlen attention),
  - TRL ``packing=True, packing_strategy="bfd", padding_free=True`` (same tokens per micro-batch),
  - TRL plain padding (``packing=False``, ``per_device_train_batch_size`` rows).
  Reported: trained (non-pad) tokens/s, the share of computed positions that are padding, and the
  bin fill (trained tokens / token budget of the steps: how many steps an epoch takes).

    python benchmarks/bench_trl.py            # full run (tens of minutes on 2 CPU cores)
    python benchmarks/bench_trl.py --quick    # smoke run (1 prompt x 4 samples, 256-token SFT steps)
"""

from __future__ import annotations

import argparse
import os
import platform
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import datasets  # noqa: E402
from transformers import TrainerCallback  # noqa: E402

from benchmarks._workloads import CHAT_QUESTIONS, GRPO_QUESTIONS  # noqa: E402


def load_model():
    from packing.models import load_smollm2

    model, tok = load_smollm2(torch.float32)
    if getattr(model, "is_quantized", False):  # fresh from the GGUF: Trainer refuses it; the cache is clean
        model, tok = load_smollm2(torch.float32)
    model.train()
    return model, tok


class StepClock(TrainerCallback):
    """Wall time of every optimizer step."""

    def __init__(self):
        self.times: list[float] = []
        self._start = 0.0

    def on_step_begin(self, args, state, control, **kwargs):
        self._start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self._start)


def _steady(times: list[float]) -> float:
    return float(np.mean(times[1:] if len(times) > 1 else times))


# ----------------------------------------------------------------------------- GRPO
def reward_digits(completions, **kwargs) -> list[float]:
    """1 for a completion that contains a number (a stand-in for a maths verifier)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [float(any(ch.isdigit() for ch in t)) for t in texts]


def run_grpo(name: str, cfg: dict, out_dir: Path) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    from inference.trl import nopad_rollout_func

    model, tok = load_model()
    prompts = [[{"role": "user", "content": q}] for q in GRPO_QUESTIONS[: cfg["prompts"]]]
    settings = dict(output_dir=str(out_dir / name.replace(" ", "_")),
                    per_device_train_batch_size=cfg["prompts_per_step"] * cfg["G"], num_generations=cfg["G"],
                    max_completion_length=cfg["new_tokens"], max_steps=cfg["steps"],
                    learning_rate=1e-6, logging_steps=1, report_to=[], use_cpu=True, bf16=False,
                    save_strategy="no", seed=0, beta=0.0, temperature=1.0, gradient_checkpointing=False)
    rollout = None
    if name == "TRL continuous batching":
        settings["use_transformers_continuous_batching"] = True
    if name.startswith("nopad"):
        rollout = nopad_rollout_func(importance_sampling="IS" in name,
                                     max_num_batched_tokens=cfg["max_num_batched_tokens"])
    clock = StepClock()
    trainer = GRPOTrainer(model=model, reward_funcs=reward_digits, args=GRPOConfig(**settings),
                          train_dataset=datasets.Dataset.from_dict({"prompt": prompts}), processing_class=tok,
                          rollout_func=rollout, callbacks=[clock])
    gen_times: list[float] = []
    generate = trainer._generate

    def timed_generate(prompts_):
        start = time.perf_counter()
        result = generate(prompts_)
        gen_times.append(time.perf_counter() - start)
        return result

    trainer._generate = timed_generate
    trainer.train()
    logs = [h for h in trainer.state.log_history if "completions/mean_length" in h]
    key = "sampling/sampling_logp_difference/"
    gap = [h[key + "mean"] for h in logs if key + "mean" in h]
    gap_max = [h[key + "max"] for h in logs if key + "max" in h]
    return {
        "name": name,
        "s_per_step": _steady(clock.times),
        "gen_s_per_step": _steady(gen_times),
        "mean_len": float(np.mean([h["completions/mean_length"] for h in logs])),
        "gap_mean": float(np.mean(gap)) if gap else None,
        "gap_max": float(np.max(gap_max)) if gap_max else None,
    }


# ----------------------------------------------------------------------------- SFT
def sft_texts(n: int, max_words: int, seed: int) -> list[str]:
    """Mixed-length documents: lognormal word counts (median ~max_words/5), words drawn from the
    benchmark's chat questions, so the token lengths spread from a few to ``max_length``."""
    rng = random.Random(seed)
    words = " ".join(CHAT_QUESTIONS).split()
    lengths = np.clip(np.random.default_rng(seed).lognormal(np.log(max_words / 5), 0.9, size=n), 4, max_words)
    return [" ".join(rng.choice(words) for _ in range(int(k))) for k in lengths]


def run_sft(name: str, cfg: dict, texts: list[str], out_dir: Path) -> dict:
    from trl import SFTConfig, SFTTrainer

    from dataloaders.trainer import NopadSFTTrainer

    model, tok = load_model()
    base = NopadSFTTrainer if name == "nopad" else SFTTrainer
    counts = {"real": 0, "computed": 0}

    class Counting(base):
        def training_step(self, model_, inputs, num_items_in_batch=None):
            computed = int(inputs["input_ids"].numel())
            mask = inputs.get("attention_mask")
            counts["real"] += int(mask.sum()) if mask is not None else computed
            counts["computed"] += computed
            return super().training_step(model_, inputs, num_items_in_batch)

    settings = dict(output_dir=str(out_dir / name.replace(" ", "_")), max_length=cfg["max_length"],
                    per_device_train_batch_size=cfg["rows"], max_steps=cfg["sft_steps"], learning_rate=1e-6,
                    report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0, logging_steps=1,
                    dataset_num_proc=None, gradient_checkpointing=False)
    if name == "TRL packing+padding_free":
        settings.update(packing=True, packing_strategy="bfd", padding_free=True)
    clock = StepClock()
    trainer = Counting(model=model, args=SFTConfig(**settings),
                       train_dataset=datasets.Dataset.from_dict({"text": texts}), processing_class=tok,
                       callbacks=[clock])
    trainer.train()
    steps = len(clock.times)
    # steady state: drop the first step's time and (approximately) its tokens
    real_per_step = counts["real"] / steps
    budget = cfg["rows"] * cfg["max_length"]
    return {
        "name": name,
        "tok_s": real_per_step / _steady(clock.times),
        "pad_frac": 1 - counts["real"] / max(counts["computed"], 1),
        "fill": counts["real"] / (steps * budget) if name != "TRL padding" else None,
        "steps": steps,
    }


# ----------------------------------------------------------------------------- main
def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip", choices=["grpo", "sft"], default=None)
    parser.add_argument("--grpo-steps", type=int, default=None, help="override the GRPO step count")
    cli = parser.parse_args()
    torch.set_num_threads(cli.threads)
    if cli.quick:
        cfg = dict(prompts=8, prompts_per_step=1, G=4, new_tokens=8, steps=2, max_num_batched_tokens=1024,
                   max_length=128, rows=2, sft_docs=40, sft_steps=3)
    else:
        cfg = dict(prompts=8, prompts_per_step=2, G=8, new_tokens=48, steps=4, max_num_batched_tokens=2048,
                   max_length=512, rows=4, sft_docs=400, sft_steps=6)
    if cli.grpo_steps:
        cfg["steps"] = cli.grpo_steps
    out_dir = Path("/tmp/nopad_bench_trl")
    print(f"# bench_trl  torch {torch.__version__}  {platform.processor() or platform.machine()}  "
          f"threads={cli.threads}  {'quick' if cli.quick else 'full'}  {cfg}", flush=True)

    if cli.skip != "grpo":
        results = []
        systems = ("TRL generate", "TRL continuous batching", "nopad rollout_func", "nopad rollout_func + IS")
        for name in systems:
            results.append(run_grpo(name, cfg, out_dir))
            print(f"  done {name}", flush=True)
        best_peer = min(r["s_per_step"] for r in results if r["name"].startswith("TRL"))
        print(f"\nGRPOTrainer: {cfg['prompts_per_step']} prompts x {cfg['G']} samples, "
              f"<= {cfg['new_tokens']} new tokens, {cfg['steps']} steps (first = warm-up)")
        print(f"{'system':<28}{'s/step':>9}{'gen s':>9}{'mean len':>10}{'vs best TRL':>13}"
              f"{'logp gap mean':>15}{'max':>10}")
        for r in results:
            unmeasured = "none fed" if r["name"].startswith("TRL") else "IS off"
            gap = unmeasured if r["gap_mean"] is None else f"{r['gap_mean']:.2e}"
            gmax = "" if r["gap_max"] is None else f"{r['gap_max']:.2e}"
            print(f"{r['name']:<28}{r['s_per_step']:>9.2f}{r['gen_s_per_step']:>9.2f}{r['mean_len']:>10.1f}"
                  f"{best_peer / r['s_per_step']:>12.2f}x{gap:>15}{gmax:>10}")

    if cli.skip != "sft":
        texts = sft_texts(cfg["sft_docs"], cfg["max_length"] // 2, seed=0)
        results = []
        for name in ("nopad", "TRL packing+padding_free", "TRL padding"):
            results.append(run_sft(name, cfg, texts, out_dir))
            print(f"  done {name}", flush=True)
        trl_packed = next(r for r in results if r["name"] == "TRL packing+padding_free")
        print(f"\nSFTTrainer: {cfg['sft_docs']} mixed-length docs, max_length {cfg['max_length']}, "
              f"{cfg['rows']} x {cfg['max_length']} tokens per micro-batch, {cfg['sft_steps']} steps")
        print(f"{'system':<28}{'tok/s':>9}{'vs TRL packing':>16}{'padding':>9}{'bin fill':>10}")
        for r in results:
            fill = "-" if r["fill"] is None else f"{r['fill']:.1%}"
            print(f"{r['name']:<28}{r['tok_s']:>9.0f}{r['tok_s'] / trl_packed['tok_s']:>15.2f}x"
                  f"{r['pad_frac']:>9.1%}{fill:>10}")


if __name__ == "__main__":
    main()
