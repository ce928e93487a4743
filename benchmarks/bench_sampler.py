"""Does keeping the sampler's buffers across steps pay? Generator decode steps with the sampler's
rows x vocab scratch reused (nopad's default) against fresh scratch every step (what the sampler
did before: the allocator hands the memory back to the OS at the end of a step and the next step
faults it in again), measured in ONE run with the two ways interleaved step by step.

SmolLM2-135M-Instruct, ``--seqs`` chat prompts decoding together; greedy, temperature 1, and
temperature 0.7 with top-p 0.9; fp32 and bf16. Printed per case: median step time, median time in
the sampler and page faults per step (minor faults from ``getrusage``) of each way, and the ratio.
Then a greedy step's argmax over the same rows x vocab logits: torch's against the sampler's (numpy's
on CPU), the same indices; a repetition penalty from a dense mask against (row, token) pairs, the same
bits. ``--compiled-pick``: the greedy pick (argmax and the token's log-prob)
as one ``torch.compile``d function, against the sampler's eager ops on the same logits: whether the
sampler belongs inside a compiled decode step on this device (#53 item 3).

    python benchmarks/bench_sampler.py            # 48 sequences, 10 steps each way (~2 min)
    python benchmarks/bench_sampler.py --quick    # a tiny random Llama, 8 sequences, 3 steps each way
"""

from __future__ import annotations

import argparse
import os
import resource
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from benchmarks._workloads import chat_workload  # noqa: E402
from benchmarks.bench_generate import DTYPES, _sampler_timer, load_model  # noqa: E402

CASES = {
    "greedy": dict(temperature=0.0),
    "T=1": dict(temperature=1.0),
    "T=0.7 top-p 0.9": dict(temperature=0.7, top_p=0.9),
}


def minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def time_steps(model, tok, prompts, params: dict, steps: int) -> dict[str, dict[str, float]]:
    """Decode steps of all ``prompts`` (after their prefill), alternating reused and fresh sampler
    buffers; medians per way."""
    from nopad.inference.generator import Generator
    from nopad.inference.sampler_memory import SamplerBuffers
    from nopad.inference.sampling_params import SamplingParams

    gen = Generator(
        model,
        tok,
        max_num_batched_tokens=4096,
        max_num_seqs=len(prompts),
        num_blocks=len(prompts) * (-(-(max(map(len, prompts)) + 2 * steps + 8) // 16)) + 8,
    )
    ids = [
        gen.add_request(p, SamplingParams(max_tokens=2 * steps + 4, ignore_eos=True, seed=i, **params))
        for i, p in enumerate(prompts)
    ]
    while gen.stats()["decode_tokens"] < 2 * len(prompts):
        gen.step()  # prefill, then two decode steps: every sequence decodes from here on
    kept = gen.sampler.buffers
    got: dict[str, dict[str, list[float]]] = {
        w: {"step_ms": [], "sampler_ms": [], "faults": []} for w in ("reused", "fresh")
    }
    for i in range(2 * steps):
        way = "reused" if i % 2 else "fresh"
        gen.sampler.buffers = kept if way == "reused" else SamplerBuffers()
        with _sampler_timer() as sampler:
            faults, start = minor_faults(), time.perf_counter()
            gen.step()
            seconds = time.perf_counter() - start
        got[way]["step_ms"].append(seconds * 1e3)
        got[way]["sampler_ms"].append(sampler.seconds * 1e3)
        got[way]["faults"].append(minor_faults() - faults)
    for rid in ids:
        gen.abort(rid)
    gen.release()
    return {way: {k: median(v) for k, v in parts.items()} for way, parts in got.items()}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a tiny random Llama, 8 sequences, 3 steps each way")
    p.add_argument("--seqs", type=int, default=48, help="sequences decoding together")
    p.add_argument("--steps", type=int, default=10, help="timed steps of each way")
    p.add_argument("--dtypes", type=lambda v: v.split(","), default=["fp32", "bf16"])
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument("--tiny-model", action="store_true", help=argparse.SUPPRESS)
    p.add_argument(
        "--compiled-pick", action="store_true", help="also time a torch.compile'd greedy pick against the eager ops"
    )
    args = p.parse_args(argv)
    if args.quick:
        args.seqs, args.steps, args.tiny_model = 8, 3, True
    if args.seqs < 1 or args.steps < 1 or args.threads < 1:
        p.error(f"--seqs, --steps and --threads must be >= 1, got {args.seqs}, {args.steps}, {args.threads}")
    unknown = [d for d in args.dtypes if d not in DTYPES]
    if unknown:
        p.error(f"--dtypes: unknown {unknown}; choose from {sorted(DTYPES)}")
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    model, tok = load_model(args)
    prompts, _ = chat_workload(tok, args.seqs, 1, 1, seed=0)
    print(
        f"{args.model_name}, {args.seqs} sequences decoding ({min(map(len, prompts))}-"
        f"{max(map(len, prompts))} prompt tokens), vocabulary {model.config.vocab_size}, "
        f"{torch.get_num_threads()} threads, torch {torch.__version__}; "
        f"medians of {args.steps} steps each way"
    )
    head = (
        f"{'dtype':5s} {'sampling':16s} | {'step ms':>8s} {'sampler ms':>10s} {'faults':>7s} | "
        f"{'step ms':>8s} {'sampler ms':>10s} {'faults':>7s} | {'step':>6s} {'sampler':>7s}"
    )
    print(f"{'':22s}   reused buffers (nopad)          | fresh every step (before)        | fresh / reused")
    print(head + "\n" + "-" * len(head))
    report = {}
    for name in args.dtypes:
        model = model.to(DTYPES[name])
        for case, params in CASES.items():
            r = report[f"{name} {case}"] = time_steps(model, tok, prompts, params, args.steps)
            a, b = r["reused"], r["fresh"]
            print(
                f"{name:5s} {case:16s} | {a['step_ms']:8.1f} {a['sampler_ms']:10.2f} {a['faults']:7.0f} | "
                f"{b['step_ms']:8.1f} {b['sampler_ms']:10.2f} {b['faults']:7.0f} | "
                f"{b['step_ms'] / a['step_ms']:5.2f}x {b['sampler_ms'] / a['sampler_ms']:6.2f}x",
                flush=True,
            )
    report["argmax"] = time_argmax(args.seqs, model.config.vocab_size, args.steps)
    report["penalties"] = {
        rows: time_penalties(rows, model.config.vocab_size, args.steps) for rows in sorted({args.seqs, 256})
    }
    if args.compiled_pick:
        report["compiled_pick"] = {
            rows: time_compiled_pick(rows, model.config.vocab_size, args.steps) for rows in (args.seqs, 256)
        }
    return report


def interleaved(fns: dict, repeats: int) -> dict[str, float]:
    """Each of ``fns``' median wall ms over at least 5 calls, the calls interleaved (so load hits all alike)."""
    times = {name: [] for name in fns}
    for _ in range(max(repeats, 5)):
        for name, fn in fns.items():
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: median(t) * 1e3 for name, t in times.items()}


def time_argmax(rows: int, vocab: int, repeats: int) -> dict[str, float]:
    """A greedy step's argmax over ``rows x vocab`` fp32 logits: torch's (``Tensor.argmax``) against the
    sampler's (``argmax_rows``: numpy's on CPU), interleaved; both must give the same indices."""
    from nopad.inference.sampler import argmax_rows

    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0))
    assert torch.equal(argmax_rows(x), x.argmax(dim=-1))
    out = interleaved({"torch": lambda: x.argmax(dim=-1), "nopad": lambda: argmax_rows(x)}, repeats)
    print(
        f"greedy argmax over {rows} x {vocab} fp32 logits, {torch.get_num_threads()} threads: torch "
        f"{out['torch']:.3f} ms, nopad (numpy on CPU) {out['nopad']:.3f} ms: {out['torch'] / out['nopad']:.2f}x, "
        "the same indices"
    )
    return out


