"""Multi-turn tool rollouts: nopad episodes vs TRL ``GRPOTrainer``'s own tool loop, in ONE run.

Both sides are a ``GRPOTrainer`` on the same model, tokenizer, tools, prompts and sampling
settings (``temperature=1``, ``top_p=1``, ``max_completion_length``), and both are timed on the
same call, ``trainer._generate_and_score_completions(batch)`` (generation, tool rounds, rewards;
no log-prob forward at these settings), after one untimed warm-up call on one group:

- **TRL**: ``GRPOTrainer(tools=[lookup])``, TRL's default generation. Its ``_tool_call_loop``
  runs in lockstep: after each round the unfinished samples are generated again as one padded
  ``model.generate`` batch over their whole history, while finished ones wait; tools run one after
  another on the main thread.
- **nopad**: ``NopadGRPOTrainer(tools=[lookup])`` with its default rollout: every sample is an
  episode in the in-flight generator; at a tool call it pauses with its KV blocks kept, the tool
  runs in a thread pool while the others decode, and it resumes by prefilling the result only.

Workload: chat prompts (the Qwen2.5 tool-calling chat template, TRL's, with the tool's schema)
with ``--prompts`` x ``--samples`` rollouts, up to ``--max-tool-rounds`` rounds of a ``lookup``
tool that sleeps a random ``--latency-ms`` range. The random-weight and the small instruct model
rarely write a well-formed tool call on their own, so one forward hook, the same on both sides,
steers them: the call is one added token (``CALL``), drawn with probability ``--call-p`` at the
start of every line, and followed by ``<|im_end|>``; everything else is the model's own sampling.
The number of tool rounds per episode is reported for both sides.

Reported per side: wall time of the rollout batch (the ratio TRL / nopad is the speed-up);
tokens prefilled (nopad: the scheduler's count; TRL: every position of every ``generate`` prefill,
padding included) vs the unique tokens that need a prefill (each group's prompt once, plus every
tool-result token); the share of the wall time the decode loop sat waiting on tools (TRL: tools
run sequentially between generate calls; nopad: time with no runnable sequence left, so decoding
never waits for a tool while another sequence can run).

    python benchmarks/bench_agentic.py              # SmolLM2-135M, 32 prompts x 8 samples
    python benchmarks/bench_agentic.py --prompts 4 --samples 4 --max-tokens 96   # reduced
    python benchmarks/bench_agentic.py --quick      # tiny random model, seconds (a test runs it)
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

import datasets  # noqa: E402

CALL_TEXT = '<tool_call>\n{"name": "lookup", "arguments": {"key": "x"}}\n</tool_call>'
TOPICS = [
    "the boiling point of water",
    "the capital of France",
    "the speed of light",
    "the tallest mountain",
    "the largest ocean",
    "the author of Hamlet",
    "the year the Moon landing happened",
    "pi to 5 digits",
]


def make_lookup(latency_ms: tuple[float, float], seed: int, spent: list[float]):
    """The tool: sleeps a random latency, records it in ``spent``, returns a fixed fact."""
    rng = random.Random(seed)

    def lookup(key: str) -> str:
        """Look a fact up in the knowledge base.

        Args:
            key: What to look up.
        """
        delay = rng.uniform(*latency_ms) / 1000.0
        time.sleep(delay)
        spent.append(delay)
        return f"The entry for {key} says: 42."

    return lookup


def tokenizer_with_tool_call(quick: bool):
    """SmolLM2's tokenizer with TRL's Qwen2.5 tool-calling template and ``CALL_TEXT`` as one token."""
    from tokenizers import AddedToken
    from trl.chat_template_utils import add_response_schema, qwen2_5_chat_template

    from nopad.assets.smollm2 import load_smollm2_tokenizer

    tok = load_smollm2_tokenizer()
    tok.add_tokens([AddedToken(CALL_TEXT, special=False, normalized=False)])
    tok.chat_template = qwen2_5_chat_template
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return add_response_schema(tok)


def load_model(tok, quick: bool):
    if quick:
        import transformers

        config = transformers.LlamaConfig(
            vocab_size=len(tok),
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=4096,
            pad_token_id=tok.pad_token_id,
            eos_token_id=tok.eos_token_id,
            tie_word_embeddings=True,
        )
        torch.manual_seed(0)
        model = transformers.LlamaForCausalLM(config)
    else:
        from nopad.assets.smollm2 import load_smollm2

        model, _ = load_smollm2(torch.float32)
        model.resize_token_embeddings(len(tok))
    model.generation_config.pad_token_id = tok.pad_token_id
    return model.float().train()


def steer(model, tok, call_p: float):
    """After a newline token, the call token with probability ``call_p``; after it, <|im_end|>."""
    newline = tok.convert_tokens_to_ids("Ċ")
    call, eos = tok.convert_tokens_to_ids(CALL_TEXT), tok.eos_token_id
    odds = float(torch.log(torch.tensor(call_p / (1 - call_p))))

    def hook(module, args, kwargs, out):
        ids, keep = kwargs["input_ids"], kwargs.get("logits_to_keep", 0)
        logits = out.logits
        rows = torch.stack(
            [
                ids[b][keep] if isinstance(keep, torch.Tensor) else (ids[b, -keep:] if keep else ids[b])
                for b in range(ids.size(0))
            ]
        )
        rows = rows[:, -logits.size(1) :]
        others = logits.clone()
        others[..., call] = float("-inf")
        call_logit = torch.logsumexp(others.float(), -1).to(logits.dtype) + odds
        fixed = torch.where(rows == newline, call_logit, logits[..., call])
        eos_logit = torch.where(rows == call, torch.full_like(fixed, 1e4), logits[..., eos])
        steered = logits.clone()  # not in place: the logits may be a custom Function's output
        steered[..., call], steered[..., eos] = fixed, eos_logit
        out.logits = steered
        return out

    return model.register_forward_hook(hook, with_kwargs=True)


def count_prefill(model, counter: dict):
    """Positions of every multi-token forward (a ``generate`` prefill), padding included."""

    def pre(module, args, kwargs):
        ids = kwargs.get("input_ids")
        if ids is not None and ids.dim() == 2 and ids.size(1) > 1:
            counter["prefill"] += int(ids.numel())

    return model.register_forward_pre_hook(pre, with_kwargs=True)


def make_trainer(cls, model, tok, tools, args, out_dir: str, **extra):
    from trl import GRPOConfig

    n = args.prompts * args.samples
    config = GRPOConfig(
        output_dir=out_dir,
        per_device_train_batch_size=n,
        num_generations=args.samples,
        steps_per_generation=1,
        max_completion_length=args.max_tokens,
        temperature=1.0,
        top_p=1.0,
        top_k=0,
        max_tool_calling_iterations=args.max_tool_rounds,
        report_to=[],
        use_cpu=True,
        bf16=False,
        save_strategy="no",
        seed=args.seed,
        logging_steps=1,
    )
    prompts = [
        [
            {
                "role": "user",
                "content": f"Use the lookup tool to find {TOPICS[i % len(TOPICS)]}, "
                f"then answer in one sentence. (question {i})",
            }
        ]
        for i in range(args.prompts)
    ]
    reward = lambda completion_ids, **kw: [float(len(c)) for c in completion_ids]  # noqa: E731
    trainer = cls(
        model=model,
        reward_funcs=reward,
        args=config,
        processing_class=tok,
        tools=tools,
        train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
        **extra,
    )
    batch = [{"prompt": p} for p in prompts for _ in range(args.samples)]
    return trainer, batch


def tool_rounds(tool_mask_rows) -> list[int]:
    """Tool rounds per completion: runs of 0 in its tool mask."""
    rounds = []
    for row in tool_mask_rows:
        row = [int(x) for x in row]
        rounds.append(sum(1 for i, m in enumerate(row) if m == 0 and (i == 0 or row[i - 1] == 1)))
    return rounds


def warm_up(trainer, group: list[dict]) -> None:
    """One untimed call on one group with 4-token completions and no tool round: first-call costs
    (nopad's generator and KV cache, which a training run builds once) stay out of the timing."""
    length, rounds = trainer.max_completion_length, trainer.max_tool_calling_iterations
    trainer.max_completion_length, trainer.max_tool_calling_iterations = 4, 0
    try:
        trainer._generate_and_score_completions(group)
    finally:
        trainer.max_completion_length, trainer.max_tool_calling_iterations = length, rounds


def run_side(name, trainer, batch, model, tok, args, spent: list[float]):
    counter = {"prefill": 0}
    handles = [steer(model, tok, args.call_p), count_prefill(model, counter)]
    try:
        warm_up(trainer, batch[: args.samples])
        generator = getattr(trainer.rollout_func, "generator", None)
        if generator is not None:
            generator.reset_stats()  # count the timed batch only
        torch.manual_seed(args.seed)
        spent.clear()
        counter["prefill"] = 0
        t0 = time.perf_counter()
        out = trainer._generate_and_score_completions(batch)
        wall = time.perf_counter() - t0
    finally:
        for h in handles:
            h.remove()
    completion_mask = out["completion_mask"]
    tool_mask = out.get("tool_mask")
    tool_mask = tool_mask * completion_mask if tool_mask is not None else completion_mask
    tool_tokens = int((completion_mask - tool_mask).sum())
    prompt_tokens = [int(m.sum()) for m in out["prompt_mask"]]
    unique = sum(prompt_tokens[:: args.samples]) + tool_tokens  # each group's prompt once + tool results
    rows = [m[c.bool()].tolist() for m, c in zip(tool_mask, completion_mask)]
    rounds = tool_rounds(rows)
    return {
        "side": name,
        "wall_s": wall,
        "prefilled": counter["prefill"],
        "unique_prefill": unique,
        "tool_rounds_mean": sum(rounds) / len(rounds),
        "tool_rounds_hist": _hist(rounds),
        "model_tokens": int(tool_mask.sum()),
        "tool_tokens": tool_tokens,
        "tool_s": sum(spent),
        "rows": len(rounds),
    }


def _hist(values: list[int]) -> dict[int, int]:
    return {k: values.count(k) for k in sorted(set(values))}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="tiny random model, 4 prompts x 4 samples, seconds")
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--samples", type=int, default=8)
    p.add_argument("--max-tokens", type=int, default=256, help="max_completion_length (whole episode)")
    p.add_argument("--max-tool-rounds", type=int, default=4, help="max_tool_calling_iterations")
    p.add_argument("--call-p", type=float, default=0.7, help="probability of a call at a line start")
    p.add_argument("--latency-ms", type=float, nargs=2, default=(10.0, 50.0))
    p.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    if args.quick:
        args.prompts, args.samples, args.max_tokens = 4, 4, 48
        args.latency_ms = (1.0, 5.0)
    if args.threads:
        torch.set_num_threads(args.threads)
    from trl import GRPOTrainer

    from nopad.training.trl.grpo_trainer import NopadGRPOTrainer
    from nopad.training.trl.rollout import nopad_rollout_func

    tok = tokenizer_with_tool_call(args.quick)
    base = load_model(tok, args.quick)
    spent: list[float] = []
    lookup = make_lookup(tuple(args.latency_ms), args.seed, spent)
    import tempfile

    results = {}
    with tempfile.TemporaryDirectory() as out_dir:
        model = copy.deepcopy(base)
        trainer, batch = make_trainer(GRPOTrainer, model, tok, [lookup], args, out_dir)
        results["trl"] = run_side("TRL tool loop", trainer, batch, model, tok, args, spent)
        print(f"TRL tool loop: {results['trl']['wall_s']:.1f} s", file=sys.stderr, flush=True)
        del trainer, model
        model = copy.deepcopy(base)
        rollout = nopad_rollout_func(max_num_batched_tokens=1024)
        trainer, batch = make_trainer(NopadGRPOTrainer, model, tok, [lookup], args, out_dir, rollout_func=rollout)
        results["nopad"] = run_side("nopad episodes", trainer, batch, model, tok, args, spent)
        stats = rollout.last_stats
        results["nopad"]["prefilled"] = int(stats["prefill_tokens"])  # the scheduler's own count
        results["nopad"]["tool_wait_s"] = float(stats.get("tool_wait_s", 0.0))
        results["nopad"]["preemptions"] = int(stats["preemptions"]) + int(stats["paused_preemptions"])
    results["trl"]["tool_wait_s"] = results["trl"]["tool_s"]  # sequential tools: the loop waits on each
    for r in results.values():
        r["prefill_ratio"] = r["prefilled"] / max(r["unique_prefill"], 1)
        r["tool_wait_share"] = r["tool_wait_s"] / r["wall_s"]
    speedup = results["trl"]["wall_s"] / results["nopad"]["wall_s"]
    results["speedup"] = speedup
    model_name = "tiny random Llama (2 layers, hidden 64)" if args.quick else "SmolLM2-135M-Instruct fp32"
    print(
        f"workload: {model_name}, CPU, {torch.get_num_threads()} threads; {args.prompts} prompts x "
        f"{args.samples} samples, max_completion_length={args.max_tokens}, <= {args.max_tool_rounds} tool "
        f"rounds (call p={args.call_p} per line start), tool latency {args.latency_ms[0]:g}-"
        f"{args.latency_ms[1]:g} ms, temperature 1, top_p 1"
    )
    print(
        f"{'side':<16}{'wall s':>9}{'prefilled':>11}{'unique':>9}{'ratio':>7}{'tool wait':>11}"
        f"{'model tok':>11}{'tool tok':>10}  tool rounds per episode"
    )
    for r in (results["trl"], results["nopad"]):
        print(
            f"{r['side']:<16}{r['wall_s']:>9.2f}{r['prefilled']:>11}{r['unique_prefill']:>9}"
            f"{r['prefill_ratio']:>7.2f}{r['tool_wait_share']:>10.1%} {r['model_tokens']:>10}"
            f"{r['tool_tokens']:>10}  mean {r['tool_rounds_mean']:.2f} {r['tool_rounds_hist']}"
        )
    print(f"nopad preemptions: {results['nopad']['preemptions']}")
    print(f"rollout wall time, TRL tool loop / nopad episodes: {speedup:.2f}x")
    return results


if __name__ == "__main__":
    main()
