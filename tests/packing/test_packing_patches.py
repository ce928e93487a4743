"""Importing nopad computes nothing and patches nothing; transformers is patched on first use and
given back by ``uninstall()``. An import that ran torch ops started OpenMP's threads, and a child
forked after it hung in its first multi-threaded GEMM (GNU OpenMP after fork)."""

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PUBLIC = ("nopad.packing", "nopad.dataloaders", "nopad.inference", "nopad.training", "nopad.recipes", "nopad.assets")

# In a fresh interpreter: import every public module, check transformers is untouched, then fork and
# run a 512x512 GEMM on two threads in the child; the parent reports the child's fate.
CHILD = textwrap.dedent(f"""
    import importlib, os, pkgutil, signal, sys, time
    import torch
    torch.set_num_threads(2)
    for top in {PUBLIC!r}:
        package = importlib.import_module(top)
        for info in pkgutil.walk_packages(package.__path__, top + "."):
            importlib.import_module(info.name)
    from transformers.integrations import hub_kernels
    from nopad.packing.mixers import patches
    assert not patches.installed(), "importing nopad patched transformers"
    assert not hasattr(hub_kernels.use_kernel_func_from_hub_with_fallback, "_nopad_kernel")
    pid = os.fork()
    if pid == 0:
        a = torch.randn(512, 512)
        (a @ a).sum()
        os._exit(0)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            print("child exit", os.waitstatus_to_exitcode(status))
            sys.exit(0)
        time.sleep(0.05)
    os.kill(pid, signal.SIGKILL)
    print("child hung")
""")


@pytest.mark.timeout(240)
def test_fork_after_importing_every_public_module_runs_a_threaded_gemm():
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    result = subprocess.run(
        [sys.executable, "-c", CHILD], cwd=ROOT, env=env, capture_output=True, text=True, timeout=200
    )
    assert result.returncode == 0, result.stderr[-3000:]
    assert result.stdout.strip().endswith("child exit 0"), result.stdout


def test_first_use_patches_and_uninstall_gives_transformers_back():
    from transformers import masking_utils
    from transformers.integrations import hub_kernels
    from transformers.models.qwen3_5 import modeling_qwen3_5 as qwen

    from nopad.packing.hf import register_nopad_attention
    from nopad.packing.mixers import mamba2, patches

    register_nopad_attention()  # first use (or a no-op if another test got there first)
    assert patches.installed()
    assert qwen.torch_chunk_gated_delta_rule._nopad_kernel == "chunk_gated_delta_rule"
    families = [sys.modules[m.__module__] for m in mamba2.mixers()]
    assert families and all(hasattr(f.mamba2_chunk_scan, "nopad_original") for f in families)
    assert masking_utils._preprocess_mask_arguments._nopad_mask_args
    try:
        patches.uninstall()
        assert not patches.installed()
        assert not hasattr(hub_kernels.use_kernel_func_from_hub_with_fallback, "_nopad_kernel")
        assert not hasattr(qwen.torch_chunk_gated_delta_rule, "_nopad_kernel")
        assert not any(hasattr(f.mamba2_chunk_scan, "nopad_original") for f in families)
        assert not hasattr(masking_utils._preprocess_mask_arguments, "_nopad_mask_args")
    finally:
        register_nopad_attention()
    assert patches.installed()
    assert qwen.torch_chunk_gated_delta_rule._nopad_kernel == "chunk_gated_delta_rule"
    assert all(hasattr(f.mamba2_chunk_scan, "nopad_original") for f in families)
    assert masking_utils._preprocess_mask_arguments._nopad_mask_args
