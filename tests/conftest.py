"""Shared fixtures. Without CUDA, Triton kernels run under Triton's interpreter: ``TRITON_INTERPRET``
is read when a kernel is decorated (``@triton.jit``, at its module's import), and conftest.py is
imported before any test module imports nopad, so setting it here reaches every kernel. A value the
caller set is kept (``TRITON_INTERPRET=0`` on a GPU machine is the caller's choice)."""

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

# `make test` runs the suite on pytest-xdist workers, one per core: each worker (and every process it
# starts) gets one thread, so two workers share CI's two cores instead of four threads fighting for
# them. A value the caller set is kept.
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

# The longest files (by `make test`'s --durations=30, and single-file runs for the last two), longest
# first. Under `--dist loadfile` each file is one unit of work, handed out in collection order:
# starting these first keeps one long file from running alone at the end while the other worker sits
# idle (test_training_trl.py was the second-last file collected; the training files left for the end
# now take under ~20 s each).
LONGEST_FIRST = (
    "tests/benchmarks/test_benchmarks_quick.py",
    "tests/test_readme.py",
    "tests/test_readme_launch.py",
    "tests/packing/test_packing_invariance_triton.py",
    "tests/recipes/test_recipes_grpo_resume.py",
    "tests/packing/test_packing_verification.py",
    "tests/training/test_training_sharded.py",
    "tests/recipes/test_recipes_sft.py",
    "tests/recipes/test_recipes_pipeline.py",
    "tests/recipes/test_recipes_lora.py",
    "tests/training/test_training_trl.py",
    "tests/test_nonfinite.py",
    "tests/gpu/test_gpu_check.py",
)


def pytest_collection_modifyitems(config, items):
    """Under xdist, the longest files first (a stable sort: the rest keep their order)."""
    if XDIST_WORKER:
        rank = {path: i for i, path in enumerate(LONGEST_FIRST)}
        items.sort(key=lambda item: rank.get(item.nodeid.split("::")[0], len(rank)))


def _single_thread():
    """Tiny tensors run faster on one thread, and CI's two cores are shared with other work."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


one_thread = pytest.fixture(_single_thread, name="one_thread")  # for a test
# for every test of a module: `pytestmark = pytest.mark.usefixtures("one_thread_module")`
one_thread_module = pytest.fixture(_single_thread, scope="module", name="one_thread_module")


@pytest.fixture(scope="module")
def nopad_patches():
    """transformers patched for nopad's mixers, for tests that call its kernel functions or read
    its modules directly, with no nopad entry point first (importing nopad patches nothing)."""
    from nopad.packing.mixers import patches

    patches.install()


# DeepSpeed JIT-compiles its CPU shared-memory op (used only by its inference all-reduce, never by
# ZeRO training) the first time any rank starts, 45-100 s on a fresh machine. The build is cached in
# torch's extensions directory, behind torch's file lock: built here in the background (nice, on the
# core the single-threaded tests leave idle) while the suite collects and runs, the first DeepSpeed
# test finds it built (or waits on the lock) instead of paying for it on its own clock.
_DS_SHM_BUILD = (
    "from deepspeed.accelerator import get_accelerator\n"
    "b = get_accelerator().create_op_builder('ShareMemCommBuilder')\n"
    "if b is not None and b.is_compatible():\n"
    "    b.load()\n"
)
_DS_BUILD = pytest.StashKey[subprocess.Popen]()


def pytest_sessionstart(session):
    """Start the DeepSpeed op build when the run includes the slow (multi-process) tests."""
    markexpr = session.config.getoption("markexpr") or ""
    if XDIST_WORKER:  # the controller starts it once for all workers
        return
    if "slow" not in markexpr.replace("not slow", "") or importlib.util.find_spec("deepspeed") is None:
        return
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    session.config.stash[_DS_BUILD] = subprocess.Popen(
        ["nice", "-n", "10", sys.executable, "-c", _DS_SHM_BUILD],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )


def pytest_sessionfinish(session):
    """Wait for the build rather than kill it: a build killed inside torch's lock leaves the lock
    file behind, and every later DeepSpeed start would wait on it forever. One still running after
    10 minutes (waiting on another process's lock?) is left to finish on its own."""
    build = session.config.stash.get(_DS_BUILD, None)
    if build is not None:
        try:
            build.wait(timeout=600)
        except subprocess.TimeoutExpired:
            pass
