"""What the boundary probe (``nopad.packing.hf.boundary_probe``) costs: the one-off check at a model's
first packed or tree forward, ``verify`` or ``Generator``, that runs one row of two short sequences
twice and refuses a model whose second sequence moves when the first one changes.

For each model, in the same run: the first probe (cold: it also pays the first forward's one-time
warm-up of nopad's kernels, which the model's first real forward would otherwise pay), the median of
later probes (warm: what the probe itself costs), one plain forward of the same 12 tokens (sdpa, no
grad), one forward of the probe's packed row through nopad's attention (the probe runs two), and one
forward of 1024 tokens, for scale. Models: SmolLM2-135M (attention only)
and a tiny random Qwen3.5 (Gated DeltaNet + attention, through nopad's wrapped kernels).

    python benchmarks/bench_boundary_probe.py            # both models, 5 warm probes each
    python benchmarks/bench_boundary_probe.py --quick    # the tiny hybrid only
"""

from __future__ import annotations

import argparse
import contextlib
import sys
import time
from pathlib import Path
from statistics import median

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from anywhere

from benchmarks._tiny_configs import build_model  # noqa: E402
from nopad.packing.hf import boundary_probe, use_nopad_attention  # noqa: E402
from nopad.packing.varlen import VarlenMeta  # noqa: E402


def forward_ms(model, length: int, repeats: int, nopad: bool = False) -> float:
    """Median ms of one no-grad forward of ``length`` tokens: one sequence under the model's own
    attention (sdpa), or with ``nopad`` the probe's packed row through nopad's attention."""
    ids = (torch.arange(length) * 7 + 3) % model.config.vocab_size
    meta = VarlenMeta.from_lengths(boundary_probe.PROBE_LENGTHS)
    kwargs = dict(position_ids=meta.position_ids[None], nopad_meta=meta) if nopad else {}
    times = []
    with torch.no_grad(), use_nopad_attention(model) if nopad else contextlib.nullcontext():
        for _ in range(repeats + 1):
            start = time.perf_counter()
            model(input_ids=ids[None], use_cache=False, **kwargs)
            times.append((time.perf_counter() - start) * 1e3)
    return median(times[1:])


def measure(name: str, model, repeats: int) -> None:
    cold = boundary_probe.probe(model)
    assert cold.crossing is None and not cold.skipped, (cold.crossing, cold.skipped)
    warm = median(boundary_probe.probe(model).ms for _ in range(repeats))
    row = sum(boundary_probe.PROBE_LENGTHS)
    plain, packed = forward_ms(model, row, repeats), forward_ms(model, row, repeats, nopad=True)
    long = forward_ms(model, 1024, max(1, repeats // 2))
    print(
        f"{name:<28} probe cold {cold.ms:7.1f} ms, warm {warm:7.1f} ms | one forward of {row} tokens: "
        f"sdpa {plain:6.1f} ms, nopad packed {packed:6.1f} ms | 1024 tokens (sdpa) {long:7.1f} ms"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the tiny hybrid only")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    torch.set_num_threads(max(1, torch.get_num_threads()))
    print(
        f"torch {torch.__version__}, {torch.get_num_threads()} threads, cpu; probe row "
        f"{boundary_probe.PROBE_LENGTHS} tokens, run twice"
    )
    measure("tiny Qwen3.5 (hybrid, fp32)", build_model("qwen3_5"), args.repeats)
    if not args.quick:
        from nopad.assets.smollm2 import load_smollm2

        model, _ = load_smollm2()
        measure("SmolLM2-135M (fp32)", model, args.repeats)


if __name__ == "__main__":
    main()
