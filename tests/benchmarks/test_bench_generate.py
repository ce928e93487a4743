"""Smoke test: the generation benchmark's --quick mode runs end to end on a tiny random model, every
system generates exactly the requested tokens, and nopad's greedy tokens match HF's."""

import json

import pytest

from benchmarks._workloads import chat_workload, static_batch_occupancy
from nopad.assets.smollm2 import load_smollm2_tokenizer


def test_static_batch_occupancy_counts_held_and_useful_slots():
    held, useful = static_batch_occupancy([3, 1, 2, 5, 2], batch_size=2)
    assert held == [2, 2, 2, 2, 2, 2, 2, 2, 1, 1]
    assert useful == [2, 1, 1, 2, 2, 1, 1, 1, 1, 1]


def test_chat_workload_is_deterministic_and_in_range():
    tok = load_smollm2_tokenizer()
    prompts, max_new = chat_workload(tok, 70, 16, 256, seed=3)
    again, max_new_again = chat_workload(tok, 70, 16, 256, seed=3)
    assert prompts == again and max_new == max_new_again
    assert len(prompts) == 70 and len(set(map(tuple, prompts))) == 70  # cycled questions stay distinct
    assert all(16 <= k <= 256 for k in max_new)
    with pytest.raises(ValueError, match="min_new <= max_new"):
        chat_workload(tok, 4, 10, 5, seed=0)


def test_prefill_workload_is_deterministic_and_in_range():
    from benchmarks._workloads import prefill_workload

    tok = load_smollm2_tokenizer()
    prompts, max_new = prefill_workload(tok, 6, 128, 512, 4, 16, seed=1)
    assert (prompts, max_new) == prefill_workload(tok, 6, 128, 512, 4, 16, seed=1)
    assert all(128 <= len(p) <= 512 for p in prompts) and all(4 <= k <= 16 for k in max_new)
    with pytest.raises(ValueError, match="min_prompt <= max_prompt"):
        prefill_workload(tok, 2, 512, 128, 4, 16, seed=0)


def test_quick_run_on_tiny_model(tmp_path, capsys):
    from benchmarks.bench_generate import main

    report = main(["--quick", "--tiny-model", "--threads", "1", "--out-dir", str(tmp_path), "--dtypes", "fp32,bf16"])
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "bench_generate.json").read_text())
    for dtype in ("fp32", "bf16"):
        section = report[dtype]
        assert (tmp_path / f"generate_occupancy_{dtype}.png").stat().st_size > 0
        assert saved[dtype]["workloads"] == section["workloads"]
        assert set(section["workloads"]) == {"Workload 1: chat", "Workload 2: prefill-heavy"}
        for runs in section["workloads"].values():
            assert len(runs) == 3 and len({r["tokens"] for r in runs.values()}) == 1  # same useful tokens
        if dtype == "fp32":  # bf16 ties may break differently in HF's padded batches
            assert all(m["token_fraction"] == 1.0 for m in section["greedy_match_alone"].values())
        grpo = section["grpo"]
        nopad = next(v for k, v in grpo.items() if k.startswith("nopad"))
        assert nopad["prefill_tokens"] < grpo["naive_prefill_tokens"]
        for split in section["breakdown"].values():  # the instrumented run's parts fit in its time
            assert 0 < split["linear_s"] + split["attention_s"] + split["sampling_s"] <= split["seconds"]
            assert split["sampling_s"] > 0
            assert split["ceiling_vs_hf_generate"] > 0
        assert set(section["breakdown"]) == set(section["workloads"])
        floor = section["decode_floor"]
        assert floor["step_ms"] > 0 and floor["floor_ms"] > floor["linear_ms"] > 0
        assert floor["ratio"] > 0  # median of per-step ratios, each step against the linears timed with it
    assert "Workload 2: prefill-heavy" in out and "x the floor" in out and "linear layers" in out
