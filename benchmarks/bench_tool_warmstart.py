"""Tool episodes on the model nopad ships: the calculator's tool-call rate and reward before and after
a warm-start SFT on demonstrations the task writes itself, and after a few GRPO steps.

SmolLM2-135M-Instruct (fp32, CPU) with nopad's tool template (``model.tool_template=smollm2``) on
``task.name=calculator_chat``: "What is 17 * 23 + 4?" after a system turn that shows the call
format; the tool is called as ``<tool_call>{"name": "calculator", ...}</tool_call>``. Side by side
in one run, on the same held-out questions (seed 2; the demonstrations are seed 1, GRPO's prompts
seed 0), sampled at temperature 1 as GRPO samples:

  (a) before   the model as shipped
  (b) SFT      after the warm start: ``nopad.recipes.sft`` on ``python -m nopad.recipes.tool_tasks demos.jsonl``
               (``data.per_turn_samples=true``: the call turn and the answer turn each a sample)
  (c) GRPO     ``--grpo-steps`` steps of ``nopad.recipes.grpo`` from (b): each step's own rollouts (GRPO's
               prompts, seed 0), as the recipe logs them

Per row: the share of episodes that called the tool, the tool calls per episode, malformed calls,
and the reward (``last_number_match`` on the last model turn, the GRPO recipe's reward). One thread
by default: on a loaded machine more threads spin against each other.

    python benchmarks/bench_tool_warmstart.py            # SmolLM2: 8 questions x 4 samples, minutes
    python benchmarks/bench_tool_warmstart.py --quick    # a tiny random Llama with SmolLM2's tokenizer
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere (recipes/)

from nopad.assets.smollm2 import load_smollm2, load_smollm2_tokenizer  # noqa: E402
from nopad.inference import EpisodeLimits, Generator, SamplingParams  # noqa: E402
from nopad.inference.tools import ChatTemplateTools, use_tool_template  # noqa: E402
from nopad.recipes.config import load_config  # noqa: E402
from nopad.recipes.grpo import run_grpo  # noqa: E402
from nopad.recipes.grpo_config import GRPORecipeConfig  # noqa: E402
from nopad.recipes.sft import train as run_sft  # noqa: E402
from nopad.recipes.sft_config import SFTRecipeConfig  # noqa: E402
from nopad.recipes.tasks import last_number_match  # noqa: E402
from nopad.recipes.tool_tasks import CALCULATOR_SYSTEM, calculator, calculator_chat_task, chat_tool_prompt  # noqa: E402
from nopad.recipes.tool_tasks import main as write_demos  # noqa: E402


def tiny_model(vocab_size: int):
    import transformers

    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(
        transformers.LlamaConfig(
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=2048,
            tie_word_embeddings=True,
        )
    )


def measure(model, tok, examples, samples: int, max_tokens: int) -> dict:
    """Tool episodes on ``examples``: the share that called the tool, calls per episode, malformed
    calls and the mean reward."""
    prompts = [chat_tool_prompt(tok, CALCULATOR_SYSTEM, ex["prompt"], "calculator_chat") for ex in examples]
    gen = Generator(model, tok, block_size=16, num_blocks=1024, max_num_seqs=64, max_num_batched_tokens=1024)
    start = time.perf_counter()
    params = SamplingParams(n=samples, temperature=1.0, max_tokens=max_tokens, seed=0)
    limits = EpisodeLimits(max_turns=3, max_tokens=3 * max_tokens, tool_timeout=10.0)
    episodes = gen.run_episodes(
        prompts, {"calculator": calculator}, params, limits=limits, tool_format=ChatTemplateTools(tok)
    )
    seconds = time.perf_counter() - start
    gen.release()
    rewards = []
    for ep in episodes:
        last = ep.turns[-1] if ep.turns else None
        text = tok.decode(ep.completion_ids[last.start : last.end], skip_special_tokens=True) if last else ""
        rewards.append(last_number_match(text, examples[ep.prompt_index]))
    n = len(episodes)
    out = {
        "episodes": n,
        "called": sum(ep.num_tool_calls > 0 for ep in episodes) / n,
        "calls_per_episode": sum(ep.num_tool_calls for ep in episodes) / n,
        "malformed": sum(ep.num_malformed for ep in episodes) / n,
        "reward": sum(rewards) / n,
        "seconds": seconds,
    }
    print("measured: " + json.dumps({k: round(v, 3) for k, v in out.items()}), flush=True)
    return out


def warm_start(model, tok, out: Path, args) -> float:
    """The documented warm start: demonstrations as JSONL, then the SFT recipe on them."""
    demos = out / "calculator_demos.jsonl"
    write_demos([str(demos), "--num", str(args.demos), "--seed", "1"])
    cfg = load_config(
        SFTRecipeConfig,
        overrides=[
            f"data.source={demos}",
            "data.per_turn_samples=true",
            f"train.epochs={args.sft_epochs}",
            f"train.lr={args.sft_lr}",
            "train.grad_accum=1",
            f"data.tokens_per_batch={args.sft_tokens}",
            "train.progress=false",
            f"checkpoint.output_dir={out / 'sft'}",
            "checkpoint.save_final=false",
        ],
    )
    start = time.perf_counter()
    result = run_sft(cfg, model=model, tokenizer=tok)
    print(f"sft: {result['steps']} steps, losses {[round(x, 3) for x in result['losses']]}", flush=True)
    return time.perf_counter() - start


def grpo(model, tok, args) -> list[dict]:
    """``nopad.recipes.grpo`` on ``calculator_chat`` from the warm-started model; its per-step metrics."""
    cfg = load_config(
        GRPORecipeConfig,
        overrides=[
            "task.name=calculator_chat",
            f"train.steps={args.grpo_steps}",
            f"train.lr={args.grpo_lr}",
            f"rollout.prompts_per_step={args.grpo_prompts}",
            f"rollout.num_generations={args.grpo_samples}",
            f"rollout.max_tokens={3 * args.max_tokens}",
            "rollout.max_prompt_tokens=256",
            "rollout.max_turns=3",
        ],
    )
    history = run_grpo(cfg, model=model, tokenizer=tok, progress=False)
    for h in history:
        print(
            "grpo step: "
            + json.dumps(
                {k: round(h[k], 3) for k in ("reward_mean", "tool_calls_per_episode", "rollout_s", "train_s")}
            ),
            flush=True,
        )
    return history


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="tiny random Llama, 2 questions x 2 samples, seconds")
    p.add_argument("--questions", type=int, default=8, help="held-out questions measured")
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--samples", type=int, default=4, help="episodes per question")
    p.add_argument("--max-tokens", type=int, default=48, help="tokens per model turn")
    p.add_argument("--demos", type=int, default=16, help="warm-start demonstrations")
    p.add_argument("--sft-epochs", type=int, default=2)
    p.add_argument("--sft-lr", type=float, default=2e-4)
    p.add_argument("--sft-tokens", type=int, default=256, help="tokens per SFT step (about 2 demos)")
    p.add_argument("--grpo-steps", type=int, default=1, help="0: no GRPO row")
    p.add_argument("--grpo-lr", type=float, default=1e-6)
    p.add_argument("--grpo-prompts", type=int, default=2, help="prompts per GRPO step")
    p.add_argument("--grpo-samples", type=int, default=4, help="completions per prompt")
    args = p.parse_args()
    if args.quick:
        args.questions, args.samples, args.max_tokens, args.demos = 2, 2, 8, 4
        args.sft_epochs, args.grpo_steps, args.grpo_prompts, args.grpo_samples = 1, 1, 2, 2
    torch.set_num_threads(args.threads)
    tok = use_tool_template(load_smollm2_tokenizer())
    model = tiny_model(len(tok)) if args.quick else load_smollm2(torch.float32)[0]
    name = "tiny random Llama, SmolLM2's tokenizer" if args.quick else "SmolLM2-135M-Instruct fp32"
    examples = calculator_chat_task(args.questions, seed=2)
    rows = [("(a) before", measure(model, tok, examples, args.samples, args.max_tokens), None)]
    with tempfile.TemporaryDirectory() as tmp:
        sft_s = warm_start(model, tok, Path(tmp), args)
        rows.append(
            (
                "(b) after warm-start SFT",
                measure(model, tok, examples, args.samples, args.max_tokens),
                f"SFT {args.demos} demos x {args.sft_epochs} epochs: {sft_s:.0f} s",
            )
        )
        for h in grpo(model, tok, args) if args.grpo_steps else []:
            m = {
                "called": float("nan"),
                "calls_per_episode": h["tool_calls_per_episode"],
                "malformed": float("nan"),
                "reward": h["reward_mean"],
                "seconds": h["rollout_s"] + h["train_s"],
            }
            rows.append(
                (
                    f"(c) GRPO step {h['step']} rollouts",
                    m,
                    f"{args.grpo_prompts} prompts x {args.grpo_samples}, lr {args.grpo_lr:g}",
                )
            )
    print(
        f"\ncalculator_chat, {name}, {args.questions} held-out questions x {args.samples} samples "
        f"(temperature 1, <= {args.max_tokens} tokens per turn, <= 3 turns), "
        f"{torch.get_num_threads()} threads"
    )
    print(f"{'':28} {'called the tool':>16} {'calls/episode':>14} {'malformed':>10} {'reward':>7}  cost")
    for label, m, cost in rows:
        print(
            f"{label:28} {m['called']:16.2f} {m['calls_per_episode']:14.2f} {m['malformed']:10.2f} "
            f"{m['reward']:7.3f}  {cost or ''} (measured in {m['seconds']:.0f} s)"
        )


if __name__ == "__main__":
    main()
