"""Every ``benchmarks/bench_*.py`` runs its ``--quick`` smoke mode in the default suite, found by
name, so a benchmark added later is covered without touching this file and a moved import or a
renamed argument breaks a test, not ``make bench`` (the contract is in benchmarks/README.md).

Each run is its own process, as ``make bench`` runs it (the script's ``__main__``, its argument
parsing, its imports from a fresh interpreter), on the CPU whatever the machine, with its own
timeout; its whole process group is killed if it runs over (bench_sharded starts workers)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.launch import run_in_group

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = sorted((ROOT / "benchmarks").glob("bench_*.py"))
TIMEOUT_S = 600  # a --quick run takes seconds to a minute on two idle cores; this is the hang guard
# benchmarks whose --quick run a test of their own drives in-process, checking what it reports
# (running them again here would only repeat that work)
DRIVEN_BY = {
    "bench_generate.py": "test_bench_generate.py",
    "bench_sampler.py": "test_bench_sampler.py",
    "bench_agentic.py": "test_bench_agentic.py",
}
# what a quick run must print, beyond exiting 0
PRINTS = {
    "bench_attention_plan.py": [
        "training step: registry.choose runs per forward 1;",
        "decode step: registry.choose runs per forward 1;",
    ],
    # the share of the work's ratio, not only of the redundancy, that tree rows reach
    "bench_tree_train.py": ["work (fwd+bwd FLOPs, estimated): tree "],
}


def run_quick(path: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the CPU path, on any machine
    env.pop("TRITON_INTERPRET", None)  # set by conftest.py for the Triton tests; make bench has none
    # this checkout's packages first, as pytest has them (not another checkout installed editable)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), env.get("PYTHONPATH")) if p)
    cmd = [sys.executable, str(path), "--quick"]
    returncode, out, err = run_in_group(cmd, TIMEOUT_S, cwd=ROOT, env=env)
    if returncode is None:
        pytest.fail(
            f"{path.name} --quick ran over {TIMEOUT_S} s; a quick run must take seconds "
            f"(benchmarks/README.md). Last output:\n{out[-2000:]}\n{err[-2000:]}"
        )
    return subprocess.CompletedProcess(cmd, returncode, out, err)


def test_the_benchmarks_are_found():
    assert len(BENCHMARKS) >= 10, [p.name for p in BENCHMARKS]
    assert set(DRIVEN_BY) | set(PRINTS) <= {p.name for p in BENCHMARKS}


@pytest.mark.timeout(900)  # the run's own 600 s (bench_sharded starts workers)
@pytest.mark.parametrize("path", BENCHMARKS, ids=lambda p: p.name)
def test_quick_run_exits_cleanly(path):
    assert "--quick" in path.read_text(), f"{path.name} has no --quick mode (benchmarks/README.md)"
    if path.name in DRIVEN_BY:
        test = ROOT / "tests" / "benchmarks" / DRIVEN_BY[path.name]
        assert '"--quick"' in test.read_text(), f"{test.name} no longer runs {path.name} --quick"
        pytest.skip(f"{test.name} runs it in-process")
    proc = run_quick(path)
    assert proc.returncode == 0, f"{path.name} --quick exited {proc.returncode}:\n{proc.stderr[-8000:]}"
    assert proc.stdout.strip(), f"{path.name} --quick printed nothing"
    for line in PRINTS.get(path.name, []):
        assert line in proc.stdout, proc.stdout[-3000:]