def time_penalties(rows: int, vocab: int, repeats: int, seen_per_row: int = 200) -> dict[str, float]:
    """A repetition penalty over ``rows x vocab`` fp32 logits, each row having seen ``seen_per_row`` tokens:
    from a dense ``(rows, vocab)`` mask (:func:`nopad.inference.penalties.penalize`, the form on an
    accelerator and in a compiled step) against the rows' (row, token) pairs (``penalize_pairs``, the form
    on CPU), interleaved; both must give the same bits."""
    from nopad.inference.penalties import penalize, penalize_pairs

    g = torch.Generator().manual_seed(0)
    x = torch.randn(rows, vocab, generator=g)
    tokens = torch.randint(0, vocab, (rows, seen_per_row), generator=g)
    mask = torch.zeros(rows, vocab, dtype=torch.bool)
    mask[torch.arange(rows)[:, None], tokens] = True
    pairs = torch.stack([torch.arange(rows).repeat_interleave(seen_per_row), tokens.reshape(-1)])
    penalty = torch.full((rows,), 1.1)
    assert torch.equal(penalize(x, mask, penalty), penalize_pairs(x, pairs, penalty))
    out = interleaved(
        {"mask": lambda: penalize(x, mask, penalty), "pairs": lambda: penalize_pairs(x, pairs, penalty)}, repeats
    )
    print(
        f"repetition penalty over {rows} x {vocab} fp32 logits, {seen_per_row} seen tokens a row, "
        f"{torch.get_num_threads()} threads: dense mask {out['mask']:.3f} ms, (row, token) pairs "
        f"{out['pairs']:.3f} ms: {out['mask'] / out['pairs']:.2f}x, the same bits"
    )
    return out


def _greedy_pick(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Each row's argmax and its log-prob, ``log_softmax``'s expression at that token only."""
    tokens = x.argmax(dim=-1)
    top = x.amax(dim=-1, keepdim=True)
    picked = (x.gather(1, tokens[:, None]) - top)[:, 0] - torch.log(torch.exp(x - top).sum(dim=-1))
    return tokens, picked


def time_compiled_pick(rows: int, vocab: int, repeats: int) -> dict[str, float]:
    """The sampler's greedy ops (log-softmax into its kept buffer, numpy's argmax, a gather) against
    :func:`_greedy_pick` compiled (one fused kernel: no ``(rows, vocab)`` log-prob tensor written),
    interleaved, on the same fp32 logits; the same tokens, the log-probs' largest gap printed."""
    from nopad.inference.sampler import argmax_rows
    from nopad.inference.sampler_memory import SamplerBuffers, log_softmax_into

    x = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    buffers = SamplerBuffers()

    def eager():
        logprobs = log_softmax_into(x, buffers, "raw_logprobs")
        tokens = argmax_rows(x)
        return tokens, logprobs.gather(1, tokens[:, None])[:, 0]

    compiled = torch.compile(_greedy_pick, dynamic=True)
    (t_eager, lp_eager), (t_compiled, lp_compiled) = eager(), compiled(x)  # (compiles here, untimed)
    assert torch.equal(t_eager, t_compiled), "the compiled pick chose other tokens"
    times = {"eager": [], "compiled": []}
    for _ in range(max(repeats, 5)):
        for name, fn in (("eager", eager), ("compiled", lambda: compiled(x))):
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    out = {name: median(t) * 1e3 for name, t in times.items()}
    gap = (lp_eager - lp_compiled).abs().max().item()
    print(
        f"greedy pick over {rows} x {vocab} fp32 logits, {torch.get_num_threads()} threads: the sampler's eager ops "
        f"{out['eager']:.3f} ms, compiled {out['compiled']:.3f} ms: {out['eager'] / out['compiled']:.2f}x; the same "
        f"tokens, log-probs within {gap:.1e}"
    )
    return out


if __name__ == "__main__":
    main()
