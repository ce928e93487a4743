"""benchmarks/sweep_families.py, the sweep of every causal LM family in transformers that found
silent errors, on two families: one nopad serves (llama: exact flat, tree and in
the generator) and one it refuses (BART's decoder: positions it counts itself). Keeps the script
from rotting; the whole sweep takes about 30 minutes and is run by hand."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_the_sweep_reports_exact_and_refused_families(tmp_path):
    out = tmp_path / "sweep.jsonl"
    proc = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "sweep_families.py"), "llama", "bart"],
        capture_output=True,
        text=True,
        timeout=600,
        cwd=tmp_path,
        env={**os.environ, "SWEEP_RESULTS": str(out)},
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    outcome = {(r["family"], r["check"]): r["outcome"] for r in map(json.loads, out.read_text().splitlines())}
    assert {check: outcome[("llama", check)] for check in ("verify_flat", "verify_tree", "generate")} == {
        "verify_flat": "OK",
        "verify_tree": "OK",
        "generate": "OK",
    }, proc.stdout
    assert {check: outcome[("bart", check)] for check in ("verify_flat", "verify_tree", "generate")} == {
        "verify_flat": "REFUSED",
        "verify_tree": "REFUSED",
        "generate": "REFUSED",
    }, proc.stdout
