"""Real fla's ``chunk_gated_delta_rule`` on the CPU under the Triton interpreter, against
transformers' torch function per sequence and through nopad's ``varlen_delta_rule``: a packed row
of three sequences (one longer than a 64-token chunk, one of one token), each from its own
initial state, two query/key heads for four value heads; outputs, final states and every input's
gradient. Run by tests/packing/test_packing_hybrid.py when fla is installed (CI has no fla):

    python tests/support/fla_interpret.py SCRATCH_DIR

Two things make fla 0.6 run there, both here and nowhere else: the autotuner keeps each
kernel's first configuration (it would time them all, on no GPU), and fla is copied into
SCRATCH_DIR with ``i_t.to(tl.int64)`` written ``tl.cast(i_t, tl.int64)`` (a ``range()`` loop
index is a Python int under the interpreter, which has no ``.to``; compiled, both are the same).
Prints the worst differences; exits 1 when one is over 1e-5.
"""

from __future__ import annotations

import importlib.util
import os
import re
import shutil
import sys
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "1"  # read when triton is imported
ROOT = Path(__file__).resolve().parents[2]


def patched_fla(scratch: Path) -> Path:
    """A copy of the installed fla whose loop indices the interpreter can cast."""
    source = Path(importlib.util.find_spec("fla").submodule_search_locations[0])
    target = scratch / "fla"
    shutil.copytree(source, target, dirs_exist_ok=True, ignore=shutil.ignore_patterns("__pycache__"))
    for path in target.rglob("*.py"):
        text = path.read_text()
        if "i_t.to(tl.int64)" in text:
            path.write_text(re.sub(r"\bi_t\.to\(tl\.int64\)", "tl.cast(i_t, tl.int64)", text))
    return scratch


def main(scratch: Path) -> int:
    sys.path[:0] = [str(patched_fla(scratch)), str(ROOT)]
    from triton.runtime import autotuner

    prune = autotuner.Autotuner.prune_configs
    autotuner.Autotuner.prune_configs = lambda self, kwargs: prune(self, kwargs)[:1]

    import functools

    import fla.ops.gated_delta_rule as fla_module
    import torch
    import torch.nn.functional as F
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule

    reached = []  # nopad's calls of fla (it looks the function up on the module)

    @functools.wraps(chunk_gated_delta_rule)
    def counted(*args, **kwargs):
        reached.append(kwargs.get("cu_seqlens"))
        return chunk_gated_delta_rule(*args, **kwargs)

    fla_module.chunk_gated_delta_rule = counted
    from transformers.models.qwen3_5 import modeling_qwen3_5

    from nopad.packing.mixers import varlen_delta_rule
    from nopad.packing.mixers.kernels import KERNELS_ENV
    from nopad.packing.varlen import VarlenMeta

    torch_rule = modeling_qwen3_5.torch_chunk_gated_delta_rule
    while hasattr(torch_rule, "__wrapped__"):
        torch_rule = torch_rule.__wrapped__
    g = torch.Generator().manual_seed(0)
    lengths, heads, v_heads, dim = [5, 70, 1], 2, 4, 16
    total, n = sum(lengths), len(lengths)
    inputs = [
        torch.randn(1, total, heads, dim, generator=g),
        torch.randn(1, total, heads, dim, generator=g),
        torch.randn(1, total, v_heads, dim, generator=g),
        F.logsigmoid(torch.randn(1, total, v_heads, generator=g)),  # decay in log space
        torch.rand(1, total, v_heads, generator=g),
        torch.randn(n, v_heads, dim, dim, generator=g),
    ]
    weights = torch.randn(1, total, v_heads, dim, generator=g), torch.randn(n, v_heads, dim, dim, generator=g)
    cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()])

    def run(rule):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out, final = rule(*leaves)
        ((out * weights[0]).sum() + (final * weights[1]).sum()).backward()
        return [out.detach(), final.detach(), *(t.grad for t in leaves)]

    def fla(q, k, v, decay, beta, h0):
        return chunk_gated_delta_rule(
            q, k, v, decay, beta, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu
        )

    def alone(q, k, v, decay, beta, h0):
        parts = [
            torch_rule(
                *(t[:, a:b] for t in (q, k, v, decay, beta)),
                initial_state=h0[i : i + 1],
                output_final_state=True,
                use_qk_l2norm_in_kernel=True,
            )
            for i, (a, b) in enumerate(zip(cu[:-1].tolist(), cu[1:].tolist()))
        ]
        return torch.cat([p[0] for p in parts], dim=1), torch.cat([p[1] for p in parts])

    def nopad(q, k, v, decay, beta, h0):
        return varlen_delta_rule(
            torch_rule,
            q,
            k,
            v,
            decay,
            beta,
            meta=VarlenMeta.from_lengths(lengths),
            initial_state=h0,
            output_final_state=True,
            use_qk_l2norm_in_kernel=True,
        )

    names = ["output", "final state", "dq", "dk", "dv", "dg", "dbeta", "dh0"]
    want = run(alone)
    os.environ[KERNELS_ENV] = "package"  # nopad's dispatch to fla on the CPU
    results = {"fla": run(fla), "nopad -> fla": run(nopad)}
    worst = 0.0
    for label, got in results.items():
        gaps = {
            name: float((a - b).abs().max() / max(1.0, float(b.abs().max()))) for name, a, b in zip(names, got, want)
        }
        worst = max(worst, *gaps.values())
        print(
            f"{label} vs transformers' torch rule per sequence: "
            + ", ".join(f"{name} {gap:.1e}" for name, gap in gaps.items())
        )
    print(f"nopad called fla {len(reached)} times (one of them its backward's trial on a tiny row)")
    return 0 if worst <= 1e-5 and len(reached) >= 2 else 1


if __name__ == "__main__":
    sys.exit(main(Path(sys.argv[1])))
