"""Output tokens/s of nopad's in-flight generator against HF transformers, measured in ONE run.

Workload 1 (chat): N chat prompts of varied length, max_new_tokens ~ U[16, 256] (fixed seed),
greedy, ignore_eos, so every system generates exactly the same number of tokens per request.
Only the requested output tokens count.
  - HF `generate`, static left-padded batches of 16 in arrival order; each batch runs to its
    longest request (the extra tokens are computed but not counted).
  - HF continuous batching (`init_continuous_batching` / `add_request` / `get_result`, sdpa).
  - nopad `Generator`.
Workload 2 (GRPO-shaped): P prompts x n samples, fixed new tokens, temperature 1.0, seeded:
prefill tokens computed vs naive (n * sum of prompt lengths) and tokens/s vs HF
`generate(num_return_sequences=n, do_sample=True)` and HF continuous batching.

Also: greedy agreement of nopad with HF (a fast but wrong generator is worthless), a PNG of
batch-slot occupancy per forward step, static vs in-flight, in benchmarks/out/, and where nopad's
time goes on each workload (a second, instrumented run: linear layers, attention, sampling, the rest; HF
generate's time over nopad's linear time is the ratio's ceiling if the rest were free).

    python benchmarks/bench_generate.py            # full run (~10 min on 2 idle cores)
    python benchmarks/bench_generate.py --quick    # smoke run: a tiny random Llama
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from statistics import median_high as median  # the upper middle of an even count, a measured step

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from benchmarks._workloads import (  # noqa: E402
    chat_workload,
    grpo_workload,
    prefill_workload,
    static_batch_occupancy,
    tiny_llama,
)

OUT_DIR = Path(__file__).resolve().parent / "out"
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


@dataclass
class Run:
    """One system on one workload: useful output tokens, wall time, and what it computed."""

    name: str
    tokens: int
    seconds: float
    outputs: list[list[int]] = field(default_factory=list)
    notes: str = ""
    prefill_tokens: int | None = None

    @property
    def tok_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else float("nan")


# ---------------------------------------------------------------------------------------------
# HF transformers peers


def _left_pad(prompts: list[list[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    return ids, mask


@torch.no_grad()
def hf_generate(model, prompts, max_new_tokens: int, pad_id: int, **sampling) -> list[list[int]]:
    """One padded ``model.generate`` call that never stops early (eos_token_id=-1 disables the
    EOS stopping criterion without masking the EOS logit, like ``ignore_eos``)."""
    ids, mask = (t.to(model.device) for t in _left_pad(prompts, pad_id))
    out = model.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=max_new_tokens,
        min_new_tokens=0,
        eos_token_id=-1,
        pad_token_id=pad_id,
        **sampling,
    )
    return out[:, ids.shape[1] :].tolist()


def run_hf_static(model, prompts, max_new, batch_size: int, pad_id: int) -> Run:
    outputs, computed = [], 0
    start = time.perf_counter()
    for b in range(0, len(prompts), batch_size):
        ks = max_new[b : b + batch_size]
        rows = hf_generate(model, prompts[b : b + batch_size], max(ks), pad_id, do_sample=False)
        outputs += [row[:k] for row, k in zip(rows, ks)]
        _check_lengths("HF generate", outputs[b:], ks)
        computed += len(ks) * max(ks)
    seconds = time.perf_counter() - start
    useful = sum(max_new)
    return Run(
        f"HF generate, static batches of {batch_size}",
        useful,
        seconds,
        outputs,
        notes=f"computed {computed} tokens, {useful / computed:.0%} useful",
    )


def run_hf_cb(
    model,
    prompts,
    max_new,
    *,
    gen_config,
    max_batch_tokens: int,
    max_seqs: int,
    num_return_sequences: int = 1,
    seed: int | None = None,
) -> Run:
    """HF continuous batching, sized to the workload (its default reserves 60% of RAM on CPU)."""
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    page = 256
    pages_per_request = [math.ceil((len(p) + k) / page) for p, k in zip(prompts, max_new)]
    cb_config = ContinuousBatchingConfig(
        page_size=page,
        num_blocks=sum(pages_per_request) * num_return_sequences + 4,
        max_batch_tokens=max_batch_tokens,
        max_requests_per_batch=max_seqs,
        seed=seed,
    )
    manager = model.init_continuous_batching(generation_config=gen_config, continuous_batching_config=cb_config)
    manager.start()
    try:
        _hf_cb_collect(manager, [prompts[0]], [4], 1 * num_return_sequences)  # warm-up
        start = time.perf_counter()
        results = _hf_cb_collect(manager, prompts, max_new, len(prompts) * num_return_sequences)
        seconds = time.perf_counter() - start
    finally:
        manager.stop(block=True)
        manager.destroy()
    outputs = [results[rid] for rid in sorted(results, key=_cb_order)]
    _check_lengths("HF CB", outputs, [k for k in max_new for _ in range(num_return_sequences)])
    return Run(
        "HF continuous batching (sdpa)",
        sum(map(len, outputs)),
        seconds,
        outputs,
        notes=f"page {page}, {cb_config.num_blocks} pages, budget {max_batch_tokens}",
    )


def _hf_cb_collect(manager, prompts, max_new, expected: int) -> dict[str, list[int]]:
    first = manager._request_counter
    for p, k in zip(prompts, max_new):
        manager.add_request(p, max_new_tokens=k, eos_token_id=-1)  # -1: never stop at EOS
    results = {}
    while len(results) < expected:
        r = manager.get_result(timeout=1)
        if r is None:
            if not manager.is_running():
                raise RuntimeError("HF continuous batching thread died")
            continue
        if r.error is not None:
            raise RuntimeError(f"HF continuous batching request {r.request_id} failed: {r.error}")
        if r.is_finished():
            results[r.request_id] = r.generated_tokens
    return {rid: toks for rid, toks in results.items() if _cb_order(rid)[0] >= first}


def _cb_order(request_id: str) -> tuple[int, int]:
    """``req_12`` / ``req_12__child#3`` -> (12, child index), the parent first."""
    parent, _, child = request_id.partition("__child#")
    return int(parent.split("_")[1]), int(child) + 1 if child else 0


