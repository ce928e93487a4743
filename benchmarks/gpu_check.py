"""One command that checks nopad on a CUDA machine and benchmarks it against what a user would use instead.

    python benchmarks/gpu_check.py            # on a CUDA machine: pytest -m gpu, then the benchmarks
    python benchmarks/gpu_check.py --quick    # the whole pipeline on CPU with tiny shapes (a smoke run)
    make gpu-check

Without CUDA (and without ``--quick``) it says so in one line and exits 0. Nothing is downloaded:
the models are built from inline configs of real shapes with random weights, the prompts are random
token ids, and the GRPO comparison uses a character-level tokenizer built here. It writes
``gpu_report.md`` and ``gpu_report.json`` (``--out`` picks the folder): the device and versions, the
attention backend chosen for each path, every figure with its peer and ratio, and each goal met or
missed. A benchmark that fails is recorded with its error and the others still run.
See benchmarks/README.md for carrying the wheels onto an offline GPU machine.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import inspect
import json
import logging
import os
import platform
import subprocess
import sys
import time
import traceback
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))  # run from anywhere
os.environ.setdefault("TRL_EXPERIMENTAL_SILENCE", "1")

from benchmarks import bench_generate, bench_train  # noqa: E402
from benchmarks._workloads import sync_device  # noqa: E402

log = logging.getLogger("gpu_check")

# Real shapes (the published configs), random weights.
MODELS = {
    "SmolLM2-135M": (
        "LlamaConfig",
        dict(
            hidden_size=576,
            num_hidden_layers=30,
            num_attention_heads=9,
            num_key_value_heads=3,
            intermediate_size=1536,
            vocab_size=49152,
            rope_theta=100000.0,
            tie_word_embeddings=True,
            max_position_embeddings=8192,
        ),
    ),
    "Qwen2.5-0.5B": (
        "Qwen2Config",
        dict(
            hidden_size=896,
            num_hidden_layers=24,
            num_attention_heads=14,
            num_key_value_heads=2,
            intermediate_size=4864,
            vocab_size=151936,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
    ),
    "Qwen2.5-1.5B": (
        "Qwen2Config",
        dict(
            hidden_size=1536,
            num_hidden_layers=28,
            num_attention_heads=12,
            num_key_value_heads=2,
            intermediate_size=8960,
            vocab_size=151936,
            rope_theta=1000000.0,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
    ),
    # the shape of the larger models people train with RL: for the decode-floor and generation goals
    # (``gpu_session.sh realshapes``), not in a default run (its memory and time)
    "Llama-3.1-8B": (
        "LlamaConfig",
        dict(
            hidden_size=4096,
            num_hidden_layers=32,
            num_attention_heads=32,
            num_key_value_heads=8,
            intermediate_size=14336,
            vocab_size=128256,
            rope_theta=500000.0,
            tie_word_embeddings=False,
            max_position_embeddings=8192,
        ),
    ),
}
DEFAULT_MODELS = ["SmolLM2-135M", "Qwen2.5-0.5B", "Qwen2.5-1.5B"]
# A hybrid of Qwen3.5's layout (3 Gated DeltaNet layers per full-attention layer, its 248,320
# vocabulary, value heads as many as key heads, 128-wide linear heads, 256-wide attention heads) at
# about 0.8B parameters: the hybrid training and generation goals (>= 2x), measured where fla runs.
HYBRID_MODELS = {
    "Qwen3.5-0.8B-like": (
        "Qwen3_5TextConfig",
        dict(
            hidden_size=1024,
            num_hidden_layers=24,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            intermediate_size=3584,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            vocab_size=248320,
            tie_word_embeddings=True,
            max_position_embeddings=32768,
        ),
    ),
    # the same layout at about 2B parameters (Qwen3.5-2B-like): the real-shape decode and generation part
    "Qwen3.5-2B-like": (
        "Qwen3_5TextConfig",
        dict(
            hidden_size=2048,
            num_hidden_layers=24,
            layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 6,
            num_attention_heads=8,
            num_key_value_heads=2,
            head_dim=256,
            intermediate_size=6144,
            linear_num_key_heads=16,
            linear_num_value_heads=16,
            linear_key_head_dim=128,
            linear_value_head_dim=128,
            linear_conv_kernel_dim=4,
            vocab_size=248320,
            tie_word_embeddings=True,
        ),
    ),
}
TINY_HYBRID = (
    "Qwen3_5TextConfig",
    dict(
        hidden_size=64,
        num_hidden_layers=4,
        layer_types=["linear_attention"] * 3 + ["full_attention"],
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        intermediate_size=128,
        linear_num_key_heads=2,
        linear_num_value_heads=4,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        vocab_size=512,
        max_position_embeddings=2048,
    ),
)
MODEL_CLASSES = {
    "LlamaConfig": "LlamaForCausalLM",
    "Qwen2Config": "Qwen2ForCausalLM",
    "Qwen3_5TextConfig": "Qwen3_5ForCausalLM",
}
TINY = (
    "LlamaConfig",
    dict(
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=128,
        vocab_size=512,
        max_position_embeddings=2048,
    ),
)

GOALS = {  # figure -> (comparison, threshold): "ge" ratio >= threshold, "le" ratio <= threshold
    "train_vs_padded": ("ge", 2.0),
    "train_vs_flatten": ("ge", 1.0),
    "generate_vs_hf_generate": ("ge", 3.0),
    "generate_vs_hf_cb": ("ge", 1.5),
    "decode_vs_floor_128": ("le", 1.5),
    "grpo_vs_trl": ("ge", 2.0),
    "hybrid_train_vs_padded": ("ge", 2.0),
    "hybrid_generate_vs_hf_generate": ("ge", 2.0),
}


def grpo_trainer_class():
    """NopadGRPOTrainer from wherever this tree keeps it (it may move from dataloaders/ to training/)."""
    for module in ("nopad.training.trl.grpo_trainer", "nopad.training.grpo_trainer", "nopad.dataloaders.grpo_trainer"):
        try:
            return importlib.import_module(module).NopadGRPOTrainer
        except ImportError:
            continue
    raise ImportError(
        "NopadGRPOTrainer is in none of nopad.training.trl.grpo_trainer, nopad.training.grpo_trainer, "
        "nopad.dataloaders.grpo_trainer"
    )


def build_model(spec, device: torch.device, dtype: torch.dtype, attn: str = "sdpa"):
    config_cls, fields = spec
    config = getattr(transformers, config_cls)(**fields)
    config._attn_implementation = attn
    torch.manual_seed(0)
    model_cls = getattr(transformers, MODEL_CLASSES[config_cls])
    with torch.device(device):
        model = model_cls(config)
    return model.to(dtype)


def ratio(ours: float, peer: float) -> float:
    return ours / peer if peer and peer > 0 else float("nan")


# ---------------------------------------------------------------------------------------------- environment


def environment(device: torch.device) -> dict:
    env = {
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(device),
        "gpu": None,
        "driver": None,
    }
    for pkg in ("triton", "transformers", "trl", "accelerate", "datasets", "flash_attn"):
        try:
            env[pkg] = importlib.import_module(pkg).__version__
        except Exception:  # not installed, or broken on this machine: say so, don't fail the check
            env[pkg] = None
    if device.type == "cuda":
        env["gpu"] = torch.cuda.get_device_name(device)
        try:
            query = ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"]
            smi = subprocess.run(query, capture_output=True, text=True, timeout=30)
            env["driver"] = smi.stdout.strip() or None
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    return env


def backends(device: torch.device, dtype: torch.dtype, block_size: int) -> dict:
    """The attention backend ``choose_backend`` picks for each path nopad runs."""
    from nopad.packing.attention import choose_backend

    paths = {
        "training (grad)": dict(grad=True),
        "training, softcap": dict(grad=True, softcap=30.0),
        "training, sliding window": dict(grad=True, sliding_window=128),
        "shared-prefix rows": dict(grad=True, shared_prefix=True),
        "generation prefill/decode (paged)": dict(paged=True, block_size=block_size),
        "generation, softcap (paged)": dict(paged=True, block_size=block_size, softcap=30.0),
    }
    out = {}
    for name, kw in paths.items():
        try:
            out[name] = choose_backend(device, dtype, **kw)
        except Exception as exc:  # a path this machine cannot run: record why
            out[name] = f"error: {exc}"
    return out


# quickest first; the hybrid file compiles (and autotunes) fla's kernels on first use: minutes
GPU_TEST_FILES = (
    "tests/gpu/test_gpu.py",
    "tests/packing/test_packing_triton_attention.py",
    "tests/gpu/test_gpu_hybrid.py",
)


def run_pytest_gpu(quick: bool, log_dir: Path) -> dict:
    """The GPU tests (marker ``gpu``) and the Triton kernel tests (they run natively on CUDA), in
    subprocesses, each file on its own so a slow or failing one does not hide the others. Each
    file's whole output goes to ``log_dir`` as it runs: a run cut by a time limit keeps what it
    printed (pytest prints failures only at the end)."""
    if quick:  # the smoke run only checks the step is wired: collect, don't run (they skip without CUDA)
        commands = [["-q", "-m", "gpu", "--co", "tests/gpu/test_gpu.py"]]
    else:
        # no -x: every test's result is recorded; a per-test limit, so one stuck in fla's first-call
        # autotuning (minutes) does not take the rest of the file with it
        commands = [["-m", "slow or not slow", "-v", "--tb=short", "--timeout", "150", path] for path in GPU_TEST_FILES]
    runs = []
    for extra in commands:
        cmd = [sys.executable, "-m", "pytest", "-p", "no:cacheprovider", *extra]  # -v: one line a test
        log = log_dir / f"pytest_{Path(extra[-1]).stem}.log"
        with open(log, "w") as sink:
            proc = subprocess.run(cmd, cwd=ROOT, stdout=sink, stderr=subprocess.STDOUT, timeout=3600)
        lines = log.read_text().strip().splitlines()
        runs.append(
            {
                "command": " ".join(cmd[2:]),
                "returncode": proc.returncode,
                "log": str(log),
                "summary": lines[-1] if lines else "",
                "failures": [line for line in lines if " FAILED" in line],
            }
        )
    return {"runs": runs, "returncode": max(r["returncode"] for r in runs)}


# ---------------------------------------------------------------------------------------------- training


def _to(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device) if hasattr(v, "to") and not isinstance(v, bool) else v for k, v in batch.items()}


def bench_training(spec, device, dtype, n_seqs: int, budget: int, cap: int) -> dict:
    """Forward+backward real tokens/s: nopad packed vs padded (sdpa) vs DataCollatorWithFlattening."""
    from nopad.packing.hf import register_nopad_attention

    register_nopad_attention()
    model = build_model(spec, device, dtype).train()
    lengths = bench_train.make_lengths(n_seqs, cap, seed=0)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    seqs = [torch.randint(0, vocab, (int(n),), generator=g) for n in lengths]
    real = int(lengths.sum())
    flatten_attn = "flash_attention_2" if _has("flash_attn") and device.type == "cuda" else "sdpa"
    rows = {
        "padded (sdpa)": ("sdpa", bench_train.padded_batches(seqs, budget)),
        f"DataCollatorWithFlattening ({flatten_attn})": (flatten_attn, bench_train.flattened_batches(seqs, budget)),
        "nopad packed": ("nopad", bench_train.nopad_batches(seqs, budget)),
    }
    results = {}
    for name, (impl, batches) in rows.items():
        batches = [_to(b, device) for b in batches]
        sync_device(device)
        results[name] = bench_train.run(model, impl, batches, real)
        sync_device(device)
    ours = results["nopad packed"]["tok_s"]
    padded = results["padded (sdpa)"]["tok_s"]
    flat = next(v["tok_s"] for k, v in results.items() if k.startswith("DataCollator"))
    del model
    return {
        "systems": results,
        "real_tokens": real,
        "figures": {
            "train_vs_padded": _figure(ours, padded, "tok/s", "padded (sdpa)"),
            "train_vs_flatten": _figure(ours, flat, "tok/s", f"flattening ({flatten_attn})"),
        },
    }


def _has(module: str) -> bool:
    try:
        importlib.import_module(module)
        return True
    except Exception:
        return False


def _figure(ours: float, peer: float, unit: str, peer_name: str) -> dict:
    return {"nopad": ours, "peer": peer, "peer_name": peer_name, "unit": unit, "ratio": ratio(ours, peer)}


def bench_hybrid(spec, device, dtype, train: dict, gen: dict, count: int, block_size: int) -> dict:
    """The hybrid goals (>= 2x) on a hybrid model: packed training vs padded batches, and the Generator vs
    HF ``generate`` (HF's continuous batching keeps no recurrent state: not a peer here). Each half
    is reported on its own, so a failing one does not hide the other."""
    out = {}
    try:
        with _hf_delta_rule_trainable(spec, device) as fla_refusal:
            training = bench_training(spec, device, dtype, *train.values())
        figures = training.pop("figures")
        training["figures"] = {
            "hybrid_train_vs_padded": figures["train_vs_padded"],
            "hybrid_train_vs_flatten": figures["train_vs_flatten"],
        }  # reported, no goal
        if fla_refusal:
            training["note"] = (
                "fla's gated backward refuses this GPU, so both sides trained on the torch "
                f"delta rule (nopad's reference, transformers' own): {fla_refusal}"
            )
        out["training"] = training
    except Exception as exc:  # noqa: BLE001 - reported, and generation still runs
        log.exception("hybrid training failed")
        out["training"] = {"error": f"{type(exc).__name__}: {exc}"}
    generation = bench_generation(
        spec, device, dtype, [count], gen["new_range"], gen["prompt_range"], block_size, False
    )
    for entry in generation.values():
        entry["hybrid_generate_vs_hf_generate"] = entry.pop("generate_vs_hf_generate")
    out["generation"] = generation
    return out


@contextlib.contextmanager
def _hf_delta_rule_trainable(spec, device):
    """Where fla is installed but its backward refuses this GPU (fla 0.6 on Hopper under Triton 3.4
    to 3.7.0, fla #640), transformers' own layer raises in every backward (it calls fla whenever
    it is installed) while nopad trains on its reference: the padded peer gets transformers' torch
    rule for the training benchmark, as a user there would have to. Yields fla's error, or None."""
    from nopad.packing.mixers.delta_rule import fla_backward_error
    from nopad.packing.mixers.hf_kernels import dispatcher

    error = fla_backward_error(device) if device.type == "cuda" else None
    module = sys.modules[getattr(transformers, MODEL_CLASSES[spec[0]]).__module__]
    original = getattr(module, "torch_chunk_gated_delta_rule", None)
    if error is None or original is None:
        yield None
        return
    module.torch_chunk_gated_delta_rule = dispatcher("chunk_gated_delta_rule", inspect.unwrap(original))
    try:
        yield error
    finally:
        module.torch_chunk_gated_delta_rule = original


# ---------------------------------------------------------------------------------------------- generation


def random_prompts(n: int, vocab: int, lo: int, hi: int, new_lo: int, new_hi: int, seed: int):
    rng = np.random.default_rng(seed)
    prompts = [rng.integers(0, vocab, int(rng.integers(lo, hi + 1))).tolist() for _ in range(n)]
    max_new = [int(rng.integers(new_lo, new_hi + 1)) for _ in range(n)]
    return prompts, max_new


def bench_generation(spec, device, dtype, counts, new_range, prompt_range, block_size: int, cb: bool) -> dict:
    """Output tok/s at each sequence count: nopad vs HF generate (padded) vs HF continuous batching."""
    model = build_model(spec, device, dtype).eval()
    out = {}
    for n in counts:
        prompts, max_new = random_prompts(n, model.config.vocab_size, *prompt_range, *new_range, seed=n)
        args = SimpleNamespace(block_size=block_size, max_batch_tokens=max(2048, 16 * n), max_seqs=n)
        with torch.no_grad():
            nopad, _ = bench_generate.run_nopad(model, None, prompts, max_new, args)
            overlapped, _ = bench_generate.run_nopad(
                model, None, prompts, max_new, SimpleNamespace(**vars(args), overlap=True)
            )
            hf = bench_generate.run_hf_static(model, prompts, max_new, n, pad_id=0)
        entry = {
            "nopad_tok_s": nopad.tok_s,
            "nopad_overlap_tok_s": overlapped.tok_s,
            "hf_generate_tok_s": hf.tok_s,
            "generate_vs_hf_generate": _figure(nopad.tok_s, hf.tok_s, "out tok/s", "HF generate (padded)"),
            "overlap_vs_hf_generate": _figure(overlapped.tok_s, hf.tok_s, "out tok/s", "HF generate (padded)"),
        }
        if cb:
            try:
                gen_config = transformers.GenerationConfig(
                    do_sample=False, max_new_tokens=max(max_new), eos_token_id=-1, pad_token_id=0
                )
                hf_cb = bench_generate.run_hf_cb(
                    model, prompts, max_new, gen_config=gen_config, max_batch_tokens=args.max_batch_tokens, max_seqs=n
                )
                entry["generate_vs_hf_cb"] = _figure(nopad.tok_s, hf_cb.tok_s, "out tok/s", "HF generate_batch (CB)")
            except Exception as exc:
                entry["generate_vs_hf_cb"] = {"error": f"{type(exc).__name__}: {exc}"}
        out[str(n)] = entry
    del model
    return out


# ---------------------------------------------------------------------------------------------- decode floor


def copy_bandwidth(device: torch.device, nbytes: int, repeats: int = 5) -> float:
    """Device-to-device bytes/s of a big ``copy_`` (read + write counted)."""
    src = torch.empty(nbytes // 2, dtype=torch.bfloat16, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    sync_device(device)
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    sync_device(device)
    return 2 * nbytes * repeats / (time.perf_counter() - start)


def _decoding_generator(
    model,
    n: int,
    prompt_range,
    block_size: int,
    new_tokens: int,
    graph_draws: bool | None = None,
    sampling: dict | None = None,
    **gen_kwargs,
):
    """A Generator with ``n`` sequences all past prefill (every step from here is a pure decode step
    of ``n`` rows). Its KV cache holds all of them for ``new_tokens`` more tokens: the default 1 GiB
    held 168 of SmolLM2's 256, so "256 rows" ran 168, then 160 after a preemption. ``graph_draws``:
    whether a compiled step draws its rows inside its graph (:mod:`nopad.inference.graph_sampler`);
    ``sampling``: the rows' sampling parameters (default greedy)."""
    from nopad.inference.generator import Generator
    from nopad.inference.sampling_params import SamplingParams

    prompts, _ = random_prompts(n, model.config.vocab_size, *prompt_range, 1, 1, seed=n)
    # every context stays inside one power-of-two block-table width for the whole run: a table
    # outgrowing its bucket mid-run times a CUDA-graph recording (the H100's 128 rows did, 32 -> 33)
    width = block_size * 2 ** int(np.log2(max(1, prompt_range[1] // block_size)))
    prompts = [p[: max(1, width - new_tokens)] for p in prompts]
    budget = max(2048, sum(map(len, prompts)))
    blocks = sum(-(-(len(p) + new_tokens) // block_size) for p in prompts)
    gen = Generator(
        model,
        None,
        block_size=block_size,
        max_num_batched_tokens=budget,
        max_num_seqs=n,
        num_blocks=blocks,
        **gen_kwargs,
    )
    if graph_draws is not None:  # the draw inside the compiled graph (on by default on CUDA) or after it
        gen._ensure_runner().graph_draws = graph_draws
    endless = SamplingParams(**{"temperature": 0.0, **(sampling or {})}, max_tokens=10_000, ignore_eos=True)
    ids = [gen.add_request(p, endless) for p in prompts]
    gen.step()  # one step prefills all of them (the budget holds every prompt)
    return gen, prompts, ids


def close(gen, ids) -> None:
    """Abort the endless requests, collect their outputs, and give the K/V memory back."""
    for rid in ids:
        gen.abort(rid)
    gen.step()
    gen.release()


def step_kv_bytes(model, context_lens: list[int], dtype: torch.dtype) -> int:
    cfg = model.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * head_dim * sum(context_lens) * dtype.itemsize


WARMUP_STEPS = 3


def _compile_events() -> dict[str, int]:
    """Dynamo compilations and CUDA-graph recordings so far (torch's own counters)."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "compiles": counters["stats"]["unique_graphs"],
        "cudagraph_recordings": len(compilation_time_metrics.get("CUDAGraphNode.record", [])),
        "cudagraph_skips": counters["inductor"]["cudagraph_skips"],
    }


def time_decode(gen, device, steps: int) -> tuple[float, dict]:
    """Median seconds per decode step, and what happened in the timed steps: compilations (0 after
    the warm-up), CUDA-graph recordings (one per bucket first reached here), decode steps that ran
    padded, the buckets, and the mean and slowest step."""
    # attention held across the steps, as generate() and run() hold it: a bare gen.step() also
    # switches the model's attention implementation to nopad and back (bench_decode_host.py times both)
    with gen.live.attention():
        for _ in range(WARMUP_STEPS):  # warm-up (compilation and graph capture when static)
            gen.step()
        sync_device(device)
        before, static_before = _compile_events(), gen._runner.static_steps
        drawn_before = gen.stats()["graph_draw_steps"]
        times = []
        for _ in range(steps):  # a step ends on the host reading its sampled tokens: timed one by one
            start = time.perf_counter()
            gen.step()
            if not gen.overlap:  # overlapped, a step returns with the next one launched: each call
                sync_device(device)  # waits for the step before it, so its time is the pipeline's per step
            times.append(time.perf_counter() - start)
    # the median: a step that records a CUDA graph for a bucket first reached here (the block table
    # outgrowing its width mid-run) or meets a slow first call is one step, not the figure
    seconds = float(np.median(times))
    events = {k: v - before[k] for k, v in _compile_events().items()}
    events["mean_step_ms"], events["max_step_ms"] = 1e3 * float(np.mean(times)), 1e3 * max(times)
    events["static_steps"] = gen._runner.static_steps - static_before
    events["graph_draw_steps"] = gen.stats()["graph_draw_steps"] - drawn_before
    events["buckets"] = sorted(gen._runner.static_shapes)
    return seconds, {"timed_steps": events}


def bench_decode_floor(
    spec, device, dtype, counts, prompt_range, block_size: int, steps: int, bw_bytes: int, goal_count: int = 128
) -> dict:
    """Decode step time vs its floor, (weight bytes + step K/V bytes) / copy bandwidth, with and
    without CUDA graphs."""
    model = build_model(spec, device, dtype).eval()
    bandwidth = copy_bandwidth(device, bw_bytes)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    variants = {"eager": {}, "eager + overlap": dict(overlap=True)}
    if device.type == "cuda":
        variants["static_decode"] = dict(static_decode=True)
        variants["compile_decode (CUDA graphs)"] = dict(compile_decode=True)
        variants["compile_decode + overlap"] = dict(compile_decode=True, overlap=True)
    out = {"bandwidth_GBps": bandwidth / 1e9, "weight_bytes": weight_bytes, "counts": {}}
    for n in counts:
        row, at_goal = {}, {}
        if device.type == "cuda" and n == goal_count:  # item 3's gain: the same step, drawn after the graph
            top_p = dict(temperature=0.7, top_p=0.95, seed=0)  # a sampled, filtered step (the eager draw syncs)
            at_goal = {
                "compile_decode + overlap, draw after the graph": dict(
                    compile_decode=True, overlap=True, graph_draws=False
                ),
                "compile_decode + overlap, T=0.7 top-p 0.95": dict(compile_decode=True, overlap=True, sampling=top_p),
                "compile_decode + overlap, T=0.7 top-p 0.95, draw after the graph": dict(
                    compile_decode=True, overlap=True, graph_draws=False, sampling=top_p
                ),
                # greedy rows with a repetition penalty: the kept device mask, read inside the graph
                "compile_decode + overlap, repetition penalty 1.1": dict(
                    compile_decode=True, overlap=True, sampling=dict(temperature=0.0, repetition_penalty=1.1)
                ),
            }
        for name, kw in {**variants, **at_goal}.items():
            try:
                with torch.no_grad():
                    gen, prompts, ids = _decoding_generator(
                        model, n, prompt_range, block_size, WARMUP_STEPS + steps + 2, **kw
                    )
                    seconds, events = time_decode(gen, device, steps)
                    close(gen, ids)
                ctx = [len(p) + 4 + steps // 2 for p in prompts]  # mean context over the timed steps
                floor = (weight_bytes + step_kv_bytes(model, ctx, dtype)) / bandwidth
                row[name] = {"step_ms": seconds * 1e3, "floor_ms": floor * 1e3, "ratio": seconds / floor, **events}
            except Exception as exc:
                row[name] = {"error": f"{type(exc).__name__}: {exc}"}
        out["counts"][str(n)] = row
    best = [v["ratio"] for v in out["counts"].get(str(goal_count), {}).values() if "ratio" in v]
    if best:
        out["figures"] = {
            "decode_vs_floor_128": {
                "nopad": min(best),
                "peer": 1.0,
                "peer_name": "floor",
                "unit": f"x floor at {goal_count} seqs",
                "ratio": min(best),
            }
        }
    del model
    return out


def bench_host_overhead(spec, device, dtype, n: int, prompt_range, block_size: int, steps: int) -> dict:
    """Share of a decode step's wall time the GPU is idle (kernel intervals from torch.profiler)."""
    if device.type != "cuda":
        return {"idle_share": "n/a on CPU"}
    from torch.profiler import ProfilerActivity, profile

    model = build_model(spec, device, dtype).eval()
    out = {}
    variants = {
        "eager": {},
        "compile_decode (CUDA graphs)": dict(compile_decode=True),
        "compile_decode + overlap": dict(compile_decode=True, overlap=True),
        "compile_decode + overlap, draw after the graph": dict(compile_decode=True, overlap=True, graph_draws=False),
    }
    for name, kw in variants.items():
        with torch.no_grad():
            gen, _, ids = _decoding_generator(model, n, prompt_range, block_size, WARMUP_STEPS + steps + 2, **kw)
            for _ in range(WARMUP_STEPS):  # a new Generator's cache records its bucket's graph again
                gen.step()
            sync_device(device)
            activities = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
            with gen.live.attention(), profile(activities=activities) as prof:  # held, as in time_decode
                start = time.perf_counter()
                for _ in range(steps):
                    gen.step()
                sync_device(device)
                wall_us = (time.perf_counter() - start) * 1e6
            kernels = [e for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
            busy_us = _busy_us(kernels)
            out[name] = {
                "idle_share": max(0.0, 1 - busy_us / wall_us),
                "step_ms": wall_us / steps / 1e3,
                "top_kernels_us_per_step": _top_kernels(kernels, steps),
            }
            close(gen, ids)
    del model
    return out


def _top_kernels(events, steps: int, top: int = 8) -> dict[str, float]:
    """Where the GPU time of a step goes: the kernels with the most time, in microseconds per step."""
    totals: dict[str, float] = {}
    for e in events:
        totals[e.name] = totals.get(e.name, 0.0) + e.time_range.end - e.time_range.start
    ranked = sorted(totals.items(), key=lambda kv: -kv[1])[:top]
    return {name[:80]: us / steps for name, us in ranked}


def _busy_us(events) -> float:
    """Length of the union of the device events' [start, end) intervals."""
    spans = sorted((e.time_range.start, e.time_range.end) for e in events)
    busy, cur_start, cur_end = 0.0, None, None
    for s, e in spans:
        if cur_end is None or s > cur_end:
            if cur_end is not None:
                busy += cur_end - cur_start
            cur_start, cur_end = s, e
        else:
            cur_end = max(cur_end, e)
    if cur_end is not None:
        busy += cur_end - cur_start
    return busy


# ---------------------------------------------------------------------------------------------- GRPO


def char_tokenizer():
    """A character-level fast tokenizer with a chat template, built offline (TRL needs a real one)."""
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {"<pad>": 0, "<eos>": 1}
    for i in range(32, 127):
        vocab[chr(i)] = len(vocab)
    vocab["\n"] = len(vocab)
    core = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    core.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", eos_token="<eos>")
    tok.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant: {% endif %}"
    )
    return tok


def bench_grpo(spec, device, dtype, cfg: dict, out_dir: Path) -> dict:
    """Seconds per GRPO step: NopadGRPOTrainer vs TRL GRPOTrainer's default generation, same config."""
    import datasets
    from trl import GRPOConfig, GRPOTrainer

    from benchmarks.bench_trl import GRPO_QUESTIONS, StepClock, _steady, reward_digits

    nopad_cls = grpo_trainer_class()
    tok = char_tokenizer()
    prompts = [[{"role": "user", "content": q}] for q in (GRPO_QUESTIONS * 8)[: cfg["prompts"]]]
    results = {}
    for name, cls in (("TRL GRPOTrainer", GRPOTrainer), ("NopadGRPOTrainer", nopad_cls)):
        model = build_model(spec, device, dtype).train()
        settings = dict(
            output_dir=str(out_dir / name),
            per_device_train_batch_size=cfg["G"],
            num_generations=cfg["G"],
            max_completion_length=cfg["new_tokens"],
            max_steps=cfg["steps"],
            learning_rate=1e-6,
            logging_steps=1,
            report_to=[],
            use_cpu=device.type != "cuda",
            bf16=dtype == torch.bfloat16,
            save_strategy="no",
            seed=0,
            beta=0.0,
            temperature=1.0,
            gradient_checkpointing=False,
        )
        clock = StepClock()
        trainer = cls(
            model=model,
            reward_funcs=reward_digits,
            args=GRPOConfig(**settings),
            train_dataset=datasets.Dataset.from_dict({"prompt": prompts}),
            processing_class=tok,
            callbacks=[clock],
        )
        trainer.train()
        results[name] = {"s_per_step": _steady(clock.times)}
        del trainer, model
    ours, peer = results["NopadGRPOTrainer"]["s_per_step"], results["TRL GRPOTrainer"]["s_per_step"]
    return {
        "systems": results,
        "figures": {
            "grpo_vs_trl": {
                "nopad": ours,
                "peer": peer,
                "peer_name": "TRL GRPOTrainer",
                "unit": "s/step",
                "ratio": ratio(peer, ours),
            }
        },
    }


# ---------------------------------------------------------------------------------------------- report


def guarded(report: dict, key: str, fn, *args) -> None:
    """Run one benchmark; a failure is recorded (with its error) and the check goes on."""
    start = time.perf_counter()
    try:
        report[key] = fn(*args)
    except Exception as exc:
        log.error("%s failed: %s", key, exc)
        report[key] = {"error": f"{type(exc).__name__}: {exc}", "traceback": traceback.format_exc(limit=4)}
    log.info("%s done in %.1f s", key, time.perf_counter() - start)


def collect_goals(report: dict) -> dict:
    """Every goal, the worst figure for it across models and counts, met or missed."""
    found: dict[str, list[tuple[str, float]]] = {}

    def walk(node, where):
        if isinstance(node, dict):
            for k, v in node.items():
                if k in GOALS and isinstance(v, dict) and isinstance(v.get("ratio"), float):
                    found.setdefault(k, []).append((where, v["ratio"]))
                else:
                    walk(v, f"{where}/{k}" if where else k)

    walk(report, "")
    goals = {}
    for name, (op, threshold) in GOALS.items():
        figures = [(w, r) for w, r in found.get(name, []) if r == r]  # drop NaN
        if not figures:
            goals[name] = {"threshold": threshold, "op": op, "status": "not measured"}
            continue
        where, worst = (min if op == "ge" else max)(figures, key=lambda t: t[1])
        met = worst >= threshold if op == "ge" else worst <= threshold
        goals[name] = {
            "threshold": threshold,
            "op": op,
            "worst": worst,
            "where": where,
            "status": "met" if met else "missed",
        }
    return goals


def write_reports(report: dict, out: Path) -> None:
    """``gpu_report.json`` and ``gpu_report.md`` in ``out``, with the goals met or missed so far."""
    report["goals"] = collect_goals(report)
    (out / "gpu_report.json").write_text(json.dumps(report, indent=1, default=str))
    write_markdown(report, out / "gpu_report.md")


def write_markdown(report: dict, path: Path) -> None:
    env = report["environment"]
    lines = [f"# nopad GPU check ({'quick smoke run' if report['quick'] else 'full run'})", "", "| | |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in env.items()]
    lines += ["", "## Attention backend per path", "", "| path | backend |", "|---|---|"]
    lines += [f"| {k} | {v} |" for k, v in report["backends"].items()]
    lines += ["", "## Tests", ""]
    for r in report.get("pytest", {}).get("runs", []):
        lines.append(f"- `{r['command']}`: rc {r['returncode']}, {r['summary']}")
        lines += [f"  - {failure}" for failure in r.get("failures", [])]
    lines += ["", "## Goals", "", "| goal | need | worst measured | where | status |", "|---|---|---|---|---|"]
    for name, g in report["goals"].items():
        need = ("≥ " if g["op"] == "ge" else "≤ ") + f"{g['threshold']}x"
        worst = f"{g['worst']:.2f}x" if "worst" in g else "-"
        lines.append(f"| {name} | {need} | {worst} | {g.get('where', '-')} | {g['status']} |")
    lines += ["", "## Figures", "", "| where | nopad | peer | peer value | ratio |", "|---|---|---|---|---|"]
    for where, fig in _figures(report):
        lines.append(
            f"| {where} | {fig['nopad']:.4g} {fig['unit']} | {fig['peer_name']} | "
            f"{fig['peer']:.4g} | {fig['ratio']:.2f}x |"
        )
    lines += ["", "## Host overhead (share of a decode step's wall time the GPU is idle)", ""]
    for label, res in report.get("models", {}).items():
        for variant, v in res.get("host_overhead", {}).items():
            share = v.get("idle_share") if isinstance(v, dict) else v
            share = f"{share:.1%}" if isinstance(share, float) else share
            lines.append(f"- {label}, {variant}: {share}")
    lines += [
        "",
        "## Raw",
        "",
        "```json",
        json.dumps({k: v for k, v in report.items() if k != "environment"}, indent=1, default=str),
        "```",
        "",
    ]
    path.write_text("\n".join(lines))


def _figures(node, where=""):
    if isinstance(node, dict):
        for k, v in node.items():
            if isinstance(v, dict) and {"nopad", "peer", "ratio"} <= v.keys():
                yield (f"{where}/{k}" if where else k), v
            elif k != "goals":
                yield from _figures(v, f"{where}/{k}" if where else k)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--quick", action="store_true", help="the whole pipeline on CPU with tiny shapes")
    parser.add_argument("--out", type=Path, default=Path("."), help="folder for gpu_report.md / .json")
    parser.add_argument(
        "--skip", nargs="*", default=[], choices=["pytest", "train", "generate", "decode", "host", "grpo", "hybrid"]
    )
    parser.add_argument("--models", nargs="*", default=DEFAULT_MODELS, choices=list(MODELS))
    parser.add_argument(
        "--hybrid-models",
        nargs="*",
        default=["Qwen3.5-0.8B-like"],
        choices=list(HYBRID_MODELS),
        help="hybrid models for the >= 2x goals (training and generation only)",
    )
    parser.add_argument(
        "--decode-counts",
        nargs="+",
        type=int,
        default=[64, 128, 256],
        help="sequence counts of the decode-floor step (the goal is read at 128)",
    )
    args = parser.parse_args(argv)
    if min(args.decode_counts) < 1:
        parser.error("--decode-counts: each count is a number of sequences, at least 1")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not torch.cuda.is_available() and not args.quick:
        print("gpu_check: no CUDA device on this machine; nothing to check (use --quick for a CPU smoke run)")
        return 0
    device = torch.device("cuda" if torch.cuda.is_available() and not args.quick else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    if args.quick:
        torch.set_num_threads(1)
        specs, hybrids = {"tiny": TINY}, {"tiny-hybrid": TINY_HYBRID}
        counts, floor_counts, block = [4], [4], 16
        train = dict(n_seqs=12, budget=256, cap=128)
        gen = dict(new_range=(2, 6), prompt_range=(4, 16))
        steps, bw_bytes, grpo = 2, 1 << 20, dict(prompts=2, G=2, new_tokens=4, steps=1)
        hybrid = dict(train=train, gen=gen, count=4)
    else:
        specs = {m: MODELS[m] for m in args.models}
        hybrids = {m: HYBRID_MODELS[m] for m in args.hybrid_models}
        from nopad.packing.attention import paged_block_size

        counts, floor_counts, block = [64, 128, 256], args.decode_counts, paged_block_size(device, dtype)
        train = dict(n_seqs=256, budget=4096, cap=2048)  # padded logits stay well inside 80 GB
        gen = dict(new_range=(32, 512), prompt_range=(16, 512))
        steps, bw_bytes, grpo = 20, 1 << 30, dict(prompts=16, G=8, new_tokens=256, steps=4)
        hybrid = dict(
            train=dict(n_seqs=128, budget=4096, cap=2048),
            gen=dict(new_range=(32, 256), prompt_range=(16, 512)),
            count=64,
        )
    report: dict = {"quick": args.quick, "environment": environment(device), "backends": backends(device, dtype, block)}
    args.out.mkdir(parents=True, exist_ok=True)

    def step(target: dict, key: str, fn, *fn_args) -> None:
        """One benchmark, then the report so far on disk (a run cut off by a time limit keeps it)."""
        guarded(target, key, fn, *fn_args)
        write_reports(report, args.out)

    if "pytest" not in args.skip:
        step(report, "pytest", run_pytest_gpu, args.quick, args.out)
    out_dir = Path("/tmp/nopad_gpu_check")
    for label, spec in specs.items():
        res: dict = report.setdefault("models", {}).setdefault(label, {})
        if "train" not in args.skip:
            step(res, "training", bench_training, spec, device, dtype, *train.values())
        if "generate" not in args.skip:
            step(
                res,
                "generation",
                bench_generation,
                spec,
                device,
                dtype,
                counts,
                gen["new_range"],
                gen["prompt_range"],
                block,
                True,
            )
        if "decode" not in args.skip:
            step(
                res,
                "decode_floor",
                bench_decode_floor,
                spec,
                device,
                dtype,
                floor_counts,
                gen["prompt_range"],
                block,
                steps,
                bw_bytes,
                floor_counts[-1] if args.quick else 128,
            )
        if "host" not in args.skip:
            step(
                res,
                "host_overhead",
                bench_host_overhead,
                spec,
                device,
                dtype,
                4 if args.quick else 128,
                gen["prompt_range"],
                block,
                steps,
            )
        if device.type == "cuda":
            torch.cuda.empty_cache()
    if "hybrid" not in args.skip:
        for label, spec in hybrids.items():
            step(
                report.setdefault("hybrid", {}),
                label,
                bench_hybrid,
                spec,
                device,
                dtype,
                hybrid["train"],
                hybrid["gen"],
                hybrid["count"],
                block,
            )
    if "grpo" not in args.skip:  # the smallest model: the comparison is about the loop, not the size
        first = next(iter(specs.values()))
        step(report, "grpo", bench_grpo, first, device, dtype, grpo, out_dir)
    write_reports(report, args.out)
    print(f"gpu_check: wrote {args.out / 'gpu_report.md'} and gpu_report.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
