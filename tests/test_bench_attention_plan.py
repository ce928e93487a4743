"""Smoke test: the attention-plan benchmark runs end to end and sees one decision per forward."""

from benchmarks.bench_attention_plan import main


def test_quick_run_decides_once_per_forward(capsys):
    report = main(["--quick", "--layers", "4"])
    assert set(report) == {"training step", "decode step"}
    for case in report.values():
        assert case["rule_runs"] == 1
        assert case["decision_us"] > case["lookup_us"] > 0 and case["step_ms"] > 0
    assert "registry.choose runs per forward 1" in capsys.readouterr().out