# ---------------------------------------------------------------------------------------------
# nopad


def make_generator(model, tok, prompts, max_new, n: int, args):
    from nopad.inference.generator import Generator

    blocks = sum(math.ceil((len(p) + k) / args.block_size) for p, k in zip(prompts, max_new)) * n
    return Generator(
        model,
        tok,
        block_size=args.block_size,
        max_num_batched_tokens=args.max_batch_tokens,
        max_num_seqs=args.max_seqs,
        num_blocks=blocks + 64,
        compile_decode=getattr(args, "compile_decode", False),
        overlap=getattr(args, "overlap", None),
    )


def run_nopad(model, tok, prompts, max_new, args, warmed=lambda: None) -> tuple[Run, list[int]]:
    """The timed nopad run; ``warmed()`` is called between the warm-up and the timed part."""
    from nopad.inference.sampling_params import SamplingParams

    gen = make_generator(model, tok, prompts, max_new, 1, args)
    gen.generate([prompts[0]], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))  # warm-up
    gen.reset_stats()
    warmed()
    params = [SamplingParams(temperature=0, max_tokens=k, ignore_eos=True) for k in max_new]
    start = time.perf_counter()
    results = gen.generate(prompts, params)
    seconds = time.perf_counter() - start
    stats = gen.stats()
    outputs = [r.outputs[0].token_ids for r in results]
    _check_lengths("nopad", outputs, max_new)
    hits = stats["prefix_cache_hit_tokens"]
    notes = (
        f"{stats['steps']} forward steps, block {args.block_size}, budget {args.max_batch_tokens}, "
        f"{stats['preemptions']} preemptions, prefix-cache hits {hits} tokens"
    )
    name = "nopad Generator (in-flight)"
    if gen.overlap:
        name = "nopad Generator (in-flight, overlap)"
        notes += (
            f"; overlap: {stats['overlap_steps']} steps launched before the one before was read back, "
            f"{100 * stats['overlap_breaks'] / max(stats['steps'], 1):.1f} breaks per 100 steps, "
            f"{stats['overlap_wasted_tokens']} tokens computed past a stop"
        )
    return Run(name, sum(max_new), seconds, outputs, notes), stats["seqs_per_step"]


