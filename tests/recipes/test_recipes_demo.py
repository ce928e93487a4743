"""nopad.recipes.demo.packing_report and the embedded corpus it reads."""

import io
import re
import sys
import time

import numpy as np
import pytest

from nopad.assets.corpus import load_corpus
from nopad.recipes.demo import packing_report, padded_to_longest


class WordCounter:
    """A stand-in tokenizer: one token per whitespace-separated word."""

    def __call__(self, texts, add_special_tokens=True):
        return {"input_ids": [[0] * len(t.split()) for t in texts]}


def test_corpus_is_deterministic_varied_and_offline():
    docs = load_corpus(2000)
    assert len(docs) == 2000 and docs == load_corpus(2000)
    assert docs[0].startswith("__future__\n\n")
    sizes = np.array([len(d) for d in docs])
    assert sizes.min() >= 80 and sizes.max() > 20 * np.median(sizes)
    assert len(set(docs)) > 1900


def test_padded_to_longest():
    rows, slots = padded_to_longest(np.array([1, 2, 3, 10, 5]), micro_batch_size=2, seed=0)
    shuffled = np.random.default_rng(0).permutation([1, 2, 3, 10, 5])
    expected = 2 * max(shuffled[:2]) + 2 * max(shuffled[2:4]) + shuffled[4]
    assert (rows, slots) == (5, expected)


def test_packing_report_numbers_and_table():
    out = io.StringIO()
    report = packing_report(WordCounter(), capacities=(256, 512), max_documents=300, out=out)
    lengths = np.array([len(d.split()) + 1 for d in load_corpus(300)])
    assert [(r["capacity"], r["method"]) for r in report] == [
        (c, m)
        for c in (256, 512)
        for m in ("nopad best-fit packing", "pad to longest (micro-batch 8)", "pad to capacity")
    ]
    for r in report:
        tokens = int(np.minimum(lengths, r["capacity"]).sum())
        assert r["tokens"] == tokens and r["efficiency"] == pytest.approx(tokens / r["slots"])
    nopad, longest, full = report[3:]
    lower_bound = -(-nopad["tokens"] // 512)
    assert lower_bound <= nopad["rows"] <= lower_bound + 2 and nopad["slots"] == nopad["rows"] * 512
    assert nopad["efficiency"] > 0.95 > longest["efficiency"] > full["efficiency"]
    assert full["slots"] == 300 * 512
    text = out.getvalue()
    assert "nopad packing report: 300 documents" in text
    assert "fewer token slots than padding to the longest" in text


def test_grpo_demo_prints_one_row_per_step_with_the_gap():
    import torch

    from nopad.recipes.demo import grpo_demo
    from nopad.recipes.tiny_model import AsciiTokenizer
    from tests.support.models import tiny_model

    torch.set_num_threads(1)
    out = io.StringIO()
    history = grpo_demo(tiny_model("llama"), AsciiTokenizer(), steps=1, out=out)
    assert [h["step"] for h in history] == [0]
    assert history[0]["logprob_gap_max"] == 0.0  # batch-invariant mode: exactly on-policy
    lines = out.getvalue().splitlines()
    assert lines[1].startswith("GRPO on the live model (8 arithmetic prompts x 8 samples per step")
    assert lines[2].split() == [
        "step",
        "reward",
        "rollout",
        "tok/s",
        "train",
        "tok/s",
        "packed",
        "padded",
        "logprob",
        "gap",
        "max",
        "mean",
        "IS",
        "ratio",
        "range",
    ]
    row = lines[4].split()
    assert row[6:] == ["0.00e+00", "0.00e+00", "1.00000-1.00000"]
    assert "batch-invariant mode" in lines[5]
    assert row[0] == "0" and int(row[4]) == history[0]["train_tokens"]
    assert int(row[5]) == history[0]["padded_train_tokens"]


def _busy(*args, seconds: float = 0.03, **kwargs):
    """CPU work, so a phase's CPU seconds are not all zero."""
    end = time.process_time() + seconds
    while time.process_time() < end:
        pass


def test_the_demo_ends_with_each_phase_wall_and_cpu_seconds(monkeypatch, capsys):
    """The last line names every phase with its wall and CPU seconds, so a slow run says where
    its time went (the README's figure once differed 2.7x from a CI run and nobody could tell why)."""
    import nopad.assets.smollm2
    from nopad.recipes import demo

    def load():
        _busy()
        return "model", "tokenizer"

    monkeypatch.setattr(sys, "argv", ["nopad-demo"])
    monkeypatch.setattr(nopad.assets.smollm2, "load_smollm2", load)
    for name in ("packing_report", "sft_demo", "grpo_demo"):
        monkeypatch.setattr(demo, name, _busy)
    demo.main()
    last = capsys.readouterr().out.strip().splitlines()[-1]
    match = re.fullmatch(r"demo finished in (\d+) s, (\d+) CPU s on (\d+) threads: (.*)", last)
    assert match, last
    phases = re.findall(r"([a-zA-Z ]+?) (\d+) s \((\d+) CPU s\)(?:, |$)", match[4])
    assert [p[0] for p in phases] == ["model load", "packing report", "packed SFT", "GRPO"]
    assert int(match[3]) >= 1


def test_phase_clock_laps_add_up():
    from nopad.recipes.demo import PhaseClock

    clock = PhaseClock()
    clock.lap("a")
    _busy(seconds=0.02)
    clock.lap("b")
    assert [name for name, *_ in clock.phases] == ["a", "b"]
    assert clock.phases[1][2] >= 0.02 and all(w >= 0 and c >= 0 for _, w, c in clock.phases)
    assert sum(c for *_, c in clock.phases) <= time.process_time() - clock.start_cpu
