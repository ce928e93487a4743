"""bench_decode_host's GRPO shape (``--samples``): nopad's rows come as forked groups, and the overlapped
step serves them from the decode batch's arrays (no Python call per added row); and its HF ``generate()``
figures, per decode step."""

from __future__ import annotations

import pytest

from benchmarks.bench_decode_host import main


def test_groups_of_samples_are_served_from_the_kept_arrays_when_overlapped():
    report = main(["--layers", "1", "--rows", "8", "16", "--samples", "4", "--prompt-len", "5"])
    per_row = report["python_calls_per_added_row"]
    assert per_row["nopad, overlap"] == 0 == per_row["nopad"]
    assert per_row["nopad, general step"] > 0


@pytest.mark.parametrize("argv", [["--samples", "3", "--rows", "16"], ["--samples", "0"]])
def test_samples_that_do_not_divide_the_rows_are_refused(argv, capsys):
    with pytest.raises(SystemExit):
        main(argv)
    assert "--samples must be at least 1 and divide every --rows count" in capsys.readouterr().err


def test_hf_generate_is_measured_per_decode_step():
    """The generate() loop's figures are per decode step: its Python calls per step exceed the bare loop's
    (it runs processors and stopping criteria besides the same forward)."""
    report = main(["--layers", "1", "--rows", "4", "--prompt-len", "5", "--quick"])[4]
    generate, bare = report["HF generate()"], report["HF"]
    assert generate["outside_ms"] > 0
    assert generate["python_per_step"] > bare["python"]  # (the bare loop's per layer, of one layer)