def run_nopad_grpo(model, tok, prompts, args) -> Run:
    from nopad.inference.sampling_params import SamplingParams

    n, new = args.grpo_n, args.grpo_new_tokens
    gen = make_generator(model, tok, prompts, [new] * len(prompts), n, args)
    gen.generate([prompts[0][:8]], SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))  # warm-up
    gen.reset_stats()
    params = [
        SamplingParams(temperature=1.0, max_tokens=new, ignore_eos=True, n=n, seed=args.seed + i)
        for i in range(len(prompts))
    ]
    start = time.perf_counter()
    results = gen.generate(prompts, params)
    seconds = time.perf_counter() - start
    stats = gen.stats()
    outputs = [o.token_ids for r in results for o in r.outputs]
    _check_lengths("nopad", outputs, [new] * (n * len(prompts)))
    notes = (
        f"{stats['steps']} forward steps, {stats['preemptions']} preemptions, "
        f"prefix-cache hit tokens {stats['prefix_cache_hit_tokens']}"
    )
    return Run(
        "nopad Generator (n shares the prompt)",
        len(outputs) * new,
        seconds,
        outputs,
        notes,
        prefill_tokens=stats["prefill_tokens"],
    )


def _check_lengths(name: str, outputs: list[list[int]], expected: list[int]) -> None:
    got = [len(o) for o in outputs]
    if got != list(expected):
        first = next(i for i, (a, b) in enumerate(zip(got, expected)) if a != b)
        raise RuntimeError(
            f"{name} generated {sum(got)} tokens, expected {sum(expected)} (first mismatch at request {first})"
        )


# ---------------------------------------------------------------------------------------------
# Correctness, plot, table


def agreement(ref: list[list[int]], out: list[list[int]]) -> tuple[int, float]:
    """(identical sequences, fraction of tokens before the first divergence) of ``out`` vs ``ref``."""
    same, prefix, total = 0, 0, 0
    for a, b in zip(ref, out):
        same += a == b
        k = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        prefix += k
        total += len(a)
    return same, prefix / max(total, 1)


def plot_occupancy(static_held, static_useful, inflight, batch_size: int, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(10, 4))
    ax.plot(
        range(len(static_held)),
        static_held,
        color="0.6",
        lw=1,
        ls="--",
        drawstyle="steps-post",
        label=f"static batches of {batch_size}: slots held",
    )
    ax.plot(
        range(len(static_useful)),
        static_useful,
        color="tab:red",
        lw=1.2,
        drawstyle="steps-post",
        label=f"static: sequences doing useful work ({len(static_useful)} steps)",
    )
    if inflight:
        ax.plot(
            range(len(inflight)),
            inflight,
            color="tab:blue",
            lw=1.2,
            drawstyle="steps-post",
            label=f"nopad in-flight: sequences per step ({len(inflight)} steps)",
        )
    ax.set_xlabel("forward step")
    ax.set_ylabel("sequences in the step")
    ax.set_title("Batch slot occupancy per forward step, chat workload")
    ax.legend(loc="upper right", fontsize=8)
    ax.set_ylim(bottom=0)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def print_table(title: str, runs: list[Run], peers: list[Run], extra: dict[str, str] | None = None) -> None:
    """One row per system; a ratio column per peer (tok/s of the row / tok/s of the peer)."""
    cols = [f"vs {p.name.split(',')[0].split(' (')[0]}" for p in peers]
    head = f"{'system':<40} {'tokens':>7} {'s':>7} {'tok/s':>7}" + "".join(f" {c:>{len(c)}}" for c in cols)
    print(f"\n{title}\n{head}\n{'-' * len(head)}")
    for r in runs:
        ratios = "".join(f" {r.tok_s / p.tok_s:>{len(c) - 1}.2f}x" for p, c in zip(peers, cols))
        print(f"{r.name:<40} {r.tokens:>7} {r.seconds:>7.1f} {r.tok_s:>7.1f}{ratios}")
        notes = "; ".join(x for x in (r.notes, (extra or {}).get(r.name, "")) if x)
        if notes:
            print(f"    {notes}")


