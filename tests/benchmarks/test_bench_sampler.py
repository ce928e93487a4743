"""Smoke test: the sampler benchmark runs end to end on a tiny random model and reports both ways."""

from benchmarks.bench_sampler import CASES, main


def test_quick_run_on_tiny_model(capsys):
    report = main(["--quick", "--tiny-model", "--threads", "1", "--dtypes", "fp32,bf16"])
    argmax = report.pop("argmax")
    assert argmax["torch"] > 0 and argmax["nopad"] > 0
    penalties = report.pop("penalties")  # (the run asserts the two forms' bits equal)
    assert set(penalties) == {8, 256} and all(p["mask"] > 0 and p["pairs"] > 0 for p in penalties.values())
    assert set(report) == {f"{d} {c}" for d in ("fp32", "bf16") for c in CASES}
    for case in report.values():
        for way in ("reused", "fresh"):
            assert case[way]["step_ms"] > case[way]["sampler_ms"] > 0 and case[way]["faults"] >= 0
    assert "fresh / reused" in capsys.readouterr().out
