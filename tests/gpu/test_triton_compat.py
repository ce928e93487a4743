"""nopad's Triton kernels under the Triton of the lent GPU machines (3.6) as well as CI's: they
compile ahead of time for sm_90 (H100) with no GPU (tests/support/triton_aot.py), and the Triton
interpreter tests pass with that Triton first on the path. GPU time is short; an API difference
should show here. ``make triton-compat`` installs Triton 3.6 into ``$NOPAD_TRITON36``
(default /tmp/triton36) and runs this file; without it the 3.6 tests are skipped.

Triton 3.6's interpreter turns a scalar (a 1-element array there) into a loop bound with
``int(array)``, which NumPy >= 2.4 refuses (3.9 squeezes first), so the target directory also
holds numpy < 2.4: every kernel with a data-dependent loop fails otherwise, before any nopad
code runs. Compiling for a GPU does not touch NumPy."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
TRITON36 = Path(os.environ.get("NOPAD_TRITON36", "/tmp/triton36"))
INTERPRETER_TESTS = [
    "tests/packing/test_packing_triton_attention.py",
    "tests/packing/test_packing_invariance_triton.py",
]
HAS_36 = any(TRITON36.glob("triton-3.6.*.dist-info"))
needs_36 = pytest.mark.skipif(not HAS_36, reason=f"no Triton 3.6 in {TRITON36} (make triton-compat installs it)")
pytestmark = pytest.mark.slow


def environment(path: Path | None, **extra: str) -> dict[str, str]:
    """The environment with ``path`` (a ``pip install --target`` directory) first on sys.path."""
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="", **extra)
    if path is not None:
        env["PYTHONPATH"] = os.pathsep.join([str(path), str(ROOT)])
    return env


def run(args: list[str], env: dict[str, str], timeout: int) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, *args], cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)


def triton_version(env: dict[str, str]) -> str:
    proc = run(["-c", "import triton; print(triton.__version__)"], env, 120)
    assert proc.returncode == 0, proc.stderr[-2000:]
    return proc.stdout.strip()


@pytest.mark.parametrize("which", ["installed", pytest.param("3.6", marks=needs_36)])
def test_every_kernel_compiles_for_sm90_without_a_gpu(which):
    pytest.importorskip("triton")
    env = environment(TRITON36 if which == "3.6" else None, TRITON_INTERPRET="0")
    if which == "3.6":
        assert triton_version(env).startswith("3.6"), "the 3.6 directory does not shadow the installed Triton"
    proc = run(["tests/support/triton_aot.py", "--arch", "90"], env, 1200)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "all compiled" in proc.stdout and "sm_90" in proc.stdout


@needs_36
def test_interpreter_tests_pass_under_triton_36():
    env = environment(TRITON36, TRITON_INTERPRET="1")
    assert triton_version(env).startswith("3.6")
    proc = run(["-m", "pytest", "-q", "-p", "no:cacheprovider", *INTERPRETER_TESTS], env, 2400)
    assert proc.returncode == 0, proc.stdout[-6000:]
    assert " passed" in proc.stdout and " skipped" not in proc.stdout, proc.stdout[-2000:]
