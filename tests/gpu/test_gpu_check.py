"""The GPU check script's smoke mode runs end to end on CPU, so the script cannot rot unseen."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
# hang guards, not speed checks: the smoke run takes ~25 s on two idle cores, and under `make test`
# another xdist worker shares them
TIMEOUT_S = 300


def test_quick_run_writes_both_reports_with_every_section(tmp_path):
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")  # the smoke run is the CPU path, on any machine
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py", "--quick", "--out", str(tmp_path)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_report.json").read_text())
    assert report["quick"] is True
    for key in ("torch", "triton", "transformers", "gpu", "driver", "cuda"):
        assert key in report["environment"]
    assert report["backends"]["training (grad)"] and report["backends"]["generation prefill/decode (paged)"]
    assert report["pytest"]["returncode"] in (0, 5), report["pytest"]  # collected; 5: all deselected
    tiny = report["models"]["tiny"]
    for section in ("training", "generation", "decode_floor", "host_overhead"):
        assert "error" not in tiny[section], (section, tiny[section])
    assert "error" not in report["grpo"], report["grpo"]
    hybrid = report["hybrid"]["tiny-hybrid"]  # the hybrid goals (>= 2x) on a Qwen3.5-layout model
    assert "error" not in hybrid, hybrid
    assert hybrid["training"]["figures"]["hybrid_train_vs_padded"]["ratio"] > 0
    assert tiny["host_overhead"]["idle_share"] == "n/a on CPU"
    for goal in (
        "train_vs_padded",
        "train_vs_flatten",
        "generate_vs_hf_generate",
        "generate_vs_hf_cb",
        "decode_vs_floor_128",
        "grpo_vs_trl",
        "hybrid_train_vs_padded",
        "hybrid_generate_vs_hf_generate",
    ):
        assert report["goals"][goal]["status"] in ("met", "missed"), (goal, report["goals"][goal])
    markdown = (tmp_path / "gpu_report.md").read_text()
    assert "## Goals" in markdown and "train_vs_padded" in markdown and "| torch |" in markdown


def test_without_cuda_it_says_so_in_one_line():
    env = dict(os.environ, CUDA_VISIBLE_DEVICES="")
    proc = subprocess.run(
        [sys.executable, "benchmarks/gpu_check.py"],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=TIMEOUT_S,
    )
    assert proc.returncode == 0
    assert proc.stdout.strip().count("\n") == 0 and "no CUDA" in proc.stdout
