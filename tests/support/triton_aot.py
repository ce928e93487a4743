"""Compile every ``@triton.jit`` kernel of nopad ahead of time for one GPU architecture, with no
GPU: ``triton.compile`` on an ``ASTSource`` with an explicit ``GPUTarget`` runs the whole
pipeline (TTIR, TTGIR, LLVM IR, PTX, and ptxas to a cubin) on the host. So an API or lowering
difference in the Triton a GPU machine has shows here, not in the GPU's short time.

    python tests/support/triton_aot.py              # sm_90 (H100), the Triton on sys.path
    python tests/support/triton_aot.py --arch 80    # sm_80 (A100)

Prints one line per kernel variant and exits 1 if any fails. ``TRITON_INTERPRET`` must be unset
or 0 (the interpreter replaces the kernels with Python functions that cannot be compiled); the
script clears it before nopad is imported. Run by tests/gpu/test_triton_compat.py and
``make triton-compat`` (which puts Triton 3.6, the lent H100's, first on the path).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ["TRITON_INTERPRET"] = "0"  # read when the kernels are decorated, at nopad's import
sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from anywhere

import torch  # noqa: E402

from nopad.packing import invariant_kernels  # noqa: E402
from nopad.packing.attention import triton_kernel  # noqa: E402

# dtype -> the pointer type Triton's signatures name
POINTER = {torch.float32: "*fp32", torch.bfloat16: "*bf16", torch.float16: "*fp16"}
ATTENTION_INTS = [
    "stride_qt",
    "stride_qh",
    "stride_kt",
    "stride_kh",
    "stride_vt",
    "stride_vh",
    "stride_ot",
    "stride_oh",
    "stride_table",
]


def attention_variant(
    dtype: torch.dtype,
    head_dim: int,
    *,
    paged: bool,
    decode: bool,
    softcap: bool,
    groups: int = 2,
    page: int = 16,
    sinks: bool = False,
) -> tuple[dict, dict]:
    """The (signature, constexprs) of one ``_attention_kernel`` specialization, with the tile
    configuration :func:`triton_kernel.tile_config` gives every call of that head dim and dtype."""
    tile = triton_kernel.tile_config(head_dim, dtype)
    ptr = POINTER[dtype]
    signature = {
        "Q": ptr,
        "K": ptr,
        "V": ptr,
        "OUT": ptr,
        "CU_Q": "*i32",
        "KEYS": "*i32",
        "TABLE": "*i32",
        "SINK": "*fp32",
    }
    signature.update({name: "i32" for name in ATTENTION_INTS})
    signature.update(scale="fp32", softcap="fp32", window="i32")
    constexprs = dict(
        G=groups,
        HEAD_DIM=head_dim,
        D_PAD=triton_kernel._padded(head_dim),
        BLOCK_M=tile.block_m,
        BLOCK_N=tile.block_n,
        PAGE=page if paged else 1,
        PAGED=paged,
        DECODE=decode,
        CAUSAL=True,
        SOFTCAP=softcap,
        INTERPRETED=False,
        FP32=dtype == torch.float32,
        SINKS=sinks,
    )
    signature.update({name: "constexpr" for name in constexprs})
    return signature, constexprs


def variants():
    """(name, kernel, signature, constexprs, options): every kernel, in the dtypes and tile
    configurations the launchers use (each distinct ``tile_config`` at least once)."""
    tk = triton_kernel
    for dtype, head_dim, paged, decode, softcap in [
        (torch.bfloat16, 64, False, False, False),  # a packed training row
        (torch.bfloat16, 128, True, False, False),  # a prefill chunk over a paged cache
        (torch.float16, 128, True, True, True),  # a decode step, softcap
        (torch.float32, 64, False, False, False),  # fp32: IEEE dots
        (torch.float32, 128, True, True, False),  # fp32's smaller tile
        (torch.float32, 256, False, False, False),  # fp32's single-stage tile
        (torch.bfloat16, 256, True, True, False),  # the largest head dim
    ]:
        tile = tk.tile_config(head_dim, dtype)
        signature, constexprs = attention_variant(dtype, head_dim, paged=paged, decode=decode, softcap=softcap)
        name = (
            f"_attention_kernel {str(dtype)[6:]} d{head_dim} {'paged' if paged else 'flat'}"
            f"{' decode' if decode else ''}{' softcap' if softcap else ''}"
        )
        yield name, tk._attention_kernel, signature, constexprs, dict(num_warps=tile.warps, num_stages=tile.stages)
    ik = invariant_kernels
    for dtype in (torch.float32, torch.bfloat16):
        ptr = POINTER[dtype]
        signature = {
            "X": ptr,
            "W": ptr,
            "B": ptr,
            "OUT": ptr,
            "M": "i32",
            "N": "i32",
            "K": "i32",
            "stride_xm": "i32",
            "stride_wn": "i32",
            "stride_om": "i32",
        }
        constexprs = dict(
            HAS_BIAS=True, INTERPRETED=False, FP32=dtype == torch.float32, BM=ik.BLOCK_M, BN=ik.BLOCK_N, BK=ik.BLOCK_K
        )
        signature.update({name: "constexpr" for name in constexprs})
        yield f"_matmul_kernel {str(dtype)[6:]}", ik._matmul_kernel, signature, constexprs, {}
    row = {"X": "*bf16", "OUT": "*bf16", "N": "i32", "stride_x": "i32"}
    for mean in (False, True):
        yield (
            f"_row_sum_kernel bf16{' mean' if mean else ''}",
            ik._row_sum_kernel,
            {
                "X": "*bf16",
                "OUT": "*bf16",
                "M": "i32",
                "N": "i32",
                "stride_x": "i32",
                "MEAN": "constexpr",
                "ROWS": "constexpr",
                "BLOCK": "constexpr",
            },
            dict(MEAN=mean, ROWS=ik.SUM_ROWS, BLOCK=ik.SUM_BLOCK),
            {},
        )
    yield (
        "_softmax_kernel bf16 log",
        ik._softmax_kernel,
        {**row, "stride_o": "i32", "LOG": "constexpr", "BLOCK": "constexpr"},
        dict(LOG=True, BLOCK=ik.BLOCK),
        {},
    )


def jit_kernels() -> set[str]:
    """Names of every ``@triton.jit`` function in the modules above, so a new kernel cannot be
    left out of :func:`variants` unseen (``_dot`` is a device helper, compiled inside the
    attention kernel)."""
    import triton

    found = set()
    for module in (triton_kernel, invariant_kernels):
        found |= {name for name, obj in vars(module).items() if isinstance(obj, triton.runtime.JITFunction)}
    return found


def compile_all(arch: int) -> list[str]:
    """Compile every variant for ``sm_{arch}``; return the failures (empty when all compiled)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    if triton_kernel.triton is None:
        raise SystemExit("triton is not installed (pip install triton)")
    target = GPUTarget("cuda", arch, 32)
    print(f"triton {triton.__version__} from {Path(triton.__file__).parent}, target sm_{arch}", flush=True)
    failures, seen = [], set()
    for name, kernel, signature, constexprs, options in variants():
        seen.add(kernel.__name__)
        start = time.perf_counter()
        try:
            source = ASTSource(kernel, signature, constexprs)
            compiled = triton.compile(source, target=target, options=options)
            ptx, cubin = compiled.asm["ptx"], compiled.asm["cubin"]
            assert f".target sm_{arch}" in ptx and len(cubin) > 0, "no sm_{arch} PTX / cubin"
            print(f"ok    {name}: {len(cubin)} B cubin, {time.perf_counter() - start:.1f}s", flush=True)
        except Exception as error:  # report every kernel, not only the first failure
            failures.append(f"{name}: {type(error).__name__}: {error}")
            print(f"FAIL  {name}: {type(error).__name__}: {str(error)[-2000:]}", flush=True)
    missing = jit_kernels() - seen - {"_dot"}
    if missing:
        failures.append(f"kernels with no variant in tests/support/triton_aot.py: {sorted(missing)}")
        print(f"FAIL  {failures[-1]}")
    return failures


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 90 for sm_90 (H100)")
    failures = compile_all(parser.parse_args(argv).arch)
    print(f"{'all compiled' if not failures else f'{len(failures)} failed'}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
