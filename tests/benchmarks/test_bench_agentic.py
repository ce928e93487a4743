"""Smoke test: the agentic-rollout benchmark runs both sides end to end on a tiny model."""

import pytest

pytest.importorskip("trl")


def test_quick_run_compares_nopad_episodes_with_trls_tool_loop(capsys):
    from benchmarks.bench_agentic import main

    report = main(["--quick", "--threads", "1"])
    for side in ("trl", "nopad"):
        r = report[side]
        assert r["wall_s"] > 0 and r["rows"] == 16 and r["model_tokens"] > 0
        assert r["prefilled"] >= r["unique_prefill"] > 0
    assert report["nopad"]["tool_tokens"] > 0 and report["trl"]["tool_tokens"] > 0  # tool rounds ran
    # nopad prefills each group's prompt once and each tool result once (nothing preempted here)
    assert report["nopad"]["preemptions"] == 0 and report["nopad"]["prefill_ratio"] <= 1.05
    assert report["speedup"] == report["trl"]["wall_s"] / report["nopad"]["wall_s"]
    assert "TRL tool loop / nopad episodes" in capsys.readouterr().out
