"""Hybrid-model training throughput: padded batches vs nopad packed rows, same model,
same data, same token budget per step.

A random-weight Qwen3.5 text model (``Qwen3_5ForCausalLM``: Gated DeltaNet ``linear_attention``
layers and ``full_attention`` layers 3:1, as the released models lay them), scaled down to fit a
2-core CPU, in fp32 and bf16; LFM2 (short-convolution layers) and a Bamba-shaped Mamba2 hybrid.
Forward + backward real (non-padding) tokens per second over the same lognormal-length sequences:

  padded  micro-batches of B sequences padded to their longest (DataCollatorWithPadding),
          attention_mask, sdpa; B = budget / mean length
  nopad   nopad.packing.pack BFD bins of ``budget`` tokens, one packed row each with its VarlenMeta:
          attention through nopad, the delta rule, the Mamba2 scan and the convolution through
          nopad's varlen mixers (packing/mixers/), each document from a zero state

Generation (``--generation``, on by default): the same random-weight models in eval mode, their
weights in each of ``--dtypes`` (bf16: the model cast to bf16, as it is served), greedy, on one
mixed-length batch of prompts with per-request output lengths (ignore_eos; HF stops no row
early, so this is what an EOS at a different step per row costs it), only the requested tokens
counted:

  HF      ``model.generate`` on the whole batch left-padded, sdpa, its own hybrid cache (conv and
          recurrent state per row); the batch runs to its longest request
  nopad   ``nopad.inference.Generator``: in-flight batching, paged K/V, per-sequence state slots
          (inference/state_cache.py), chunked prefill

with greedy agreement (identical sequences) so a fast wrong answer shows. ``--compile-decode``
adds a third row per model and dtype: the same ``Generator`` with ``compile_decode=True`` (its
decode steps padded to bucketed shapes and run by one ``torch.compile`` of the model, the hybrid
layers' state slots read and written in place; CUDA graphs on CUDA), its compilation in the
warm-up, outside the timing.

Prefix cache (``--prefix-cache``, on by default): requests that share a long system prompt, all
given to one ``Generator.generate`` call, greedy, fp32, with the generator's prefix cache off and
on. On a hybrid model a request reuses cached K/V blocks only up to a block boundary where a state
snapshot was kept (inference/state_prefix.py), so the row says how many prompt tokens it skipped
and how many snapshots it restored, and whether the outputs equal the cache-off run.

Decode step (``--step-cost MODELS``): the CPU time of one decode step of the ``Generator`` and of
HF ``generate`` at the same 12, 4 and 1 rows (no padding on either side), fp32: where the
generation ratio comes from, since both run the model's own layers once per step.

Subnormals: a strong decay's ``exp`` inside a 64-token chunk reaches subnormal floats, which a
CPU multiplies tens of times slower. nopad's own chunked scans flush them (``flushed_exp``);
transformers' functions, which the padded side runs, do not, so part of the training ratio on a
CPU is that. ``--flush-subnormals`` flushes them on both sides (as a GPU costs them nothing), which
leaves the part that packing gives.

Exact mode (``--exact-mode on|off|only``, on by default): the same packed rows, forward + backward, outside
and inside ``nopad.packing.batch_invariant()``, where the delta rule and the Mamba2 scan run token by
token (the order of the generator's decode) and the convolution as ordered gathers, so rollout
log-probs equal the trainer's bitwise; the ratio is what that exactness costs the trainer.

    python benchmarks/bench_hybrid.py            # full run
    python benchmarks/bench_hybrid.py --quick    # smoke run, a tiny model
    python benchmarks/bench_hybrid.py --models '' --exact-mode off --generation '' --prefix-cache qwen3_5
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch
import transformers

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from benchmarks.bench_generate import agreement, hf_generate, run_hf_static, run_nopad  # noqa: E402
from benchmarks.bench_train import make_lengths, nopad_batches, padded_batches  # noqa: E402
from nopad.packing.hf import register_nopad_attention  # noqa: E402
from nopad.packing.invariance import batch_invariant  # noqa: E402


def qwen3_5(vocab: int, quick: bool) -> transformers.PreTrainedModel:
    """Qwen3.5's shape at 1/16 of its width: 3 linear-attention layers per full-attention layer,
    linear heads of half the hidden size, value heads twice the key heads, a 4-tap conv."""
    hidden, layers = (64, 4) if quick else (256, 8)
    config = transformers.Qwen3_5TextConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        num_attention_heads=4,
        num_key_value_heads=1,
        head_dim=hidden // 4,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=hidden // 4,
        linear_value_head_dim=hidden // 4,
        linear_conv_kernel_dim=4,
        max_position_embeddings=4096,
    )
    return _build(transformers.Qwen3_5ForCausalLM, config)


def lfm2(vocab: int, quick: bool) -> transformers.PreTrainedModel:
    """LFM2's layout (short-conv layers, every third layer attention), the same width."""
    hidden, layers = (64, 3) if quick else (256, 6)
    config = transformers.Lfm2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        layer_types=(["conv", "conv", "full_attention"]) * (layers // 3),
        num_attention_heads=4,
        num_key_value_heads=1,
        max_position_embeddings=4096,
    )
    return _build(transformers.Lfm2ForCausalLM, config)


