"""Smoke test: the generation benchmark's --quick mode runs end to end on a tiny random model, every
system generates exactly the requested tokens, and nopad's greedy tokens match HF's."""

import json

import pytest

from benchmarks._workloads import chat_workload, static_batch_occupancy
from packing.models import load_smollm2_tokenizer


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


def test_quick_run_on_tiny_model(tmp_path, capsys):
    from benchmarks.bench_generate import main

    report = main(["--quick", "--tiny-model", "--threads", "1", "--out-dir", str(tmp_path)])
    out = capsys.readouterr().out
    assert (tmp_path / "generate_occupancy.png").stat().st_size > 0
    assert json.loads((tmp_path / "bench_generate.json").read_text())["chat"] == report["chat"]
    chat = report["chat"]
    assert len(chat) == 3 and len({r["tokens"] for r in chat.values()}) == 1  # same useful tokens
    assert report["greedy_match_alone"]["token_fraction"] == 1.0
    grpo = report["grpo"]
    nopad = next(v for k, v in grpo.items() if k.startswith("nopad"))
    assert nopad["prefill_tokens"] < grpo["naive_prefill_tokens"]
    assert "Workload 1" in out and "Workload 2" in out
