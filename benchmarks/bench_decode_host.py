"""The host cost of one eager decode step, per layer: nopad's generator step next to transformers'
own decode step (one token per row, ``DynamicCache``, SDPA) on the same model, in the same run.

On a GPU an eager decode step of a small model is host-bound (the H200 run of ``gpu_check.py``
found the GPU idle 92% of nopad's step): what the step costs is the Python and the operator calls
the host makes per layer. A CPU with a tiny hidden size shows that cost with little compute under
it. Both sides run twin random Llamas (same weights; 30 layers, hidden 64, 4 heads / 2 KV heads,
fp32, one thread) on the same prompts, their steps interleaved; each side's figures:

- CPU ms per step and per layer (thread CPU time, so other processes on the machine do not count;
  with ``--device cuda`` also the wall time, synchronized after each step);
- of that, the attention calls' (nopad's backend forward / ``F.scaled_dot_product_attention``: on
  CPU their compute, on CUDA the host time of their launches), and the rest per layer;
- Python function calls and aten operator calls per layer, counted (noise-free). On CUDA every aten
  call that is not a view launches a kernel and each costs the host several microseconds;
- Python calls per row and the CPU ms outside the model's forward: the step's bookkeeping
  (scheduling, step inputs, sampling, appending), the part that grows with the rows (``--rows 64 256``);
- the same for the general step (``nopad, general step``: every row walked in Python, as before the
  decode batch kept its arrays, :mod:`nopad.inference.decode_batch`), and for an overlapped generator
  (``Generator(overlap=True)``: each step launches the next before reading its own tokens back, on the
  general step), whose host work a GPU hides behind the forward;
- and transformers' own ``generate()`` loop per decode step (a long minus a short greedy generation
  of the same prompts): the bookkeeping a user of HF pays per step outside the forward (input
  preparation, logits processors, stopping criteria, mask and cache-position updates). The ``HF``
  rows' step is a bare greedy loop (an argmax and a read-back, no stop check, nothing recorded): the
  lower bound of any generator's bookkeeping, not one a user runs.

nopad's step runs inside ``gen.live.attention()`` as ``generate()``/``run()`` hold it; a last line
times a bare ``gen.step()`` (``stream()``), which also switches the model's attention to nopad and
back (transformers' ``set_attn_implementation`` walks every module, twice).

    python benchmarks/bench_decode_host.py            # 30 layers, 64 rows, 30 timed steps
    python benchmarks/bench_decode_host.py --quick    # 30 layers, 16 rows, 4 timed steps (seconds)
    python benchmarks/bench_decode_host.py --layers 2 --rows 64 256   # the per-row host work
    python benchmarks/bench_decode_host.py --layers 2 --rows 64 256 --samples 4   # GRPO's groups of 4
    python benchmarks/bench_decode_host.py --layers 2 --rows 64 256 --repetition-penalty 1.1   # penalised rows
    python benchmarks/bench_decode_host.py --device cuda --shape smollm2   # the GPU check (bf16)
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from statistics import median

import torch
import torch.nn.functional as F
import transformers
from torch.utils._python_dispatch import TorchDispatchMode

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from nopad.inference import Generator, SamplingParams  # noqa: E402
from nopad.packing.attention import registry  # noqa: E402

VIEW_OPS = {
    "view",
    "_unsafe_view",
    "transpose",
    "t",
    "unsqueeze",
    "squeeze",
    "slice",
    "select",
    "expand",
    "detach",
    "reshape",
    "alias",
    "as_strided",
    "permute",
}
GENERATE_STEPS = 24  # decode steps of HF generate()'s long run beyond its short one
SHAPES = {  # (hidden, intermediate, heads, kv heads, vocab)
    "tiny": (64, 128, 4, 2, 128),
    "smollm2": (576, 1536, 9, 3, 49152),  # SmolLM2-135M, the model of gpu_check.py's decode figures
}


def llama(layers: int, shape: str, device: torch.device, dtype: torch.dtype) -> transformers.PreTrainedModel:
    hidden, intermediate, heads, kv_heads, vocab = SHAPES[shape]
    torch.manual_seed(0)
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=intermediate,
        num_hidden_layers=layers,
        num_attention_heads=heads,
        num_key_value_heads=kv_heads,
        max_position_embeddings=4096,
    )
    return transformers.LlamaForCausalLM(config).to(device, dtype).eval()


class Clock:
    """Thread CPU seconds spent inside the calls it wraps (the attention calls, a step's parts), added up."""

    def __init__(self):
        self.seconds = 0.0

    def wrap(self, fn):
        def timed(*args, **kwargs):
            start = time.thread_time()
            try:
                return fn(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - start

        return timed


@contextmanager
def attention_timed(clock: Clock):
    """Time every nopad backend's forward (its registry entry) and torch's SDPA (what transformers
    calls): the compute on CPU, the launches' host time on CUDA."""
    table = registry.backends()
    saved, sdpa = dict(table), F.scaled_dot_product_attention
    for name, backend in saved.items():
        table[name] = replace(backend, forward=clock.wrap(backend.forward))
    F.scaled_dot_product_attention = clock.wrap(sdpa)
    try:
        yield
    finally:
        table.update(saved)
        F.scaled_dot_product_attention = sdpa


class AtenCalls(TorchDispatchMode):
    """Aten calls that are not views: on CUDA each launches a kernel."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.calls += func.overloadpacket.__name__ not in VIEW_OPS
        return func(*args, **(kwargs or {}))


@contextmanager
def gc_held():
    """The garbage collector run first, then held off: a collection in the middle of a counted call
    runs other objects' finalizers, Python calls that are not the call's (a test's count flaked so,
    after earlier tests' generators)."""
    gc.collect()
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def python_calls(fn) -> int:
    """Python function calls made by ``fn()``, with the garbage collector held off (:func:`gc_held`)."""
    calls = [0]

    def profile(frame, event, arg):
        calls[0] += event == "call"

    with gc_held():
        sys.setprofile(profile)
        try:
            fn()
        finally:
            sys.setprofile(None)
    return calls[0]


def nopad_side(
    model, prompts: list[list[int]], overlap: bool = False, kept: bool = True, samples: int = 1, penalty: float = 1.0
):
    """A generator (attention backend: "auto") with every prompt past prefill; returns (step, generator).
    ``kept=False``: every step is the general one (the batch's arrays are not kept from step to step,
    :mod:`nopad.inference.decode_batch`), the step before persistent step state. ``samples`` > 1: GRPO's
    shape, groups of that many seeded samples at temperature 1 (forked after their prompt's prefill),
    the rows ``len(prompts)`` in all. ``penalty``: every row's repetition penalty."""
    budget = max(2048, sum(map(len, prompts)))
    gen = Generator(
        model, None, block_size=16, max_num_seqs=len(prompts), max_num_batched_tokens=budget, overlap=overlap
    )
    if not kept:
        gen.decode_batch.serve = lambda: False
    endless = SamplingParams(temperature=0, max_tokens=100_000, ignore_eos=True, repetition_penalty=penalty)
    if samples > 1:
        endless = replace(endless, temperature=1.0, seed=0, n=samples)
    for prompt in prompts[: len(prompts) // samples]:
        gen.add_request(prompt, endless)
    gen.step()  # prefill
    return gen.step, gen


def hf_side(model, prompts: list[list[int]]):
    """transformers' own decode: the same prompts prefilled into a DynamicCache, greedy."""
    cache = transformers.DynamicCache(config=model.config)
    device = next(model.parameters()).device
    state = {"ids": torch.tensor(prompts, device=device)}

    def step():
        with torch.no_grad():
            out = model(input_ids=state["ids"], past_key_values=cache, use_cache=True)
        state["ids"] = out.logits[:, -1].argmax(-1, keepdim=True)
        state["ids"].cpu()  # the host reads the tokens back, as a generator's sampler does

    step()  # prefill
    return step


def hf_generate_bookkeeping(
    model, prompts: list[list[int]], device: torch.device, repeats: int, penalty: float = 1.0
) -> dict:
    """transformers' ``generate()`` loop per decode step, the bookkeeping a user of HF pays: CPU ms outside
    the model's forward (input preparation, logits processors, stopping criteria, the attention-mask and
    cache-position updates) and Python calls, as the difference between a long and a short greedy
    ``generate()`` of the same prompts (prefill and setup cancel). No EOS ends a row (its id is past the
    vocabulary, though the stop check runs): every step decodes every row, as the steps above.
    ``penalty``: its repetition penalty (its ``RepetitionPenaltyLogitsProcessor`` runs, 1: none)."""
    ids = torch.tensor(prompts, device=device)
    clock = Clock()
    model.forward = clock.wrap(model.forward)
    short, long = 4, 4 + GENERATE_STEPS

    def run(new_tokens: int) -> None:
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=new_tokens,
                do_sample=False,
                eos_token_id=model.config.vocab_size,  # past the vocabulary: never drawn
                pad_token_id=0,
                repetition_penalty=penalty,
            )

    def outside(new_tokens: int) -> float:
        clock.seconds = 0.0
        start = time.thread_time()
        run(new_tokens)
        return time.thread_time() - start - clock.seconds

    try:
        run(short)  # warm-up
        per_step = [(outside(long) - outside(short)) / (long - short) for _ in range(repeats)]
        calls = (python_calls(lambda: run(long)) - python_calls(lambda: run(short))) / (long - short)
    finally:
        del model.forward  # the class's forward again
    return dict(outside_ms=median(per_step) * 1e3, python_per_step=calls)


def measure(steps: dict, repeats: int, layers: int, device: torch.device, models: dict) -> dict:
    """Interleaved timed steps of every side (so load hits them alike), then the counts. ``models``:
    each side's model, whose forward is timed too: the rest of a step is the side's bookkeeping
    (scheduling, step inputs, sampling, appending), the part that grows with the rows."""
    clock, model_clock = Clock(), Clock()
    cpu, wall, attn, inside = ({n: [] for n in steps} for _ in range(4))
    for model in models.values():
        model.forward = model_clock.wrap(model.forward)
    with attention_timed(clock):
        for _ in range(repeats):
            for name, step in steps.items():
                clock.seconds = model_clock.seconds = 0.0
                start, start_wall = time.thread_time(), time.perf_counter()
                step()
                cpu[name].append(time.thread_time() - start)  # before the wait for the GPU (a spin)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)
                wall[name].append(time.perf_counter() - start_wall)
                attn[name].append(clock.seconds)
                inside[name].append(model_clock.seconds)
    for model in models.values():
        del model.forward  # the class's forward again
    out = {}
    for name, step in steps.items():
        mode = AtenCalls()
        with mode:
            step()
        r = out[name] = dict(
            step_ms=median(cpu[name]) * 1e3,
            wall_ms=median(wall[name]) * 1e3,
            attention_ms=median(attn[name]) * 1e3,
            aten=mode.calls / layers,
            outside_ms=median(c - m for c, m in zip(cpu[name], inside[name])) * 1e3,
            python=python_calls(step) / layers,
        )
        r["rest_layer_ms"] = (r["step_ms"] - r["attention_ms"]) / layers
    return out


def bookkeeping(step, gen, model, repeats: int) -> dict[str, float]:
    """Where the kept-array step's time outside the model goes, median ms over ``repeats`` steps of
    its own (a pass after the interleaved one, so its wrappers add nothing to the figures above):
    the step inputs (the forward call besides the model: the runner's input build and its record),
    the sampler's draw, the completion (read back, appends, stop checks) and the rest (the serving
    checks, blocks, counters, prefix-cache registration)."""
    batch = gen.decode_batch
    clocks = {name: Clock() for name in ("step", "forward", "model", "draw", "complete")}
    saved = batch.forward, batch.sampler.draw, batch._complete
    batch.forward = clocks["forward"].wrap(batch.forward)
    model.forward = clocks["model"].wrap(model.forward)
    batch.sampler.draw = clocks["draw"].wrap(batch.sampler.draw)
    batch._complete = clocks["complete"].wrap(batch._complete)
    timed = clocks["step"].wrap(step)
    samples = []
    try:
        for _ in range(repeats):
            for clock in clocks.values():
                clock.seconds = 0.0
            timed()
            samples.append({name: clock.seconds for name, clock in clocks.items()})
    finally:
        batch.forward, batch.sampler.draw, batch._complete = saved
        del model.forward
    parts = {
        "step inputs": [s["forward"] - s["model"] for s in samples],
        "sampler": [s["draw"] for s in samples],
        "completion": [s["complete"] for s in samples],
        "the rest": [s["step"] - s["forward"] - s["draw"] - s["complete"] for s in samples],
    }
    return {name: median(values) * 1e3 for name, values in parts.items()}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="16 rows, 4 timed steps")
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument(
        "--rows", type=int, nargs="+", default=None, help="sequences decoding, one run per count (default 64; quick 16)"
    )
    parser.add_argument("--prompt-len", type=int, default=32)
    parser.add_argument("--device", choices=("cpu", "cuda"), default="cpu")
    parser.add_argument("--shape", choices=sorted(SHAPES), default="tiny")
    parser.add_argument(
        "--samples",
        type=int,
        default=1,
        help="nopad's rows as groups of this many samples of a prompt at temperature 1 (GRPO's shape; "
        "HF's side stays one greedy row per prompt)",
    )
    parser.add_argument(
        "--repetition-penalty",
        type=float,
        default=1.0,
        help="every row's repetition penalty, nopad's and HF generate()'s (the bare HF loop applies none)",
    )
    args = parser.parse_args(argv)
    if not args.repetition_penalty > 0:
        parser.error(f"--repetition-penalty must be > 0 (1: none), got {args.repetition_penalty}")
    for name in ("layers", "prompt_len"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be at least 1, got {getattr(args, name)}")
    if args.rows is not None and min(args.rows) < 1:
        parser.error(f"--rows counts must be at least 1, got {args.rows}")
    if args.samples < 1 or any(r % args.samples for r in args.rows or [16 if args.quick else 64]):
        parser.error(f"--samples must be at least 1 and divide every --rows count, got {args.samples}")
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: this machine has no CUDA device (torch.cuda.is_available() is False)")
    torch.set_num_threads(1)
    counts = sorted(set(args.rows or [16 if args.quick else 64]))
    report = {rows: run(args, rows) for rows in counts}
    if len(counts) > 1:  # what each row added costs: the part of a step that grows with the batch
        low, high = report[counts[0]], report[counts[-1]]
        added = counts[-1] - counts[0]
        per_row = {
            name: (high[name]["python"] - low[name]["python"]) * args.layers / added
            for name in low
            if isinstance(low[name], dict) and "python" in low[name]
        }
        print(
            f"Python calls per added row ({counts[0]} -> {counts[-1]} rows): "
            + ", ".join(f"{name} {calls:.2f}" for name, calls in per_row.items())
        )
        report["python_calls_per_added_row"] = per_row
    return report


def run(args, rows: int) -> dict:
    """Both sides' figures at ``rows`` sequences decoding."""
    device = torch.device(args.device)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    repeats = 4 if args.quick else 30
    seed = torch.Generator().manual_seed(0)
    prompts = torch.randint(3, SHAPES[args.shape][-1], (rows, args.prompt_len), generator=seed).tolist()
    hf_model, nopad_model, general_model, overlap_model = (
        llama(args.layers, args.shape, device, dtype) for _ in range(4)
    )
    hf_step = hf_side(hf_model, prompts)  # a twin, kept on SDPA
    same = dict(samples=args.samples, penalty=args.repetition_penalty)
    nopad_step, gen = nopad_side(nopad_model, prompts, **same)
    general_step, general_gen = nopad_side(general_model, prompts, kept=False, **same)
    overlap_step, overlap_gen = nopad_side(overlap_model, prompts, overlap=True, **same)
    # held across steps, as generate() and run() hold it
    with gen.live.attention(), general_gen.live.attention(), overlap_gen.live.attention():
        for _ in range(3):
            nopad_step()
            general_step()
            overlap_step()
            hf_step()
        report = measure(
            {"nopad": nopad_step, "nopad, general step": general_step, "nopad, overlap": overlap_step, "HF": hf_step},
            repeats,
            args.layers,
            device,
            {
                "nopad": nopad_model,
                "nopad, general step": general_model,
                "nopad, overlap": overlap_model,
                "HF": hf_model,
            },
        )
        parts = bookkeeping(nopad_step, gen, nopad_model, repeats)
    bare = measure(
        {"nopad, bare gen.step()": nopad_step}, max(2, repeats // 3), args.layers, device, {"nopad": nopad_model}
    )
    generate = hf_generate_bookkeeping(hf_model, prompts, device, max(2, repeats // 6), args.repetition_penalty)
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else float("nan")
    where = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU, 1 thread"
    print(
        f"eager decode step, {args.layers}-layer Llama ({args.shape}: hidden {SHAPES[args.shape][0]}), "
        f"{rows} rows past a {args.prompt_len}-token prompt"
        + (f" (nopad: groups of {args.samples} samples at temperature 1)" if args.samples > 1 else "")
        + (f", repetition penalty {args.repetition_penalty}" if args.repetition_penalty != 1.0 else "")
        + f", {str(dtype).removeprefix('torch.')}, {where}; "
        f"thread CPU time, median of {repeats}; load average {load:.2f}"
    )
    wall = "wall ms/step  " if device.type == "cuda" else ""
    print(
        f"{'':24s} {wall}{'ms/step':>8s} {'ms/layer':>9s} {'attention ms':>13s} {'rest ms/layer':>14s} "
        f"{'py calls/layer':>15s} {'py calls/row':>13s} {'aten calls/layer':>17s} "
        f"{'outside model ms':>17s}"
    )
    for name, r in {**report, **bare}.items():
        wall = f"{r['wall_ms']:12.2f}  " if device.type == "cuda" else ""
        print(
            f"{name:24s} {wall}{r['step_ms']:8.2f} {r['step_ms'] / args.layers:9.3f} "
            f"{r['attention_ms']:13.2f} {r['rest_layer_ms']:14.3f} {r['python']:15.1f} "
            f"{r['python'] * args.layers / rows:13.1f} {r['aten']:17.1f} {r['outside_ms']:17.2f}"
        )
    n, h = report["nopad"], report["HF"]
    print(
        f"nopad / HF: step {n['step_ms'] / h['step_ms']:.2f}x, host work besides the attention calls "
        f"{n['rest_layer_ms'] / h['rest_layer_ms']:.2f}x, Python calls {n['python'] / h['python']:.2f}x, "
        f"aten calls {n['aten'] / h['aten']:.2f}x, CPU time outside the model "
        f"{n['outside_ms'] / h['outside_ms']:.2f}x"
    )
    print(
        f"HF generate() per decode step (its whole loop; a long minus a short generation): CPU ms outside the "
        f"model {generate['outside_ms']:.2f}, Python calls {generate['python_per_step']:.0f}; nopad / HF "
        f"generate(): CPU time outside the model {n['outside_ms'] / generate['outside_ms']:.2f}x, Python calls "
        f"{n['python'] * args.layers / generate['python_per_step']:.2f}x (HF's row above is a bare greedy loop's "
        "lower bound: an argmax and a read-back, no stop check, nothing recorded)"
    )
    g = report["nopad, general step"]
    print(
        f"nopad's kept arrays / its general step: CPU time outside the model {n['outside_ms'] / g['outside_ms']:.2f}x, "
        f"Python calls per row {n['python'] * args.layers / rows:.1f} vs {g['python'] * args.layers / rows:.1f}"
    )
    print(
        "nopad's step outside the model, by part (CPU ms, a pass of its own): "
        + ", ".join(f"{name} {ms:.2f}" for name, ms in parts.items())
    )
    o = report["nopad, overlap"]
    print(
        f"nopad overlapped / HF: step {o['step_ms'] / h['step_ms']:.2f}x, "
        f"Python calls {o['python'] / h['python']:.2f}x, "
        f"CPU time outside the model {o['outside_ms'] / h['outside_ms']:.2f}x (one CPU does not overlap with "
        "itself: on a GPU this host work runs while the device computes the step launched before it)"
    )
    for generator in (gen, general_gen, overlap_gen):
        generator.abort_all()
    return {**report, **bare, "HF generate()": generate, "load": load, "nopad_parts_ms": parts}


if __name__ == "__main__":
    main()