def print_env(args) -> None:
    import transformers

    load = os.getloadavg() if hasattr(os, "getloadavg") else ("?",)
    print(
        f"torch {torch.__version__}, transformers {transformers.__version__}, python "
        f"{platform.python_version()}, {platform.machine()}, {os.cpu_count()} CPUs, "
        f"torch threads {torch.get_num_threads()}, load average {load[0]:.2f} at start"
    )
    print(f"model {args.model_name}, CPU, dtypes {', '.join(args.dtypes)}; seed {args.seed}")


# ---------------------------------------------------------------------------------------------


def load_model(args):
    if args.tiny_model:  # for the smoke test: random weights, real tokenizer and chat template
        from nopad.assets.smollm2 import load_smollm2_tokenizer

        tok = load_smollm2_tokenizer()
        args.model_name = "tiny random Llama (smoke test)"
        return tiny_llama(tokenizer=tok).eval(), tok
    from nopad.assets.smollm2 import load_smollm2

    args.model_name = "SmolLM2-135M-Instruct"
    return load_smollm2()


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="smoke run: a tiny random Llama, small workloads")
    p.add_argument("--num-prompts", type=int, default=64)
    p.add_argument("--min-new-tokens", type=int, default=16)
    p.add_argument("--max-new-tokens", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=16, help="HF generate static batch size")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--block-size", type=int, default=16, help="nopad KV block size")
    p.add_argument("--max-batch-tokens", type=int, default=512, help="token budget per step (nopad, HF CB)")
    p.add_argument("--max-seqs", type=int, default=64, help="max sequences per step (nopad, HF CB)")
    p.add_argument("--grpo-prompts", type=int, default=8)
    p.add_argument("--grpo-n", type=int, default=8)
    p.add_argument("--grpo-new-tokens", type=int, default=128)
    p.add_argument("--check-prompts", type=int, default=4, help="prompts re-run alone with HF for agreement")
    p.add_argument(
        "--overlap", action="store_true", help="nopad with Generator(overlap=True); its notes count the pipeline breaks"
    )
    p.add_argument("--skip-hf-generate", action="store_true")
    p.add_argument("--skip-hf-cb", action="store_true")
    p.add_argument("--skip-grpo", action="store_true")
    p.add_argument(
        "--dtypes",
        type=lambda v: v.split(","),
        default=["fp32", "bf16"],
        help="comma-separated, each a full pass: fp32, bf16, fp16",
    )
    p.add_argument("--prefill-prompts", type=int, default=48)
    p.add_argument("--prefill-min-prompt", type=int, default=256)
    p.add_argument("--prefill-max-prompt", type=int, default=1024)
    p.add_argument("--prefill-min-new", type=int, default=8)
    p.add_argument("--prefill-max-new", type=int, default=32)
    p.add_argument("--skip-prefill", action="store_true")
    p.add_argument(
        "--skip-breakdown", action="store_true", help="skip the second, instrumented nopad run that splits its time"
    )
    p.add_argument("--floor-batch", type=int, default=48, help="sequences in the timed decode step")
    p.add_argument("--floor-context", type=int, default=256, help="prompt tokens of each of them")
    p.add_argument("--floor-steps", type=int, default=10)
    p.add_argument("--skip-floor", action="store_true")
    p.add_argument(
        "--no-floor-compiled",
        dest="floor_compiled",
        action="store_false",
        help="skip timing the compiled decode step (its first compilation takes ~1-2 min)",
    )
    p.add_argument("--tiny-model", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--out-dir", type=Path, default=OUT_DIR)
    args = p.parse_args(argv)
    if args.quick:
        args.tiny_model = True
        args.num_prompts, args.min_new_tokens, args.max_new_tokens = 8, 8, 32
        args.batch_size, args.grpo_prompts, args.grpo_n, args.grpo_new_tokens = 4, 2, 4, 16
        args.check_prompts = 2
        args.prefill_prompts, args.prefill_min_prompt, args.prefill_max_prompt = 4, 64, 256
        args.prefill_min_new, args.prefill_max_new = 4, 8
        args.floor_batch, args.floor_context, args.floor_steps = 8, 48, 3
        args.floor_compiled = False
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        p.error(f"--dtypes: unknown {unknown}; choose from {sorted(DTYPES)}")
    return args


def run_workload(label: str, model, tok, prompts, max_new, args, report: dict, plot: bool) -> None:
    """One greedy workload: nopad vs HF generate (static batches) vs HF continuous batching."""
    import transformers

    pad_id = tok.pad_token_id
    lens = [len(p) for p in prompts]
    print(
        f"\n{label}: {len(prompts)} prompts of {min(lens)}-{max(lens)} tokens (mean "
        f"{sum(lens) / len(lens):.0f}, sum {sum(lens)}), max_new_tokens {min(max_new)}-{max(max_new)} "
        f"(sum {sum(max_new)}), greedy, ignore_eos"
    )
    runs: list[Run] = []
    hf_static = hf_cb = None
    print("running nopad ...", flush=True)
    nopad, occupancy = run_nopad(model, tok, prompts, max_new, args)
    runs.append(nopad)
    if not args.skip_hf_generate:
        print("running HF generate (static batches) ...", flush=True)
        hf_generate(model, [prompts[0]], 2, pad_id, do_sample=False)  # warm-up
        hf_static = run_hf_static(model, prompts, max_new, args.batch_size, pad_id)
        runs.insert(0, hf_static)
    if not args.skip_hf_cb:
        print("running HF continuous batching ...", flush=True)
        cfg = transformers.GenerationConfig(do_sample=False, eos_token_id=-1, pad_token_id=pad_id)
        hf_cb = run_hf_cb(
            model, prompts, max_new, gen_config=cfg, max_batch_tokens=args.max_batch_tokens, max_seqs=args.max_seqs
        )
        runs.insert(len(runs) - 1, hf_cb)
    peers = [r for r in (hf_static, hf_cb) if r is not None]
    print_table(f"{label}, output tokens/s", runs, peers)
    report["workloads"][label] = {r.name: {"tokens": r.tokens, "seconds": r.seconds, "tok_s": r.tok_s} for r in runs}

    print("Greedy agreement of nopad (identical sequences; tokens before first divergence):")
    for ref in peers:
        same, frac = agreement(ref.outputs, nopad.outputs)
        print(f"  vs {ref.name:<42} {same}/{len(prompts)} sequences, {frac:.1%} of tokens")
    k = min(args.check_prompts, len(prompts))
    if k:
        alone = [
            hf_generate(model, [p], min(m, 64), pad_id, do_sample=False)[0] for p, m in zip(prompts[:k], max_new[:k])
        ]
        same, frac = agreement(alone, [o[: len(a)] for o, a in zip(nopad.outputs, alone)])
        name = "HF generate, each prompt alone (<=64 tok)"
        print(f"  vs {name:<42} {same}/{k} sequences, {frac:.1%} of tokens")
        report["greedy_match_alone"][label] = {"sequences": f"{same}/{k}", "token_fraction": frac}
    if not args.skip_breakdown:
        report["breakdown"][label] = print_breakdown(model, tok, prompts, max_new, args, hf_static)

    if plot:
        held, useful = static_batch_occupancy(max_new, args.batch_size)
        path = args.out_dir / f"generate_occupancy_{report['dtype']}.png"
        plot_occupancy(held, useful, occupancy, args.batch_size, path)
        print(
            f"static batching: {len(useful)} steps, mean {sum(useful) / len(useful):.1f} useful of "
            f"{sum(held) / len(held):.1f} held slots; nopad: {len(occupancy)} steps, mean "
            f"{sum(occupancy) / max(len(occupancy), 1):.1f} sequences per step; plot: {path}"
        )


def run_grpo(model, tok, args, report: dict) -> None:
    import transformers

    pad_id = tok.pad_token_id
    gp = grpo_workload(tok, args.grpo_prompts)
    n, new = args.grpo_n, args.grpo_new_tokens
    naive = n * sum(len(p) for p in gp)
    print(f"\nGRPO workload: {len(gp)} prompts x n={n}, {new} new tokens, temperature 1.0, seeded")
    print("running nopad ...", flush=True)
    g_runs = [run_nopad_grpo(model, tok, gp, args)]
    g_peers = []
    if not args.skip_hf_generate:
        print("running HF generate (num_return_sequences) ...", flush=True)
        torch.manual_seed(args.seed)
        start = time.perf_counter()
        rows = hf_generate(
            model, gp, new, pad_id, do_sample=True, temperature=1.0, top_k=0, top_p=1.0, num_return_sequences=n
        )
        hf_g = Run(
            f"HF generate, num_return_sequences={n}",
            len(rows) * new,
            time.perf_counter() - start,
            rows,
            prefill_tokens=len(rows) * max(len(p) for p in gp),
        )
        g_peers.append(hf_g)
    if not args.skip_hf_cb:
        print("running HF continuous batching (num_return_sequences) ...", flush=True)
        cfg = transformers.GenerationConfig(
            do_sample=True,
            temperature=1.0,
            top_k=0,
            top_p=1.0,
            num_return_sequences=n,
            eos_token_id=-1,
            pad_token_id=pad_id,
        )
        g_peers.append(
            run_hf_cb(
                model,
                gp,
                [new] * len(gp),
                gen_config=cfg,
                max_batch_tokens=args.max_batch_tokens,
                max_seqs=args.max_seqs,
                num_return_sequences=n,
                seed=args.seed,
            )
        )
    extra = {
        r.name: f"prefill tokens computed {r.prefill_tokens} = {r.prefill_tokens / naive:.3f} of naive {naive}"
        for r in g_runs + g_peers
        if r.prefill_tokens is not None
    }
    print_table("GRPO groups, output tokens/s", g_peers + g_runs, g_peers, extra)
    report["grpo"] = {
        r.name: {"tokens": r.tokens, "seconds": r.seconds, "tok_s": r.tok_s, "prefill_tokens": r.prefill_tokens}
        for r in g_peers + g_runs
    }
    report["grpo"]["naive_prefill_tokens"] = naive


# ---------------------------------------------------------------------------------------------
# The decode step against its floor


def read_bandwidth(threads: int, nbytes: int = 1 << 30, repeats: int = 5) -> float:
    """Bytes/s of reading a buffer far larger than the caches once (a multi-threaded sum over it,
    best of ``repeats``): the rate any decode step must read its K/V at."""
    buf = torch.ones(nbytes // 4, dtype=torch.float32)
    best = float("inf")
    for _ in range(repeats + 1):
        start = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - start)
    del buf
    return nbytes / best


def bare_linear_pass(model, rows: int):
    """A function timing one pass of every ``nn.Linear`` of the model (lm_head included) on
    ``rows`` rows, as bare ``F.linear`` calls in the weights' dtype: the step's matmul floor."""
    linears = [m for m in model.modules() if isinstance(m, torch.nn.Linear)]
    inputs = {}
    for m in linears:
        key = (m.in_features, m.weight.dtype)
        inputs.setdefault(key, torch.randn(rows, m.in_features, dtype=m.weight.dtype))

    def timed() -> float:
        with torch.no_grad():
            start = time.perf_counter()
            for m in linears:
                torch.nn.functional.linear(inputs[(m.in_features, m.weight.dtype)], m.weight, m.bias)
            return time.perf_counter() - start

    timed()  # warm-up
    return timed


def print_breakdown(model, tok, prompts, max_new, args, hf_static: Run | None) -> dict:
    """Where nopad's time goes on a workload: a second nopad run, with the model's linear layers and
    nopad's attention calls timed. The linear layers are the same GEMMs HF runs (on fewer tokens), so
    HF generate's time over nopad's linear time is the most this workload's ratio could be if
    everything else took no time."""
    with _LinearTimer() as linears, _attention_timer() as attention, _sampler_timer() as sampler:

        def zero_timers():  # the warm-up is not part of the timed run
            linears.seconds = attention.seconds = sampler.seconds = 0.0

        run, _ = run_nopad(model, tok, prompts, max_new, args, warmed=zero_timers)
    total = run.seconds
    other = total - linears.seconds - attention.seconds - sampler.seconds
    print(
        f"nopad's time, instrumented run: {total:.1f} s = linear layers {linears.seconds:.1f} s "
        f"({linears.seconds / total:.0%}) + attention {attention.seconds:.1f} s "
        f"({attention.seconds / total:.0%}) + sampling {sampler.seconds:.1f} s "
        f"({sampler.seconds / total:.0%}) + everything else {other:.1f} s ({other / total:.0%})"
    )
    out = {
        "seconds": total,
        "linear_s": linears.seconds,
        "attention_s": attention.seconds,
        "sampling_s": sampler.seconds,
    }
    if hf_static is not None:
        bound = hf_static.seconds / linears.seconds
        print(
            f"  HF generate's time / nopad's linear-layer time: {bound:.2f}x (the ratio's ceiling "
            f"if attention and everything else were free)"
        )
        out["ceiling_vs_hf_generate"] = bound
    return out


class _LinearTimer:
    """Wall time spent inside the model's ``nn.Linear`` layers (their forward, patched)."""

    def __enter__(self):
        self.seconds, self.original = 0.0, torch.nn.Linear.forward

        def timed(module, x):
            start = time.perf_counter()
            try:
                return self.original(module, x)
            finally:
                self.seconds += time.perf_counter() - start

        torch.nn.Linear.forward = timed
        return self

    def __exit__(self, *exc):
        torch.nn.Linear.forward = self.original
        return False


class _CallTimer:
    """Wall time spent in calls of ``module.name``, patched where its one caller looks it up."""

    def __init__(self, module_name: str, name: str):
        import importlib

        self.module, self.name, self.seconds = importlib.import_module(module_name), name, 0.0
        self.original = getattr(self.module, name)

    def __enter__(self):
        def timed(*a, **kw):
            start = time.perf_counter()
            try:
                return self.original(*a, **kw)
            finally:
                self.seconds += time.perf_counter() - start

        setattr(self.module, self.name, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.module, self.name, self.original)
        return False


def _attention_timer() -> _CallTimer:
    """nopad's attention calls (the one call site in nopad.packing.hf.attention)."""
    return _CallTimer("nopad.packing.hf.attention", "varlen_attention")


def _sampler_timer() -> _CallTimer:
    """The sampler's work (``sample_on_device``, where ``Sampler.draw`` calls it; the read-back after
    it is a few ``tolist`` calls)."""
    return _CallTimer("nopad.inference.sampler", "sample_on_device")


def time_decode_steps(model, tok, prompts: list[list[int]], args, bare, **gen_kwargs):
    """Per timed step: seconds of one decode step of all ``prompts`` (after their prefill and two
    warm-up decode steps, which also compile with ``compile_decode``), of its attention calls, and
    of the bare linear pass ``bare()`` timed right before it. Pairing them keeps the ratio honest on
    a machine whose speed drifts (measured here: bare linears 127 ms in one run, 241 in another)."""
    from nopad.inference.generator import Generator
    from nopad.inference.sampling_params import SamplingParams

    steps, batch, context = args.floor_steps, len(prompts), len(prompts[0])
    gen = Generator(
        model,
        tok,
        block_size=args.block_size,
        max_num_batched_tokens=max(args.max_batch_tokens, 2048),
        max_num_seqs=max(batch, args.max_seqs),
        num_blocks=batch * math.ceil((context + 2 * steps + 8) / args.block_size) + 8,
        **gen_kwargs,
    )
    ids = [
        gen.add_request(p, SamplingParams(temperature=0, max_tokens=2 * steps + 8, ignore_eos=True)) for p in prompts
    ]
    while gen.stats()["decode_tokens"] < 2 * batch:
        gen.step()  # prefill every prompt, then two decode steps as warm-up
    times, attn, linear = [], [], []
    for _ in range(steps):
        linear.append(bare())
        with _attention_timer() as timer:
            start = time.perf_counter()
            gen.step()
            times.append(time.perf_counter() - start)
        attn.append(timer.seconds)
    for rid in ids:
        gen.abort(rid)
    gen.release()
    return times, attn, linear


def decode_floor(model, tok, args, report: dict) -> None:
    """Time nopad's decode step at ``--floor-batch`` sequences of ``--floor-context`` tokens against
    its floor: the bare linear layers at that batch plus reading the step's K/V once at the
    machine's measured read bandwidth. Eager (the default) and with ``compile_decode=True``
    (torch.compile fuses the model's small ops around the attention kernel)."""
    batch, context, steps = args.floor_batch, args.floor_context, args.floor_steps
    config = model.config
    dtype = next(model.parameters()).dtype
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    bw = read_bandwidth(args.threads)
    bare = bare_linear_pass(model, batch)
    g = torch.Generator().manual_seed(args.seed)
    prompts = [torch.randint(100, config.vocab_size - 100, (context,), generator=g).tolist() for _ in range(batch)]
    times, attn, linear = time_decode_steps(model, tok, prompts, args, bare)
    ctx = context + 3 + steps // 2  # mean keys per sequence during the timed steps
    per_key = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * dtype.itemsize  # K and V
    kv_bytes = batch * ctx * per_key
    kv_s = kv_bytes / bw
    step_s, attn_s, linear_s = median(times), median(attn), median(linear)
    floor = linear_s + kv_s
    ratio = median([t / (lin + kv_s) for t, lin in zip(times, linear)])  # each step against its own floor
    print(
        f"\nDecode step, {batch} sequences x ~{ctx} keys, {str(dtype).replace('torch.', '')} "
        f"(medians of {steps} steps, each right after a timed bare-linear pass):"
    )
    print(
        f"  measured read bandwidth {bw / 1e9:.1f} GB/s; K/V read per step {kv_bytes / 1e6:.0f} MB "
        f"-> {kv_s * 1e3:.1f} ms at that rate"
    )
    print(
        f"  bare linear layers at {batch} rows: {linear_s * 1e3:.1f} ms "
        f"(range {min(linear) * 1e3:.1f}-{max(linear) * 1e3:.1f})"
    )
    print(
        f"  floor {floor * 1e3:.1f} ms | nopad step {step_s * 1e3:.1f} ms = {ratio:.2f}x the "
        f"floor (median of per-step ratios; target <= 1.3x)"
    )
    print(
        f"  of the step: attention {attn_s * 1e3:.1f} ms ({kv_bytes / attn_s / 1e9:.1f} GB/s = "
        f"{kv_bytes / attn_s / bw:.0%} of bandwidth), everything else {(step_s - attn_s) * 1e3:.1f} ms "
        f"(linear floor {linear_s * 1e3:.1f} ms)"
    )
    report["decode_floor"] = {
        "batch": batch,
        "keys": ctx,
        "bandwidth_gb_s": bw / 1e9,
        "kv_mb": kv_bytes / 1e6,
        "linear_ms": linear_s * 1e3,
        "floor_ms": floor * 1e3,
        "step_ms": step_s * 1e3,
        "attention_ms": attn_s * 1e3,
        "ratio": ratio,
    }
    if args.floor_compiled:
        print("  compiling the decode step (compile_decode=True) ...", flush=True)
        times, _, linear = time_decode_steps(model, tok, prompts, args, bare, compile_decode=True)
        compiled_ratio = median([t / (lin + kv_s) for t, lin in zip(times, linear)])
        print(
            f"  nopad step with compile_decode=True {median(times) * 1e3:.1f} ms = {compiled_ratio:.2f}x "
            f"the floor (bare linears {median(linear) * 1e3:.1f} ms alongside)"
        )
        report["decode_floor"].update(compiled_step_ms=median(times) * 1e3, compiled_ratio=compiled_ratio)


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    import transformers

    transformers.logging.set_verbosity_error()  # eos_token_id=-1 warns on every generate call
    model, tok = load_model(args)
    print_env(args)
    report: dict = {"args": {k: str(v) for k, v in vars(args).items()}}
    for name in args.dtypes:
        dtype = DTYPES[name]
        model = model.to(dtype)
        print(f"\n{'=' * 30} {name}: weights, activations and KV cache in {name} {'=' * 30}")
        section = report[name] = {"dtype": name, "workloads": {}, "greedy_match_alone": {}, "breakdown": {}}
        prompts, max_new = chat_workload(tok, args.num_prompts, args.min_new_tokens, args.max_new_tokens, args.seed)
        run_workload("Workload 1: chat", model, tok, prompts, max_new, args, section, plot=True)
        if not args.skip_prefill:
            prompts, max_new = prefill_workload(
                tok,
                args.prefill_prompts,
                args.prefill_min_prompt,
                args.prefill_max_prompt,
                args.prefill_min_new,
                args.prefill_max_new,
                args.seed,
            )
            run_workload("Workload 2: prefill-heavy", model, tok, prompts, max_new, args, section, plot=False)
        if not args.skip_grpo:
            run_grpo(model, tok, args, section)
        if not args.skip_floor:
            decode_floor(model, tok, args, section)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    (args.out_dir / "bench_generate.json").write_text(json.dumps(report, indent=2))
    return report


if __name__ == "__main__":
    main()