def bamba(vocab: int, quick: bool) -> transformers.PreTrainedModel:
    """A Mamba2 hybrid (Bamba's layout, as Granite-4 hybrid and Nemotron-H lay theirs: Mamba2
    layers with an attention layer every fourth), the same width: 2x expansion, 64-dim heads,
    a 64-wide SSM state, a 4-tap conv."""
    hidden, layers = (64, 4) if quick else (256, 8)
    config = transformers.BambaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=3 * hidden,
        num_hidden_layers=layers,
        attn_layer_indices=list(range(3, layers, 4)),
        num_attention_heads=4,
        num_key_value_heads=1,
        mamba_n_heads=2 * hidden // 64,
        mamba_d_head=64,
        mamba_d_state=16 if quick else 64,
        mamba_n_groups=1,
        mamba_chunk_size=64,
        max_position_embeddings=4096,
    )
    return _build(transformers.BambaForCausalLM, config)


def _build(cls, config) -> transformers.PreTrainedModel:
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    return cls(config).float().train()


def run(model, impl: str, batches, real_tokens: int, dtype: torch.dtype, warm_up: bool = True) -> dict:
    model.set_attn_implementation(impl)
    model.zero_grad(set_to_none=True)
    with torch.autocast("cpu", dtype=dtype, enabled=dtype != torch.float32):
        if warm_up:
            model(**batches[0]).loss.backward()
            model.zero_grad(set_to_none=True)
        start = time.perf_counter()
        computed = 0
        for batch in batches:
            model(**batch).loss.backward()
            computed += batch["input_ids"].numel()
        elapsed = time.perf_counter() - start
    model.zero_grad(set_to_none=True)
    return dict(seconds=elapsed, tok_s=real_tokens / elapsed, steps=len(batches), efficiency=real_tokens / computed)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="smoke run: a tiny model, 4 short sequences")
    parser.add_argument("--sequences", type=int, default=None)
    parser.add_argument("--budget", type=int, default=None, help="tokens per step (default 2048)")
    parser.add_argument("--models", default="qwen3_5,lfm2,bamba", help="comma-separated: qwen3_5, lfm2, bamba")
    parser.add_argument(
        "--generation",
        default="qwen3_5,lfm2,bamba",
        help="models for the generation part, comma-separated ('' to skip it)",
    )
    parser.add_argument("--gen-prompts", type=int, default=None, help="prompts of the generation batch")
    parser.add_argument(
        "--gen-batch",
        type=int,
        default=None,
        help="sequences at once in the generation part: HF's static batch size and the "
        "Generator's max_num_seqs (default: every prompt in one batch)",
    )
    parser.add_argument(
        "--compile-decode",
        action="store_true",
        help="generation: also time the Generator with compile_decode=True (a third row)",
    )
    parser.add_argument("--device", default="cpu", help="generation: the device (cuda for the GPU check)")
    parser.add_argument(
        "--step-cost",
        default=None,
        help="models whose decode-step CPU time to compare at 12, 4 and 1 rows, fp32 "
        "(comma-separated; default: none, qwen3_5 with --quick)",
    )
    parser.add_argument(
        "--prefix-cache",
        default="qwen3_5,lfm2,bamba",
        help="models for the shared-system-prompt part, comma-separated ('' to skip it)",
    )
    parser.add_argument(
        "--dtypes", default="float32,bfloat16", help="comma-separated; bf16 runs under CPU autocast, fp32 weights"
    )
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's; 1 with --quick)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--flush-subnormals",
        action="store_true",
        help="torch.set_flush_denormal(True) for the whole run, both sides: what the "
        "peer costs when subnormal floats cost nothing (as on a GPU), so the gain of "
        "packing alone shows (use with --threads 1: the flag is per thread)",
    )
    parser.add_argument(
        "--exact-mode",
        choices=("on", "off", "only"),
        default="on",
        help="also (only) time the packed rows inside nopad.packing.batch_invariant()",
    )
    args = parser.parse_args()
    args.threads = args.threads or (1 if args.quick else torch.get_num_threads())
    torch.set_num_threads(args.threads)
    if args.flush_subnormals and not torch.set_flush_denormal(True):
        raise SystemExit("--flush-subnormals: this CPU cannot flush subnormal floats (no SSE3)")
    n = args.sequences or (4 if args.quick else 24)
    budget = args.budget or (256 if args.quick else 2048)
    vocab = 512 if args.quick else 2048  # a small head: the layers carry the compute
    lengths = make_lengths(n, budget, args.seed)
    if args.quick:
        lengths = np.maximum(lengths // 8, 2)
    g = torch.Generator().manual_seed(args.seed)
    seqs = [torch.randint(3, vocab, (int(x),), generator=g) for x in lengths]
    real = int(lengths.sum())
    register_nopad_attention()
    padded, packed = padded_batches(seqs, budget), nopad_batches(seqs, budget)
    print(
        f"{n} sequences, {real} tokens (median {int(np.median(lengths))}, max {lengths.max()}), "
        f"budget {budget} tokens/step, {args.threads} threads"
        + (", subnormals flushed on both sides" if args.flush_subnormals else "")
    )
    padded_rows = sum(batch["input_ids"].numel() for batch in padded)
    print(
        f"padding ceiling: the padded batches run {padded_rows} token rows for {real} real ones, so a "
        f"model costed per token gains at most {padded_rows / real:.2f}x from packing (attention more)"
    )
    print(
        f"{'model':8s} {'dtype':9s} {'system':22s} {'steps':>5s} {'tokens eff':>10s} {'seconds':>8s} "
        f"{'tok/s':>8s} {'vs padded':>9s}"
    )
    builders = {"qwen3_5": qwen3_5, "lfm2": lfm2, "bamba": bamba}
    for name in filter(None, args.models.split(",")) if args.exact_mode != "only" else ():  # '' skips it
        model = builders[name](vocab, args.quick)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            base = run(model, "sdpa", padded, real, dtype, not args.quick)
            nopad = run(model, "nopad", packed, real, dtype, not args.quick)
            for system, r in (("padded, sdpa", base), ("nopad packed (BFD)", nopad)):
                print(
                    f"{name:8s} {dtype_name:9s} {system:22s} {r['steps']:5d} {r['efficiency']:10.1%} "
                    f"{r['seconds']:8.2f} {r['tok_s']:8.0f} {r['tok_s'] / base['tok_s']:8.2f}x"
                )
    if args.exact_mode != "off":
        exact_mode_cost(args, builders, vocab, packed, real)
    if args.generation:
        generation([builders[name] for name in args.generation.split(",")], vocab, args)
    if args.step_cost is None:
        args.step_cost = "qwen3_5" if args.quick else ""
    if args.step_cost:
        step_cost([builders[name] for name in args.step_cost.split(",")], vocab, args)
    if args.prefix_cache:
        prefix_cache([builders[name] for name in args.prefix_cache.split(",")], vocab, args)


def exact_mode_cost(args, builders, vocab: int, packed, real: int) -> None:
    """Packed forward + backward tokens/s outside and inside ``batch_invariant()``, same rows."""
    print(
        f"\nexact mode (nopad.packing.batch_invariant), packed rows, forward + backward\n"
        f"{'model':8s} {'dtype':9s} {'system':22s} {'seconds':>8s} {'tok/s':>8s} {'vs default':>10s}"
    )
    for name in filter(None, args.models.split(",")):
        model = builders[name](vocab, args.quick)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            default = run(model, "nopad", packed, real, dtype, not args.quick)
            with batch_invariant():
                exact = run(model, "nopad", packed, real, dtype, not args.quick)
            for system, r in (("nopad packed", default), ("nopad packed, exact", exact)):
                print(
                    f"{name:8s} {dtype_name:9s} {system:22s} {r['seconds']:8.2f} {r['tok_s']:8.0f} "
                    f"{r['tok_s'] / default['tok_s']:9.2f}x"
                )


def generation(builders, vocab: int, args) -> None:
    """nopad ``Generator`` vs HF ``generate`` on one mixed-length greedy batch, per model."""
    from types import SimpleNamespace

    n = args.gen_prompts or (4 if args.quick else 12)
    rng = np.random.default_rng(args.seed + 1)
    lengths = np.maximum(make_lengths(n, 1024, args.seed + 1) // (16 if args.quick else 4), 2)
    new = rng.integers(4, 9, n) if args.quick else rng.integers(16, 97, n)
    max_new = [int(k) for k in new]
    prompts = [rng.integers(3, vocab, int(x)).tolist() for x in lengths]
    batch = args.gen_batch or n
    engines = {"": SimpleNamespace(block_size=16, max_batch_tokens=512, max_seqs=batch)}
    if args.compile_decode:
        engines[", compile_decode"] = SimpleNamespace(**vars(engines[""]), compile_decode=True)
    print(
        f"\ngeneration: {n} prompts of {int(lengths.min())}-{int(lengths.max())} tokens (median "
        f"{int(np.median(lengths))}), {min(max_new)}-{max(max_new)} new tokens each "
        f"({sum(max_new)} in all), {batch} at once, greedy, weights in each dtype, {args.threads} threads"
    )
    print(padding_ceiling(lengths, max_new, batch))
    print(
        f"{'model':8s} {'dtype':9s} {'system':44s} {'seconds':>8s} {'tok/s':>8s} {'vs HF':>7s} "
        f"{'CPU s':>7s} {'vs HF':>7s}  agreement"
    )
    for build in builders:
        for dtype_name in args.dtypes.split(","):
            model = build(vocab, args.quick).eval().to(device=args.device, dtype=getattr(torch, dtype_name))
            name = build.__name__
            model.set_attn_implementation("sdpa")
            hf_generate(model, [prompts[0]], 2, 0, do_sample=False)  # warm-up, untimed (as nopad's)
            start = time.process_time()  # CPU seconds too: on a shared machine wall time is mostly the load
            hf = run_hf_static(model, prompts, max_new, batch, pad_id=0)
            hf_cpu = time.process_time() - start
            rows = [(hf, hf_cpu, "")]
            for label, engine in engines.items():
                model.set_attn_implementation("sdpa")  # the Generator switches its own copy of the setting
                warmed: list[float] = []
                graphs = compiled_graphs()
                nopad, _ = run_nopad(
                    model, None, prompts, max_new, engine, warmed=lambda mark=warmed: mark.append(time.process_time())
                )
                cpu = time.process_time() - warmed[0]
                same, prefix = agreement(hf.outputs, nopad.outputs)
                nopad.name += label
                note = f"{same}/{n} sequences identical to HF, {prefix:.0%} tokens"
                if label:  # a graph break splits the step (its CUDA graph): one graph a kind of step, no break
                    made, breaks = (b - a for a, b in zip(graphs, compiled_graphs()))
                    note += f"; {made} compiled graph(s) (logits; on CUDA also the draws), {breaks} graph break(s)"
                rows.append((nopad, cpu, note))
            for run_, cpu, note in rows:
                print(
                    f"{name:8s} {dtype_name:9s} {run_.name:44s} {run_.seconds:8.2f} "
                    f"{run_.tokens / run_.seconds:8.1f} {hf.seconds / run_.seconds:6.2f}x "
                    f"{cpu:7.2f} {hf_cpu / cpu:6.2f}x  {note}"
                )
            print(f"{'':8s} load average {' '.join(f'{x:.1f}' for x in os.getloadavg())}")


def padding_ceiling(lengths, max_new: list[int], batch: int) -> str:
    """What the batch's padding alone allows: HF runs each batch of ``batch`` requests left-padded
    to its longest prompt and for its longest request; a model whose cost is per token (its linear
    layers, its convolution) cannot beat HF by more than the ratio of the token rows HF runs to the
    real ones, however little else costs."""
    lengths, new = np.asarray(lengths), np.asarray(max_new)
    real = int(lengths.sum() + new.sum())
    hf = sum(
        len(lengths[i : i + batch]) * (int(lengths[i : i + batch].max()) + int(new[i : i + batch].max()))
        for i in range(0, len(lengths), batch)
    )
    return (
        f"padding ceiling: HF runs {hf} token rows for {real} real ones, so a model costed per token "
        f"gains at most {hf / real:.2f}x from dropping the padding"
    )


def compiled_graphs() -> tuple[int, int]:
    """Graphs dynamo has compiled and graph breaks it has met so far in this process."""
    from torch._dynamo.utils import counters

    return counters["stats"]["unique_graphs"], sum(counters["graph_break"].values())


def step_cost(builders, vocab: int, args) -> None:
    """CPU ms of one decode step, nopad ``Generator`` vs HF ``generate``, at the same rows: the
    difference of a run of ``1 + new`` tokens and one of 1 token (the same prefill), over ``new``."""
    prompt_len, new, counts = (16, 4, (2, 1)) if args.quick else (64, 40, (12, 4, 1))
    rng = np.random.default_rng(args.seed + 3)
    print(
        f"\ndecode step: rows of {prompt_len}-token prompts, {new} steps timed (a run of {new + 1} tokens "
        f"minus a run of 1), fp32, greedy, {args.threads} threads, best of 2"
    )
    print(f"{'model':8s} {'rows':>4s} {'nopad ms':>9s} {'HF ms':>9s} {'HF / nopad':>10s}")
    for build in builders:
        model = build(vocab, args.quick).eval()
        for rows in counts:
            prompts = [rng.integers(3, vocab, prompt_len).tolist() for _ in range(rows)]
            nopad = _decode_ms(model, prompts, new, nopad=True)
            hf = _decode_ms(model, prompts, new, nopad=False)
            print(f"{build.__name__:8s} {rows:4d} {nopad:9.2f} {hf:9.2f} {hf / nopad:9.2f}x")


def _decode_ms(model, prompts: list[list[int]], new: int, nopad: bool) -> float:
    from nopad.inference import Generator, SamplingParams

    ids = torch.tensor(prompts)
    rows, width = ids.shape
    gen = (
        Generator(
            model,
            block_size=16,
            max_num_batched_tokens=rows * width,
            max_num_seqs=rows,
            num_blocks=rows * -(-(width + new + 1) // 16) + 8,
        )
        if nopad
        else None
    )

    def run_(k: int) -> None:
        if nopad:
            params = SamplingParams(temperature=0, max_tokens=k, ignore_eos=True)
            gen.generate(prompts, params, use_tqdm=False)
            return
        model.set_attn_implementation("sdpa")
        with torch.no_grad():
            model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                max_new_tokens=k,
                min_new_tokens=0,
                eos_token_id=-1,
                pad_token_id=0,
                do_sample=False,
            )

    run_(2)  # warm-up
    tries = []
    for _ in range(2):
        start = time.process_time()
        run_(1)
        mid = time.process_time()
        run_(1 + new)
        tries.append(((time.process_time() - mid) - (mid - start)) / new * 1000)
    return min(tries)


def prefix_cache(builders, vocab: int, args) -> None:
    """One batch of requests sharing a long system prompt through the ``Generator``, its prefix
    cache off and on (state snapshots on hybrid models), side by side per model."""
    from nopad.inference import Generator, SamplingParams

    n, system_len, budget = (4, 64, 64) if args.quick else (16, 512, 512)
    rng = np.random.default_rng(args.seed + 2)
    system = rng.integers(3, vocab, system_len).tolist()
    tails = rng.integers(4, 13, n) if args.quick else rng.integers(16, 65, n)
    prompts = [system + rng.integers(3, vocab, int(k)).tolist() for k in tails]
    new = 4 if args.quick else 16
    params = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
    blocks = n * -(-(system_len + int(tails.max()) + new) // 16) + 8
    print(
        f"\nprefix cache: {n} prompts of a {system_len}-token system prompt + {int(tails.min())}-"
        f"{int(tails.max())} own tokens, {new} new tokens each, one generate() call, budget {budget} "
        f"tokens/step, block 16, greedy, fp32, {args.threads} threads"
    )
    print(
        f"{'model':8s} {'prefix cache':12s} {'seconds':>8s} {'computed':>8s} {'skipped':>8s} "
        f"{'snapshots':>9s} {'vs off':>7s}  agreement"
    )
    for build in builders:
        model = build(vocab, args.quick).eval()
        runs = {}
        for caching in (False, True):
            gen = Generator(
                model,
                block_size=16,
                num_blocks=blocks,
                max_num_batched_tokens=budget,
                max_num_seqs=n,
                enable_prefix_caching=caching,
            )
            gen.generate([prompts[0][:20]], SamplingParams(temperature=0, max_tokens=2), use_tqdm=False)
            gen.reset_stats()
            start = time.perf_counter()
            outs = gen.generate(prompts, params, use_tqdm=False)
            runs[caching] = (time.perf_counter() - start, [o.outputs[0].token_ids for o in outs], gen.stats())
        off_s, off_out, _ = runs[False]
        for caching, (seconds, outputs, stats) in runs.items():
            same = sum(a == b for a, b in zip(off_out, outputs))
            print(
                f"{build.__name__:8s} {'on' if caching else 'off':12s} {seconds:8.2f} "
                f"{sum(stats['tokens_per_step']):8d} {stats['prefix_cache_hit_tokens']:8d} "
                f"{stats.get('state_snapshot_hits', 0):9d} {off_s / seconds:6.2f}x  "
                f"{same}/{n} sequences identical to the cache-off run"
            )


if __name__ == "__main__":
    main()
