"""What deciding the attention backend costs per forward: how many times the registry's rule
(``nopad.packing.attention.registry.choose``) runs in one forward of a 30-layer model, and how long
those decisions take, in a training step (a packed row, forward + backward) and in a decode step
(one token per sequence, paged K/V).

A tiny-width 30-layer Llama on CPU, so the decisions are a visible share of the step. Printed:
the rule's runs per forward; the time of one full decision (``choose_backend``: what every layer
paid before the plan) and of one layer's look-up in a made plan; the decisions' cost per forward
(runs x decision + look-ups); the Python function calls of one step (noise-free, unlike the
time); and the median time of the whole step. The script uses only the
public API, so it runs at an older commit as well: run it at both and compare the lines.

    python benchmarks/bench_attention_plan.py            # 30 layers, 40 timed steps
    python benchmarks/bench_attention_plan.py --quick    # 30 layers, 5 timed steps (seconds)
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from functools import partial
from pathlib import Path
from statistics import median

import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from nopad.packing.attention import choose_backend, registry  # noqa: E402
from nopad.packing.hf import use_nopad_attention  # noqa: E402
from nopad.packing.varlen import VarlenMeta  # noqa: E402

BLOCK_SIZE = 16


def tiny_llama(layers: int) -> transformers.PreTrainedModel:
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )
    return transformers.LlamaForCausalLM(config).float()


def count_calls(fn) -> tuple[int, int]:
    """``(runs of registry.choose, Python function calls in all)`` during ``fn()``: counted by code
    object, whichever module calls it; the second is a noise-free measure of the step's Python work."""
    code, runs, calls = registry.choose.__code__, [0], [0]

    def profile(frame, event, arg):
        if event == "call":
            calls[0] += 1
            runs[0] += frame.f_code is code

    sys.setprofile(profile)
    try:
        fn()
    finally:
        sys.setprofile(None)
    return runs[0], calls[0]


def per_call_us(fn, repeats: int) -> float:
    """Microseconds per call: the fastest of 5 batches (the others lost time to other processes)."""
    fn()
    best = float("inf")
    for _ in range(5):
        start = time.perf_counter()
        for _ in range(repeats // 5):
            fn()
        best = min(best, (time.perf_counter() - start) / (repeats // 5))
    return best * 1e6


def lookup_us(repeats: int, **call) -> float | None:
    """One layer's look-up in a made plan (None at a commit without plans)."""
    try:
        from nopad.packing.attention.plan import AttentionPlan
    except ImportError:
        return None
    plan, cpu = AttentionPlan(), torch.device("cpu")
    return per_call_us(lambda: plan.decide(cpu, torch.float32, **call), repeats)


def training_step(model, lengths):
    meta = VarlenMeta.from_lengths(lengths)
    ids = torch.randint(3, 128, (1, meta.total_q))

    def step():
        model.zero_grad(set_to_none=True)
        out = model(input_ids=ids, position_ids=meta.position_ids[None], nopad_meta=meta, use_cache=False)
        out.logits.float().square().mean().backward()

    return step


def decode_step(model, seqs: int, context: int):
    """One decode token per sequence on top of ``context`` cached tokens, K/V in a paged cache."""
    config = model.config
    head_dim = config.hidden_size // config.num_attention_heads
    blocks_per_seq = -(-(context + 1) // BLOCK_SIZE)
    cache = [
        tuple(torch.zeros(seqs * blocks_per_seq, BLOCK_SIZE, config.num_key_value_heads, head_dim) for _ in range(2))
        for _ in range(config.num_hidden_layers)
    ]
    table = torch.arange(seqs * blocks_per_seq, dtype=torch.int32).view(seqs, blocks_per_seq)
    slots = table[:, context // BLOCK_SIZE].long() * BLOCK_SIZE + context % BLOCK_SIZE
    meta = VarlenMeta.for_step([1] * seqs, [context] * seqs, block_table=table, slot_mapping=slots)
    ids = torch.randint(3, 128, (1, seqs))

    def step():
        with torch.no_grad():
            model(
                input_ids=ids,
                position_ids=meta.position_ids[None],
                nopad_meta=meta,
                nopad_kv_cache=cache,
                use_cache=False,
            )

    return step


def median_ms(step, repeats: int) -> float:
    step()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return median(times) * 1e3


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="5 timed steps, fewer micro-benchmark repeats")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    os.environ.pop(registry.BACKEND_ENV, None)
    steps, repeats = (5, 500) if args.quick else (40, 10000)
    model = tiny_llama(args.layers)
    report = {}
    cases = {  # the step, and its layers' call as choose_backend takes it
        "training step": (training_step(model, [48, 32, 64, 40, 72]), dict(grad=True)),
        "decode step": (decode_step(model, seqs=8, context=40), dict(paged=True, block_size=BLOCK_SIZE)),
    }
    with use_nopad_attention(model):
        for name, (step, call) in cases.items():
            step()
            runs, python_calls = count_calls(step)
            decision = per_call_us(partial(choose_backend, "cpu", torch.float32, **call), repeats)
            lookup = lookup_us(repeats, **call)
            cost = runs * decision + (args.layers * lookup if lookup is not None else 0.0)
            report[name] = dict(
                rule_runs=runs,
                python_calls=python_calls,
                decision_us=decision,
                lookup_us=lookup,
                decisions_us=cost,
                step_ms=median_ms(step, steps),
            )
    print(f"{args.layers}-layer Llama (hidden 32) on CPU, {args.threads} thread(s)")
    for name, r in report.items():
        lookup = "-" if r["lookup_us"] is None else f"{r['lookup_us']:.2f} us"
        print(
            f"{name}: registry.choose runs per forward {r['rule_runs']}; "
            f"one decision {r['decision_us']:.1f} us, one plan look-up {lookup}; "
            f"decisions per forward {r['decisions_us']:.0f} us; Python calls per step {r['python_calls']}; "
            f"median step {r['step_ms']:.2f} ms"
        )
    return report


if __name__ == "__main__":
    main()
