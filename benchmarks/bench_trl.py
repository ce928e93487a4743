"""nopad inside TRL's trainers vs TRL's own paths, same model, data and config, in ONE run.

Model: SmolLM2-135M-Instruct (fp32, CPU), loaded once per system from the same weights.

GRPO (``GRPOTrainer``, gsm8k-style chat prompts behind a system prompt with a worked example, so
~250-token prompts; ``num_generations`` samples each, the same reward, seed and steps; generation
happens every step):
  - TRL default generation (padded ``model.generate``) and TRL's padded training forward,
  - TRL ``use_transformers_continuous_batching=True``, TRL's training forward,
  - nopad ``rollout_func`` (in-process generator on the live policy), TRL's training forward,
  - ``NopadGRPOTrainer(shared_prefix=False)``: nopad rollout + packed training forward,
  - ``NopadGRPOTrainer()``: nopad rollout + shared-prefix rows (each prompt computed once per row);
    both with their default ``batch_invariant=False``, and the shared-prefix one once more with
    ``batch_invariant=True`` (exact ratio, but every GEMM on 32-row tiles, so a decode step of 8
    sequences computes 32 rows).
  Reported: seconds per step (after one warm-up step), split into generation ("gen"), TRL's
  log-prob forwards ("fwd": old / reference / loss forward, whichever run) and the rest ("bwd+":
  backward, optimizer, rewards and TRL's bookkeeping), and the largest gap |log pi_rollout -
  log pi_trainer| over the completion tokens between the log-probs the rollout hands TRL and the
  loss forward's (TRL's own paths return no log-probs: TRL then treats samples as on-policy).
  Completions are sampled, so their lengths (and the training cost) differ a little between
  systems; mean completion length is printed.

SFT (``SFTTrainer`` / nopad, an offline dataset of mixed-length texts, lognormal token lengths):
  - nopad: ``NopadSFTTrainer`` (global BFD bins of ``per_device_train_batch_size * max_length``
    tokens, nopad varlen attention),
  - TRL ``packing=True, packing_strategy="bfd", padding_free=True`` (same tokens per micro-batch),
  - TRL plain padding (``packing=False``, ``per_device_train_batch_size`` rows).
  Reported: trained (non-pad) tokens/s, the share of computed positions that are padding, and the
  bin fill (trained tokens / token budget of the steps: how many steps an epoch takes).

LoRA (``--lora``): the GRPO rows again with one ``peft.LoraConfig`` (rank 16, alpha 32, all linear
layers) given as ``peft_config=`` to TRL's ``GRPOTrainer`` and to ``NopadGRPOTrainer`` alike; each
trainer wraps the model itself, and only the adapter trains.

    python benchmarks/bench_trl.py            # full run (tens of minutes on 2 CPU cores)
    python benchmarks/bench_trl.py --quick    # smoke run: a tiny random Llama, 1 prompt x 4 samples
    python benchmarks/bench_trl.py --lora --skip sft   # GRPO with LoRA: TRL vs nopad, same peft_config
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

from benchmarks._workloads import CHAT_QUESTIONS, GRPO_QUESTIONS, tiny_llama  # noqa: E402


def load_model(tiny: bool = False):
    """SmolLM2-135M-Instruct, or with ``tiny`` a tiny random Llama with its tokenizer."""
    from nopad.assets.smollm2 import load_smollm2, load_smollm2_tokenizer

    if tiny:
        tok = load_smollm2_tokenizer()
        return tiny_llama(tokenizer=tok).train(), tok
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
# A system prompt with one worked example: GRPO prompts are rarely tiny (instructions, few-shot),
# and a long prompt is what the shared-prefix rows save n - 1 copies of.
SYSTEM_PROMPT = (
    "You are a careful maths tutor. Solve the problem step by step: restate what is known, write each "
    "intermediate quantity with its unit, check the arithmetic of every step, and finish with a line "
    "of the form 'Answer: <number>'. Keep the explanation short and do not repeat the question. "
    "Example. Question: A baker makes 24 rolls in the morning and twice as many in the afternoon. He "
    "sells 50 rolls and gives 6 away. How many rolls are left? Solution: In the afternoon he makes "
    "2 x 24 = 48 rolls, so 24 + 48 = 72 rolls in total. He sells 50 and gives away 6, which is "
    "50 + 6 = 56 rolls. 72 - 56 = 16 rolls are left. Answer: 16."
)

# (system name, rollout, trainer): "TRL" = TRL's own path, "nopad" = ours
GRPO_SYSTEMS = (
    ("TRL generate", "TRL", "TRL"),
    ("TRL continuous batching", "TRL CB", "TRL"),
    ("nopad rollout_func", "nopad", "TRL"),
    ("nopad rollout + trainer (packing)", "nopad", "nopad packing"),
    ("nopad rollout + trainer (shared-prefix)", "nopad", "nopad shared-prefix"),
    ("  same, batch_invariant=True", "nopad", "nopad shared-prefix exact"),
)


def reward_digits(completions, **kwargs) -> list[float]:
    """Share of digits among the first 20 characters' worth (a stand-in for a maths verifier that
    still separates the samples of a group)."""
    texts = [c[-1]["content"] if isinstance(c, list) else c for c in completions]
    return [min(sum(ch.isdigit() for ch in t), 20) / 20 for t in texts]


def grpo_prompts(n: int) -> list[list[dict]]:
    return [[{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": q}] for q in GRPO_QUESTIONS[:n]]


LORA_SYSTEMS = (GRPO_SYSTEMS[0], GRPO_SYSTEMS[4], GRPO_SYSTEMS[5])  # TRL's default vs nopad's trainer


def lora_config():
    """The one adapter every system trains under ``--lora``."""
    from peft import LoraConfig

    return LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules="all-linear", task_type="CAUSAL_LM")


def run_grpo(name: str, rollout_kind: str, trainer_kind: str, cfg: dict, out_dir: Path, lora: bool = False) -> dict:
    from trl import GRPOConfig, GRPOTrainer

    from nopad.training.trl.grpo_trainer import NopadGRPOTrainer
    from nopad.training.trl.rollout import nopad_rollout_func

    model, tok = load_model(cfg["tiny_model"])
    settings = dict(
        output_dir=str(out_dir / name.replace(" ", "_")),
        per_device_train_batch_size=cfg["prompts_per_step"] * cfg["G"],
        num_generations=cfg["G"],
        max_completion_length=cfg["new_tokens"],
        max_steps=cfg["steps"],
        learning_rate=1e-6,
        logging_steps=1,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        beta=0.0,
        temperature=1.0,
        gradient_checkpointing=False,
    )
    if rollout_kind == "TRL CB":
        settings["use_transformers_continuous_batching"] = True
        # a cache for the step's sequences (1,024 tokens each in 256-token pages), as nopad's
        # generator sizes its own: unsized, transformers fills most of the free memory (OOM on a
        # shared machine)
        settings["transformers_continuous_batching_config"] = dict(
            num_blocks=cfg["prompts_per_step"] * cfg["G"] * 4 + 4
        )
    kwargs: dict = {"peft_config": lora_config()} if lora else {}
    cls = GRPOTrainer
    if rollout_kind == "nopad":
        kwargs["rollout_func"] = nopad_rollout_func(max_num_batched_tokens=cfg["max_num_batched_tokens"])
    if trainer_kind.startswith("nopad"):
        cls = NopadGRPOTrainer
        kwargs["shared_prefix"] = "shared-prefix" in trainer_kind
        kwargs["rollout_func"] = None  # the trainer's own nopad rollout, batch-invariant like its forward
        if trainer_kind.endswith("exact"):  # ratio exactly 1; every GEMM on 32-row tiles
            kwargs["batch_invariant"] = True
    gaps: list[float] = []
    prompt_lens: list[int] = []

    forward_times: list[float] = []  # every log-prob forward TRL runs (old / ref / loss), per step

    class Measured(cls):
        def _get_per_token_logps_and_entropies(self, *args, **kw):
            start = time.perf_counter()
            out = super()._get_per_token_logps_and_entropies(*args, **kw)
            forward_times[-1] += time.perf_counter() - start
            return out

        def _compute_loss(self, model_, inputs):
            """Record the gap between the rollout's log-probs and the loss forward's."""
            inner = self._get_per_token_logps_and_entropies
            prompt_lens.extend(inputs["prompt_mask"].sum(1).tolist())

            def grab(*args, **kw):
                out = inner(*args, **kw)
                sampled = inputs.get("sampling_per_token_logps")
                if sampled is not None:
                    mask = inputs["completion_mask"].bool()
                    gaps.append(float((out[0].detach() - sampled)[mask].abs().max()))
                return out

            self._get_per_token_logps_and_entropies = grab
            try:
                return super()._compute_loss(model_, inputs)
            finally:
                del self._get_per_token_logps_and_entropies

        def training_step(self, *args, **kw):
            forward_times.append(0.0)
            return super().training_step(*args, **kw)

    clock = StepClock()
    trainer = Measured(
        model=model,
        reward_funcs=reward_digits,
        args=GRPOConfig(**settings),
        train_dataset=datasets.Dataset.from_dict({"prompt": grpo_prompts(cfg["prompts"])}),
        processing_class=tok,
        callbacks=[clock],
        **kwargs,
    )
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
    step = _steady(clock.times)
    gen = _steady(gen_times)
    return {
        "name": name,
        "s_per_step": step,
        "gen_s_per_step": gen,
        "fwd_s_per_step": _steady(forward_times),
        "rest_s_per_step": step - gen - _steady(forward_times),  # backward, optimizer, TRL's bookkeeping
        "mean_len": float(np.mean([h["completions/mean_length"] for h in logs])),
        "prompt_len": float(np.mean(prompt_lens)) if prompt_lens else 0.0,
        "gap_max": max(gaps) if gaps else None,
        "batch_invariant": bool(getattr(trainer, "nopad_batch_invariant", False)),
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

    from nopad.training.trl.sft_trainer import NopadSFTTrainer

    model, tok = load_model(cfg["tiny_model"])
    base = NopadSFTTrainer if name == "nopad" else SFTTrainer
    counts = {"real": 0, "computed": 0}

    class Counting(base):
        def training_step(self, model_, inputs, num_items_in_batch=None):
            computed = int(inputs["input_ids"].numel())
            mask = inputs.get("attention_mask")
            counts["real"] += int(mask.sum()) if mask is not None else computed
            counts["computed"] += computed
            return super().training_step(model_, inputs, num_items_in_batch)

    settings = dict(
        output_dir=str(out_dir / name.replace(" ", "_")),
        max_length=cfg["max_length"],
        per_device_train_batch_size=cfg["rows"],
        max_steps=cfg["sft_steps"],
        learning_rate=1e-6,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=0,
        logging_steps=1,
        dataset_num_proc=None,
        gradient_checkpointing=False,
    )
    if name == "TRL packing+padding_free":
        settings.update(packing=True, packing_strategy="bfd", padding_free=True)
    clock = StepClock()
    trainer = Counting(
        model=model,
        args=SFTConfig(**settings),
        train_dataset=datasets.Dataset.from_dict({"text": texts}),
        processing_class=tok,
        callbacks=[clock],
    )
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
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="small smoke run")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--skip", choices=["grpo", "sft"], default=None)
    parser.add_argument("--grpo-steps", type=int, default=None, help="override the GRPO step count")
    parser.add_argument("--lora", action="store_true", help="GRPO with one peft LoraConfig in every trainer")
    cli = parser.parse_args()
    torch.set_num_threads(cli.threads)
    if cli.quick:
        cfg = dict(
            prompts=8,
            prompts_per_step=1,
            G=4,
            new_tokens=8,
            steps=2,
            max_num_batched_tokens=1024,
            max_length=128,
            rows=2,
            sft_docs=40,
            sft_steps=3,
            tiny_model=True,
        )
    else:
        cfg = dict(
            prompts=8,
            prompts_per_step=1,
            G=8,
            new_tokens=64,
            steps=3,
            max_num_batched_tokens=2048,
            max_length=512,
            rows=4,
            sft_docs=400,
            sft_steps=6,
            tiny_model=False,
        )
    if cli.grpo_steps:
        cfg["steps"] = cli.grpo_steps
    out_dir = Path("/tmp/nopad_bench_trl")
    print(
        f"# bench_trl  torch {torch.__version__}  {platform.processor() or platform.machine()}  "
        f"threads={cli.threads}  {'quick' if cli.quick else 'full'}  {cfg}",
        flush=True,
    )

    if cli.skip != "grpo":
        results = []
        for name, rollout_kind, trainer_kind in LORA_SYSTEMS if cli.lora else GRPO_SYSTEMS:
            results.append(run_grpo(name, rollout_kind, trainer_kind, cfg, out_dir, lora=cli.lora))
            print(f"  done {name}: {results[-1]['s_per_step']:.2f} s/step", flush=True)
        best_peer = min(r["s_per_step"] for r in results if r["name"].startswith("TRL"))
        lora = ", LoRA r=16 all-linear (peft_config)" if cli.lora else ""
        print(
            f"\nGRPOTrainer: {cfg['prompts_per_step']} prompts x {cfg['G']} samples, prompts of "
            f"{results[0]['prompt_len']:.0f} tokens (mean), <= {cfg['new_tokens']} new tokens, "
            f"{cfg['steps']} steps (first = warm-up), fp32, beta=0, no gradient checkpointing{lora}"
        )
        print(
            f"{'system':<42}{'s/step':>8}{'gen s':>8}{'fwd s':>8}{'bwd+ s':>8}{'len':>6}{'vs best TRL':>13}"
            f"{'max |logp gap| fed':>22}"
        )
        for r in results:
            if r["gap_max"] is None:
                gap = "n/a, no log-probs"
            else:
                gap = f"{r['gap_max']:.1e}" + (" (batch-inv.)" if r["batch_invariant"] else "")
            ratio = best_peer / r["s_per_step"]
            print(
                f"{r['name']:<42}{r['s_per_step']:>8.2f}{r['gen_s_per_step']:>8.2f}{r['fwd_s_per_step']:>8.2f}"
                f"{r['rest_s_per_step']:>8.2f}{r['mean_len']:>6.0f}{ratio:>12.2f}x{gap:>22}"
            )

    if cli.skip != "sft":
        texts = sft_texts(cfg["sft_docs"], cfg["max_length"] // 2, seed=0)
        results = []
        for name in ("nopad", "TRL packing+padding_free", "TRL padding"):
            results.append(run_sft(name, cfg, texts, out_dir))
            print(f"  done {name}", flush=True)
        trl_packed = next(r for r in results if r["name"] == "TRL packing+padding_free")
        print(
            f"\nSFTTrainer: {cfg['sft_docs']} mixed-length docs, max_length {cfg['max_length']}, "
            f"{cfg['rows']} x {cfg['max_length']} tokens per micro-batch, {cfg['sft_steps']} steps"
        )
        print(f"{'system':<28}{'tok/s':>9}{'vs TRL packing':>16}{'padding':>9}{'bin fill':>10}")
        for r in results:
            fill = "-" if r["fill"] is None else f"{r['fill']:.1%}"
            print(
                f"{r['name']:<28}{r['tok_s']:>9.0f}{r['tok_s'] / trl_packed['tok_s']:>15.2f}x"
                f"{r['pad_frac']:>9.1%}{fill:>10}"
            )


if __name__ == "__main__":
    main()
